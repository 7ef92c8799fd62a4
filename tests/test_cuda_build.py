"""The build switch of zero_py._cuda (setup.py): ZP_CUDA=0 leaves it out, ZP_CUDA=1 makes a
missing nvcc an error, the default builds it only where nvcc and the CUDA runtime are found; and
zero_py itself never needs it."""

import os
import runpy
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def setup_py(monkeypatch):
    monkeypatch.chdir(ROOT)
    return runpy.run_path(os.path.join(ROOT, "setup.py"), run_name="zp_setup_probe")


def test_zp_cuda_0_leaves_the_module_out(setup_py, monkeypatch):
    monkeypatch.setenv("ZP_CUDA", "0")
    assert setup_py["_cuda_extension"]() is None


def test_zp_cuda_1_without_nvcc_is_an_error(setup_py, monkeypatch, tmp_path):
    monkeypatch.setenv("ZP_CUDA", "1")
    monkeypatch.setenv("NVCC", str(tmp_path / "no-nvcc"))
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(RuntimeError, match="nvcc was not found"):
        setup_py["_cuda_extension"]()
    monkeypatch.setenv("ZP_CUDA", "auto")
    assert setup_py["_cuda_extension"]() is None  # auto: CPU only, no error


def test_default_builds_cuda_where_nvcc_is(setup_py, monkeypatch):
    monkeypatch.delenv("ZP_CUDA", raising=False)
    ext = setup_py["_cuda_extension"]()
    if setup_py["_find_nvcc"]() is None:
        assert ext is None
        return
    assert ext is not None and ext.name == "zero_py._cuda"
    assert sorted(os.path.basename(s) for s in ext.zp_cuda["cu"]) == ["buffers.cu", "optim.cu"]
    assert "csrc/python/module.c" not in ext.sources  # the CPU binding stays CUDA-free
    assert "csrc/python/cuda_module.c" in ext.sources
    flags = setup_py["_nvcc_flags"]()
    # the numerics contract of elementwise.cuh, and sm_80 + sm_90 + PTX
    for f in ("--fmad=false", "--prec-div=true", "--prec-sqrt=true", "--ftz=false"):
        assert f in flags
    assert "arch=compute_80,code=sm_80" in flags and "arch=compute_90,code=sm_90" in flags
    assert "arch=compute_90,code=compute_90" in flags


def test_cpu_extension_has_no_cuda_dependency(setup_py):
    cpu = setup_py["extensions"][0]
    assert cpu.name == "zero_py._C"
    assert not any("kernels/cuda" in s or "csrc/comm/" in s or "cuda_module" in s
                   for s in cpu.sources)


def test_zero_py_imports_without_the_cuda_module():
    """A fresh interpreter where zero_py._cuda cannot be imported still imports and runs
    zero_py, and the CUDA path reports why it is unavailable."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'zero_py._cuda':\n"
        "            raise ImportError('blocked for the test')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import zero_py, zero_py.kernels.cuda, zero_py.collectives.nccl\n"
        "assert zero_py.kernels.cuda.native_module() is None\n"
        "why = zero_py.kernels.cuda.unavailable_reason()\n"
        "assert 'not built' in why and 'blocked for the test' in why, why\n"
        "assert zero_py.collectives.nccl.unavailable_reason() == why\n"
        "print('ok')\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
