"""The binding zero_py._C is the compiled C module, and its errors are Python exceptions whose
messages say what to change."""

import importlib.machinery

import pytest

import zero_py
from zero_py._native import _C


def test_the_c_extension_is_really_loaded():
    assert _C.__file__.endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))
    assert zero_py.kernels.cpu._C is _C


def test_layout_plan_shards_tile_each_bucket():
    plan = _C.layout_plan([10, 300, 7, 64], [0, 0, 1, 0], [0, 0, 0, 0], [4, 4, 4, 4], 4, 64,
                          512)
    for b, numel in enumerate(plan["bucket_numel"]):
        assert numel % (4 * 16) == 0
        assert plan["bucket_shard_numel"][b] * 4 == numel
    assert sorted(plan["bucket_params"]) == [0, 1, 2, 3]
    assert plan["padding_numel"] == sum(plan["buffer_numel"]) - (10 + 300 + 7 + 64)


@pytest.mark.parametrize("args,exc,match", [
    (([0], [0], [0], [4], 2, 64, 1024), ValueError, "0 elements"),
    (([4], [0], [0], [4], 0, 64, 1024), ValueError, "world_size must be >= 1"),
    (([4], [0], [0], [4], 2, 48, 1024), ValueError, "power of two"),
    (([4], [0], [0], [3], 2, 64, 1024), ValueError, "element size 3"),
    (([4, 4], [0], [0], [4], 2, 64, 1024), ValueError, "one entry per parameter"),
])
def test_layout_plan_errors_say_what_to_change(args, exc, match):
    with pytest.raises(exc, match=match):
        _C.layout_plan(*args)


def test_schedule_releases_buckets_in_order():
    s = _C.Schedule([1, 0, 1, 2], 3)
    assert s.grad_ready(0) == ()           # bucket 1 waits for bucket 0
    assert s.grad_ready(2) == ()
    assert s.grad_ready(1) == (0, 1)       # bucket 0 complete: 0 and 1 go, in order
    assert s.flush() == (2,)
    with pytest.raises(RuntimeError, match="after the end of backward"):
        s.grad_ready(3)
    s.reset()
    assert s.released == 0 and not s.is_ready(0)
    s.grad_ready(1)
    with pytest.raises(RuntimeError, match="twice"):
        s.grad_ready(1)
    with pytest.raises(IndexError, match="outside"):
        s.grad_ready(4)


def test_schedule_rejects_empty_buckets():
    with pytest.raises(ValueError, match="bucket 1 holds no parameter"):
        _C.Schedule([0, 0, 2], 3)
