"""The C core never aborts on extreme sizes: zero_py._C's planner and schedules answer a value
outside their range (2**62 bytes of alignment, 2**31 ranks, numel past 2**56, counts past
int32 or int64) with a ValueError or OverflowError that names the argument and its allowed
range. Before the fix, layout_plan with align_bytes=2**62 and world_size=4 killed the process
with SIGFPE; the fuzzer's crash inputs (tests/fuzz/regressions/) are replayed here too."""

import subprocess
import sys

import pytest

from zero_py._native import _C

P = 2**62
I64 = 2**63 - 1
I32 = 2**31 - 1


def plan(numels=(1,), groups=None, buffers=None, elem_sizes=None, world_size=1, align_bytes=64,
         bucket_bytes=1 << 20):
    n = len(numels)
    return _C.layout_plan(list(numels), list(groups or [0] * n), list(buffers or [0] * n),
                          list(elem_sizes or [4] * n), world_size, align_bytes, bucket_bytes)


def test_the_reported_sigfpe_is_a_value_error_in_a_fresh_process():
    """The issue's input, run in a child so that a regression shows as a signal here rather
    than killing the test session."""
    code = ("import zero_py._C as C\n"
            "try:\n"
            "    C.layout_plan([1], [0], [0], [1], 4, 2**62, 1 << 20)\n"
            "except ValueError as e:\n"
            "    print('ValueError:', e)\n")
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=120)
    assert child.returncode == 0, f"exit {child.returncode}: {child.stderr[-2000:]}"
    assert "align_bytes must be a power of two in [1, 2**30]" in child.stdout


@pytest.mark.parametrize("world_size", [1, 2, 4, 14, 4096, I32])
@pytest.mark.parametrize("align_bytes", [2**31, 2**61, P, I64, -P, -(2**63), 0, 3, 48])
def test_layout_plan_refuses_alignments_outside_1_to_2_30(world_size, align_bytes):
    match = r"align_bytes must be a power of two in \[1, 2\*\*30\]"
    with pytest.raises(ValueError, match=match):
        plan(elem_sizes=[1], world_size=world_size, align_bytes=align_bytes)


# (what, kwargs, exception, message)
LAYOUT_LIMITS = [
    ("align past int64", dict(align_bytes=2**70), OverflowError,
     r"layout_plan: align_bytes must be a power of two in \[1, 2\*\*30\], got "
     r"1180591620717411303424"),
    ("world_size past int32", dict(world_size=2**40), OverflowError,
     r"layout_plan: world_size must be in \[1, 2\*\*31-1\], got 1099511627776"),
    ("world_size -2**31", dict(world_size=-(2**31)), ValueError, "world_size must be >= 1"),
    ("world_size 0", dict(world_size=0), ValueError, "world_size must be >= 1"),
    ("bucket_bytes past int64", dict(bucket_bytes=-(2**64)), OverflowError,
     r"bucket_bytes must be in \[1, 2\*\*63-1\]"),
    ("bucket_bytes -2**63", dict(bucket_bytes=-(2**63)), ValueError,
     r"bucket_bytes must be in \[1, 2\*\*63-1\]"),
    ("numel past int64", dict(numels=[2**64]), OverflowError, r"numels\[0\] must be in \[1, "),
    ("numel 2**63-1", dict(numels=[I64]), ValueError,
     "parameter 0 has 9223372036854775807 elements of 4 bytes; numel \\* elem_size must be at "
     "most 2\\*\\*56 bytes"),
    ("numel 2**62 of 4 bytes", dict(numels=[P]), ValueError, "at most 2\\*\\*56 bytes"),
    ("numel -2**63", dict(numels=[-(2**63)]), ValueError, "parameter 0 has .* elements"),
    ("numels adding up past 2**56", dict(numels=[2**51] * 64, elem_sizes=[8] * 64,
                                         bucket_bytes=I64), ValueError,
     "the parameters, each aligned, need more than 2\\*\\*56 bytes"),
    ("padding past 2**56", dict(world_size=I32, align_bytes=2**30, elem_sizes=[1]), ValueError,
     "padded to world_size \\* align_bytes, need more than 2\\*\\*56 bytes .*world_size="
     "2147483647, align_bytes=1073741824"),
    ("group past int32", dict(groups=[2**40]), OverflowError,
     r"groups\[0\] must be in \[0, 2\*\*31-1\]"),
    ("group -2**31", dict(groups=[-(2**31)]), ValueError, "groups are >= 0"),
    ("buffer past int32", dict(buffers=[2**32]), OverflowError,
     r"buffers\[0\] must be in \[0, 64\)"),
    ("buffer 2**31-1", dict(buffers=[I32]), ValueError, r"buffer ids are in \[0, 64\)"),
    ("elem_size past int32", dict(elem_sizes=[2**35]), OverflowError,
     r"elem_sizes\[0\] must be 1, 2, 4 or 8"),
    ("elem_size -2**31", dict(elem_sizes=[-(2**31)]), ValueError, "use 1, 2, 4 or 8"),
    ("a float size", dict(world_size=2.0), TypeError, "cannot be interpreted as an integer"),
]


