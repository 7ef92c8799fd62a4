# zero_py: `make demo` runs the main job, `make test` runs every check: the C tests, the wheel
# (wheel-check), ruff (lint) and the Python tests.
# All install what is missing first. torch is pinned to the CPU build this machine carries
# (never an unpinned torch: pip would fetch several GB of CUDA wheels); users need torch>=2.4.

PYTHON ?= python3
TORCH_PIN ?= torch==2.13.0
CC ?= gcc

# Which C files make up the core and each module: csrc/sources.mk, setup.py reads it too.
include csrc/sources.mk
CORE_SRC := $(wildcard $(ZP_CORE_SRC))
CTEST_SRC := $(wildcard tests/c/*.c)
CFLAGS_TEST := -std=c11 -O1 -g -Wall -Wextra -Werror -fno-omit-frame-pointer \
               -fsanitize=address,undefined -fno-sanitize-recover=all -Icsrc -Itests/c

.PHONY: peers all deps build install gpu-wheels test test-long test-torch ctest fuzz soak wheel-check lint pytest demo bench bench-bodies clean gpu-check

all: build

# DeepSpeed, the benchmarks' peer (pyproject's `peers` extra): installed without its dependencies
# so that pip never touches torch, then those it needs; libaio-dev for its aio op (NVMe).
# DeepSpeed builds its CPU ops itself at first use (minutes).
peers: deps
	$(PYTHON) -m pip install --no-deps "deepspeed>=0.15"
	$(PYTHON) -m pip install hjson ninja py-cpuinfo "pydantic>=2" msgpack einops psutil
	@$(PYTHON) -c "import torch; print('torch', torch.__version__, '(unchanged)')"
	-@command -v apt-get >/dev/null && apt-get install -y -q libaio-dev >/dev/null

deps:
	@$(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install "$(TORCH_PIN)"
	@$(PYTHON) -c "import pytest" 2>/dev/null || $(PYTHON) -m pip install pytest
	@# pytest-xdist (make test's two workers) needs execnet and pytest only: torch is left alone
	@$(PYTHON) -c "import xdist" 2>/dev/null || $(PYTHON) -m pip install "pytest-xdist>=3.0" || \
	  echo "pytest-xdist did not install: make test runs pytest in one process (slower)"
	@# setuptools >= 77: pyproject.toml's SPDX license; it also builds wheels without `wheel`
	@$(PYTHON) -c "import sys, setuptools as s; sys.exit(int(s.__version__.split('.')[0]) < 77)" \
	  2>/dev/null || $(PYTHON) -m pip install "setuptools>=77"
	@$(PYTHON) -m ruff --version >/dev/null 2>&1 || $(PYTHON) -m pip install ruff
	@# safetensors (checkpoint files) has no Python dependencies: it leaves torch alone
	@$(PYTHON) -c "import safetensors" 2>/dev/null || $(PYTHON) -m pip install "safetensors>=0.4"
	@# transformers (the Hugging Face model tests) does not depend on torch; accelerate (its
	@# Trainer, tested with zero_py.integrations.hf_trainer) does: torch is pinned to the
	@# installed build, and checked after
	@$(PYTHON) -c "import importlib.util as u, sys; \
	  sys.exit(not (u.find_spec('transformers') and u.find_spec('accelerate')))" || { \
	  v=$$($(PYTHON) -c "import torch; print(torch.__version__)") && \
	  $(PYTHON) -m pip install "transformers>=4.40" "accelerate>=1.1" "torch==$$v" && \
	  $(PYTHON) -c "import sys, torch; v = torch.__version__; \
	  sys.exit(0 if v == '$$v' else 'installing transformers changed torch $$v to ' + v)"; }
	@# tqdm (the demo's progress bar) and matplotlib (python -m zero_py plot, its tests): neither
	@# depends on torch; torch is pinned to the installed build all the same, and checked after
	@$(PYTHON) -c "import tqdm, matplotlib" 2>/dev/null || { \
	  v=$$($(PYTHON) -c "import torch; print(torch.__version__)") && \
	  $(PYTHON) -m pip install "tqdm>=4.60" "matplotlib>=3.5" "torch==$$v" && \
	  $(PYTHON) -c "import sys, torch; v = torch.__version__; \
	  sys.exit(0 if v == '$$v' else 'installing tqdm/matplotlib changed torch $$v to ' + v)"; }

# Editable install, without dependencies (torch is handled above) and without build
# isolation (the build needs only setuptools, which is already here).
# ZP_WERROR=1: warnings fail the build here (gpu-check's machine, whose compilers may warn of
# more, builds with 0).
ZP_WERROR ?= 1

build: deps install

# The install alone, with nothing fetched: for a machine without a network (gpu-check's), whose
# own torch and pytest are used. It needs setuptools >= 77 (pyproject.toml's SPDX license).
install:
	ZP_WERROR=$(ZP_WERROR) $(PYTHON) -m pip install -q --no-deps --no-build-isolation -e .
	@$(PYTHON) -c "import zero_py._C as c; print('zero_py._C built, CPU kernels:', c.cpu_isa())"
	@$(PYTHON) -c "import zero_py.kernels.cuda as c; m = c.native_module(); \
	print('zero_py._cuda', 'built' if m else 'not built', '(GPU: ' + (c.unavailable_reason() or 'usable') + ')')"

# The C tests and the bodies' benchmark are compiled one object per source file, the objects
# side by side (a sub-make with -j: `make test` itself runs one target at a time), each object
# rebuilt when its file, csrc/sources.mk or any header changes.
NPROC := $(shell nproc 2>/dev/null || echo 1)
C_HEADERS := $(wildcard $(ZP_HEADERS) tests/c/*.h)
CFLAGS_BENCH := -std=c11 -O3 -fno-math-errno -Wall -Wextra -Werror -Icsrc
CTEST_OBJ := $(patsubst %.c,build/obj-test/%.o,$(CORE_SRC) $(CTEST_SRC))
BODIES_OBJ := $(patsubst %.c,build/obj-bench/%.o,benchmarks/optim_bodies.c $(CORE_SRC))

build/obj-test/%.o: %.c csrc/sources.mk $(C_HEADERS)
	@mkdir -p $(@D)
	$(CC) $(CFLAGS_TEST) -c $< -o $@

build/obj-bench/%.o: %.c csrc/sources.mk $(C_HEADERS)
	@mkdir -p $(@D)
	$(CC) $(CFLAGS_BENCH) -c $< -o $@

build/ctest: $(CTEST_OBJ)
	$(CC) $(CFLAGS_TEST) $^ -lpthread -lm -o $@

# ... and the optimizer bodies' benchmark at a size that times nothing: it builds (so it does
# not rot) and checks every body against the scalar one, bit for bit, at 1001 elements.
ctest:
	@$(MAKE) --no-print-directory -j$(NPROC) build/ctest build/optim_bodies
	./build/ctest
	./build/optim_bodies 1001 1 1 > /dev/null

# Coverage-guided fuzzing of the pure C layers (libFuzzer + ASan + UBSan, built with clang):
# one harness per noun in tests/fuzz/ (layout, schedule, prefetch, and contract: the optimizer
# tables' checks), each run for FUZZ_SECONDS after replaying its kept crash inputs
# (tests/fuzz/regressions/<harness>/). Not part of `make test`. Logs, corpus and any crash
# input go to build/fuzz/ (tests/fuzz/run.sh).
# clang is its one tool (Debian's clang package brings libFuzzer): installed when missing.
FUZZ_SECONDS ?= 60
FUZZ_HARNESSES := layout schedule prefetch contract
FUZZ_CC ?= clang
FUZZ_SRC := csrc/common/status.c csrc/layout/layout.c csrc/schedule/schedule.c \
            csrc/schedule/prefetch.c csrc/kernels/contract.c
FUZZ_FLAGS := -std=c11 -g -O1 -Wall -Wextra -Werror -fsanitize=fuzzer,address,undefined \
              -fno-sanitize-recover=all -Icsrc -Itests/fuzz

build/fuzz/fuzz_%: tests/fuzz/fuzz_%.c tests/fuzz/fuzz_input.h $(FUZZ_SRC) \
                   $(wildcard $(ZP_HEADERS))
	@mkdir -p build/fuzz
	$(FUZZ_CC) $(FUZZ_FLAGS) $(FUZZ_SRC) $< -lm -o $@

fuzz:
	@mkdir -p build/fuzz
	@printf 'int LLVMFuzzerTestOneInput(const char *d, long n) { return (int)(d - d + n * 0); }\n' \
	  > build/fuzz/probe.c
	@$(FUZZ_CC) -fsanitize=fuzzer build/fuzz/probe.c -o build/fuzz/probe 2>/dev/null || { \
	  echo "fuzz: installing clang (libFuzzer) with apt-get"; \
	  s=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$s apt-get install -y clang || { $$s apt-get update && $$s apt-get install -y clang; }; }
	@$(MAKE) --no-print-directory FUZZ_CC=$(FUZZ_CC) $(addprefix build/fuzz/fuzz_,$(FUZZ_HARNESSES))
	tests/fuzz/run.sh $(FUZZ_SECONDS) $(FUZZ_HARNESSES)

# Leak soak, outside `make test` (about two minutes): 1000 steps of stages 2 and 3 at 2 ranks
# with evaluation forwards, clipping and checkpoint saves and loads; fails when RSS, file
# descriptors, threads or /dev/shm files keep growing (benchmarks/soak.py). SOAK_STEPS=N.
SOAK_STEPS ?= 1000

soak: build
	$(PYTHON) -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/soak.py \
	  --stage 2 --steps $(SOAK_STEPS)
	$(PYTHON) -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/soak.py \
	  --stage 3 --steps $(SOAK_STEPS)

# The wheel as users get it: built from the sdist (so MANIFEST.in is tested too) and installed
# into a fresh venv under build/ that sees this machine's packages (torch) but not the source
# tree, where every module must import from the venv (tests/packaging/check_wheel.py): a
# subpackage or extension missing from the wheel fails here rather than for a user.
WHEEL_DIR := build/wheel
WHEEL_VENV := build/wheel-venv

wheel-check: deps
	@# a stale *.egg-info/SOURCES.txt is read back into the sdist: it would hide a missing file
	rm -rf $(WHEEL_DIR) $(WHEEL_VENV) *.egg-info
	$(PYTHON) setup.py -q sdist -d $(WHEEL_DIR)
	ZP_WERROR=1 $(PYTHON) -m pip wheel -q --no-deps --no-build-isolation -w $(WHEEL_DIR) \
	  $(WHEEL_DIR)/zero_py-*.tar.gz
	$(PYTHON) -m venv --system-site-packages --without-pip $(WHEEL_VENV)
	$(WHEEL_VENV)/bin/python -m pip install -q --no-deps --no-index $(WHEEL_DIR)/zero_py-*.whl
	cd $(WHEEL_VENV) && bin/python -I $(CURDIR)/tests/packaging/check_wheel.py \
	  $(CURDIR)/$(WHEEL_DIR)/zero_py-*.whl $(CURDIR)/zero_py

lint: deps
	$(PYTHON) -m ruff check zero_py tests benchmarks setup.py

# Two pytest workers (pytest-xdist), each taking whole files (their module fixtures run once):
# most tests wait on their ranks, gloo and subprocesses more than they compute. The fault
# injection runs alone afterwards: it starts ~25 ranks at once, each bound to connect and to
# raise within its process group's timeout. PYTEST_WORKERS=0 runs everything in one process.
PYTEST_WORKERS ?= 2
SERIAL_TESTS = tests/test_fault_injection.py
pytest: build
	@if [ "$(PYTEST_WORKERS)" != 0 ] && $(PYTHON) -c "import xdist" 2>/dev/null; then \
	  workers="-n $(PYTEST_WORKERS) --dist loadfile"; \
	else echo "pytest: one process (PYTEST_WORKERS=0, or pytest-xdist is missing)"; workers=; fi; \
	set -x; $(PYTHON) -m pytest -q -p no:benchmark $$workers -m "not slow" \
	  $(addprefix --ignore=,$(SERIAL_TESTS)) tests
	$(PYTHON) -m pytest -q -p no:benchmark -m "not slow" $(SERIAL_TESTS)

# Every Python test, the slow ones too (measured memory, many processes; tens of minutes).
test-long: build
	$(PYTHON) -m pytest -q tests

test: ctest wheel-check lint pytest

# The Python tests under another release of torch (pyproject accepts torch>=2.4), in a venv of
# its own under build/ with this checkout's extension (it does not link against torch):
# `make test-torch TORCH_VERSION=2.4.0`. PyPI's x86_64 wheels are CUDA builds: several GB the
# first time; they run on the CPU.
TORCH_VERSION ?= 2.14.1
TORCH_VENV ?= build/venv-torch-$(TORCH_VERSION)
test-torch: install
	@test -x $(TORCH_VENV)/bin/python || $(PYTHON) -m venv $(TORCH_VENV)
	@$(TORCH_VENV)/bin/python -c "import torch, pytest, safetensors, transformers, tqdm, matplotlib" \
	  2>/dev/null || $(TORCH_VENV)/bin/pip install -q "torch==$(TORCH_VERSION)" pytest \
	  "safetensors>=0.4" "transformers>=4.40" "tqdm>=4.60" "matplotlib>=3.5"
	@$(TORCH_VENV)/bin/python -c "import sys, torch; v = torch.__version__.split('+')[0]; \
	  sys.exit(0 if v == '$(TORCH_VERSION)' else 'the venv has torch ' + v)"
	PYTHONPATH=$(CURDIR) $(TORCH_VENV)/bin/python -m pytest -q -m "not slow" tests

# The demo, then its plots: per-rank memory against world size per stage (estimated, and
# measured by short runs at 1, 2 and 4 ranks beside the demo's own) and the step-time breakdown
DEMO_OUT ?= build/demo

demo: build
	$(PYTHON) -m torch.distributed.run --standalone --nproc-per-node 2 -m zero_py.examples.demo \
	  --json $(DEMO_OUT)/demo.json
	$(PYTHON) -m zero_py plot --json $(DEMO_OUT)/demo.json --out $(DEMO_OUT)
	@echo "plots: $(CURDIR)/$(DEMO_OUT)/memory.png and $(CURDIR)/$(DEMO_OUT)/step_time.png"

bench: build
	$(PYTHON) benchmarks/adamw_kernel.py
	$(PYTHON) -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/step_time.py

# The optimizer bodies alone (benchmarks/optim_bodies.c): one thread, data in L2, each body
# checked against the scalar one bit for bit, then timed in ns per element; which body to tune
# when optim_kernels.py's step falls short of its bound on a CPU.
build/optim_bodies: $(BODIES_OBJ)
	$(CC) $(CFLAGS_BENCH) $^ -lpthread -lm -o $@

bench-bodies: build/optim_bodies
	./build/optim_bodies

# On a machine with a GPU: builds (zero_py._cuda too, ZP_CUDA=1: a failed nvcc is an error;
# nothing is fetched: `install`), runs the GPU tests with ZP_REQUIRE_CUDA=1 (a missing GPU fails
# instead of skipping) and the CPU tests of the CUDA code (GPU_PYTEST_N workers when
# pytest-xdist is there), then the GPU benchmarks: kernels; step time of DDP, stages 1-3, FSDP2
# and ZeRO-Offload; and ZeRO-Offload alone at batch GPU_OFFLOAD_BATCH (the share of the host
# step hidden behind backward) with one step's timeline; the CPU kernels on the host (an x86
# other than this one). Writes env.txt, tests.log, bench.log, gpu_adamw.md, step_time.log,
# gpu_step_time.md, offload.log, gpu_offload.md, offload_timeline.txt, host_kernels.txt and
# summary.md to $(GPU_OUT)
# ($$OUT when set, else build/gpu-check); exits non-zero when the tests or a benchmark failed.
GPU_OUT ?= $(if $(OUT),$(OUT),build/gpu-check)

# The wheels gpu-check's machine lacks (it has no network), into .whl/ (ignored by git) for its
# Python (GPU_PY): setuptools >= 77, and DeepSpeed built here (no ops: it builds them there at
# first use) with what it needs, for the ZeRO-Offload comparison (ds2, ds2-cpu), which
# gpu-check runs when deepspeed imports. Carry .whl with the command and install it there
# first (docs/cuda.md, section 6).
GPU_PY ?= 3.12
GPU_PLATFORMS := --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
                 --platform manylinux2014_x86_64

gpu-wheels:
	mkdir -p .whl build/ds-sdist
	$(PYTHON) -m pip download -q --only-binary=:all: --python-version $(GPU_PY) \
	  --implementation cp $(GPU_PLATFORMS) -d .whl "setuptools>=77" hjson "pydantic>=2"
	$(PYTHON) -m pip download -q --no-deps --no-binary=:all: -d build/ds-sdist "deepspeed>=0.15"
	DS_BUILD_OPS=0 $(PYTHON) -m pip wheel -q --no-deps --no-build-isolation -w .whl \
	  build/ds-sdist/deepspeed-*.tar.gz
	@ls .whl

GPU_OFFLOAD_BATCH ?= 32
GPU_PYTEST_N ?= 4

gpu-check: SHELL := /bin/bash
gpu-check: ZP_WERROR := 0
gpu-check: export ZP_CUDA := 1
gpu-check: install
	@mkdir -p "$(GPU_OUT)"
	@{ date -u; nvidia-smi || echo "nvidia-smi: not found"; \
	  $(PYTHON) -c "import torch, zero_py.kernels.cuda as c, zero_py.collectives.nccl as n; \
	print('torch', torch.__version__, 'cuda', torch.version.cuda); \
	print('zero_py.kernels.cuda:', c.unavailable_reason() or 'usable'); \
	print('NCCL:', n.unavailable_reason() or n.load_nccl())"; } > "$(GPU_OUT)/env.txt" 2>&1; \
	cat "$(GPU_OUT)/env.txt"
	@set -o pipefail; \
	n=$$($(PYTHON) -c "import xdist" 2>/dev/null && echo "-n $(GPU_PYTEST_N)"); \
	ZP_REQUIRE_CUDA=1 PYTHONUNBUFFERED=1 $(PYTHON) -m pytest -v -rs $$n tests/gpu \
	  tests/test_cuda_kernels.py tests/test_cuda_build.py 2>&1 | tee "$(GPU_OUT)/tests.log"; \
	t=$$?; \
	PYTHONUNBUFFERED=1 $(PYTHON) benchmarks/gpu_adamw.py --out "$(GPU_OUT)/gpu_adamw.md" 2>&1 \
	  | tee "$(GPU_OUT)/bench.log"; \
	b=$$?; \
	PYTHONUNBUFFERED=1 $(PYTHON) benchmarks/gpu_step_time.py --out "$(GPU_OUT)/gpu_step_time.md" \
	  2>&1 | tee "$(GPU_OUT)/step_time.log"; \
	s=$$?; \
	ds=$$($(PYTHON) -c "import deepspeed" >/dev/null 2>&1 && echo ",ds2,ds2-cpu"); \
	PYTHONUNBUFFERED=1 $(PYTHON) benchmarks/gpu_step_time.py \
	  --only z2,z2-cpu,z2-cpu-ov,z2-cpu-sync$$ds \
	  --batch-size $(GPU_OFFLOAD_BATCH) --out "$(GPU_OUT)/gpu_offload.md" 2>&1 \
	  | tee "$(GPU_OUT)/offload.log"; \
	o=$$?; \
	PYTHONUNBUFFERED=1 timeout 180 $(PYTHON) benchmarks/gpu_offload_timeline.py \
	  --batch-size $(GPU_OFFLOAD_BATCH) > "$(GPU_OUT)/offload_timeline.txt" 2>&1; \
	PYTHONUNBUFFERED=1 timeout 300 $(PYTHON) benchmarks/optim_kernels.py --sizes 10,30 \
	  --kinds adamw,sgd --params fp32,bf16 \
	  --variants "ZP_CPU_SPLIT=static;ZP_CPU_PREFETCH=0;ZP_CPU_ISA=avx2" \
	  > "$(GPU_OUT)/host_kernels.txt" 2>&1; \
	{ echo "# make gpu-check, $$(date -u +%F)"; echo; \
	  echo "tests: exit $$t: $$(grep -v "^\s*$$" "$(GPU_OUT)/tests.log" | tail -n 1)"; \
	  echo "kernel benchmark: exit $$b"; echo "step-time benchmark: exit $$s"; \
	  echo "offload benchmark: exit $$o"; echo; \
	  cat "$(GPU_OUT)/gpu_adamw.md" 2>/dev/null; echo; \
	  cat "$(GPU_OUT)/gpu_step_time.md" 2>/dev/null; echo; \
	  cat "$(GPU_OUT)/gpu_offload.md" 2>/dev/null; echo; \
	  echo "## One offloaded step (host ms from the start of backward; offload_timeline.txt)"; \
	  grep -E "^## |backward returned|GPU backward done|finish|settle|host.step|step returned" \
	    "$(GPU_OUT)/offload_timeline.txt"; echo; \
	  echo "## The CPU kernels on this machine's host (host_kernels.txt)"; \
	  grep -E "^CPU:|^\| [0-9]+M \| (fp32|bf16) \| [a-z]+ \| [0-9.]+x \(" \
	    "$(GPU_OUT)/host_kernels.txt"; } > "$(GPU_OUT)/summary.md"; \
	cat "$(GPU_OUT)/summary.md"; \
	test $$t -eq 0 -a $$b -eq 0 -a $$s -eq 0 -a $$o -eq 0

clean:
	rm -rf build dist *.egg-info zero_py/_C*.so zero_py/_cuda*.so
