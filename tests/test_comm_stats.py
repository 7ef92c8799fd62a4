"""Bytes on the wire: each executor's counts, and ZeroOptimizer.comm_stats() against the ZeRO
volume computed here from the model's parameter counts.

Stages 1-2 move 2Ψ(N-1)/N per rank and step (a reduce-scatter of the gradients, an all-gather
of the parameters). Stage 3 moves (3Ψ - Ψ_kept)(N-1)/N: a gather in forward and one in
backward per unit, only one for the units kept gathered from forward into backward and for
the persistent parameters, and the reduce-scatter. Ψ is in elements of the communicated
dtype, padded as the flat layout pads: every parameter starts at a multiple of align_bytes in
its bucket, every bucket is a multiple of N * align_bytes. Ψ_padded is computed here from the
parameter counts and that rule, checked against the layout, and bounded against the unpadded
Ψ. The gloo point-to-point forms are checked to send and receive exactly what they count
(dist.isend / irecv tallied); the NCCL executor's counts are checked without a GPU, through a
stand-in for its communicator.
"""

import contextlib
import os
import random
import shutil
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import distributed
import models
import zero_py
from zero_py.collectives import channel, make_executor, nccl
from zero_py.collectives.stats import (CommStats, StepWindow, control, difference,
                                       ring_bytes, totals)
from zero_py.collectives.torch_dist import TorchDistExecutor
from zero_py.collectives.work import CollectiveError, Work

ALIGN_BYTES = 64
# torch 2.13 renamed the flat all-gather and deprecated the old name
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
WIDTHS = (13, 21, 30, 21, 17, 9)  # the stack's layer widths: no count is a multiple of 16


class _Layer(nn.Module):
    def __init__(self, d_in, d_out):
        super().__init__()
        self.fc = nn.Linear(d_in, d_out)

    def forward(self, x):
        return torch.tanh(self.fc(x))


class _Stack(nn.Module):
    """Layers of different sizes (each a stage-3 unit) behind a parameter of the root's own."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(WIDTHS[0]))
        self.layers = nn.ModuleList(_Layer(a, b) for a, b in zip(WIDTHS, WIDTHS[1:]))

    def forward(self, x):
        x = x * self.scale
        for layer in self.layers:
            x = layer(x)
        return x


def _round_up(n, k):
    return (n + k - 1) // k * k


def _padded_numel(numels, world_size, itemsize):
    """A bucket of parameters of `numels` elements, in layout order: each starts aligned, the
    bucket ends on a multiple of world_size * align (the layout's padding rule)."""
    a = ALIGN_BYTES // itemsize
    end = 0
    for n in numels:
        end = _round_up(end, a) + n
    return _round_up(end, world_size * a)


def _buckets(storage, numel_of):
    """Per bucket: its parameters' element counts (from the model, not the layout) in layout
    order, and the layout's own padded size."""
    out = []
    for b in range(storage.n_buckets):
        members = sorted(storage.bucket_params[b], key=lambda i: storage.param_offset[i])
        out.append(([numel_of[id(storage.params[i])] for i in members],
                     storage.bucket_numel[b]))
    return out


def _outside_steps(model, opt):
    """A checkpoint saved and loaded, the optimizer's and the model's full state dicts: their
    collectives belong to no step (before, the next step's counts held them: broadcasts and
    all-gathers of the object exchanges, 124 kB at 2 ranks for consolidate_state_dict; then
    the control all-reduce of consolidate_state_dict's and load_state_dict's checks)."""
    path = [tempfile.mkdtemp(prefix="zp_comm_") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(path)
    zero_py.save_checkpoint(os.path.join(path[0], "ck"), model, opt)
    zero_py.load_checkpoint(os.path.join(path[0], "ck"), model, opt)
    opt.consolidate_state_dict()
    opt.load_state_dict(opt.state_dict())  # its ranks' agreement check (control) too
    if hasattr(model, "_zero_py"):  # built by initialize
        zero_py.full_state_dict(model)
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path[0])


def _train(model, opt, rank, dtype, steps, clip_at=None, outside_at=None):
    gen = torch.Generator().manual_seed(100 + rank)
    seen = []
    for step in range(steps):
        if step == outside_at:
            _outside_steps(model, opt)
        x = torch.randn(4, WIDTHS[0], generator=gen).to(dtype)
        y = torch.randn(4, WIDTHS[-1], generator=gen).to(dtype)
        torch.nn.functional.mse_loss(model(x).float(), y.float()).backward()
        if step == clip_at:
            opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        seen.append(opt.comm_stats())
    return seen


def _stage_1_2(rank, world_size, stage, dtype, reduce_dtype=None, outside=False):
    torch.manual_seed(0)
    model = _Stack().to(dtype)
    numel_of = {id(p): p.numel() for p in model.parameters()}
    opt = zero_py.ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=stage, lr=1e-3,
                                bucket_bytes=1024, align_bytes=ALIGN_BYTES,
                                grad_reduce_dtype=reduce_dtype)
    before = opt.comm_stats()
    seen = _train(model, opt, rank, dtype, steps=3 if outside else 2, clip_at=1,
                  outside_at=2 if outside else None)
    out = {"before": before, "steps": seen, "buckets": _buckets(opt._flat, numel_of),
           "psi": sum(numel_of.values())}
    if outside:  # steps without a backward of their own (docs/scale-out.md)
        opt.step()
        out["no backward"] = opt.comm_stats()
        x = torch.randn(4, WIDTHS[0]).to(dtype)
        torch.nn.functional.mse_loss(model(x).float(), torch.ones(4, WIDTHS[-1])).backward()
        opt.step()
        opt.step()  # again, without zero_grad: applies the gradients a second time
        out["twice"] = opt.comm_stats()
    return out


