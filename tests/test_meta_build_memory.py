"""Partitioned construction never holds a whole model on a rank: measured, on gloo at 4 ranks.

A model of UNITS equal Linear layers (one unit each) is built on the meta device and given to
zero_py.initialize(stage=3). On every rank the peak resident memory during initialize (VmHWM,
reset through /proc/self/clear_refs after a warm-up that pays the one-time costs: the native
library, the gather group, the optimizer probe) may exceed what the rank keeps afterwards (its
parameter and gradient shards, measured as resident memory and checked against their tensor
sizes) by two units and a small slack, never by a model: a replay that kept every module's
values alive until the end would exceed it by the whole model (25 MB here, against 2 + 2 MB).
Both ways of initializing are measured: the modules' reset_parameters() alone, and followed
by an init_fn. The values must equal an ordinary build from the same seed.

Resident memory tracks live memory only if the allocator returns freed blocks: glibc raises
its mmap threshold after freeing a large block and then keeps freed blocks in its heap, so the
ranks are started with the threshold fixed at 64 KiB (MALLOC_MMAP_THRESHOLD_), which makes
every tensor of a unit its own mapping, given back when freed.
"""

import gc

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import distributed
import zero_py

WORLD = 4
UNITS = 24
WIDTH = 512
UNIT_BYTES = (WIDTH * WIDTH + WIDTH) * 4          # one Linear(512, 512), fp32: 1.05 MB
MODEL_BYTES = UNITS * UNIT_BYTES                   # 25.2 MB
SLACK = 2 * 2**20  # gloo and Python bookkeeping: measured transients stay below 1 MB
PERSISTENCE = 4097  # biases (up to 4096 wide) stay replicated (the persistent pseudo-unit)
SEED = 11


class Stack(nn.Module):
    def __init__(self, units=UNITS, width=WIDTH):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(units))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def init_fn(m):
    """An init pass as model.apply(fn) runs it after construction (GPT-2 style)."""
    if isinstance(m, nn.Linear):
        nn.init.normal_(m.weight, std=0.02)
        nn.init.uniform_(m.bias, -0.1, 0.1)


