"""The torch.distributed executor's collectives against torch.distributed's own, on gloo.

The executor picks other forms than the flat collectives on gloo (reduce-scatter as an
all-reduce plus a copy; all-gather as one broadcast per rank from a size up): each must give
what dist.all_gather_into_tensor / a sum over every rank's input give, for sizes on both sides
of the switch, several dtypes and an input that aliases its output chunk."""

import pytest
import torch
import torch.distributed as dist

from tests.distributed import run
from zero_py import executor as ex

# below and above the broadcast all-gather switch (in elements of fp32)
SIZES = [12, 1000, ex.BROADCAST_ALL_GATHER_BYTES // 4 + 8]
DTYPES = [torch.float32, torch.bfloat16, torch.float64]


def _data(rank, numel, dtype):
    g = torch.Generator().manual_seed(1000 * rank + numel)
    return torch.randn(numel, generator=g, dtype=torch.float64).to(dtype)


def collectives(rank, world):
    e = ex.TorchDistExecutor()
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
            n = numel // world
            out[(numel, str(dtype))] = {
                "ag_equal": torch.equal(got, ref),
                "ag_aliased_equal": torch.equal(aliased, ref),
                "rs_err": (shard.double() - total[rank * n:(rank + 1) * n]).abs().max().item(),
                "rs_tol": 1e-12 if dtype == torch.float64 else (
                    4e-6 if dtype == torch.float32 else 0.1),
            }
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_gloo_collectives_match_torch_distributed(world):
    for rank, res in enumerate(run(collectives, world)):
        for key, r in res.items():
            assert r["ag_equal"], (rank, key, "all_gather differs from all_gather_into_tensor")
            assert r["ag_aliased_equal"], (rank, key, "all_gather with an aliased input differs")
            assert r["rs_err"] <= r["rs_tol"], (rank, key, r)
