"""Builds zero_py and its C extension zero_py._C.

The extension is plain C11 compiled with the C compiler: no C++, no PyTorch headers, so
`pip install .` needs only setuptools in its build environment and finishes in seconds.
ZP_WERROR=1 adds -Werror (the Makefile sets it; users' compilers may warn differently).
"""

import glob
import os

from setuptools import Extension, setup

CORE_DIRS = ["common", "layout", "schedule", "kernels/cpu", "python"]
sources = sorted(s for d in CORE_DIRS for s in glob.glob(os.path.join("csrc", d, "*.c")))

extra_compile_args = ["-std=c11", "-O3", "-fno-math-errno", "-Wall", "-Wextra"]
if os.environ.get("ZP_WERROR") == "1":
    extra_compile_args.append("-Werror")

setup(
    ext_modules=[
        Extension(
            "zero_py._C",
            sources=sources,
            include_dirs=["csrc"],
            extra_compile_args=extra_compile_args,
            extra_link_args=["-pthread"],
            libraries=["m"],
        )
    ],
)
