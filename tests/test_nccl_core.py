"""The native NCCL executor's C core (csrc/comm/) without a GPU: communicator.c and nccl_lib.c
built against host stand-ins of the CUDA runtime (tests/c/comm/fake_cudart.c) and loading a
stand-in libnccl (tests/c/comm/fake_nccl.c) by path, as they load the real one, with the C
tests' flags (-Werror, ASan, UBSan). tests/c/comm/test_comm.c checks every NCCL call of the
all-to-all (one ncclGroupStart/End around an ncclSend and ncclRecv per rank, chunk offsets in
bytes, the communicator's stream), its refusals, a failed call inside the group (named, and the
group still closed), the watchdog on a stuck all-to-all and on a stuck enqueue, and a library
older than NCCL 2.7 (it loads; only the all-to-all is refused). tests/gpu/ runs the real one."""

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = ["-std=c11", "-O1", "-g", "-Wall", "-Wextra", "-Werror", "-fno-omit-frame-pointer",
         "-fsanitize=address,undefined", "-fno-sanitize-recover=all"]


def _cuda_include():
    """A directory holding cuda_runtime_api.h (the declarations the fakes define), or None."""
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"]
    nvcc = shutil.which(os.environ.get("NVCC", "nvcc"))
    if nvcc:
        homes.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    for home in homes:
        if home and os.path.isfile(os.path.join(home, "include", "cuda_runtime_api.h")):
            return os.path.join(home, "include")
    return None


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cc = shutil.which(os.environ.get("CC", "cc"))
    inc = _cuda_include()
    if cc is None or inc is None:
        pytest.skip("needs a C compiler and the CUDA headers (cuda_runtime_api.h)")
    out = tmp_path_factory.mktemp("comm")
    comm = os.path.join(ROOT, "tests", "c", "comm")

    def build(args):
        r = subprocess.run([cc, *FLAGS, *args], capture_output=True, text=True, cwd=ROOT)
        assert r.returncode == 0, r.stderr

    build(["-fPIC", "-shared", os.path.join(comm, "fake_nccl.c"),
           "-o", str(out / "libfake_nccl.so")])
    build(["-fPIC", "-shared", "-DFAKE_NO_P2P", os.path.join(comm, "fake_nccl.c"),
           "-o", str(out / "libfake_nccl_old.so")])
    build(["-Icsrc", f"-I{inc}", "csrc/common/status.c", "csrc/comm/nccl_lib.c",
           "csrc/comm/communicator.c", os.path.join(comm, "fake_cudart.c"),
           os.path.join(comm, "test_comm.c"), "-lpthread", "-lm", "-ldl",
           "-o", str(out / "test_comm")])
    return out


@pytest.mark.parametrize("library,mode", [("libfake_nccl.so", "p2p"),
                                          ("libfake_nccl_old.so", "old")])
def test_nccl_core_against_a_stand_in_nccl(built, library, mode):
    r = subprocess.run([str(built / "test_comm"), str(built / library), mode],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.strip() == f"{mode}: 0 failure(s)"
