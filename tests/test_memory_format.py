"""Memory formats: a parameter keeps its strides (channels_last, channels_last_3d, any
permutation of its dims) under every stage, as under DDP and torch.optim, and its state dicts
and checkpoints hold the logical tensors.

zero_py used to copy every parameter into its flat buffer in row-major order and make it a
row-major view there: a channels_last convolution weight came out with strides (27, 9, 3, 1)
instead of (27, 1, 9, 3) under stages 1, 2 and 3. Each case below trains a small net whose
parameters are channels_last (Conv2d), channels_last_3d (Conv3d) and transposed (a Linear
weight given as .t()), at 2 ranks, against DDP + torch.optim.AdamW, and compares strides as
well as values (tolerance as tests/test_parity_ddp.py).
"""

import json
import os

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import distributed
import zero_py

RTOL = 1e-5
LR = 3e-3


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3)
        self.conv2 = nn.Conv2d(8, 6, 3)
        self.conv3 = nn.Conv3d(2, 4, (1, 2, 2))
        self.proj = nn.Parameter(torch.randn(5, 6).t() * 0.3)  # (6, 5), strides (1, 6)

    def forward(self, x, v):
        h = torch.relu(self.conv2(torch.relu(self.conv1(x)))).mean((2, 3))
        return (h @ self.proj).pow(2).mean() + self.conv3(v).pow(2).mean()


def _net(seed=0, channels_last=True):
    torch.manual_seed(seed)
    net = _Net()
    if channels_last:
        net.conv1.to(memory_format=torch.channels_last)
        net.conv2.to(memory_format=torch.channels_last)
        net.conv3.to(memory_format=torch.channels_last_3d)
    return net


def _batch(gen):
    x = torch.randn(4, 3, 8, 8, generator=gen).to(memory_format=torch.channels_last)
    v = torch.randn(4, 2, 2, 5, 5, generator=gen)
    return x, v


def _strides(model):
    return {n: tuple(p.stride()) for n, p in model.named_parameters()}


def _full(model):
    """Every rank: {name: (strides, values)} of the full parameters."""
    with zero_py.gathered(model):
        return {n: (tuple(p.stride()), p.detach().clone()) for n, p in model.named_parameters()}


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _train(model, opt, gen, steps):
    for _ in range(steps):
        model(*_batch(gen)).backward()
        opt.step()
        opt.zero_grad()


def _parity(rank, world):
    ref = _net()
    ddp = DDP(ref)
    ref_opt = torch.optim.AdamW(ddp.parameters(), lr=LR, weight_decay=0.1)
    want = _strides(ref)
    assert want["conv1.weight"] == (27, 1, 9, 3) and want["proj"] == (1, 6)
    gen = torch.Generator().manual_seed(100 + rank)
    _train(ddp, ref_opt, gen, 3)
    ref_state = ref_opt.state_dict()["state"]
    out = {"want": want}
    for stage in (1, 2, 3):
        model, opt = zero_py.initialize(_net(), torch.optim.AdamW, stage=stage, lr=LR,
                                        weight_decay=0.1, bucket_bytes=1024)
        at_init = _full(model)
        gen = torch.Generator().manual_seed(100 + rank)
        _train(model, opt, gen, 3)
        after = _full(model)
        full_sd = opt.consolidate_state_dict(to=0)
        rel = max(_rel(after[n][1], p.detach()) for n, p in ref.named_parameters())
        r = {"init": {n: s for n, (s, _) in at_init.items()},
             "after": {n: s for n, (s, _) in after.items()}, "param_rel": rel}
        if stage < 3:
            r["live"] = _strides(model)
        if rank == 0:  # the consolidated state: torch.optim's values, shapes and strides
            r["state"] = {k: (tuple(full_sd["state"][k]["exp_avg"].stride()),
                              _rel(full_sd["state"][k]["exp_avg_sq"],
                                   ref_state[k]["exp_avg_sq"]))
                          for k in ref_state}
            r["ref_state"] = {k: tuple(ref_state[k]["exp_avg"].stride()) for k in ref_state}
        out[stage] = r
    # partitioned construction: a model built on the meta device, converted there
    torch.manual_seed(0)
    built = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Conv2d(8, 4, 3)).to(
        memory_format=torch.channels_last)
    torch.manual_seed(0)
    with torch.device("meta"):
        meta = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Conv2d(8, 4, 3))
    meta.to(memory_format=torch.channels_last)
    meta, _ = zero_py.initialize(meta, torch.optim.AdamW, stage=3)
    got = _full(meta)
    out["meta"] = {n: (got[n][0] == p.stride() and torch.equal(got[n][1], p.detach()))
                   for n, p in built.named_parameters()}
    return out


