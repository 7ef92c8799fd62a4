# sources.mk - which files make up each build product: the one list, read by the Makefile
# (`include csrc/sources.mk`, then $(wildcard ...)) and by setup.py (zp_sources()).
#
# Keep to the subset of make that setup.py reads: `NAME := words` lines (a trailing backslash
# continues a line), comments, and `$(NAME)` for a list defined above. A word is a path or a
# glob, relative to the repository root; make's $(wildcard) and Python's glob expand it alike,
# and setup.py refuses a word that matches no file.

# The C core: the pure layers, the table contract of the kernel families, the CPU kernel
# family and the I/O helpers (checksums). Plain C11: no Python, no CUDA. The C tests
# (`make ctest`) link exactly this.
ZP_CORE_SRC := csrc/common/*.c csrc/layout/*.c csrc/schedule/*.c csrc/kernels/contract.c \
               csrc/kernels/cpu/*.c csrc/io/*.c

# zero_py._C: the core and its CPython binding.
ZP_C_MODULE_SRC := $(ZP_CORE_SRC) csrc/python/module.c csrc/python/prefetch_py.c \
                   csrc/python/io_py.c csrc/python/quantize_py.c

# zero_py._cuda, its C part (the C compiler): status and threads, the table contract, the NCCL
# executor and the binding. Not the CPU kernel family: the kernels are the .cu files below.
ZP_CUDA_MODULE_SRC := csrc/common/*.c csrc/kernels/contract.c csrc/comm/*.c \
                      csrc/python/cuda_module.c csrc/python/nccl_py.c

# zero_py._cuda, its CUDA part (nvcc), and the headers those files include: a change to one of
# these headers recompiles every .cu file.
ZP_CUDA_CU_SRC := csrc/kernels/cuda/*.cu
ZP_CUDA_CU_HEADERS := csrc/kernels/cuda/*.cuh csrc/kernels/cuda/*.h csrc/kernels/*.h \
                      csrc/common/status.h

# Every C header: a change to one rebuilds the C extensions and the C tests.
ZP_HEADERS := csrc/*/*.h csrc/*/*/*.h