def _stage_3(rank, world_size, dtype, persistence_threshold=0, outside=False):
    torch.manual_seed(0)
    model = _Stack().to(dtype)
    # the units as this test sees them: the root (its own parameter), each layer in forward
    # order, and the persistent pseudo-unit (the parameters under the threshold)
    small = [p.numel() < persistence_threshold for p in model.parameters()]
    unit_of = {id(p): (len(WIDTHS) if s else k) for (p, s, k) in zip(
        model.parameters(), small, [0] + [k for k in range(1, len(WIDTHS)) for _ in "wb"])}
    numel_of = {id(p): p.numel() for p in model.parameters()}
    model, opt = zero_py.initialize(model, torch.optim.AdamW, stage=3, wrap_policy={_Layer},
                                    lr=1e-3, align_bytes=ALIGN_BYTES,
                                    persistence_threshold=persistence_threshold)
    seen = _train(model, opt, rank, dtype, steps=4 if outside else 3,
                  outside_at=3 if outside else None)
    flat = opt._flat
    return {"steps": seen, "buckets": _buckets(flat, numel_of), "psi": sum(numel_of.values()),
            "bucket_unit": [unit_of[id(flat.params[flat.bucket_params[b][0]])]
                            for b in range(flat.n_buckets)],
            "layout_bucket_unit": list(flat.bucket_unit)}


