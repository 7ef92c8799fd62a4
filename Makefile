# zero_py: `make demo` runs the main job, `make test` runs every test (C and Python).
# Both install what is missing first. torch is pinned to the CPU build this machine carries
# (never an unpinned torch: pip would fetch several GB of CUDA wheels); users need torch>=2.4.

PYTHON ?= python3
TORCH_PIN ?= torch==2.13.0
CC ?= gcc

CORE_SRC := $(wildcard csrc/common/*.c csrc/layout/*.c csrc/schedule/*.c csrc/kernels/cpu/*.c)
CTEST_SRC := $(wildcard tests/c/*.c)
CFLAGS_TEST := -std=c11 -O1 -g -Wall -Wextra -Werror -fno-omit-frame-pointer \
               -fsanitize=address,undefined -fno-sanitize-recover=all -Icsrc -Itests/c

.PHONY: all deps build test ctest pytest demo bench clean

all: build

deps:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install "$(TORCH_PIN)"
	@$(PYTHON) -c "import pytest" 2>/dev/null || $(PYTHON) -m pip install pytest
	@$(PYTHON) -c "import setuptools" 2>/dev/null || $(PYTHON) -m pip install "setuptools>=64"

# Editable install, without dependencies (torch is handled above) and without build
# isolation (the build needs only setuptools, which is already here).
build: deps
	ZP_WERROR=1 $(PYTHON) -m pip install -q --no-deps --no-build-isolation -e .
	@$(PYTHON) -c "import zero_py._C as c; print('zero_py._C built, CPU kernels:', c.cpu_isa())"

build/ctest: $(CORE_SRC) $(CTEST_SRC) $(wildcard csrc/*/*.h csrc/kernels/*/*.h tests/c/*.h)
	@mkdir -p build
	$(CC) $(CFLAGS_TEST) $(CORE_SRC) $(CTEST_SRC) -lpthread -lm -o $@

ctest: build/ctest
	./build/ctest

pytest: build
	$(PYTHON) -m pytest -q tests

test: ctest pytest

demo: build
	$(PYTHON) -m torch.distributed.run --standalone --nproc-per-node 2 -m zero_py.demo

bench: build
	$(PYTHON) benchmarks/adamw_kernel.py
	$(PYTHON) -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/step_time.py

clean:
	rm -rf build *.egg-info zero_py/_C*.so
