"""A stage-3 parameter is safe to touch, and the rest of what users do with a model works.

Against independent references (DDP + torch.optim, a plain model, torch.distributed): reading a
parameter between uses (its shard slice) never crashes and equals its slice of the full value;
model.state_dict() gives full values on every rank and torch.save of it loads into a plain
model; model.load_state_dict() round-trips and refuses wrong shapes without writing anything; a
submodule's state_dict() and load_state_dict() (a block, an embedding, the tied head) do the
same against DDP, where gathers are shared-memory reads and where they are collective;
frozen parameters are sharded (memory) and stay frozen; no_sync() issues no reduction and
matches DDP's no_sync; a process group that is a subgroup trains (two subgroups side by side,
each against DDP on its group; a group of every rank after a stage-3 model over one subgroup
only); every collective of stage 3 goes through the executor seam.

What a training script does that stage 3 must not get wrong silently: rank 0 alone saves
(`if rank == 0: torch.save(model.state_dict(), path)`: the values DDP trained, while the
others wait at a barrier or go on training; refused on every rank, or after the group's
timeout, where gathers are collective); a cast or move after initialize (refused at the next
forward or step, on every rank); a parameter used in the loss outside its unit's forward (the
root unit's between forward and backward matches DDP; a block's is refused at backward with
its name). Bad input gets a clear error (device, gradient of a parameter between uses).

Every scenario of one world size runs in one set of processes (start-up dominates).
"""

import copy
import datetime
import io
import os
import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import distributed
import models
import zero_py
from zero_py.collectives import TorchDistExecutor
from zero_py.examples.demo import Block

LR = dict(lr=3e-3, weight_decay=0.1)


def _batch(gen, vocab=32, block=16, batch=4):
    idx = torch.randint(0, vocab, (batch, block + 1), generator=gen)
    return idx[:, :-1], idx[:, 1:]


def _step(model, opt, gen):
    idx, tgt = _batch(gen)
    loss = model(idx, tgt)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _full(model):
    """Every parameter's full value by name, from zero_py.gathered."""
    with zero_py.gathered(model):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


def touch(rank, world_size):
    torch.manual_seed(0)
    model, opt = zero_py.initialize(models.TiedGPT(), stage=3, wrap_policy={Block}, **LR)
    gen = torch.Generator().manual_seed(rank)
    _step(model, opt, gen)
    full = _full(model)
    out = {}
    w = max(model.blocks[0].parameters(), key=lambda p: p.dim())  # a weight matrix
    # reads that used to crash (SIGSEGV) or raise "storage is not resizable"
    norm = w.norm()
    out["norm_finite"] = bool(torch.isfinite(norm))
    out["repr"] = "tensor" in repr(w.detach())
    out["clone"] = w.detach().clone().numel() == w.numel()
    ema = {n: p.detach().clone() for n, p in model.named_parameters()}  # an EMA's first copy
    out["ema"] = len(ema) == len(dict(model.named_parameters()))
    # a parameter between uses is exactly its slice of the full value
    ok = True
    for n, p in model.named_parameters():
        s = model._zero_py.optimizer._engine.flat.slice_of_param.get(
            model._zero_py.optimizer._engine.flat.index_of(p))
        want = full[n].reshape(-1)[s.param_lo:s.param_hi] if s is not None else full[n][:0]
        ok = ok and torch.equal(p.detach().reshape(-1), want.reshape(-1))
        ok = ok and tuple(zero_py.full_shape(p)) == tuple(full[n].shape)
    out["slices"] = ok
    # model.state_dict(): full values on every rank, equal to gathered()
    sd = model.state_dict()
    out["sd_full"] = all(torch.equal(sd[n], full[n]) for n in full)
    out["sd_keys"] = set(sd) == set(models.TiedGPT().state_dict())
    # torch.save(model.state_dict()) loads into a plain model
    buf = io.BytesIO()
    torch.save(sd, buf)
    plain = models.TiedGPT()
    plain.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=True))
    out["plain_equal"] = all(torch.equal(p, full[n]) for n, p in plain.named_parameters())
    # load_state_dict: other values in, the same values out, and training goes on from them
    same = torch.Generator().manual_seed(7)  # the same dict on every rank, as from one file
    other = {k: v + 0.01 * torch.randn(v.shape, generator=same) for k, v in sd.items()}
    other["lm_head.weight"] = other["tok_emb.weight"]  # tied: one parameter, two names
    model.load_state_dict(other)
    back = model.state_dict()
    out["roundtrip"] = all(torch.equal(back[k], other[k]) for k in other)
    # a wrong shape is refused before anything is written
    bad = dict(other)
    bad["ln_f.weight"] = torch.zeros(3)
    try:
        model.load_state_dict(bad)
        out["bad_shape"] = "no error"
    except RuntimeError as exc:
        out["bad_shape"] = str(exc)
    out["unchanged"] = all(torch.equal(v, other[k]) for k, v in model.state_dict().items())
    # inside gathered() the parameters are full and loading still works
    with zero_py.gathered(model):
        out["gathered_shape"] = tuple(model.ln_f.weight.shape) == tuple(full["ln_f.weight"].shape)
    # an in-place write between uses would reach this rank's slice only (and be undone by the
    # next step): refused, naming the parameter; nothing changes. Reading into an EMA is fine.
    before = model.state_dict()
    writes = {"mul_": lambda: w.mul_(0.9), "setitem": lambda: w.__setitem__(0, 1.0),
              "iadd": lambda: w.__iadd__(1.0), "init": lambda: torch.nn.init.normal_(w),
              "out": lambda: torch.mul(w, 2, out=w),
              "foreach": lambda: torch._foreach_mul_(list(model.blocks[0].parameters()), 0.5)}
    out["writes"] = {}
    for name, write in writes.items():
        try:
            with torch.no_grad():
                write()
            out["writes"][name] = "no error"
        except RuntimeError as exc:
            out["writes"][name] = str(exc)
    out["writes_changed_nothing"] = all(torch.equal(v, before[k])
                                        for k, v in model.state_dict().items())
    ema = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for n, p in model.named_parameters():
            ema[n].mul_(0.5).add_(p, alpha=0.5)
    # the way to write: rank 0's edit inside gathered(modifier_rank=0) reaches every rank
    name_w = next(n for n, p in model.named_parameters() if p is w)
    with zero_py.gathered(model, modifier_rank=0), torch.no_grad():
        w.mul_(0.5 if rank == 0 else 3.0)
    out["gathered_write"] = torch.equal(model.state_dict()[name_w], before[name_w] * 0.5)
    return out