def _p2p_counts(rank, world_size):
    """Random reduce-scatters, all-gathers and all-to-alls through the point-to-point forms,
    with every isend and irecv tallied; all-reduces and broadcasts through gloo's own."""
    tally = {"sent": 0, "received": 0}
    isend, irecv = dist.isend, dist.irecv

    def counted_isend(tensor, *args, **kwargs):
        tally["sent"] += tensor.numel() * tensor.element_size()
        return isend(tensor, *args, **kwargs)

    def counted_irecv(tensor, *args, **kwargs):
        tally["received"] += tensor.numel() * tensor.element_size()
        return irecv(tensor, *args, **kwargs)

    dist.isend, dist.irecv = counted_isend, counted_irecv
    try:
        ex = TorchDistExecutor(label="p2p")
        rng = random.Random(7)  # the same sizes on every rank
        gen = torch.Generator().manual_seed(rank)
        out = {"calls": [], "wrong": 0}
        for _ in range(6):
            chunk = rng.randint(1, 3000)
            dtype = rng.choice([torch.float32, torch.bfloat16])
            for kind in ("reduce_scatter", "all_gather", "all_to_all"):
                sent0, recv0 = tally["sent"], tally["received"]
                counted0 = ex.stats.snapshot().get(kind, {"bytes_sent": 0, "bytes_received": 0})
                if kind == "reduce_scatter":
                    full = torch.randn(world_size * chunk, generator=gen).to(dtype)
                    got = torch.empty(chunk, dtype=dtype)
                    ex.reduce_scatter(got, full.clone()).wait()
                    ref = full.float()
                    dist.all_reduce(ref)
                    ref = ref[rank * chunk:(rank + 1) * chunk]
                elif kind == "all_to_all":
                    full = torch.randn(world_size * chunk, generator=gen).to(dtype)
                    got = torch.empty_like(full)
                    ex.all_to_all(got, full).wait()
                    ref = torch.empty_like(full)
                    dist.all_to_all_single(ref, full)
                    ref = ref.float()
                else:
                    mine = torch.randn(chunk, generator=gen).to(dtype)
                    got = torch.empty(world_size * chunk, dtype=dtype)
                    ex.all_gather(got, mine).wait()
                    ref = torch.empty_like(got)
                    _all_gather_flat(ref, mine)
                    ref = ref.float()
                tol = 1e-6 if dtype == torch.float32 else 3e-2
                out["wrong"] += int(not torch.allclose(got.float(), ref, rtol=tol, atol=tol))
                counted = ex.stats.snapshot()[kind]
                out["calls"].append({
                    "kind": kind, "chunk_bytes": chunk * torch.tensor([], dtype=dtype).itemsize,
                    "sent": tally["sent"] - sent0, "received": tally["received"] - recv0,
                    "counted_sent": counted["bytes_sent"] - counted0["bytes_sent"],
                    "counted_received": counted["bytes_received"] - counted0["bytes_received"]})
        bcast = torch.randn(777, generator=gen)
        for src in range(world_size):
            ex.broadcast(bcast, src).wait()
        ex.all_reduce(torch.randn(1001, generator=gen)).wait()
        ex.all_reduce_max(torch.zeros(10, dtype=torch.uint8)).wait()
        with control():
            ex.all_reduce(torch.zeros(3, dtype=torch.int64)).wait()
        out["totals"] = ex.stats.snapshot()
        out["gather_label"] = channel(ex).stats.label
        return out
    finally:
        dist.isend, dist.irecv = isend, irecv


def _accumulated(rank, world_size, stage):
    """Three steps of two micro-batches each, the second clipped by the 2-norm and the third by
    the inf-norm, beside a reference (torch.optim.AdamW on the gradients all-reduced by hand,
    torch's clip_grad_norm_): the control calls of each step, and the largest difference of
    the parameters at the end."""
    torch.manual_seed(0)
    ref = _Stack()
    model = _Stack()
    model.load_state_dict(ref.state_dict())
    hyper = dict(lr=1e-2, weight_decay=0.1)
    if stage == 3:
        model, opt = zero_py.initialize(model, torch.optim.AdamW, stage=3,
                                        wrap_policy={_Layer}, **hyper)
    else:
        opt = zero_py.ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=stage,
                                    bucket_bytes=1024, **hyper)
    ref_opt = torch.optim.AdamW(ref.parameters(), **hyper)
    gen = torch.Generator().manual_seed(200 + rank)
    calls = []
    for norm_type in (None, 2.0, float("inf")):
        for _ in range(2):
            x = torch.randn(4, WIDTHS[0], generator=gen)
            y = torch.randn(4, WIDTHS[-1], generator=gen)
            for m in (model, ref):
                torch.nn.functional.mse_loss(m(x), y).backward()
        models.average_grads(ref)
        if norm_type is not None:  # max_norm below the norms: the clip scales
            opt.clip_grad_norm_(0.05, norm_type)
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, norm_type)
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        calls.append(opt.comm_stats()["shard"]["control"]["calls"])
    with zero_py.gathered(model) if stage == 3 else contextlib.nullcontext():
        diff = max(float((a.detach() - b.detach()).abs().max())
                   for a, b in zip(model.parameters(), ref.parameters()))
    return {"calls": calls, "diff": diff}


