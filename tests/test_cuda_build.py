"""The build switch of zero_py._cuda (setup.py): ZP_CUDA=0 leaves it out, ZP_CUDA=1 makes a
missing nvcc an error, the default builds it only where nvcc and the CUDA runtime are found; and
zero_py itself never needs it."""

import glob
import os
import re
import runpy
import shutil
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
    assert sorted(os.path.basename(s) for s in ext.zp_cuda["cu"]) == [
        "buffers.cu", "optim.cu", "quantize.cu", "upload.cu"]
    assert "csrc/python/module.c" not in ext.sources  # the CPU binding stays CUDA-free
    assert "csrc/python/cuda_module.c" in ext.sources
    # the CUDA module shares the table contract with the CPU kernel family, not its code
    assert "csrc/kernels/contract.c" in ext.sources
    assert not any("kernels/cpu/" in s for s in ext.sources)
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


def _cpu_family_functions():
    """The functions the CPU kernel family's headers (csrc/kernels/cpu/*.h) declare."""
    names = set()
    for header in glob.glob(os.path.join(ROOT, "csrc", "kernels", "cpu", "*.h")):
        with open(header) as f:
            text = re.sub(r"/\*.*?\*/", "", f.read(), flags=re.S)
        # declarations with external linkage (a static inline helper is no symbol to link)
        names.update(re.findall(r"^(?!static\b)[A-Za-z_][\w \t*]*?\b(zp_\w+)\(", text,
                                flags=re.M))
    return names


def test_cuda_module_does_not_contain_the_cpu_kernel_family():
    """zero_py._cuda shares only csrc/kernels/contract.c (the tables' checks) with the CPU
    kernel family: its kernels are the .cu files, so none of the CPU family's functions are
    linked into it."""
    import zero_py.kernels.cuda as cuda

    mod = cuda.native_module()
    if mod is None:
        pytest.skip(f"zero_py._cuda is not built: {cuda.unavailable_reason()}")
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) is not installed")
    out = subprocess.run([nm, "--defined-only", mod.__file__], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    defined = {line.split()[-1] for line in out.stdout.splitlines() if line.strip()}
    assert {"zp_opt_check", "zp_grad_stats_check"} <= defined  # the contract: both families
    cpu_family = _cpu_family_functions()
    assert {"zp_opt_step_cpu", "zp_grad_stats_cpu", "zp_convert_ops_for"} <= cpu_family
    assert not cpu_family & defined, sorted(cpu_family & defined)