def frozen(rank, world_size):
    """LoRA-style: most weights frozen. They are sharded (memory) and never change."""
    torch.manual_seed(0)
    ref = models.TiedGPT(n_layer=4, d_model=64)
    for n, p in ref.named_parameters():
        if "blocks" in n and "ln" not in n:
            p.requires_grad_(False)
    zm = copy.deepcopy(ref)
    ddp = DDP(ref)
    ref_opt = torch.optim.AdamW([p for p in ddp.parameters() if p.requires_grad], **LR)
    zm, zopt = zero_py.initialize(zm, stage=3, wrap_policy={Block}, **LR)
    frozen_before = {n: p.detach().clone() for n, p in ref.named_parameters()
                     if not p.requires_grad}
    gen_a = torch.Generator().manual_seed(rank)
    gen_b = torch.Generator().manual_seed(rank)
    losses = [(_step(ddp, ref_opt, gen_a), _step(zm, zopt, gen_b)) for _ in range(5)]
    full = _full(zm)
    rep = zopt.memory_report()
    frozen_bytes = sum(v.numel() * v.element_size() for v in frozen_before.values())
    # one unfrozen since (PEFT's set_adapter does so): refused at step() on every rank, also
    # where its slice on this rank is empty (that rank skipped the check, stepped on: a hang)
    sizes = [None] * world_size
    dist.all_gather_object(sizes, [(n, p.numel()) for n, p in zm.named_parameters()
                                   if not p.requires_grad])
    name = next(n for k, (n, _) in enumerate(sizes[0]) if min(s[k][1] for s in sizes) == 0)
    thawed = zm.get_parameter(name)
    thawed.requires_grad_(True)
    try:
        _step(zm, zopt, gen_b)
        unfrozen = ""
    except RuntimeError as exc:
        unfrozen = str(exc)
    thawed.requires_grad_(False)
    zopt.zero_grad()
    return {"unfrozen": (name, unfrozen), "loss_rel": max(abs(a - b) / abs(a) for a, b in losses),
            "rel": max(models.max_rel_diff(full[n], p) for n, p in ref.named_parameters()),
            "frozen_kept": all(torch.equal(full[n], v) for n, v in frozen_before.items()),
            "frozen_local": sum(p.numel() * p.element_size() for p in zm.parameters()
                                if not p.requires_grad),
            "frozen_bytes": frozen_bytes,
            "kept": rep["params"] - rep["gathered_peak"] - rep["gather_transport"],
            "padding": rep["padding"],
            "ddp_params": rep["ddp_params"],
            "all_bytes": sum(p.numel() * p.element_size() for p in ref.parameters())}


def all_frozen(rank, world_size, tmp):
    """RLHF-style: a trained policy beside a frozen reference model and a frozen reward model,
    each sharded alone under stage 3 (defect: a model with no trainable parameter was refused),
    against DDP with plain frozen copies. The reward model takes the policy's logits with
    gradients: they reach the policy through it, none its parameters."""
    torch.manual_seed(0)
    policy = models.TiedGPT(n_layer=2, d_model=32)
    torch.manual_seed(1)
    ref = models.TiedGPT(n_layer=2, d_model=32).requires_grad_(False)
    torch.manual_seed(2)
    reward = nn.Sequential(nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 1)).requires_grad_(False)
    plain = {"ref": copy.deepcopy(ref), "reward": copy.deepcopy(reward)}
    ddp = DDP(copy.deepcopy(policy))
    ddp_opt = torch.optim.AdamW(ddp.parameters(), **LR)
    zp, zopt = zero_py.initialize(policy, stage=3, wrap_policy={Block}, **LR)
    zref, ref_opt = zero_py.initialize(ref, stage=3, wrap_policy={Block})
    zrew, rew_opt = zero_py.initialize(reward, stage=3, wrap_policy={nn.Linear})

    def loss_of(pol, r, w, idx, tgt):
        logits = pol(idx)
        with torch.no_grad():
            ref_logits = r(idx)
        ce = nn.functional.cross_entropy(logits.reshape(-1, 32), tgt.reshape(-1))
        return ce + (logits - ref_logits).square().mean() - 0.1 * w(logits).mean()

    gen = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(3):
        idx, tgt = _batch(gen)
        pair = []
        for pol, r, w, opts in ((zp, zref, zrew, (zopt, ref_opt, rew_opt)),
                                (ddp, plain["ref"], plain["reward"], (ddp_opt,))):
            loss = loss_of(pol, r, w, idx, tgt)
            loss.backward()
            for o in opts:
                o.step()
                o.zero_grad()
            pair.append(loss.item())
        losses.append(pair)
    full, ref_sd = _full(zp), zref.state_dict()
    out = {"loss_rel": max(abs(a - b) / abs(b) for a, b in losses),
           "rel": max(models.max_rel_diff(full[n], p) for n, p in ddp.module.named_parameters()),
           "ref_kept": all(torch.equal(ref_sd[k], v) for k, v in plain["ref"].state_dict().items()),
           "no_param_grads": all(p.grad is None for m in (zref, zrew) for p in m.parameters()),
           "ref_local": sum(p.numel() for p in zref.parameters()),
           "ref_numel": sum(p.numel() for p in plain["ref"].parameters()),
           "opt_state": len(ref_opt.state_dict()["state"])}
    # load_state_dict of other values, then a checkpoint of them loaded back after a change
    torch.manual_seed(3)
    other = models.TiedGPT(n_layer=2, d_model=32)
    zref.load_state_dict(other.state_dict())
    path = os.path.join(tmp, "frozen_ref")
    zero_py.save_checkpoint(path, zref, ref_opt)
    zref.load_state_dict(plain["ref"].state_dict())
    zero_py.load_checkpoint(path, zref, ref_opt)
    idx, _ = _batch(gen)
    with torch.no_grad():
        out["loaded"] = (zref(idx) - other(idx)).abs().max().item()
    with zero_py.gathered(zref):
        out["gathered"] = torch.equal(zref.lm_head.weight, other.lm_head.weight)
    out["alone"] = True
    if rank == 0:  # alone (a log's sample, an export) while the peers wait: gathers one-sided
        with torch.no_grad():
            alone = zref(idx)
        sd = zero_py.full_state_dict(zref)
        out["alone"] = torch.equal(alone, other(idx)) and all(
            torch.equal(sd[k], v) for k, v in other.state_dict().items())
    dist.barrier()
    return out


