"""Builds zero_py and its C extensions.

zero_py._C: plain C11 compiled with the C compiler: no C++, no PyTorch headers, no CUDA, so
`pip install .` needs only setuptools in its build environment and finishes in seconds.

zero_py._cuda: the CUDA kernels (csrc/kernels/cuda/*.cu, compiled by nvcc for sm_80 and sm_90
plus PTX for newer GPUs) and the NCCL executor (csrc/comm/, C against the CUDA runtime's
headers; NCCL itself is loaded at run time), with the table contract it shares with the CPU
kernels (csrc/kernels/contract.c) but none of the CPU kernels, linked with the static CUDA
runtime so that the module needs no CUDA library at load time. Built when nvcc is found;
ZP_CUDA=0 skips it, ZP_CUDA=1 makes a missing or failing nvcc an error (by default a failed CUDA
build only warns, unless ZP_WERROR=1, as the Makefile sets). Other knobs: NVCC (the compiler),
CUDA_HOME, ZP_CUDA_ARCHS ("80;90": real architectures; PTX of the last is embedded too),
ZP_NCCL_INCLUDE (a directory with nccl.h: the build then checks csrc/comm/nccl_lib.h's
declarations against it; found by itself in an installed nvidia-nccl-cu* wheel or the
CUDA/system include directories).

ZP_WERROR=1 adds -Werror (users' compilers may warn differently).

Which files go into which module is csrc/sources.mk's, shared with the Makefile (zp_sources()).
"""

import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from concurrent.futures import ThreadPoolExecutor

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

WERROR = os.environ.get("ZP_WERROR") == "1"
SOURCES_MK = "csrc/sources.mk"


def zp_sources(path=SOURCES_MK):
    """The lists of csrc/sources.mk, {NAME: [file, ...]}: each `NAME := words` line, `$(NAME)`
    replaced by that earlier list, each word expanded as a glob (sorted, duplicates dropped).
    A word that matches no file, or a line outside that subset of make, is an error."""
    with open(path) as f:
        raw = f.read().splitlines()
    lists = {}
    num = 0
    while num < len(raw):
        first, line = num + 1, raw[num].split("#", 1)[0].rstrip()
        num += 1
        while line.endswith("\\") and num < len(raw):
            line = line[:-1] + " " + raw[num].split("#", 1)[0].rstrip()
            num += 1
        line = line.strip()
        if not line:
            continue
        m = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*)\s*:=\s*(.*)", line)
        if m is None:
            raise ValueError(f"{path}:{first}: not a `NAME := words` line: {line!r}")
        files = []
        for word in m.group(2).split():
            ref = re.fullmatch(r"\$\(([A-Za-z0-9_]+)\)", word)
            if ref is not None:
                if ref.group(1) not in lists:
                    raise ValueError(f"{path}:{first}: $({ref.group(1)}) is not defined above")
                found = lists[ref.group(1)]
            else:
                found = sorted(glob.glob(word))
                if not found:
                    raise ValueError(f"{path}:{first}: {word} matches no file")
            files += [f for f in found if f not in files]
        lists[m.group(1)] = files
    return lists


SOURCES = zp_sources()

c_flags = ["-std=c11", "-O3", "-fno-math-errno", "-Wall", "-Wextra"]
if WERROR:
    c_flags.append("-Werror")

extensions = [
    Extension(
        "zero_py._C",
        sources=SOURCES["ZP_C_MODULE_SRC"],
        depends=SOURCES["ZP_HEADERS"],
        include_dirs=["csrc"],
        extra_compile_args=c_flags,
        extra_link_args=["-pthread"],
        libraries=["m"],
    )
]


def _log(msg: str) -> None:
    print(f"zero_py setup: {msg}", file=sys.stderr, flush=True)


