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

.PHONY: all deps build test ctest pytest demo bench clean gpu-check

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
	@$(PYTHON) -c "import zero_py.kernels.cuda as c; m = c.native_module(); \
	print('zero_py._cuda', 'built' if m else 'not built', '(GPU: ' + (c.unavailable_reason() or 'usable') + ')')"

build/ctest: $(CORE_SRC) $(CTEST_SRC) $(wildcard csrc/*/*.h csrc/kernels/*/*.h tests/c/*.h)
	@mkdir -p build
	$(CC) $(CFLAGS_TEST) $(CORE_SRC) $(CTEST_SRC) -lpthread -lm -o $@

ctest: build/ctest
	./build/ctest

pytest: build
	$(PYTHON) -m pytest -q tests

test: ctest pytest

demo: build
	$(PYTHON) -m torch.distributed.run --standalone --nproc-per-node 2 -m zero_py.examples.demo

bench: build
	$(PYTHON) benchmarks/adamw_kernel.py
	$(PYTHON) -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/step_time.py

# On a machine with a GPU: builds (zero_py._cuda too), runs the GPU tests with ZP_REQUIRE_CUDA=1
# (a missing GPU fails instead of skipping) and the CPU tests of the CUDA code, then the GPU
# benchmark. Writes env.txt, tests.log, bench.log, gpu_adamw.md and summary.md to $(GPU_OUT)
# ($$OUT when set, else build/gpu-check); exits non-zero when the tests or the benchmark failed.
GPU_OUT ?= $(if $(OUT),$(OUT),build/gpu-check)

gpu-check: SHELL := /bin/bash
gpu-check: build
	@mkdir -p "$(GPU_OUT)"
	@{ date -u; nvidia-smi || echo "nvidia-smi: not found"; \
	  $(PYTHON) -c "import torch, zero_py.kernels.cuda as c, zero_py.collectives.nccl as n; \
	print('torch', torch.__version__, 'cuda', torch.version.cuda); \
	print('zero_py.kernels.cuda:', c.unavailable_reason() or 'usable'); \
	print('NCCL:', n.unavailable_reason() or n.load_nccl())"; } > "$(GPU_OUT)/env.txt" 2>&1; \
	cat "$(GPU_OUT)/env.txt"
	@set -o pipefail; \
	ZP_REQUIRE_CUDA=1 PYTHONUNBUFFERED=1 $(PYTHON) -m pytest -v -rs tests/gpu \
	  tests/test_cuda_kernels.py tests/test_cuda_build.py 2>&1 | tee "$(GPU_OUT)/tests.log"; \
	t=$$?; \
	PYTHONUNBUFFERED=1 $(PYTHON) benchmarks/gpu_adamw.py --out "$(GPU_OUT)/gpu_adamw.md" 2>&1 \
	  | tee "$(GPU_OUT)/bench.log"; \
	b=$$?; \
	{ echo "# make gpu-check, $$(date -u +%F)"; echo; \
	  echo "tests: exit $$t: $$(grep -v "^\s*$$" "$(GPU_OUT)/tests.log" | tail -n 1)"; \
	  echo "benchmark: exit $$b"; echo; \
	  cat "$(GPU_OUT)/gpu_adamw.md" 2>/dev/null; } > "$(GPU_OUT)/summary.md"; \
	cat "$(GPU_OUT)/summary.md"; \
	test $$t -eq 0 -a $$b -eq 0

clean:
	rm -rf build *.egg-info zero_py/_C*.so zero_py/_cuda*.so