def _everything(rank, world_size):
    out = {"p2p": _p2p_counts(rank, world_size)}
    for dtype in (torch.float32, torch.bfloat16):
        # one case per stage path: checkpoints and state dicts between steps, counted in none
        outside = dtype == torch.float32 and world_size == 2
        for stage in (1, 2):
            out[(stage, dtype)] = _stage_1_2(rank, world_size, stage, dtype,
                                             outside=outside and stage == 2)
        out[(3, dtype)] = _stage_3(rank, world_size, dtype, outside=outside)
    out[(3, "persistent")] = _stage_3(rank, world_size, torch.float32, persistence_threshold=20)
    out[(2, "bf16 reduced in fp32")] = _stage_1_2(rank, world_size, 2, torch.bfloat16,
                                                  torch.float32)
    for stage in (1, 2, 3):
        out["accumulated", stage] = _accumulated(rank, world_size, stage)
    return out


@pytest.fixture(scope="module", params=[2, 3])
def measured(request):
    """Every rank's measurements at 2 and 3 ranks (one launch each)."""
    return request.param, distributed.run(_everything, request.param)


def _payload(stats):
    return {label: {k: c for k, c in kinds.items() if k != "control"}
            for label, kinds in stats.items()}


def _check_padding(buckets, world_size, itemsize, psi):
    """Ψ_padded from the parameter counts and the padding rule, equal to the layout's, and
    within the bound of that rule above the unpadded Ψ."""
    padded = 0
    bound = 0
    a = ALIGN_BYTES // itemsize
    for numels, layout_numel in buckets:
        mine = _padded_numel(numels, world_size, itemsize)
        assert mine == layout_numel, (numels, mine, layout_numel)
        padded += mine
        bound += (len(numels) - 1) * (a - 1) + world_size * a - 1
    assert psi <= padded <= psi + bound, (psi, padded, bound)
    return padded


# -- the rule ---------------------------------------------------------------------------------

def test_ring_rule_per_collective():
    for n in (1, 2, 3, 8):
        for rank in range(n):
            assert ring_bytes("reduce_scatter", 96 * n, n, rank) == (96 * (n - 1),) * 2
            assert ring_bytes("all_gather", 96 * n, n, rank) == (96 * (n - 1),) * 2
            # a chunk of 96 bytes to and from each peer
            assert ring_bytes("all_to_all", 96 * n, n, rank) == (96 * (n - 1),) * 2
            assert ring_bytes("all_reduce", 96 * n, n, rank) == (2 * 96 * (n - 1),) * 2
    # a broadcast moves B to every rank but the root, each rank forwarding it once down the ring
    for n in (2, 3, 5):
        for root in range(n):
            per_rank = [ring_bytes("broadcast", 1000, n, r, root) for r in range(n)]
            assert sum(s for s, _ in per_rank) == sum(r for _, r in per_rank) == 1000 * (n - 1)
            assert per_rank[root] == (1000, 0)
            assert per_rank[(root - 1) % n] == (0, 1000)


def test_bad_counts_are_refused():
    with pytest.raises(ValueError, match="kind must be one of"):
        ring_bytes("gather", 8, 2)
    with pytest.raises(ValueError, match="nbytes"):
        ring_bytes("all_gather", -1, 2)
    with pytest.raises(ValueError, match="not a rank"):
        ring_bytes("all_gather", 8, 2, rank=2)
    with pytest.raises(ValueError, match="root"):
        ring_bytes("broadcast", 8, 2, rank=0, root=None)
    with pytest.raises(ValueError, match="label"):
        CommStats("")


def test_control_messages_are_booked_apart():
    stats = CommStats("replicate")
    stats.record("all_reduce", 400, 4)
    other = CommStats("world")
    with control():
        stats.record("all_reduce", 24, 4)
        stats.record("all_gather", 64, 4)
        other.record("all_reduce", 8, 2)  # the flag is the thread's: any executor's call
    snap = stats.snapshot()
    assert snap["all_reduce"] == {"calls": 1, "bytes_sent": 600, "bytes_received": 600}
    assert snap["control"] == {"calls": 2, "bytes_sent": 36 + 48, "bytes_received": 36 + 48}
    assert other.snapshot() == {"control": {"calls": 1, "bytes_sent": 8, "bytes_received": 8}}
    stats.record("all_gather", 64, 4)  # after the block: payload again
    assert stats.snapshot()["all_gather"]["calls"] == 1