def _find_nvcc():
    for cand in (os.environ.get("NVCC"), shutil.which("nvcc"),
                 os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def _cuda_home(nvcc: str):
    """The toolkit root: CUDA_HOME/CUDA_PATH, else the directory above nvcc's bin, else
    /usr/local/cuda (a wrapper script in /usr/local/bin points nowhere useful)."""
    cands = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"),
             os.path.dirname(os.path.dirname(os.path.realpath(nvcc))), "/usr/local/cuda"]
    for c in cands:
        if c and os.path.isfile(os.path.join(c, "include", "cuda_runtime_api.h")):
            return c
    return None


def _cudart(home: str):
    for sub in ("lib64", "lib", "targets/x86_64-linux/lib", "targets/sbsa-linux/lib"):
        path = os.path.join(home, sub, "libcudart_static.a")
        if os.path.isfile(path):
            return path
    return None


def _nccl_include(home: str):
    cands = [os.environ.get("ZP_NCCL_INCLUDE")]
    for key in ("purelib", "platlib"):
        cands.append(os.path.join(sysconfig.get_paths()[key], "nvidia", "nccl", "include"))
    cands += [os.path.join(home, "include"), "/usr/include", "/usr/local/include"]
    for c in cands:
        if c and os.path.isfile(os.path.join(c, "nccl.h")):
            return c
    return None


def _cuda_extension():
    mode = os.environ.get("ZP_CUDA", "auto").strip().lower()
    if mode in ("0", "off", "no", "false"):
        _log("ZP_CUDA=0: zero_py._cuda is not built")
        return None
    required = mode in ("1", "on", "yes", "true")
    nvcc = _find_nvcc()
    home = _cuda_home(nvcc) if nvcc else None
    cudart = _cudart(home) if home else None
    if nvcc is None or home is None or cudart is None:
        what = ("nvcc" if nvcc is None else "the CUDA headers" if home is None
                else "libcudart_static.a")
        if required:
            raise RuntimeError(f"ZP_CUDA=1 but {what} was not found; set NVCC or CUDA_HOME")
        _log(f"no {what}: zero_py._cuda is not built (CPU only)")
        return None
    define_macros = []
    include_dirs = ["csrc", os.path.join(home, "include")]
    nccl_inc = _nccl_include(home)
    if nccl_inc is not None:
        define_macros.append(("ZP_HAVE_NCCL_H", "1"))
        include_dirs.append(nccl_inc)
        _log(f"checking csrc/comm/nccl_lib.h against {nccl_inc}/nccl.h")
    ext = Extension(
        "zero_py._cuda",
        sources=SOURCES["ZP_CUDA_MODULE_SRC"],
        depends=SOURCES["ZP_HEADERS"] + SOURCES["ZP_CUDA_CU_SRC"] + SOURCES["ZP_CUDA_CU_HEADERS"],
        include_dirs=include_dirs,
        define_macros=define_macros,
        extra_compile_args=c_flags,
        # the static runtime's symbols stay inside this module: a CUDA runtime that PyTorch
        # loaded (maybe another version) never interposes on ours, nor ours on it
        extra_link_args=["-pthread", "-Wl,--exclude-libs,ALL", "-Wl,-Bsymbolic"],
        libraries=["dl", "rt", "m", "stdc++"],  # nvcc's host code is C++
    )
    ext.zp_cuda = {"nvcc": nvcc, "home": home, "cudart": cudart, "required": required,
                   "cu": SOURCES["ZP_CUDA_CU_SRC"], "cu_headers": SOURCES["ZP_CUDA_CU_HEADERS"]}
    return ext


def _nvcc_flags():
    archs = [a.strip() for a in os.environ.get("ZP_CUDA_ARCHS", "80;90").split(";") if a.strip()]
    flags = ["-O3", "-std=c++17", "-Icsrc",
             # the numerics contract of kernels/cuda/elementwise.cuh: no contraction into fma,
             # IEEE division and square root, no flush to zero (nvcc's defaults, stated)
             "--fmad=false", "--prec-div=true", "--prec-sqrt=true", "--ftz=false",
             "-Xcompiler", "-fPIC,-ffp-contract=off,-fno-strict-aliasing,-Wall,-Wextra"]
    if WERROR:
        flags += ["--Werror", "all-warnings"]
    for a in archs:
        flags += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    flags += ["-gencode", f"arch=compute_{archs[-1]},code=compute_{archs[-1]}"]
    return flags