class _Counting:
    """An executor object (the seam's third form) that counts the collectives it runs."""

    def __init__(self, inner):
        self.inner = inner
        self.counts = {}

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if name in ("reduce_scatter", "all_gather", "all_reduce", "all_reduce_max", "broadcast"):
            def counted(*a, **k):
                self.counts[name] = self.counts.get(name, 0) + 1
                return attr(*a, **k)
            return counted
        return attr


def no_sync_and_seam(rank, world_size):
    torch.manual_seed(0)
    ref = models.TiedGPT()
    zm = copy.deepcopy(ref)
    ddp = DDP(ref)
    ref_opt = torch.optim.AdamW(ddp.parameters(), **LR)
    counting = _Counting(TorchDistExecutor())
    zm, zopt = zero_py.initialize(zm, stage=3, wrap_policy={Block}, executor=counting, **LR)
    gen = torch.Generator().manual_seed(rank)
    worst, during = 0.0, []
    for _ in range(3):
        batches = [_batch(gen) for _ in range(3)]
        for k, (idx, tgt) in enumerate(batches):
            last = k == len(batches) - 1
            with (ddp.no_sync() if not last else _nothing()):
                ddp(idx, tgt).backward()
            before = counting.counts.get("reduce_scatter", 0)
            with (zopt.no_sync() if not last else _nothing()):
                zm(idx, tgt).backward()
            if not last:
                during.append(counting.counts.get("reduce_scatter", 0) - before)
        ref_opt.step()
        ref_opt.zero_grad()
        zopt.step()
        zopt.zero_grad()
    full = _full(zm)
    worst = max(models.max_rel_diff(full[n], p) for n, p in ref.named_parameters())
    return {"rel": worst, "reductions_in_no_sync": sum(during), "counts": dict(counting.counts)}