def test_window_is_the_difference_between_marks():
    a, b = CommStats("shard"), CommStats("shard.gather")
    ex_a, ex_b = type("A", (), {"stats": a})(), type("B", (), {"stats": b})()
    a.record("reduce_scatter", 800, 2)
    window = StepWindow(lambda: [ex_a, ex_b, ex_a, object()])  # each executor once
    a.record("reduce_scatter", 800, 2)
    b.record("all_gather", 200, 2)
    window.close()
    assert window.last == {"shard": {"reduce_scatter": {"calls": 1, "bytes_sent": 400,
                                                        "bytes_received": 400}},
                           "shard.gather": {"all_gather": {"calls": 1, "bytes_sent": 100,
                                                           "bytes_received": 100}}}
    window.close()
    assert window.last == {}
    # two executors with one label add up
    assert totals([ex_a, type("C", (), {"stats": CommStats("shard")})()])["shard"] == \
        a.snapshot()
    assert difference(totals([ex_a]), {}) == totals([ex_a])


def test_nccl_executor_counts_what_it_issues(monkeypatch):
    """Without a GPU: the executor's checks and counting, with its communicator stood in."""
    ex = nccl.NcclExecutor.__new__(nccl.NcclExecutor)
    ex.stats, ex.world_size, ex.rank, ex.device = CommStats("shard"), 4, 1, torch.device("meta")
    issued = []

    def fake_issue(coll, send, recv, count, op=0, root=0):
        issued.append((coll, count))
        return Work(None)
    ex._issue = fake_issue
    meta = dict(device="meta")
    ex.reduce_scatter(torch.empty(10, **meta), torch.empty(40, **meta))
    ex.all_gather(torch.empty(40, dtype=torch.bfloat16, **meta),
                  torch.empty(10, dtype=torch.bfloat16, **meta))
    ex.all_reduce(torch.empty(6, **meta))
    ex.all_reduce_max(torch.empty(6, dtype=torch.uint8, **meta))
    ex.broadcast(torch.empty(5, **meta), src=2)  # rank 1 is the root's predecessor: sends none
    ex.broadcast(torch.empty(5, **meta), src=1)  # the root: receives none
    # one meta buffer, so the halves have distinct (fake) addresses and do not overlap
    both = torch.empty(80, dtype=torch.bfloat16, **meta)
    ex.all_to_all(both[40:], both[:40])  # 10 elements to and from each of 4 ranks
    assert ex.stats.snapshot() == {
        "reduce_scatter": {"calls": 1, "bytes_sent": 120, "bytes_received": 120},
        "all_gather": {"calls": 1, "bytes_sent": 60, "bytes_received": 60},
        "all_reduce": {"calls": 2, "bytes_sent": 36 + 8, "bytes_received": 36 + 8},
        "broadcast": {"calls": 2, "bytes_sent": 20, "bytes_received": 20},
        "all_to_all": {"calls": 1, "bytes_sent": 60, "bytes_received": 60}}
    assert issued == [(nccl.REDUCE_SCATTER, 10), (nccl.ALL_GATHER, 10), (nccl.ALL_REDUCE, 6),
                      (nccl.ALL_REDUCE, 6), (nccl.BROADCAST, 5), (nccl.BROADCAST, 5),
                      (nccl.ALL_TO_ALL, 10)]

    def failing(*args, **kwargs):
        raise CollectiveError("all-reduce", "the communicator was aborted")
    ex._issue = failing
    with pytest.raises(CollectiveError):
        ex.all_reduce(torch.empty(6, **meta))
    assert ex.stats.snapshot()["all_reduce"]["calls"] == 2  # what never went out is not counted


def test_single_rank_counts_calls_and_no_bytes(single_rank_group):
    ex = TorchDistExecutor(single_rank_group, label="solo")
    ex.all_gather(torch.zeros(8), torch.ones(8)).wait()
    ex.all_reduce(torch.ones(3)).wait()
    ex.broadcast(torch.ones(3), 0).wait()
    assert ex.stats.label == "solo"
    assert ex.stats.snapshot() == {k: {"calls": 1, "bytes_sent": 0, "bytes_received": 0}
                                   for k in ("all_gather", "all_reduce", "broadcast")}
    with pytest.raises(ValueError, match="src 1 is not a rank"):
        ex.broadcast(torch.ones(3), 1)
    # the label a hybrid-sharding replicate group takes, through the executor seam
    assert make_executor(single_rank_group, torch.device("cpu")).stats.label == "shard"
    replicate = make_executor(single_rank_group, torch.device("cpu"), label="replicate")
    assert replicate.stats.label == "replicate"
    with pytest.raises(ValueError, match="label must be a non-empty str"):
        make_executor(single_rank_group, torch.device("cpu"), label=None)