def _compile_in_parallel(compiler, workers: int) -> None:
    """Makes compiler.compile() run one compiler process per source file, `workers` at a time
    (distutils compiles an extension's sources one after another: the 40-odd files of
    zero_py._C took most of a build on a 2-core machine). The same steps as CCompiler.compile
    (_setup_compile, then _compile per object); a compiler without them keeps its own."""
    if workers < 2 or not all(hasattr(compiler, a) for a in
                              ("_setup_compile", "_get_cc_args", "_compile")):
        return

    def compile(sources, output_dir=None, macros=None, include_dirs=None, debug=0,
                extra_preargs=None, extra_postargs=None, depends=None):
        macros, objects, extra, pp_opts, build = compiler._setup_compile(
            output_dir, macros, include_dirs, sources, depends, extra_postargs)
        cc_args = compiler._get_cc_args(pp_opts, debug, extra_preargs)
        todo = [(obj, *build[obj]) for obj in objects if obj in build]
        with ThreadPoolExecutor(max_workers=workers) as pool:
            list(pool.map(lambda job: compiler._compile(job[0], job[1], job[2], cc_args, extra,
                                                        pp_opts), todo))
        return objects

    compiler.compile = compile


class BuildExt(build_ext):
    """Compiles each extension's C files in parallel, and the .cu files of zero_py._cuda with
    nvcc (in parallel) before linking it; a failure drops that module unless CUDA was
    required. The two extensions are built side by side (build_ext's own `parallel`)."""

    def finalize_options(self):
        super().finalize_options()
        if self.parallel is None:
            self.parallel = os.cpu_count() or 1

    def build_extensions(self):
        _compile_in_parallel(self.compiler, os.cpu_count() or 1)
        super().build_extensions()

    def build_extension(self, ext):
        cfg = getattr(ext, "zp_cuda", None)
        if cfg is None:
            return super().build_extension(ext)
        try:
            start = time.monotonic()
            ext.extra_objects = self._nvcc_all(cfg) + [cfg["cudart"]]
            super().build_extension(ext)
            _log(f"zero_py._cuda built in {time.monotonic() - start:.1f} s")
        except Exception as exc:  # noqa: BLE001 - any compiler failure
            if cfg["required"] or WERROR:
                raise
            _log(f"WARNING: zero_py._cuda failed to build and is skipped: {exc}")

    def _nvcc_all(self, cfg):
        out_dir = os.path.join(self.build_temp, "cuda")
        os.makedirs(out_dir, exist_ok=True)
        flags = _nvcc_flags()
        newest_header = max((os.path.getmtime(h) for h in cfg["cu_headers"]), default=0.0)

        def one(src):
            obj = os.path.join(out_dir, os.path.basename(src)[:-3] + ".o")
            if (not self.force and os.path.exists(obj)
                    and os.path.getmtime(obj) >= max(os.path.getmtime(src), newest_header)):
                return obj
            cmd = [cfg["nvcc"], "-c", src, "-o", obj] + flags
            _log(" ".join(cmd))
            done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True)
            if done.returncode != 0:
                raise RuntimeError(f"nvcc failed on {src}:\n{done.stdout}")
            if done.stdout.strip():
                _log(done.stdout.strip())
            return obj

        with ThreadPoolExecutor(max_workers=max(1, min(len(cfg["cu"]), os.cpu_count() or 1))) \
                as pool:
            return list(pool.map(one, cfg["cu"]))


if __name__ == "__main__":  # setuptools runs this file as __main__; tests import its functions
    cuda_ext = _cuda_extension()
    if cuda_ext is not None:
        extensions.append(cuda_ext)
    setup(ext_modules=extensions, cmdclass={"build_ext": BuildExt})