def test_parameters_keep_their_memory_format_and_train_as_ddp():
    """Stages 1, 2 and 3 at 2 ranks: strides equal DDP's after initialize and after steps, the
    values match DDP + AdamW, and the consolidated optimizer state is torch.optim's (values and
    strides)."""
    for rank, out in enumerate(distributed.run(_parity, 2)):
        want = out["want"]
        assert all(out["meta"].values()), f"rank {rank}: built on the meta device {out['meta']}"
        for stage in (1, 2, 3):
            r = out[stage]
            where = f"stage {stage} rank {rank}"
            assert r["init"] == want, f"{where}: strides after initialize {r['init']}"
            assert r["after"] == want, f"{where}: strides after steps {r['after']}"
            if stage < 3:
                assert r["live"] == want, f"{where}: live parameters' strides {r['live']}"
            assert r["param_rel"] <= RTOL, f"{where}: params differ by {r['param_rel']:.2e}"
            if rank == 0:
                for k, (strides, rel) in r["state"].items():
                    assert strides == r["ref_state"][k], f"{where}: state {k} strides {strides}"
                    assert rel <= RTOL, f"{where}: state {k} differs by {rel:.2e}"


def _run(model, opt, batches):
    for b in batches:
        model(*b).backward()
        opt.step()
        opt.zero_grad()


def _round_trip(rank, world):
    """A full dict (consolidate_state_dict) saved at stage 2 and loaded at stage 3; a shard dict
    loaded back at stage 2; each continued for 3 steps against the uninterrupted run."""
    out = {}
    gen = torch.Generator().manual_seed(7 + rank)
    batches = [_batch(gen) for _ in range(6)]

    model, opt = zero_py.initialize(_net(), torch.optim.AdamW, stage=2, lr=LR, bucket_bytes=1024)
    _run(model, opt, batches[:3])
    full = [opt.consolidate_state_dict(to=0)]
    torch.distributed.broadcast_object_list(full, 0)  # every rank loads the full dict
    full = full[0]
    shard = opt.state_dict()
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    _run(model, opt, batches[3:])
    want = _full(model)
    for stage, kind, sd in ((3, "full", full), (2, "shard", shard)):
        m, o = zero_py.initialize(_net(seed=5), torch.optim.AdamW, stage=stage, lr=LR,
                                  bucket_bytes=1024)
        m.load_state_dict(weights)
        o.load_state_dict(sd)
        _run(m, o, batches[3:])
        got = _full(m)
        out[(stage, kind)] = max(
            _rel(got[n][1], want[n][1]) for n in want)
    # a shard dict of a model of another memory format is refused, naming the parameter
    m, o = zero_py.initialize(_net(seed=5, channels_last=False), torch.optim.AdamW, stage=2,
                              lr=LR, bucket_bytes=1024)
    try:
        o.load_state_dict(shard)
        out["refused"] = None
    except ValueError as exc:
        out["refused"] = str(exc)
    # ranks whose parameters differ in memory order: refused on every rank before any layout
    try:
        zero_py.initialize(_net(channels_last=rank == 0), torch.optim.AdamW, stage=2)
        out["divergent"] = None
    except ValueError as exc:
        out["divergent"] = str(exc)
    return out