# -- on gloo ----------------------------------------------------------------------------------

def test_point_to_point_forms_send_what_they_count(measured):
    world_size, results = measured
    n = world_size
    for rank, r in enumerate(results):
        p2p = r["p2p"]
        assert p2p["wrong"] == 0
        for call in p2p["calls"]:
            want = (n - 1) * call["chunk_bytes"]  # the ring figure: (N-1)/N of the buffer
            assert call["sent"] == call["counted_sent"] == want, (rank, call)
            assert call["received"] == call["counted_received"] == want, (rank, call)
        t = p2p["totals"]
        # 777 fp32 from each rank in turn: received from every root but itself; sent for every
        # root but the one it precedes
        assert t["broadcast"] == {"calls": n, "bytes_sent": (n - 1) * 777 * 4,
                                  "bytes_received": (n - 1) * 777 * 4}
        ar = 2 * (1001 * 4 * (n - 1) // n) + 2 * (10 * (n - 1) // n)
        assert t["all_reduce"] == {"calls": 2, "bytes_sent": ar, "bytes_received": ar}
        assert t["control"]["calls"] == 1
        assert p2p["gather_label"] == "p2p.gather"


def test_stages_1_and_2_move_two_psi(measured):
    """2Ψ(N-1)/N per rank and step: Ψ of the gradients' dtype reduce-scattered, Ψ of the
    parameters' all-gathered, padded as the layout pads."""
    n, results = measured
    cases = [(1, torch.float32, 4, 4), (2, torch.float32, 4, 4), (1, torch.bfloat16, 2, 2),
             (2, torch.bfloat16, 2, 2), ((2, "bf16 reduced in fp32"), None, 4, 2)]
    for key, dtype, grad_size, param_size in cases:
        key = key if dtype is None else (key, dtype)
        for rank, r in enumerate(results):
            case = r[key]
            where = f"{key} rank {rank}/{n}"
            assert case["before"] == {}, where
            # the layout pads per dtype: the reduction's buffers follow the parameters' layout
            psi = _check_padding(case["buckets"], n, param_size, case["psi"])
            buckets = len(case["buckets"])
            for k, stats in enumerate(case["steps"]):
                assert set(stats) == {"shard"}, where
                assert set(stats["shard"]) == {"reduce_scatter", "all_gather", "control"}, where
                rs, ag = stats["shard"]["reduce_scatter"], stats["shard"]["all_gather"]
                assert rs["calls"] == ag["calls"] == buckets, where
                assert rs["bytes_sent"] == rs["bytes_received"] == \
                    psi * (n - 1) // n * grad_size, where
                assert ag["bytes_sent"] == ag["bytes_received"] == \
                    psi * (n - 1) // n * param_size, where
                if grad_size == param_size:
                    payload = sum(c["bytes_sent"] for c in _payload(stats)["shard"].values())
                    assert payload == 2 * psi * (n - 1) // n * param_size, where
                # the step's count (stage 1: the settings only; stage 2 also the pass's), the
                # used mask riding on it, and in step 2 the gradient norm: all small, none of
                # it payload
                control_calls = (1 if key[0] == 1 else 2) + (1 if k == 1 else 0)
                assert stats["shard"]["control"]["calls"] == control_calls, where
            if "no backward" in case:
                # a step() without a backward still reduce-scatters (a peer may have run one),
                # and all-gathers only when it updates: not before any gradient, but a second
                # step() applies the gradients again
                rs = {"calls": buckets, "bytes_sent": psi * (n - 1) // n * grad_size,
                      "bytes_received": psi * (n - 1) // n * grad_size}
                assert _payload(case["no backward"]) == {"shard": {"reduce_scatter": rs}}, where
                ag = {"calls": buckets, "bytes_sent": psi * (n - 1) // n * param_size,
                      "bytes_received": psi * (n - 1) // n * param_size}
                assert _payload(case["twice"]) == {"shard": {"reduce_scatter": rs,
                                                             "all_gather": ag}}, where


def test_one_control_all_reduce_per_point_of_agreement(measured):
    """Each point where the ranks must agree costs one small control all-reduce, and nothing
    else costs one: a stage-3 forward, a backward pass (stages 2-3), the step (its count
    carries the mask of the parameters that got a gradient, and stage 3's order of first
    uses: sharding/riders.py), a clip_grad_norm_ (its statistics carry the inf-norm's max in
    per-rank slots). Two micro-batches a step; the training matches the reference's."""
    n, results = measured
    for stage in (1, 2, 3):
        points = {1: 1, 2: 2 + 1, 3: 2 + 2 + 1}[stage]
        for rank, r in enumerate(results):
            case = r["accumulated", stage]
            where = f"stage {stage} rank {rank}/{n}: {case}"
            assert case["calls"] == [points, points + 1, points + 1], where
            assert case["diff"] < 1e-5, where


def _kept_units(unit_bytes, first_step):
    """The units held gathered from forward into backward (stage3/engine.py): the root always;
    from the second step on also the last units of the forward order that fit in the default
    prefetch budget beside the root (root + 2 x the largest unit): the last one always, then
    earlier ones while they fit."""
    kept = {0}
    if first_step:
        return kept
    room = 2 * max(unit_bytes[1:])
    for u in reversed(range(1, len(unit_bytes))):
        if len(kept) > 1 and unit_bytes[u] > room:
            break
        kept.add(u)
        room -= unit_bytes[u]
    return kept


def test_stage_3_moves_three_psi_less_the_kept_units(measured):
    """(3Ψ - Ψ_kept)(N-1)/N per rank and step: every unit gathered in forward, gathered again
    in backward unless kept from forward into backward, and the gradients reduce-scattered.
    Persistent parameters count as kept: all-gathered once, by step() after the update."""
    n, results = measured
    n_units = len(WIDTHS)  # the root and the layers; the persistent pseudo-unit is the next
    for key, size in ((torch.float32, 4), (torch.bfloat16, 2), ("persistent", 4)):
        for rank, r in enumerate(results):
            case = r[(3, key)]
            where = f"stage 3 {key} rank {rank}/{n}"
            psi = _check_padding(case["buckets"], n, size, case["psi"])
            # one bucket per unit (all of one dtype and param group), the units as expected
            assert case["bucket_unit"] == case["layout_bucket_unit"], where
            unit_psi = [0] * (n_units + 1)
            for (numels, _), u in zip(case["buckets"], case["bucket_unit"]):
                unit_psi[u] += _padded_numel(numels, n, size)
            persistent = unit_psi.pop()
            assert (persistent > 0) == (key == "persistent"), where
            units = sum(1 for u in unit_psi if u) + (persistent > 0)
            for k, stats in enumerate(case["steps"]):
                # the engine sizes a unit without parameters (the root, all persistent) 1 byte
                kept = _kept_units([max(u * size, 1) for u in unit_psi], first_step=k == 0)
                kept = {u for u in kept if unit_psi[u]}
                # some units are gathered twice, some once, from the second step on
                assert 0 < len(kept) < units - (persistent > 0) or k == 0, where
                kept_psi = sum(unit_psi[u] for u in kept) + persistent
                assert set(stats) == {"shard", "shard.gather"}, where
                assert set(stats["shard"]) == {"reduce_scatter", "control"}, where
                assert set(stats["shard.gather"]) == {"all_gather"}, where
                rs, ag = stats["shard"]["reduce_scatter"], stats["shard.gather"]["all_gather"]
                assert rs["calls"] == units, where
                assert ag["calls"] == 2 * units - len(kept) - (persistent > 0), where
                assert rs["bytes_sent"] == rs["bytes_received"] == psi * (n - 1) // n * size
                assert ag["bytes_sent"] == ag["bytes_received"] == \
                    (2 * psi - kept_psi) * (n - 1) // n * size, where
                assert rs["bytes_sent"] + ag["bytes_sent"] == \
                    (3 * psi - kept_psi) * (n - 1) // n * size, where
                # the forward's, the backward's and the step's counts (the used mask and the
                # units' order ride on them)
                assert stats["shard"]["control"]["calls"] == 3, where