@pytest.mark.parametrize("what,kwargs,exc,match", LAYOUT_LIMITS,
                         ids=[c[0] for c in LAYOUT_LIMITS])
def test_layout_plan_extreme_sizes_name_the_argument(what, kwargs, exc, match):
    with pytest.raises(exc, match=match):
        plan(**kwargs)


# The planner's crash inputs the fuzzer found before the fix (tests/fuzz/regressions/layout/,
# decoded): one-byte parameters, alignment 2**61 or 2**62.
FUZZ_CRASHES = [
    ("ubsan-world14-align2p61", 29, 14, 2**61, 2**54),
    ("ubsan-world4096-align2p62", 27, 4096, P, 3200),
    ("ubsan-world2p31-align2p62", 29, I32, P, P),
]


@pytest.mark.parametrize("name,n,world_size,align_bytes,bucket_bytes", FUZZ_CRASHES,
                         ids=[c[0] for c in FUZZ_CRASHES])
def test_layout_plan_fuzzer_crash_inputs(name, n, world_size, align_bytes, bucket_bytes):
    with pytest.raises(ValueError, match="align_bytes"):
        plan([1] * n, elem_sizes=[1] * n, world_size=world_size, align_bytes=align_bytes,
             bucket_bytes=bucket_bytes)


def test_layout_plan_edges_that_are_allowed():
    p = plan(elem_sizes=[1], align_bytes=2**30, bucket_bytes=I64)
    assert p["bucket_numel"] == [2**30] and p["padding_numel"] == 2**30 - 1
    p = plan([2**56], elem_sizes=[1], align_bytes=1)
    assert p["shard_numel"] == 2**56
    p = plan(elem_sizes=[1], world_size=I32, align_bytes=1)
    assert p["bucket_numel"] == [I32] and p["bucket_shard_numel"] == [1]


SCHEDULE_LIMITS = [
    ("n_buckets 2**31-1 (8 GiB asked for before)", ([0, 0], I32), ValueError,
     r"n_buckets=2147483647 exceeds the 2 parameters; .* must be in \[1, n_params\]"),
    ("n_buckets past int32", ([0, 0], 2**40), OverflowError,
     r"Schedule: n_buckets must be in \[1, len\(param_bucket\)\]"),
    ("n_buckets -2**31", ([0, 0], -(2**31)), ValueError, "needs >= 1 parameter and bucket"),
    ("bucket id past int32", ([0, 2**40], 2), OverflowError,
     r"param_bucket\[1\] must be a bucket id in \[0, n_buckets\)"),
    ("bucket id 2**31-1", ([0, I32], 2), IndexError, "outside"),
]


@pytest.mark.parametrize("what,args,exc,match", SCHEDULE_LIMITS,
                         ids=[c[0] for c in SCHEDULE_LIMITS])
def test_schedule_extreme_sizes_name_the_argument(what, args, exc, match):
    with pytest.raises(exc, match=match):
        _C.Schedule(*args)


def test_schedule_grad_ready_extreme_ids():
    s = _C.Schedule([0, 0], 1)
    with pytest.raises(OverflowError, match=r"Schedule.grad_ready: param must be a parameter "
                                            r"index in \[0, n_params\), got 1099511627776"):
        s.grad_ready(2**40)
    with pytest.raises(IndexError, match=r"parameter 2147483647 is outside \[0, 2\)"):
        s.grad_ready(I32)
    assert s.grad_ready(0) == () and s.grad_ready(1) == (0,)


PREFETCH_LIMITS = [
    ("bytes adding up past 2**63-1", ([I64, I64], [0, 0], 0), ValueError,
     "unit_bytes add up to more than 2\\*\\*63-1 at unit 1"),
    ("bytes past int64", ([2**64], [0], 0), OverflowError,
     r"Prefetch: unit_bytes\[0\] must be in \[1, 2\*\*63-1\]"),
    ("bytes -2**63", ([-(2**63)], [0], 0), ValueError,
     "unit 0 has .* bytes; every unit needs > 0"),
    ("budget past int64", ([1], [0], 2**64), OverflowError,
     r"Prefetch: budget_bytes must be in \[0, 2\*\*63-1\]"),
    ("budget -2**63", ([1], [0], -(2**63)), ValueError, "budget_bytes must be >= 0"),
]


@pytest.mark.parametrize("what,args,exc,match", PREFETCH_LIMITS,
                         ids=[c[0] for c in PREFETCH_LIMITS])
def test_prefetch_extreme_sizes_name_the_argument(what, args, exc, match):
    with pytest.raises(exc, match=match):
        _C.Prefetch(*args)


def test_prefetch_bytes_up_to_int64_max():
    """Units that add up to exactly 2**63-1 with the largest budget: live and peak bytes
    reach it without overflowing."""
    pf = _C.Prefetch([I64 - 1, 1], [False, False], I64)
    pf.begin(_C.PF_FORWARD)
    assert pf.need(0) == ((_C.PF_GATHER, 0), (_C.PF_GATHER, 1))
    assert pf.live_bytes == I64
    pf.done(0)
    pf.end()
    assert pf.live_bytes == 0 and pf.peak_bytes == I64