def test_optimizer_state_dict_round_trip_keeps_the_order():
    """A full dict loads at stage 3, a shard dict at stage 2, each continuing as
    the uninterrupted run; a shard dict into a model of another memory format, and ranks whose
    memory formats differ, are refused."""
    for rank, out in enumerate(distributed.run(_round_trip, 2)):
        refused, divergent = out.pop("refused"), out.pop("divergent")
        assert divergent is not None and "dim_order" in divergent, divergent
        for case, rel in out.items():
            assert rel <= RTOL, f"rank {rank} {case}: resumed run differs by {rel:.2e}"
        assert refused is not None and "memory order" in refused \
            and "channels_last" in refused, refused


def _checkpoint(rank, world, tmp):
    gen = torch.Generator().manual_seed(11 + rank)
    batches = [_batch(gen) for _ in range(6)]

    out = {}
    path = os.path.join(tmp, "ck")
    model, opt = zero_py.initialize(_net(), torch.optim.AdamW, stage=2, lr=LR, bucket_bytes=1024)
    _run(model, opt, batches[:3])
    zero_py.save_checkpoint(path, model, opt)
    out["saved"] = {n: v.clone() for n, v in zero_py.full_state_dict(model, rank=0).items()} \
        if rank == 0 else None
    _run(model, opt, batches[3:])
    want = _full(model)
    m, o = zero_py.initialize(_net(seed=5), torch.optim.AdamW, stage=3, lr=LR)
    zero_py.load_checkpoint(path, m, o)
    out["loaded_strides"] = {n: s for n, (s, _) in _full(m).items()}
    _run(m, o, batches[3:])
    got = _full(m)
    out["resumed_rel"] = max(_rel(got[n][1], want[n][1]) for n in want)
    m, o = zero_py.initialize(_net(seed=5, channels_last=False), torch.optim.AdamW, stage=3,
                              lr=LR)
    try:
        zero_py.load_checkpoint(path, m, o)
        out["refused"] = None
    except Exception as exc:  # noqa: BLE001 - the message is what is checked
        out["refused"] = str(exc)
    return out


def test_checkpoint_saved_at_stage_2_resumes_at_stage_3_and_consolidates(tmp_path):
    """save_checkpoint at stage 2, load_checkpoint at stage 3 into a channels_last model: the
    same run as without the interruption; into a row-major model: refused on every rank,
    naming the parameter. The manifest records the dim order; consolidate writes the logical
    weights."""
    tmp = str(tmp_path)
    outs = distributed.run(_checkpoint, 2, tmp)
    want = dict(_strides(_net()))
    for rank, out in enumerate(outs):
        assert out["loaded_strides"] == want, f"rank {rank}: {out['loaded_strides']}"
        assert out["resumed_rel"] <= RTOL, f"rank {rank}: resumed run {out['resumed_rel']:.2e}"
        refused = out["refused"]
        assert refused is not None and "conv1.weight" in refused \
            and "channels_last" in refused, f"rank {rank}: {refused}"
    with open(os.path.join(tmp, "ck", "manifest.json")) as f:
        params = json.load(f)["params"]
    assert params["conv1.weight"]["dim_order"] == [0, 2, 3, 1]
    assert params["conv3.weight"]["dim_order"] == [0, 2, 3, 4, 1]
    assert params["proj"]["dim_order"] == [1, 0]
    assert "dim_order" not in params["conv1.bias"]
    from safetensors.torch import load_file
    from zero_py.checkpoint.consolidate import consolidate
    consolidate(os.path.join(tmp, "ck"), os.path.join(tmp, "full.safetensors"))
    full = load_file(os.path.join(tmp, "full.safetensors"))
    saved = outs[0]["saved"]
    assert set(full) == set(saved)
    for name, value in saved.items():
        torch.testing.assert_close(full[name], value, rtol=0, atol=0, msg=name)
    net = _net(seed=5)
    net.load_state_dict(full)  # the logical tensors load into the model as they are
