"""GPU tests: skipped, with the reason, where the CUDA path cannot run (no GPU, torch without
CUDA, zero_py._cuda not built); `make gpu-check` sets ZP_REQUIRE_CUDA=1, which turns that skip
into a failure, so that a GPU run can never pass by skipping everything."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/

from zero_py.kernels import cuda  # noqa: E402


def pytest_collection_modifyitems(config, items):
    why = cuda.unavailable_reason()
    if why is None:
        return
    if os.environ.get("ZP_REQUIRE_CUDA") == "1":
        raise pytest.UsageError(f"ZP_REQUIRE_CUDA=1 but the CUDA path cannot run: {why}")
    here = os.path.dirname(os.path.abspath(__file__))
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.skip(reason=f"no usable GPU: {why}"))