def _status_bytes(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def _reset_peak():
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # VmHWM := VmRSS


def _warm_up():
    """Pays every one-time allocation that initialize makes on first use."""
    with torch.device("meta"):
        tiny = Stack(units=2, width=8)
    tiny, opt = zero_py.initialize(tiny, torch.optim.AdamW, stage=3, wrap_policy={nn.Linear},
                                   persistence_threshold=9, init_fn=init_fn)
    tiny(torch.randn(2, 8)).sum().backward()
    opt.step()
    zero_py.full_state_dict(tiny)
    del tiny, opt
    gc.collect()


def _measured_build(rank, with_init_fn, units, width):
    torch.manual_seed(SEED)
    with torch.device("meta"):
        model = Stack(units, width)
    gc.collect()
    dist.barrier()
    before = _status_bytes("VmRSS")
    _reset_peak()
    model, opt = zero_py.initialize(model, torch.optim.AdamW, stage=3, wrap_policy={nn.Linear},
                                    persistence_threshold=PERSISTENCE,
                                    init_fn=init_fn if with_init_fn else None, lr=1e-3)
    peak = _status_bytes("VmHWM")
    gc.collect()
    kept = _status_bytes("VmRSS") - before
    flat = opt._flat
    persistent = sum(flat.bucket_numel[b] * flat.bucket_dtype(b).itemsize
                     for b in flat.unit_buckets[opt._engine.persistent_unit])
    kept_tensors = (flat.shards.nbytes() + opt._reducer.grads.nbytes() + opt._masters.nbytes()
                    + persistent)
    full = zero_py.full_state_dict(model)
    out = {"growth": peak - before, "kept": kept, "kept_tensors": kept_tensors}
    if rank == 0:
        torch.manual_seed(SEED)
        ref = Stack(units, width)
        if with_init_fn:
            ref.apply(init_fn)
        ref = ref.state_dict()
        out["keys_equal"] = list(full) == list(ref)
        out["values_equal"] = all(torch.equal(full[k], ref[k]) for k in ref)
        out["random"] = all(full[k].std().item() > 1e-3 for k in ref)
    # and it trains: a step changes the parameters
    model(torch.randn(4, width)).sum().backward()
    opt.step()
    del model, opt, full
    gc.collect()
    return out


def _body(rank, world_size, units=UNITS, width=WIDTH):
    _warm_up()
    return {"reset_parameters": _measured_build(rank, False, units, width),
            "init_fn": _measured_build(rank, True, units, width)}


@pytest.fixture(scope="module")
def results():
    # the ranks inherit the environment when they are spawned (see the module docstring)
    mp = pytest.MonkeyPatch()
    mp.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    mp.setenv("MALLOC_TRIM_THRESHOLD_", "65536")
    try:
        yield distributed.run(_body, WORLD)
    finally:
        mp.undo()


@pytest.mark.parametrize("how", ["reset_parameters", "init_fn"])
def test_values_equal_an_ordinary_build(results, how):
    r = results[0][how]
    assert r["keys_equal"]
    assert r["random"], "the test model must be initialized randomly, not to constants"
    assert r["values_equal"], (f"a meta build with {how} differs from an ordinary build from "
                               "the same seed")


@pytest.mark.parametrize("how", ["reset_parameters", "init_fn"])
def test_kept_memory_is_the_shards(results, how):
    """What stays resident after initialize is the shards (and the replicated biases), not a
    retained copy of the values."""
    for rank, res in enumerate(results):
        r = res[how]
        assert r["kept"] <= r["kept_tensors"] + SLACK, (
            f"rank {rank} ({how}): initialize left {r['kept'] / 1e6:.1f} MB resident, its "
            f"shards are {r['kept_tensors'] / 1e6:.1f} MB")


@pytest.mark.parametrize("how", ["reset_parameters", "init_fn"])
def test_peak_is_kept_plus_about_one_unit(results, how):
    bound_extra = 2 * UNIT_BYTES + SLACK
    for rank, res in enumerate(results):
        r = res[how]
        transient = r["growth"] - r["kept"]
        assert transient <= bound_extra, (
            f"rank {rank} ({how}): peak RSS during initialize grew {r['growth'] / 1e6:.1f} MB, "
            f"{transient / 1e6:.1f} MB above what it keeps ({r['kept'] / 1e6:.1f} MB); "
            f"allowed: two units ({2 * UNIT_BYTES / 1e6:.1f} MB) + {SLACK / 1e6:.1f} MB")
        # and far from a model: at 4 ranks the shards (params + grads) are half of one model
        assert r["growth"] < MODEL_BYTES * 2 / WORLD + bound_extra < MODEL_BYTES, (
            f"rank {rank} ({how}): peak RSS grew {r['growth'] / 1e6:.1f} MB for a "
            f"{MODEL_BYTES / 1e6:.1f} MB model")


if __name__ == "__main__":
    # The numbers behind the test (and docs/stage3.md), for any size:
    #   python tests/test_meta_build_memory.py [UNITS WIDTH [--glibc-default]]
    # --glibc-default leaves glibc's malloc settings alone (resident memory then also counts
    # freed blocks that glibc keeps).
    import os
    import sys

    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    units, width = (int(args[0]), int(args[1])) if args else (UNITS, WIDTH)
    if "--glibc-default" not in sys.argv:
        os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
        os.environ["MALLOC_TRIM_THRESHOLD_"] = "65536"
    unit = (width * width + width) * 4
    res = distributed.run(_body, WORLD, units, width)
    print(f"{units} x Linear({width}, {width}) at {WORLD} ranks: "
          f"model {units * unit / 1e6:.1f} MB, "
          f"one unit {unit / 1e6:.2f} MB")
    for how in ("reset_parameters", "init_fn"):
        for rank, r in enumerate(res):
            print(f"  {how:16s} rank {rank}: peak growth {r[how]['growth'] / 1e6:6.1f} MB = kept "
                  f"{r[how]['kept'] / 1e6:6.1f} MB (shards {r[how]['kept_tensors'] / 1e6:.1f} MB) "
                  f"+ {(r[how]['growth'] - r[how]['kept']) / 1e6:5.1f} MB")