def no_sync_leftovers(rank, world_size):
    """Gradients accumulated under no_sync() for a block that the synced backward skips reach
    the reduction at the end of that backward (copied in from param.grad, whole, while the
    block's parameters are their shard slices again)."""
    torch.manual_seed(0)
    ref = models.TiedGPT()
    zm = copy.deepcopy(ref)
    ddp = DDP(ref, find_unused_parameters=True)
    ref_opt = torch.optim.AdamW(ddp.parameters(), **LR)
    zm, zopt = zero_py.initialize(zm, stage=3, wrap_policy={Block}, **LR)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(2):
        first, last = _batch(gen), _batch(gen)
        with ddp.no_sync():
            ddp(*first).backward()
        with zopt.no_sync():
            zm(*first).backward()
        ddp(*last, skip=(1,)).backward()
        zm(*last, skip=(1,)).backward()
        for opt in (ref_opt, zopt):
            opt.step()
            opt.zero_grad()
    full = _full(zm)
    return {"rel": max(models.max_rel_diff(full[n], p) for n, p in ref.named_parameters())}


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def subgroups(rank, world_size):
    """Two subgroups of two ranks, each a stage-3 job of its own, side by side."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = groups[rank // 2]
    torch.manual_seed(rank // 2)
    ref = models.TiedGPT()
    zm = copy.deepcopy(ref)
    ddp = DDP(ref, process_group=mine)
    ref_opt = torch.optim.AdamW(ddp.parameters(), **LR)
    zm, zopt = zero_py.initialize(zm, stage=3, wrap_policy={Block}, process_group=mine, **LR)
    gen_a = torch.Generator().manual_seed(rank)
    gen_b = torch.Generator().manual_seed(rank)
    losses = [(_step(ddp, ref_opt, gen_a), _step(zm, zopt, gen_b)) for _ in range(4)]
    full = _full(zm)
    return {"loss_rel": max(abs(a - b) / abs(a) for a, b in losses),
            "rel": max(models.max_rel_diff(full[n], p) for n, p in ref.named_parameters()),
            "group_rank": zopt.executor.rank, "group_size": zopt.executor.world_size}


def subgroup_then_all(rank, world_size):
    """A stage-3 model over ranks {2, 3} only (its gather channel made by those two), beside a
    stage-2 model over {0, 1}; then a stage-3 model over a group of every rank, against DDP.
    Its channel's new_group hung: torch named it from each rank's count of groups, which the
    first channel had made differ (collectives/local_group.py)."""
    pair = dist.new_group([0, 1]), dist.new_group([2, 3])
    mine = pair[rank // 2]
    torch.manual_seed(0)
    side, _ = zero_py.initialize(models.TiedGPT(), stage=3 if rank >= 2 else 2,
                                 process_group=mine, **LR,
                                 **({"wrap_policy": {Block}} if rank >= 2 else {}))
    everyone = dist.new_group()  # every rank, made after the channel of {2, 3} only
    ref = models.TiedGPT()
    zm = copy.deepcopy(ref)
    ddp = DDP(ref, process_group=everyone)
    ref_opt = torch.optim.AdamW(ddp.parameters(), **LR)
    zm, zopt = zero_py.initialize(zm, stage=3, wrap_policy={Block}, process_group=everyone,
                                  **LR)
    gen_a, gen_b = torch.Generator().manual_seed(rank), torch.Generator().manual_seed(rank)
    for _ in range(2):
        _step(ddp, ref_opt, gen_a), _step(zm, zopt, gen_b)
    full = _full(zm)
    return max(models.max_rel_diff(full[n], p) for n, p in ref.named_parameters())


def _pair(rank, **init_kw):
    """A TiedGPT under DDP + AdamW and the same model under stage 3."""
    torch.manual_seed(0)
    ref = models.TiedGPT()
    zm = copy.deepcopy(ref)
    ddp = DDP(ref)
    ref_opt = torch.optim.AdamW(ddp.parameters(), **LR)
    zm, zopt = zero_py.initialize(zm, stage=3, wrap_policy={Block}, **init_kw, **LR)
    return ddp, ref_opt, zm, zopt


def _rel_sd(sd, ref):
    """Largest relative difference of a state dict's parameters from DDP's, and whether it has
    every key."""
    want = ref.state_dict()
    return (max(models.max_rel_diff(sd[k], v) for k, v in want.items() if k in sd),
            set(sd) == set(want))


def one_rank_saves(rank, world_size, tmp):
    """Rank 0 alone calls model.state_dict() (and full_state_dict, gathered) while the others
    wait at a barrier or go on training: one host, so it gathers from the peers' shards alone
    and saves what DDP trained. The model's group has a 20 s timeout, so a collective gather
    fails the test instead of hanging it."""
    group = dist.new_group(timeout=datetime.timedelta(seconds=20))
    ddp, ref_opt, zm, zopt = _pair(rank, process_group=group)
    gen_a = torch.Generator().manual_seed(rank)
    gen_b = torch.Generator().manual_seed(rank)
    out = {"alone": zopt._engine.reads_alone()}
    for _ in range(3):
        _step(ddp, ref_opt, gen_a), _step(zm, zopt, gen_b)
    path = os.path.join(tmp, "rank0_alone.pt")
    if rank == 0:
        torch.save(zm.state_dict(), path)
    dist.barrier()  # the others wait here meanwhile
    if rank == 0:
        out["saved_rel"], out["saved_keys"] = _rel_sd(torch.load(path, weights_only=True),
                                                      ddp.module)
    # again a step later, the others going straight on to their next step, which waits for
    # this rank's forward
    losses = [(_step(ddp, ref_opt, gen_a), _step(zm, zopt, gen_b))]
    if rank == 0:
        out["full_rel"], out["full_keys"] = _rel_sd(zero_py.full_state_dict(zm), ddp.module)
        with zero_py.gathered(zm):
            out["gathered_rel"] = max(models.max_rel_diff(a, b) for a, b in
                                      zip(zm.parameters(), ddp.module.parameters()))
    losses += [(_step(ddp, ref_opt, gen_a), _step(zm, zopt, gen_b)) for _ in range(2)]
    # a step inside rank 0's gathered() block: its full values follow the update
    idx, tgt = _batch(gen_a)
    for model, opt in ((ddp, ref_opt), (zm, zopt)):
        model(idx, tgt).backward()
        if model is zm and rank == 0:
            with zero_py.gathered(zm):
                opt.step()
                out["step_inside_rel"] = max(models.max_rel_diff(a, b) for a, b in
                                             zip(zm.parameters(), ddp.module.parameters()))
        else:
            opt.step()
        opt.zero_grad()
    out["loss_rel"] = max(abs(a - b) / abs(a) for a, b in losses)
    out["rel"] = max(models.max_rel_diff(v, ddp.module.state_dict()[k])
                     for k, v in _full(zm).items())
    return out


def _counting(engine):
    """Counts the engine's gathers of a unit and its announcements of a collective access."""
    counts = {"gathers": 0, "announced": []}
    gather, announce = engine._gather, engine.announce

    def counted_gather(u, *a, **k):
        counts["gathers"] += 1
        return gather(u, *a, **k)

    def counted_announce(what, *a, **k):
        counts["announced"].append(what)
        return announce(what, *a, **k)

    engine._gather, engine.announce = counted_gather, counted_announce
    return counts


def _sd_rel(sd, want):
    """Largest relative difference of a state dict from `want`, 1.0 where a key or a shape
    differs (a shard slice under the full name)."""
    if set(sd) != set(want) or any(tuple(sd[k].shape) != tuple(v.shape) for k, v in want.items()):
        return 1.0
    return max(models.max_rel_diff(sd[k], v) for k, v in want.items())


def _noisy(sd):
    """A state dict plus the same seeded noise on every rank (as loaded from one file)."""
    same = torch.Generator().manual_seed(11)
    return {k: v + 0.01 * torch.randn(v.shape, generator=same) for k, v in sd.items()}


