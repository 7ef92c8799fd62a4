"""zero_py._C.Prefetch, the binding of the stage-3 gather/free schedule (csrc/schedule/prefetch.h):
commands round-trip as (kind, unit) pairs, core errors become exceptions with their messages."""

import pytest

from zero_py import _C

G, F = _C.PF_GATHER, _C.PF_FREE


def test_constants():
    assert (_C.PF_GATHER, _C.PF_FREE) == (1, 2)
    assert (_C.PF_FORWARD, _C.PF_FORWARD_EVAL, _C.PF_BACKWARD) == (0, 1, 2)


def test_forward_backward_round_trip():
    # four units of 10 bytes, unit 0 (the root) stays from forward into backward; the budget
    # lets one unit be prefetched beside the needed one
    pf = _C.Prefetch([10, 10, 10, 10], [True, False, False, False], budget_bytes=20)
    assert pf.order() == (0, 1, 2, 3)
    assert pf.seen() == ()
    pf.begin(_C.PF_FORWARD)
    assert pf.need(0) == ((G, 0), (G, 1))
    assert pf.live_bytes == 20
    assert pf.done(0) == ()  # a keep unit stays resident
    assert pf.need(1) == ()
    assert pf.done(1) == ((F, 1), (G, 2))
    assert pf.need(3) == ((G, 3),)  # a need is served beyond the budget
    assert pf.done(3) == ((F, 3),)
    assert pf.end() == ((F, 2),)  # prefetched, never needed
    assert pf.seen() == (0, 1, 3)
    assert pf.is_resident(0) and not pf.is_resident(2)
    assert (pf.live_bytes, pf.peak_bytes) == (10, 30)

    pf.begin(_C.PF_BACKWARD)  # schedule 3, 2, 1: the keep unit 0 is left out
    assert pf.need(3) == ((G, 3),)  # unit 0's 10 bytes leave no room to prefetch
    assert pf.done(3) == ((F, 3), (G, 2))
    assert pf.need(1) == ((G, 1),)  # 2 was prefetched; backward never needs it
    assert pf.need(0) == ()
    assert pf.done(1) == ((F, 1),)
    assert pf.done(0) == ((F, 0),)
    assert pf.end() == ((F, 2),)
    assert pf.live_bytes == 0
    pf.reset_peak()
    assert pf.peak_bytes == 0
    assert pf.seen() == (0, 1, 3)  # backward does not change it


def test_order_skip_and_drain():
    pf = _C.Prefetch([1, 2, 3, 4], [0, 0, 0, 0], 0)
    pf.set_order([3, 1, 2])
    assert pf.order() == (3, 1, 2)
    pf.begin(_C.PF_FORWARD_EVAL)
    # 3 is skipped: gathered and freed so that this rank's gathers match its peers'
    assert pf.need(1) == ((G, 3), (F, 3), (G, 1))
    assert pf.need(0) == ((G, 0),)  # not in the order
    assert pf.done(1) == ((F, 1),)
    assert pf.end() == ((G, 2), (F, 2), (F, 0))
    assert pf.seen() == ()  # eval does not record
    pf.set_order(())
    assert pf.order() == ()


@pytest.mark.parametrize("args,exc,match", [
    (([], [], 0), ValueError, "needs >= 1 unit"),
    (([1, 2], [False], 0), ValueError, "keep has 1 entries, unit_bytes 2"),
    (([4, 0], [False, False], 0), ValueError, "unit 1 has 0 bytes"),
    (([4], [False], -1), ValueError, "budget_bytes must be >= 0"),
    ((5, [False], 0), TypeError, "unit_bytes must be a sequence"),
    ((["4"], [False], 0), TypeError, None),
])
def test_constructor_errors(args, exc, match):
    with pytest.raises(exc, match=match):
        _C.Prefetch(*args)


def test_call_errors_leave_the_schedule_usable():
    pf = _C.Prefetch([10, 20, 30], [False, False, False], 100)
    with pytest.raises(RuntimeError, match=r"need outside a phase; call begin\(\) first"):
        pf.need(0)
    with pytest.raises(RuntimeError, match="end outside a phase"):
        pf.end()
    with pytest.raises(ValueError, match="unit 1 appears twice in the order"):
        pf.set_order([1, 0, 1])
    with pytest.raises(IndexError, match=r"order\[1\] = 3 is outside \[0, 3\)"):
        pf.set_order([0, 3])
    with pytest.raises(IndexError, match="out of range"):
        pf.set_order([2**40])
    with pytest.raises(ValueError, match="an order of 4 units"):
        pf.set_order([0, 1, 2, 0])
    assert pf.order() == (0, 1, 2)
    with pytest.raises(ValueError, match="phase 3 is not FORWARD"):
        pf.begin(3)
    pf.begin(_C.PF_FORWARD)
    with pytest.raises(RuntimeError, match=r"while phase 0 is open; call end\(\) first"):
        pf.begin(_C.PF_BACKWARD)
    with pytest.raises(RuntimeError, match="set_order during an open phase"):
        pf.set_order([2, 1, 0])
    with pytest.raises(IndexError, match=r"need\(3\): unit outside \[0, 3\)"):
        pf.need(3)
    with pytest.raises(IndexError, match="out of range"):
        pf.need(-2**40)
    with pytest.raises(TypeError):
        pf.need("0")
    with pytest.raises(RuntimeError, match=r"done\(1\): the unit is not resident; a need\(1\) is"):
        pf.done(1)
    with pytest.raises(IndexError, match=r"unit 5 is outside \[0, 3\)"):
        pf.is_resident(5)
    # none of the failures changed anything
    assert pf.live_bytes == 0
    assert pf.need(0) == ((G, 0), (G, 1), (G, 2))
    assert pf.done(0) == ((F, 0),)
    with pytest.raises(RuntimeError, match=r"done\(0\): the unit is not resident"):
        pf.done(0)
    assert pf.end() == ((F, 1), (F, 2))
    assert pf.seen() == (0,)


def test_set_keep_last_unit():
    pf = _C.Prefetch([10, 10, 10], [True, False, False], budget_bytes=20)
    pf.set_keep([True, False, True])  # the root and the last unit of the order
    pf.begin(_C.PF_FORWARD)
    with pytest.raises(RuntimeError, match="set_keep during an open phase"):
        pf.set_keep([True, False, False])
    assert pf.need(0) == ((G, 0), (G, 1))
    assert pf.done(1) == ((F, 1), (G, 2))
    assert pf.done(2) == ()  # kept for backward
    assert pf.end() == ()
    pf.begin(_C.PF_BACKWARD)
    assert pf.need(2) == ()  # still resident: not gathered again (and the budget is full)
    assert pf.done(2) == ((F, 2), (G, 1))
    assert pf.end() == ((F, 0), (F, 1))
    with pytest.raises(ValueError, match="one per unit"):
        pf.set_keep([True, False])
