"""The torch.distributed executor's collectives against torch.distributed's own, on gloo.

On gloo the executor builds all-gather and reduce-scatter from point-to-point messages: each
must give what dist.all_gather_into_tensor / a sum over every rank's input give, for several
sizes and dtypes, an input that aliases its output chunk, and several collectives in flight at
once (messages of one must never be taken for another's). The same with the all-gathers through
shared memory (collectives/shm.py, what stage 3's gather channel uses), plus more all-gathers in
flight than the ring has slots, and a peer that never arrives (an error, not a hang)."""

import os

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run
from zero_py.collectives import torch_dist as ex

SIZES = [12, 1000, 600_000]  # elements
DTYPES = [torch.float32, torch.bfloat16, torch.float64]


def _data(rank, numel, dtype):
    g = torch.Generator().manual_seed(1000 * rank + numel)
    return torch.randn(numel, generator=g, dtype=torch.float64).to(dtype)


def collectives(rank, world, shared=False):
    e = ex.TorchDistExecutor(shared_memory=shared)
    out = {}
    for numel in SIZES:
        numel = numel // world * world
        for dtype in DTYPES:
            # all-gather: fresh output, and an input that is this rank's chunk of the output
            piece = _data(rank, numel // world, dtype)
            got = torch.full((numel,), float("nan"), dtype=dtype)
            e.all_gather(got, piece).wait()
            ref = torch.empty(numel, dtype=dtype)
            dist.all_gather_into_tensor(ref, piece)
            aliased = torch.full((numel,), float("nan"), dtype=dtype)
            chunk = aliased.chunk(world)[rank]
            chunk.copy_(piece)
            e.all_gather(aliased, chunk).wait()
            # reduce-scatter: this rank's chunk of the sum (the input is scratch)
            full = _data(rank, numel, dtype)
            total = sum(_data(r, numel, dtype).double() for r in range(world))
            shard = torch.full((numel // world,), float("nan"), dtype=dtype)
            e.reduce_scatter(shard, full.clone()).wait()
            out.setdefault("scratch_direct", e.scratch_peak_bytes)  # the first reduce-scatter
            n = numel // world
            # in place: the output is this rank's chunk of the input
            inplace = full.clone()
            e.reduce_scatter(inplace[rank * n:(rank + 1) * n], inplace).wait()
            out[(numel, str(dtype))] = {
                "ag_equal": torch.equal(got, ref),
                "ag_aliased_equal": torch.equal(aliased, ref),
                "rs_err": (shard.double() - total[rank * n:(rank + 1) * n]).abs().max().item(),
                "rs_inplace_equal": torch.equal(inplace[rank * n:(rank + 1) * n], shard),
                "rs_tol": 1e-12 if dtype == torch.float64 else (
                    4e-6 if dtype == torch.float32 else 0.1),
            }
    # several in flight before any wait: two all-gathers and two reduce-scatters
    pieces = [_data(rank + 10 * k, 240 // world, torch.float32) for k in range(2)]
    fulls = [_data(rank + 20 * k, 240, torch.float32) for k in range(2)]
    gathered = [torch.empty(240 // world * world) for _ in range(2)]
    shards = [torch.empty(240 // world) for _ in range(2)]
    pending = [e.all_gather(gathered[0], pieces[0]), e.reduce_scatter(shards[0], fulls[0].clone()),
               e.all_gather(gathered[1], pieces[1]), e.reduce_scatter(shards[1], fulls[1].clone())]
    for p in reversed(pending):
        p.wait()
    out["shared_bytes"] = e.shared_bytes
    # more all-gathers in flight than the shared-memory ring has slots, waited newest first
    many = [_data(rank + 30 * k, 96 // world, torch.float32) for k in range(5)]
    many_out = [torch.empty(96 // world * world) for _ in range(5)]
    works = [e.all_gather(o, i) for o, i in zip(many_out, many)]
    for w in reversed(works):
        w.wait()
    out["many_in_flight"] = all(
        torch.equal(many_out[k], torch.cat([_data(r + 30 * k, 96 // world, torch.float32)
                                            for r in range(world)])) for k in range(5))
    n = 240 // world
    out["in_flight"] = all(
        torch.equal(gathered[k], torch.cat([_data(r + 10 * k, n, torch.float32)
                                            for r in range(world)]))
        and torch.allclose(shards[k], sum(_data(r + 20 * k, 240, torch.float32)
                                          for r in range(world))[rank * n:(rank + 1) * n],
                           rtol=0, atol=1e-5)
        for k in range(2))
    return out


@pytest.mark.parametrize("shared", [False, True], ids=["messages", "shared_memory"])
@pytest.mark.parametrize("world", [2, 3])
def test_gloo_collectives_match_torch_distributed(world, shared):
    for rank, res in enumerate(run(collectives, world, shared)):
        assert res.pop("in_flight"), (rank, "collectives in flight together got mixed up")
        assert res.pop("many_in_flight"), (rank, "more all-gathers in flight than slots")
        # the all-gathers went through shared memory exactly when asked (all ranks on one host)
        assert (res.pop("shared_bytes") > 0) == shared
        # receive buffers beyond the output: one chunk per peer after the first (none at 2)
        assert (res.pop("scratch_direct") > 0) == (world > 2)
        for key, r in res.items():
            assert r["ag_equal"], (rank, key, "all_gather differs from all_gather_into_tensor")
            assert r["ag_aliased_equal"], (rank, key, "all_gather with an aliased input differs")
            assert r["rs_err"] <= r["rs_tol"], (rank, key, r)
            assert r["rs_inplace_equal"], (rank, key, "in-place reduce-scatter differs")


def _late_peer(rank, world):
    os.environ["ZP_SHM_TIMEOUT_S"] = "2"
    e = ex.TorchDistExecutor(shared_memory=True)
    out = torch.empty(8 * world)
    e.all_gather(out, torch.full((8,), float(rank))).wait()  # maps the file, on every rank
    ok = torch.equal(out, torch.arange(world).repeat_interleave(8).float())
    if rank != 0:
        return {"ok": ok, "error": None}
    try:  # rank 1 never comes: rank 0 gets an error naming it within the timeout
        e.all_gather(out, torch.zeros(8)).wait()
        return {"ok": ok, "error": "no error"}
    except RuntimeError as exc:
        return {"ok": ok, "error": str(exc)}


def test_shared_memory_all_gather_refuses_to_wait_forever():
    res = run(_late_peer, 2)
    assert all(r["ok"] for r in res)
    assert "rank 1 did not publish" in res[0]["error"] and "within 2 s" in res[0]["error"], res


def _no_room(rank, world):
    from zero_py.collectives import shm

    def full(fd, offset, length):
        raise OSError(28, "No space left on device")

    if rank == 0:  # the rank that creates the file finds /dev/shm full
        shm.os.posix_fallocate = full
    e = ex.TorchDistExecutor(shared_memory=True)
    out = torch.empty(8 * world)
    e.all_gather(out, torch.full((8,), float(rank))).wait()
    return {"ok": torch.equal(out, torch.arange(world).repeat_interleave(8).float()),
            "shared_bytes": e.shared_bytes, "left": [f for f in os.listdir("/dev/shm")
                                                      if f.startswith("zero_py-")]}


def test_shared_memory_without_room_falls_back_to_messages():
    """A /dev/shm too small for the file (a container's 64 MiB) is found when the file is made,
    on every rank alike, and the all-gathers go back to gloo's messages: right values, no
    shared bytes, no file left behind."""
    for r in run(_no_room, 2):
        assert r["ok"] and r["shared_bytes"] == 0 and not r["left"], r


def test_all_to_all_checks_its_arguments(single_rank_group):
    """The torch.distributed executor refuses what the NCCL one refuses (collectives/
    arguments.py), before anything is sent or counted."""
    executor = ex.TorchDistExecutor(single_rank_group)
    buf = torch.zeros(200)
    bad = [((buf[:40], buf[40:80].to(torch.bfloat16)), ValueError, "one dtype"),
           ((buf[:40], buf[40:84]), ValueError, "same number of elements"),
           ((buf[:40], buf[20:60]), ValueError, "overlap"),
           ((buf[:40], buf[40:120:2]), ValueError, "contiguous"),
           ((buf[:40], [0.0] * 40), TypeError, "takes tensors")]
    for (output, input), exc, match in bad:
        with pytest.raises(exc, match=match):
            executor.all_to_all(output, input)
    assert "all_to_all" not in executor.stats.snapshot()
    out = torch.empty(40)
    executor.all_to_all(out, buf[:40] + 1).wait()  # a good call still runs
    assert torch.equal(out, buf[:40] + 1)