def submodule_state_dicts(rank, world_size):
    """A submodule's state_dict() and load_state_dict() (a block, a module inside a block, the
    root unit's embedding, the tied head) give and take full values as the root's do, against
    DDP trained alike; the root's state_dict() still gathers each unit once."""
    ddp, ref_opt, zm, zopt = _pair(rank)
    ref = ddp.module
    engine = zopt._engine
    gen_a = torch.Generator().manual_seed(rank)
    gen_b = torch.Generator().manual_seed(rank)
    for _ in range(3):
        _step(ddp, ref_opt, gen_a), _step(zm, zopt, gen_b)
    out = {}
    subs = {"block": lambda m: m.blocks[0], "inner": lambda m: m.blocks[1].mlp,
            "emb": lambda m: m.tok_emb, "head": lambda m: m.lm_head}
    counts = _counting(engine)
    for name, sub in subs.items():
        counts["gathers"] = 0
        sd, want = sub(zm).state_dict(), sub(ref).state_dict()
        out[f"{name}_keys"] = set(sd) == set(want)
        out[f"{name}_shapes"] = all(tuple(sd[k].shape) == tuple(v.shape) for k, v in want.items()
                                    if k in sd)
        out[f"{name}_rel"] = _sd_rel(sd, want)
        out[f"{name}_gathers"] = counts["gathers"]
    counts["gathers"] = 0
    full = zm.state_dict()  # the root's: the submodules' hooks must not gather again
    out["root_gathers"] = counts["gathers"]
    counts["gathers"] = 0
    zero_py.full_state_dict(zm)
    out["full_gathers"] = counts["gathers"]
    out["units"] = len(engine.units)  # each gathered once (none is resident between steps)
    out["root_rel"], out["root_keys"] = _rel_sd(full, ref)
    # with a prefix, as a parent's state_dict() gives it
    sd = zm.blocks[0].state_dict(prefix="blocks.0.")
    out["prefix_rel"] = _sd_rel(sd, {k: v for k, v in ref.state_dict().items()
                                     if k.startswith("blocks.0.")})
    # load a block's dict (and a module's inside another block), then train on: as DDP
    new = _noisy(ref.blocks[0].state_dict())
    inner = _noisy(ref.blocks[1].mlp.state_dict())
    try:  # right after the reads above: a load waits for every rank's reads (its barrier)
        zm.blocks[0].load_state_dict(new)
        zm.blocks[1].mlp.load_state_dict(inner)
        out["load_error"] = ""
    except RuntimeError as exc:
        out["load_error"] = str(exc)
    ref.blocks[0].load_state_dict(new)
    ref.blocks[1].mlp.load_state_dict(inner)
    back = zm.blocks[0].state_dict()
    out["load_back"] = _sd_rel(back, new) == 0
    # a wrong shape in a block's dict is refused before anything is written
    bad = dict(new)
    bad["mlp.0.bias"] = torch.zeros(3)
    try:
        zm.blocks[0].load_state_dict(bad)
        out["bad_shape"] = "no error"
    except RuntimeError as exc:
        out["bad_shape"] = str(exc)
    losses = [(_step(ddp, ref_opt, gen_a), _step(zm, zopt, gen_b)) for _ in range(2)]
    out["load_loss_rel"] = max(abs(a - b) / abs(a) for a, b in losses)
    out["load_rel"] = max(models.max_rel_diff(v, ref.state_dict()[k])
                          for k, v in _full(zm).items())
    # the root's load still keeps each rank's slice once (the submodules' hooks do nothing)
    sd = zm.state_dict()
    zm.load_state_dict(sd)
    ref.load_state_dict(ref.state_dict())
    # read, then load, with rank 1 the slower reader: no rank overwrites its shards while a
    # peer still reads them one-sided (a fast rank's load used to be "ahead" of a slow read)
    try:
        for k in range(6):
            if rank == 1:
                time.sleep(0.004 * (k % 3))
            zm.load_state_dict(zm.state_dict())
        out["read_load_error"] = ""
    except RuntimeError as exc:
        out["read_load_error"] = str(exc)
    losses = [(_step(ddp, ref_opt, gen_a), _step(zm, zopt, gen_b))]
    out["root_load_rel"] = max(models.max_rel_diff(v, ref.state_dict()[k])
                               for k, v in _full(zm).items())
    out["loss_rel"] = max(abs(a - b) / abs(a) for a, b in losses)
    return out


def submodule_collective(rank, world_size):
    """ZP_SHM=0 (gathers collective): a block's state_dict() on every rank gives what DDP
    trained, announced once; rank 0 alone in it is refused on every rank, as is one rank asking
    for another block than its peers."""
    os.environ["ZP_SHM"] = "0"
    try:
        ddp, ref_opt, zm, zopt = _pair(rank)
    finally:
        os.environ["ZP_SHM"] = "1"
    gen_a = torch.Generator().manual_seed(rank)
    gen_b = torch.Generator().manual_seed(rank)
    out = {"alone": zopt._engine.reads_alone()}
    _step(ddp, ref_opt, gen_a), _step(zm, zopt, gen_b)
    counts = _counting(zopt._engine)
    sd = zm.blocks[1].state_dict()
    out["rel"] = _sd_rel(sd, ddp.module.blocks[1].state_dict())
    if out["rel"] > 1e-5:
        return out  # no hooks there (not gathered, not announced): the rest would desync
    out["announced"] = list(counts["announced"])
    counts["announced"].clear()
    zm.state_dict()
    out["root_announced"] = list(counts["announced"])
    try:
        if rank == 0:
            zm.blocks[0].state_dict()
        else:
            _step(zm, zopt, gen_b)
        out["alone_error"] = ""
    except RuntimeError as exc:
        out["alone_error"] = str(exc)
    try:
        zm.blocks[rank % 2].state_dict()  # a different block on each rank
        out["other_error"] = ""
    except RuntimeError as exc:
        out["other_error"] = str(exc)
    _step(zm, zopt, gen_b)  # refused alike on every rank: training goes on
    out["after"] = zero_py.full_state_dict(zm) is not None
    return out


COLLECTIVE_TIMEOUT_S = 5


def one_rank_collective(rank, world_size):
    """ZP_SHM=0 (as across hosts): gathers are collective, so rank 0 alone in
    model.state_dict() is refused: at once on every rank when the others go on to a forward,
    after the group's timeout (5 s here) when they wait at a barrier of another group."""
    os.environ["ZP_SHM"] = "0"
    try:
        group = dist.new_group(timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        torch.manual_seed(0)
        zm, zopt = zero_py.initialize(models.TiedGPT(), stage=3, wrap_policy={Block},
                                      process_group=group, **LR)
    finally:
        os.environ["ZP_SHM"] = "1"
    gen = torch.Generator().manual_seed(rank)
    out = {"alone": zopt._engine.reads_alone()}
    _step(zm, zopt, gen)
    start = time.monotonic()
    try:
        if rank == 0:
            zm.state_dict()
        else:
            _step(zm, zopt, gen)
        out["next_error"] = ""
    except RuntimeError as exc:
        out["next_error"] = str(exc)
    out["next_s"] = time.monotonic() - start
    _step(zm, zopt, gen)  # refused alike on every rank: training goes on
    out["full_after"] = zero_py.full_state_dict(zm) is not None  # on every rank: fine
    start = time.monotonic()
    if rank == 0:
        try:
            zm.state_dict()
            out["alone_error"] = ""
        except RuntimeError as exc:
            out["alone_error"] = str(exc)
        out["alone_s"] = time.monotonic() - start
    dist.barrier()  # the others wait here, on the world group
    return out


def cast_after_initialize(rank, world_size):
    """A cast or move after initialize is refused at the next forward (on every rank, also
    where only rank 0 cast) or at step(), never undone silently."""
    gen = torch.Generator().manual_seed(rank)
    out = {}

    def model():
        torch.manual_seed(0)
        zm, zopt = zero_py.initialize(models.TiedGPT(), stage=3, wrap_policy={Block},
                                      persistence_threshold=40, **LR)
        _step(zm, zopt, gen)
        return zm, zopt

    casts = {"half": lambda m: m.half(), "bf16": lambda m: m.to(torch.bfloat16),
             "double": lambda m: m.double(), "meta": lambda m: m.to("meta"),
             "rank0_half": lambda m: m.half() if rank == 0 else m}
    for name, cast in casts.items():
        zm, zopt = model()
        cast(zm)
        try:
            _step(zm, zopt, gen)
            out[name] = ""
        except RuntimeError as exc:
            out[name] = str(exc)
    zm, zopt = model()
    idx, tgt = _batch(gen)
    zm(idx, tgt).backward()
    zm.double()
    try:
        zopt.step()
        out["at_step"] = ""
    except RuntimeError as exc:
        out["at_step"] = str(exc)
    return out


def outside_use(rank, world_size):
    """A parameter used in the loss outside its unit's forward: the root unit's (the tied
    embedding, whole from the forward to the end of backward) trains like DDP; a block's is
    refused at backward, naming it, wherever the use is (after the forward, before it, alone);
    a block's passed to a call that fails on its slice says so."""
    ddp, ref_opt, zm, zopt = _pair(rank)
    gen_a = torch.Generator().manual_seed(rank)
    gen_b = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(3):
        row = []
        for model, opt, gen in ((ddp, ref_opt, gen_a), (zm, zopt, gen_b)):
            idx, tgt = _batch(gen)
            inner = model.module if model is ddp else model
            loss = model(idx, tgt) + 1e-2 * inner.lm_head.weight.pow(2).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            row.append(loss.item())
        losses.append(row)
    out = {"root_loss_rel": max(abs(a - b) / abs(a) for a, b in losses),
           "root_rel": max(models.max_rel_diff(v, ddp.module.state_dict()[k])
                           for k, v in _full(zm).items())}
    for case in ("after", "before", "alone", "failing_call"):
        torch.manual_seed(0)
        zm, _ = zero_py.initialize(models.TiedGPT(), stage=3, wrap_policy={Block}, **LR)
        w = zm.blocks[1].mlp[0].weight
        idx, tgt = _batch(gen_b)
        try:
            if case == "after":
                (zm(idx, tgt) + 1e-2 * w.pow(2).sum()).backward()
            elif case == "before":
                penalty = 1e-2 * w.pow(2).sum()
                (zm(idx, tgt) + penalty).backward()
            elif case == "alone":
                w.pow(2).sum().backward()
            else:
                torch.nn.functional.linear(torch.randn(2, 32, generator=gen_b), w)
            out[case] = ""
        except RuntimeError as exc:
            out[case] = str(exc)
    with torch.no_grad():
        out["read_norm"] = float(w.norm())  # reading between uses is still fine
    return out


def errors(rank, world_size):
    """Bad input gets a clear error: a device that is not the model's, and a gradient computed
    from a parameter outside the forward (its shard slice)."""
    out = {}
    model = models.TiedGPT()
    with pytest.raises(ValueError, match="device=meta but the model's parameters are on cpu"):
        zero_py.initialize(model, stage=3, wrap_policy={Block}, device="meta", **LR)
    with pytest.raises(ValueError, match="only apply to stage=3"):
        zero_py.initialize(model, stage=2, device="cpu", **LR)
    model, opt = zero_py.initialize(model, stage=3, wrap_policy={Block}, **LR)
    w = model.blocks[0].ln1.weight  # its shard slice between uses
    with pytest.raises(RuntimeError, match="inside the forward"):
        (w * 2).sum().backward()
    out["ok"] = True
    return out


def _all(rank, world_size, tmp):
    out = {"touch": touch(rank, world_size), "frozen": frozen(rank, world_size),
           "all_frozen": all_frozen(rank, world_size, tmp),
           "no_sync": no_sync_and_seam(rank, world_size),
           "leftovers": no_sync_leftovers(rank, world_size),
           "one_rank_saves": one_rank_saves(rank, world_size, tmp),
           "cast": cast_after_initialize(rank, world_size),
           "outside": outside_use(rank, world_size),
           "errors": errors(rank, world_size),
           "submodule": submodule_state_dicts(rank, world_size),
           "submodule_collective": submodule_collective(rank, world_size)}
    if world_size == 4:
        out["subgroups"] = subgroups(rank, world_size)
        out["subgroup_then_all"] = subgroup_then_all(rank, world_size)
    # last: the one-rank timeout leaves its group unusable
    out["collective"] = one_rank_collective(rank, world_size)
    return out


@pytest.fixture(scope="module", params=[2, pytest.param(4, marks=pytest.mark.slow)])
def results(request, tmp_path_factory):
    return request.param, distributed.run(_all, request.param,
                                          str(tmp_path_factory.mktemp("stage3_params")))


def test_parameters_are_safe_to_read_between_uses(results):
    _, res = results
    for r in res:
        t = r["touch"]
        assert t["norm_finite"] and t["repr"] and t["clone"] and t["ema"]
        assert t["slices"], "a parameter between uses is its slice of the full value"
        assert t["gathered_shape"]
        for name, error in t["writes"].items():
            assert "would write into parameter 'blocks.0." in error, (name, error)
            assert "zero_py.gathered(model, modifier_rank=0)" in error, (name, error)
        assert t["writes_changed_nothing"]
        assert t["gathered_write"]


def test_model_state_dict_is_full_and_loads_into_a_plain_model(results):
    _, res = results
    for r in res:
        assert r["touch"]["sd_full"] and r["touch"]["sd_keys"]
        assert r["touch"]["plain_equal"]


def test_model_load_state_dict_round_trips_and_refuses_bad_shapes(results):
    _, res = results
    for r in res:
        assert r["touch"]["roundtrip"]
        assert "ln_f.weight" in r["touch"]["bad_shape"] and "nothing was loaded" in \
            r["touch"]["bad_shape"], r["touch"]["bad_shape"]
        assert r["touch"]["unchanged"]


def test_frozen_parameters_are_sharded_and_kept(results):
    n, res = results
    for r in res:
        f = r["frozen"]
        assert f["loss_rel"] < 1e-5 and f["rel"] < 1e-5
        assert f["frozen_kept"]
        # this rank holds about 1/n of the frozen bytes, not all of them
        assert f["frozen_local"] <= f["frozen_bytes"] / n + 4096
        assert f["ddp_params"] == f["all_bytes"]
        # memory_report counts them sharded: what a rank keeps is 1/n of everything
        assert f["kept"] <= f["all_bytes"] / n + f["padding"] + 4096
        name, error = f["unfrozen"]
        assert f"parameter {name!r} had requires_grad=False when the optimizer was built" \
            in error, error


def test_a_model_with_no_trainable_parameter_is_sharded_beside_a_trained_one(results):
    n, res = results
    for r in res:
        f = r["all_frozen"]
        assert f["loss_rel"] < 1e-5 and f["rel"] < 1e-5, f
        assert f["ref_kept"] and f["no_param_grads"] and f["opt_state"] == 0, f
        # the reference model is sharded: this rank holds about 1/n of it
        assert f["ref_local"] <= f["ref_numel"] / n + 256, f
        assert f["loaded"] < 1e-6 and f["gathered"] and f["alone"], f


def test_no_sync_skips_the_reduction_and_matches_ddp(results):
    _, res = results
    for r in res:
        assert r["no_sync"]["reductions_in_no_sync"] == 0
        # 4 ranks sum in another order than DDP's all-reduce, and Adam magnifies the last bits
        # of near-zero gradients; a micro-batch lost or counted twice moves parameters ~1e-2
        assert r["no_sync"]["rel"] < 1e-4


def test_no_sync_gradients_of_a_block_the_synced_backward_skips(results):
    _, res = results
    for r in res:
        assert r["leftovers"]["rel"] < 1e-4, r["leftovers"]


def test_every_stage3_collective_goes_through_the_executor(results):
    _, res = results
    for r in res:
        c = r["no_sync"]["counts"]
        assert c.get("all_gather", 0) > 0 and c.get("reduce_scatter", 0) > 0
        assert c.get("broadcast", 0) > 0 and c.get("all_reduce_max", 0) > 0


def test_a_subgroup_process_group_trains(results):
    n, res = results
    if n != 4:
        pytest.skip("two subgroups of two ranks need 4 ranks")
    for rank, r in enumerate(res):
        s = r["subgroups"]
        assert s["group_size"] == 2 and s["group_rank"] == rank % 2
        assert s["loss_rel"] < 1e-5 and s["rel"] < 1e-5


def test_a_stage3_model_over_every_rank_after_one_over_a_subgroup(results):
    n, res = results
    if n != 4:
        pytest.skip("a subgroup beside another of other models needs 4 ranks")
    for r in res:
        assert r["subgroup_then_all"] < 1e-4, r["subgroup_then_all"]


def test_stage3_device_and_gradient_errors(results):
    """Bad input gets a clear error: a device that is not the model's, and a gradient computed
    from a parameter outside the forward (its shard slice)."""
    _, res = results
    assert all(r["errors"]["ok"] for r in res)


def test_one_rank_saves_alone_what_ddp_trained(results):
    """`if rank == 0: torch.save(model.state_dict(), path)` on one host: rank 0 gathers from
    the peers' shards alone (the others at a barrier, or in their next step), saves what DDP
    trained, and training goes on matching DDP."""
    _, res = results
    assert all(r["one_rank_saves"]["alone"] for r in res)
    r = res[0]["one_rank_saves"]
    assert r["saved_keys"] and r["full_keys"]
    assert r["saved_rel"] < 1e-5 and r["full_rel"] < 1e-5 and r["gathered_rel"] < 1e-5, r
    assert r["step_inside_rel"] < 1e-5, r
    for r in res:
        assert r["one_rank_saves"]["loss_rel"] < 1e-5 and r["one_rank_saves"]["rel"] < 1e-5


def test_one_rank_state_dict_is_refused_where_gathers_are_collective(results):
    """ZP_SHM=0: rank 0 alone in model.state_dict() while the others run a forward: refused at
    once on every rank, saying to call it on every rank; training then goes on. While they
    wait at a barrier: refused on rank 0 after the group's timeout, not a hang."""
    _, res = results
    for rank, r in enumerate(res):
        c = r["collective"]
        assert not c["alone"]
        assert "every rank" in c["next_error"] and "model.state_dict()" in c["next_error"], c
        assert "forward" in c["next_error"], c  # names what the others ran
        assert c["next_s"] < COLLECTIVE_TIMEOUT_S, c
        assert c["full_after"] == (rank == 0)
    c = res[0]["collective"]
    assert "model.state_dict() was called on this rank (rank 0) but not on every rank" in \
        c["alone_error"], c
    assert "timeout" in c["alone_error"]
    assert COLLECTIVE_TIMEOUT_S - 0.5 < c["alone_s"] < COLLECTIVE_TIMEOUT_S + 5, c


@pytest.mark.parametrize("how", ["half", "bf16", "double", "meta", "rank0_half", "at_step"])
def test_a_cast_after_initialize_is_refused_on_every_rank(results, how):
    _, res = results
    want = {"half": "float16", "bf16": "bfloat16", "double": "float64", "meta": "meta",
            "rank0_half": "float16", "at_step": "float64"}[how]
    for rank, r in enumerate(res):
        msg = r["cast"][how]
        assert "changed after zero_py.initialize" in msg or "refused" in msg, (rank, msg)
        if how != "rank0_half" or rank == 0:
            assert want in msg and "before zero_py.initialize" in msg, (rank, msg)
        else:  # rank 0 cast alone: the others say so
            assert "rank 0 refused this forward" in msg, (rank, msg)


def test_a_root_unit_parameter_in_the_loss_matches_ddp(results):
    _, res = results
    for r in res:
        assert r["outside"]["root_loss_rel"] < 1e-5 and r["outside"]["root_rel"] < 1e-5, r


@pytest.mark.parametrize("case", ["after", "before", "alone", "failing_call"])
def test_a_block_parameter_outside_its_forward_is_refused_by_name(results, case):
    _, res = results
    for r in res:
        msg = r["outside"][case]
        assert "'blocks.1.mlp.0.weight' (unit 'blocks.1')" in msg, msg
        assert "shard slice" in msg and "gathered" in msg, msg
        if case != "failing_call":
            assert "outside the forward of its unit" in msg and "backward" in msg, msg
            assert "inside the forward" in msg
        assert r["outside"]["read_norm"] >= 0


def test_a_submodule_state_dict_is_full_and_matches_ddp(results):
    """model.blocks[0].state_dict() (and a module inside a block, the root unit's embedding,
    the tied head) gives full values, what DDP trained, gathering only its unit; the root's
    state_dict() still gathers each unit once, as full_state_dict() does (the submodules'
    hooks, which it runs too, gather nothing more)."""
    _, res = results
    for r in res:
        s = r["submodule"]
        for name in ("block", "inner", "emb", "head"):
            assert s[f"{name}_keys"] and s[f"{name}_shapes"], (name, s)
            assert s[f"{name}_rel"] < 1e-5, (name, s)
        assert s["block_gathers"] == 1 and s["inner_gathers"] == 1, s
        # as many as full_state_dict() on its rank (the others gather nothing for it)
        assert s["root_gathers"] == res[0]["submodule"]["full_gathers"] == s["units"], s
        assert s["root_rel"] < 1e-5 and s["root_keys"], s
        assert s["prefix_rel"] < 1e-5, s


def test_a_submodule_load_state_dict_keeps_slices_and_trains_as_ddp(results):
    """blocks[0].load_state_dict(full dict) and blocks[1].mlp's on every rank, then training
    goes on as DDP's after the same loads (the fp32 masters follow); a wrong shape in a block's
    dict is refused before anything is written; the root's load still works."""
    _, res = results
    for r in res:
        s = r["submodule"]
        assert s["load_error"] == "", s["load_error"]
        assert s["load_back"], s
        assert "mlp.0.bias" in s["bad_shape"] and "nothing was loaded" in s["bad_shape"], s
        assert s["load_loss_rel"] < 1e-5 and s["load_rel"] < 1e-5, s
        assert s["root_load_rel"] < 1e-5 and s["loss_rel"] < 1e-5, s
        assert s["read_load_error"] == "", s["read_load_error"]


def test_a_submodule_state_dict_where_gathers_are_collective(results):
    """ZP_SHM=0: a block's state_dict() on every rank is what DDP trained, announced once (the
    root's too); rank 0 alone in it, or ranks asking for different blocks, is refused on every
    rank, and training goes on."""
    _, res = results
    for rank, r in enumerate(res):
        c = r["submodule_collective"]
        assert not c["alone"]
        assert c["rel"] < 1e-5, c
        assert len(c["announced"]) == 1 and "blocks.1" in c["announced"][0], c
        assert len(c["root_announced"]) == 1, c
        assert "every rank" in c["alone_error"], c
        assert "every rank" in c["other_error"], c
        assert c["after"] == (rank == 0)
