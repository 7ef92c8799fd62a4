"""torch idioms against DDP + torch.optim at 2 ranks: calls in any order (zero_grad between
backward and step, step twice, step before any backward, zero_grad(set_to_none=False); also with
the optimizer offloaded, overlap_step included),
add_param_group after construction (a fine-tuning script unfreezing a layer), optimizer.state
as this rank's slices, the state-dict hooks, hyperparameters changed after construction (an
SGD's momentum switched on, by OneCycleLR or by hand; Adam's decoupled_weight_decay; the
record that a parameter has no momentum buffer yet kept through add_param_group, checkpoints
and state dicts), and module buffers (BatchNorm running statistics) broadcast at construction
and, with broadcast_buffers=True, before forwards as DDP does; torch.optim.swa_utils
(AveragedModel as SWA and EMA, SWALR, update_bn, the averaged copy run by one rank alone), the
step hooks, and deepcopy/pickle of the optimizer refused; forward hooks on stage-3 units
(torch.nn.utils' old-style weight_norm and prune registered before the optimizer, a user's
pre-hook, a user's forward hook with_kwargs/always_call registered after it), and an EMA
vector loaded with vector_to_parameters inside gathered(modifier_rank=0); under stage 3,
torch.func.functional_call over other tensors (per-sample gradients) and prune after
initialize refused by name.

Every scenario runs in one set of 2 processes (start-up dominates). Tolerance 1e-5 relative
(fp32: the two differ only in the order of float operations).
"""

import contextlib
import copy
import inspect
import os
import pickle
import warnings

import numpy as np
import torch
import torch.nn as nn
import torch.nn.utils.prune as prune
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils import parameters_to_vector, vector_to_parameters
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.optim.swa_utils import SWALR, AveragedModel, get_ema_multi_avg_fn, update_bn

import distributed
import models
import zero_py

RTOL = 1e-5
_TORCH = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])


def _rel(zmodel: nn.Module, ref: nn.Module) -> float:
    return max(models.max_rel_diff(a, b) for a, b in zip(zmodel.parameters(),
                                                        ref.parameters()))


def _zero(model, stage, cls=None, select=None, **kw):
    """zero_py.initialize at `stage`: AdamW(lr=1e-2, weight_decay=0.1) unless cls is given."""
    if cls is None:
        cls, kw = torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, **kw}
    if select is not None:
        kw["params"] = select(model)
    if stage == 3:
        return zero_py.initialize(model, cls, stage=3, **kw)
    return zero_py.initialize(model, cls, stage=stage, bucket_bytes=1024, **kw)


def _pair(rank, stage, **kw):
    """An MLP under DDP + AdamW and its copy under zero_py at `stage` (with `kw`, e.g.
    offload_optimizer), and this rank's data."""
    torch.manual_seed(0)
    ref = models.MLP()
    zmodel, zopt = _zero(copy.deepcopy(ref), stage, **kw)
    ddp = DDP(ref)
    ref_opt = models.reference_adamw(ddp.parameters(), lr=1e-2, weight_decay=0.1)
    return ref, zmodel, zopt, ddp, ref_opt, torch.Generator().manual_seed(rank)


def _step_both(pairs, batch) -> None:
    """One training step of each (model, optimizer) pair on the same batch."""
    for model, opt in pairs:
        models.mlp_loss(model, batch).backward()
        opt.step()
        opt.zero_grad()


# what each rank does per step: "b" backward, "s" step, "z" zero_grad(), "k" zero_grad(False)
ORDERS = ["s", "bsz", "bzs", "s", "bssz", "bsk", "bks", "bsz", "bz", "bs"]


def call_orders(rank, stage, **kw):
    ref, zmodel, zopt, ddp, ref_opt, gen = _pair(rank, stage, **kw)
    worst, moved = 0.0, []
    for order in ORDERS:
        batch = models.mlp_batch(gen)
        before = [p.detach().clone() for p in ref.parameters()]
        for model, opt in ((ddp, ref_opt), (zmodel, zopt)):
            for op in order:
                if op == "b":
                    models.mlp_loss(model, batch).backward()
                elif op == "s":
                    opt.step()
                else:
                    opt.zero_grad(set_to_none=op == "z")
        moved.append(any(not torch.equal(a, b) for a, b in zip(before, ref.parameters())))
        with zero_py.gathered(zmodel):  # stage 3: full values inside the block
            worst = max(worst, _rel(zmodel, ref))
    return {"rel": worst, "moved": moved}


def add_param_group(rank, stage, amsgrad=False):
    """Fine-tuning: the head is frozen at first, unfrozen after 3 steps with a group of its own
    (rank 1's values made different first, as a layer built on each rank would be).
    The reference trains the head's gradients from the start (DDP registers only parameters
    that require gradients when it is built) but gives them to torch.optim only then.
    amsgrad: the new group has it (the others not), as torch.optim takes it; the consolidated
    dict then holds max_exp_avg_sq for the head only, as torch's. Its lr is a NumPy float (as a
    schedule computed with NumPy writes), which the consolidated dict keeps as torch.optim's
    state_dict() does (rank 0 alone raised an UnpicklingError in consolidate_state_dict)."""
    extra = {"amsgrad": True} if amsgrad else {}
    head_lr = np.float64(5e-3) if amsgrad else 5e-3
    torch.manual_seed(0)
    ref = models.MLP()
    zmodel = copy.deepcopy(ref)
    zmodel.head.requires_grad_(False)
    base = [p for n, p in ref.named_parameters() if not n.startswith("head")]
    ddp = DDP(ref)
    ref_opt = models.reference_adamw(base, lr=1e-2, weight_decay=0.1)
    zopt = zero_py.ZeroOptimizer([p for p in zmodel.parameters() if p.requires_grad],
                                 stage=stage, lr=1e-2, weight_decay=0.1, bucket_bytes=1024)
    gen = torch.Generator().manual_seed(rank)
    worst = 0.0
    for k in range(7):
        if k == 3:
            ref_opt.add_param_group({"params": list(ref.head.parameters()), "lr": head_lr,
                                     **extra})
            zmodel.head.requires_grad_(True)
            if rank == 1:  # a new layer built per rank: add_param_group starts from rank 0's
                with torch.no_grad():
                    zmodel.head.weight.add_(1.0)
            zopt.add_param_group({"params": list(zmodel.head.parameters()), "lr": head_lr,
                                  **extra})
        batch = models.mlp_batch(gen)
        models.mlp_loss(ddp, batch).backward()
        ref_opt.step()
        ddp.zero_grad()
        models.mlp_loss(zmodel, batch).backward()
        zopt.step()
        zopt.zero_grad()
        worst = max(worst, _rel(zmodel, ref))
    full = zopt.consolidate_state_dict(to=0)
    keys = None if full is None else [sorted(full["state"][k]) for k in sorted(full["state"])]
    # optimizer.state[p] holds torch.optim's keys too, where this rank holds a slice of p
    viewed = [(sorted(zopt.state[p]), sorted(ref_opt.state[q])) for p, q in
              zip(zmodel.parameters(), ref.parameters()) if len(zopt.state[p])]
    return {"rel": worst, "groups": len(zopt.param_groups),
            "lr": [float(g["lr"]) for g in zopt.param_groups], "keys": keys,
            "full_lr": None if full is None else (type(full["param_groups"][1]["lr"]).__name__,
                                                  float(full["param_groups"][1]["lr"])),
            "ref_keys": [sorted(st) for _, st in sorted(ref_opt.state_dict()["state"].items())],
            "viewed": viewed}


def state_view_and_hooks(rank, stage):
    torch.manual_seed(0)
    ref = models.MLP()
    zmodel = copy.deepcopy(ref)
    ddp = DDP(ref)
    ref_opt = models.reference_adamw(ddp.parameters(), lr=1e-2)
    if stage == 3:
        zmodel, zopt = zero_py.initialize(zmodel, stage=3, lr=1e-2)
    else:
        zopt = zero_py.ZeroOptimizer(zmodel.parameters(), stage=stage, lr=1e-2,
                                     bucket_bytes=1024)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(3):
        batch = models.mlp_batch(gen)
        _step_both(((ddp, ref_opt), (zmodel, zopt)), batch)
    worst, held, covered = 0.0, 0, 0
    for p, q in zip(zmodel.parameters(), ref.parameters()):
        span = zopt.owned_range(p)
        mine = zopt.state[p]
        if span is None:
            assert len(mine) == 0 and p not in zopt.state
            continue
        lo, hi = span
        covered += hi - lo
        held += 1
        assert float(mine["step"]) == float(ref_opt.state[q]["step"])
        for key in ("exp_avg", "exp_avg_sq"):
            assert mine[key].shape == (hi - lo,)
            worst = max(worst, models.max_rel_diff(
                mine[key], ref_opt.state[q][key].reshape(-1)[lo:hi]))
    calls = []
    zopt.register_state_dict_pre_hook(lambda opt: calls.append("pre"))
    zopt.register_state_dict_post_hook(lambda opt, sd: {**sd, "note": "post"})
    zopt.register_load_state_dict_pre_hook(lambda opt, sd: calls.append(("load-pre",
                                                                          sd.get("note"))))
    zopt.register_load_state_dict_post_hook(lambda opt: calls.append("load-post"))
    sd = zopt.state_dict()
    zopt.load_state_dict(sd)
    full = zopt.consolidate_state_dict(to=0)
    return {"rel": worst, "held": held, "covered": covered, "len": len(zopt.state),
            "note": sd.get("note"), "full_note": None if full is None else full.get("note"),
            "calls": calls}


def _sgd_groups(model):
    """Weights with momentum from the start; biases without, switched on later."""
    return [{"params": [p for n, p in model.named_parameters() if n.endswith("weight")],
             "momentum": 0.9},
            {"params": [p for n, p in model.named_parameters() if n.endswith("bias")],
             "momentum": 0.0, "dampening": 0.3}]


def _nesterov_groups(model):
    """SGD(momentum=0.9, nesterov=True) whose param groups torch.optim takes (its constructor
    checks nesterov against the defaults only): the weights' dampened, the biases' without
    momentum (nesterov is then not read)."""
    return [{"params": [p for n, p in model.named_parameters() if n.endswith("weight")],
             "dampening": 0.2},
            {"params": [p for n, p in model.named_parameters() if n.endswith("bias")],
             "momentum": 0.0}]


# hyperparameters changed after construction, as schedulers and scripts change them:
# (optimizer class, options, param groups or None, change(step, optimizer), use OneCycleLR)
CHANGES = {
    # OneCycleLR cycles the momentum of an SGD built with momentum=0 (cycle_momentum=True)
    "sgd_one_cycle": (torch.optim.SGD, dict(lr=1e-2, dampening=0.1), None, None, True),
    # a momentum switched on after steps without one: the buffer starts as the gradient
    "sgd_momentum_later": (torch.optim.SGD, dict(lr=1e-2, dampening=0.3), None,
                           lambda k, g: g.update(momentum=0.9) if k == 2 else None, False),
    "sgd_group_momentum_later": (torch.optim.SGD, dict(lr=1e-2), _sgd_groups,
                                 lambda k, g: g.update(momentum=0.8)
                                 if k == 2 and g["momentum"] == 0 else None, False),
    # nesterov=True over groups that torch.optim.SGD accepts: one dampened, one without
    # momentum (the latter was refused by the kernel at the first step)
    "sgd_nesterov_groups": (torch.optim.SGD, dict(lr=1e-2, momentum=0.9, nesterov=True),
                            _nesterov_groups, None, False),
    # decoupled weight decay (AdamW's) or the L2 term (Adam's), as each step's group says
    "adam_decoupled_toggled": (torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1), None,
                               lambda k, g: g.update(decoupled_weight_decay=k % 3 == 1), False),
}
if "decoupled_weight_decay" not in inspect.signature(torch.optim.Adam).parameters:
    del CHANGES["adam_decoupled_toggled"]  # older torch (2.4): Adam has no such option


def changed_hyperparameters(rank, stage, case):
    cls, kw, groups, change, one_cycle = CHANGES[case]
    select = groups or (lambda m: m.parameters())
    torch.manual_seed(0)
    ref = models.MLP()
    zmodel = copy.deepcopy(ref)
    ddp = DDP(ref)
    ref_opt = cls(select(ref), **kw)
    zmodel, zopt = _zero(zmodel, stage, cls, select, **kw)
    scheds = [torch.optim.lr_scheduler.OneCycleLR(o, max_lr=5e-2, total_steps=8)
              for o in (ref_opt, zopt)] if one_cycle else []
    gen = torch.Generator().manual_seed(rank)
    worst = 0.0
    for k in range(6):
        batch = models.mlp_batch(gen)
        for model, opt in ((ddp, ref_opt), (zmodel, zopt)):
            for g in opt.param_groups:
                if change is not None:
                    change(k, g)
            models.mlp_loss(model, batch).backward()
            opt.step()
            opt.zero_grad()
        for s in scheds:
            s.step()
        with zero_py.gathered(zmodel):
            worst = max(worst, _rel(zmodel, ref))
    out = {"rel": worst}
    if one_cycle and stage < 3:
        # resume: a new optimizer built as the first was (momentum=0) and its scheduler,
        # which sets the momentum, then both state dicts; it goes on as the reference does
        saved = (copy.deepcopy(zopt.state_dict()), scheds[1].state_dict())
        resumed = models.MLP()
        resumed.load_state_dict(zmodel.state_dict())
        resumed, ropt = _zero(resumed, stage, cls, select, **kw)
        rsched = torch.optim.lr_scheduler.OneCycleLR(ropt, max_lr=5e-2, total_steps=8)
        ropt.load_state_dict(saved[0])
        rsched.load_state_dict(saved[1])
        for _ in range(2):
            batch = models.mlp_batch(gen)
            for model, opt, s in ((ddp, ref_opt, scheds[0]), (resumed, ropt, rsched)):
                models.mlp_loss(model, batch).backward()
                opt.step()
                opt.zero_grad()
                s.step()
            out["rel"] = max(out["rel"], _rel(resumed, ref))
    return out


def _sgd_momentum_groups(params, model, mixed):
    """All parameters in one group, or (mixed) weights with momentum from the start and biases
    without (their momentum is switched on later)."""
    if not mixed:
        return params
    names = {id(p): n for n, p in model.named_parameters()}
    return [{"params": [p for p in params if names[id(p)].endswith("weight")], "momentum": 0.9},
            {"params": [p for p in params if names[id(p)].endswith("bias")]}]


def momentum_record_kept(rank, stage, how, mixed, tmp):
    """SGD(momentum=0, dampening=0.3): 2 steps without momentum, then `how` (add_param_group,
    a checkpoint saved and loaded into a new optimizer, or this rank's or the full state dict
    loaded back), then momentum 0.9 for every group. torch.optim holds no momentum buffer for
    a parameter stepped only without momentum, so its first step with momentum starts the
    buffer from the gradient; zero_py used to lose that record in each of these calls and
    dampen the gradient into a zero buffer instead."""
    kw = dict(lr=5e-2, momentum=0.0, dampening=0.3)
    torch.manual_seed(0)
    ref = models.MLP()
    zmodel = copy.deepcopy(ref)
    if how == "add_group":
        zmodel.head.requires_grad_(False)
    base = [p for n, p in ref.named_parameters() if how != "add_group" or "head" not in n]
    ddp = DDP(ref)
    ref_opt = torch.optim.SGD(_sgd_momentum_groups(base, ref, mixed), **kw)

    def build(model):
        params = _sgd_momentum_groups([p for p in model.parameters() if p.requires_grad],
                                      model, mixed)
        return _zero(model, stage, torch.optim.SGD, lambda m: params, **kw)
    zmodel, zopt = build(zmodel)
    gen = torch.Generator().manual_seed(rank)
    worst = 0.0
    for k in range(5):
        if k == 2:
            if how == "add_group":
                ref_opt.add_param_group({"params": list(ref.head.parameters())})
                zmodel.head.requires_grad_(True)
                zopt.add_param_group({"params": list(zmodel.head.parameters())})
            elif how == "checkpoint":
                path = os.path.join(tmp, f"momentum_{stage}_{mixed}")
                zero_py.save_checkpoint(path, zmodel, zopt)
                torch.manual_seed(5)
                zmodel, zopt = build(models.MLP())
                zero_py.load_checkpoint(path, zmodel, zopt)
            else:
                sd = zopt.state_dict() if how == "shard_dict" else zopt.consolidate_state_dict()
                if how == "full_dict":
                    box = [sd]
                    torch.distributed.broadcast_object_list(box, 0)
                    sd = box[0]
                zopt.load_state_dict(copy.deepcopy(sd))
            for opt in (ref_opt, zopt):
                for g in opt.param_groups:
                    g["momentum"] = 0.9
        batch = models.mlp_batch(gen)
        for model, opt in ((ddp, ref_opt), (zmodel, zopt)):
            models.mlp_loss(model, batch).backward()
            opt.step()
            opt.zero_grad()
            model.zero_grad()  # the reference's head, outside its optimizer until step 2
        with zero_py.gathered(zmodel):
            worst = max(worst, _rel(zmodel, ref))
    return {"rel": worst}


# (how, stage, mixed): add_param_group rebuilds the update (stages 1-2); the others reload it
# (mixed: some groups with momentum from the start, so the update keeps buffers throughout)
MOMENTUM_RECORD = [("add_group", 1, False), ("add_group", 2, True), ("checkpoint", 1, False),
                   ("checkpoint", 2, True), ("checkpoint", 3, True), ("shard_dict", 2, True),
                   ("full_dict", 1, True)]


class BatchNormMLP(nn.Module):
    """fc1 has no bias: BatchNorm removes it, leaving it a gradient of rounding noise that
    AdamW would blow up into steps of size lr in arbitrary directions."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32, bias=False)
        self.bn = nn.BatchNorm1d(32)
        self.head = nn.Linear(32, 8)

    def forward(self, x):
        return self.head(torch.tanh(self.bn(self.fc1(x))))


def buffers(rank, stage, every_forward):
    torch.manual_seed(0)
    ref = BatchNormMLP()
    if rank == 1:  # buffers that differ per rank: rank 0's must win
        with torch.no_grad():
            ref.bn.running_mean.add_(3.0)
            ref.bn.running_var.mul_(2.0)
    zmodel, zopt = _zero(copy.deepcopy(ref), stage, broadcast_buffers=every_forward)
    synced = [b.detach().clone() for b in zmodel.buffers()]
    if not every_forward:  # DDP(broadcast_buffers=False) never syncs them: start it from ours
        with torch.no_grad():
            for a, b in zip(ref.buffers(), synced):
                a.copy_(b)
    ddp = DDP(ref, broadcast_buffers=every_forward)
    ref_opt = models.reference_adamw(ddp.parameters(), lr=1e-2, weight_decay=0.1)
    gen = torch.Generator().manual_seed(rank)
    worst = 0.0
    for _ in range(4):
        batch = models.mlp_batch(gen)
        for model, opt in ((ddp, ref_opt), (zmodel, zopt)):
            model.train()
            models.mlp_loss(model, batch).backward()
            opt.step()
            opt.zero_grad()
            model.eval()
            with torch.no_grad():
                out = model(batch[0])
            if model is ddp:
                ref_out = out
        worst = max(worst, models.max_rel_diff(out, ref_out))
        for a, b in zip(zmodel.buffers(), ref.buffers()):
            worst = max(worst, models.max_rel_diff(a.float(), b.float()))
    return {"rel": worst, "synced": synced}


def adagrad_group_accumulator(rank, stage):
    """A param group with its own initial_accumulator_value: torch.optim.Adagrad starts every
    accumulator at the constructor's value (the group's is ignored), with a warning here."""
    import warnings
    torch.manual_seed(0)
    ref = models.MLP()
    zmodel = copy.deepcopy(ref)
    ddp = DDP(ref)

    def groups(m):
        return [{"params": list(m.fc1.parameters()) + list(m.fc2.parameters())},
                {"params": list(m.head.parameters()), "initial_accumulator_value": 2.0}]
    ref_opt = torch.optim.Adagrad(groups(ref), lr=0.1, initial_accumulator_value=0.3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        zopt = zero_py.ZeroOptimizer(groups(zmodel), torch.optim.Adagrad, stage=stage, lr=0.1,
                                     initial_accumulator_value=0.3, bucket_bytes=1024)
    gen = torch.Generator().manual_seed(rank)
    worst = 0.0
    for _ in range(3):
        batch = models.mlp_batch(gen)
        _step_both(((ddp, ref_opt), (zmodel, zopt)), batch)
        worst = max(worst, _rel(zmodel, ref))
    return {"rel": worst, "warned": [str(w.message) for w in caught
                                     if "initial_accumulator_value" in str(w.message)]}


def clip_then_backward(rank, stage, clip_again, via_torch=False):
    """clip_grad_norm_ after a micro-batch's backward, then another backward (and another clip,
    or none) before step: torch's clip scaled the first gradients in place, so the second
    backward adds to clipped ones (zero_py defers the coefficient: it must settle it first).
    via_torch: zero_py's side calls torch.nn.utils.clip_grad_norm_(model.parameters()) too, as
    the DDP script did (the optimizer's clip)."""
    ref, zmodel, zopt, ddp, ref_opt, gen = _pair(rank, stage)
    worst, norms, evals = 0.0, [], []
    for _ in range(2):
        first, second = models.mlp_batch(gen), models.mlp_batch(gen)
        got = []
        for model, opt, clip in (
                (ddp, ref_opt, lambda: torch.nn.utils.clip_grad_norm_(ddp.parameters(), 0.05)),
                (zmodel, zopt, lambda: torch.nn.utils.clip_grad_norm_(zmodel.parameters(), 0.05)
                 if via_torch else zopt.clip_grad_norm_(0.05))):
            models.mlp_loss(model, first).backward()
            got.append(float(clip()))
            with torch.no_grad():  # every rank evaluates between the clip and the step
                evals.append(model(second[0]))
            models.mlp_loss(model, second).backward()
            if clip_again:
                got.append(float(clip()))
            opt.step()
            opt.zero_grad()
        norms.append(got)
        with zero_py.gathered(zmodel) if stage == 3 else contextlib.nullcontext():
            worst = max(worst, _rel(zmodel, ref))
    worst = max([worst] + [models.max_rel_diff(z, d) for d, z in zip(evals[::2], evals[1::2])])
    return {"rel": worst, "norms": norms}


def averaged_model_and_step_hooks(rank, stage):
    """torch.optim.swa_utils over a zero_py model (AveragedModel as SWA and as an EMA of
    parameters and buffers, SWALR on the ZeroOptimizer; under stage 3 copied and updated inside
    zero_py.gathered) and the optimizer's step hooks (a pre-hook that sets lr takes effect in
    that step), against the same on DDP + AdamW. A copy of the model is a plain model (a new
    optimizer may take it); the optimizer itself is refused by deepcopy and pickle."""
    out = {}
    for kind, kw in (("swa", {}), ("ema", {"multi_avg_fn": get_ema_multi_avg_fn(0.8),
                                          "use_buffers": True})):
        ref, zmodel, zopt, ddp, ref_opt, gen = _pair(rank, stage)
        if stage == 3:  # a plain copy would be of this rank's slices: refused on every rank
            try:
                AveragedModel(zmodel, **kw)
                out["plain_copy"] = "no error"
            except RuntimeError as exc:
                out["plain_copy"] = str(exc)
        inside = zero_py.gathered if stage == 3 else (lambda m: contextlib.nullcontext())
        ref_avg = AveragedModel(ref, **kw)
        with inside(zmodel):
            z_avg = AveragedModel(zmodel, **kw)
        sched = [SWALR(o, swa_lr=0.05, anneal_epochs=2) for o in (ref_opt, zopt)]
        for _ in range(3):
            _step_both(((ddp, ref_opt), (zmodel, zopt)), models.mlp_batch(gen))
            ref_avg.update_parameters(ref)
            with inside(zmodel):
                z_avg.update_parameters(zmodel)
            for s in sched:
                s.step()
        with inside(zmodel):
            out[kind] = max(_rel(z_avg.module, ref_avg.module), _rel(zmodel, ref))
    out["lr"] = zopt.param_groups[0]["lr"]
    if stage < 3:  # the copy is a plain model that a new optimizer may take
        zero_py.initialize(copy.deepcopy(zmodel), torch.optim.SGD, stage=stage, lr=0.1)
    out["copy_refused"] = []
    for copier in (copy.deepcopy, pickle.dumps):
        try:
            copier(zopt)
            out["copy_refused"].append("no error")
        except TypeError as exc:
            out["copy_refused"].append(str(exc))

    ref, zmodel, zopt, ddp, ref_opt, gen = _pair(rank, stage)
    calls = []

    def pre(opt, args, kwargs):
        calls.append(("pre", type(opt).__name__, len(args), opt.param_groups[0]["lr"]))
        for g in opt.param_groups:
            g["lr"] = 0.05

    for o in (ref_opt, zopt):
        o.register_step_pre_hook(pre)
        o.register_step_post_hook(lambda opt, args, kwargs: calls.append(
            ("post", type(opt).__name__, len(args))))
    hooks = [register_optimizer_step_pre_hook(lambda opt, args, kwargs: calls.append(
        ("global", type(opt).__name__)))]
    for _ in range(2):
        _step_both(((ddp, ref_opt), (zmodel, zopt)), models.mlp_batch(gen))
    hooks[0].remove()
    out["calls"] = [c for c in calls if c[1] != "AdamW"]
    out["ref_calls"] = [c for c in calls if c[1] == "AdamW"]
    with inside(zmodel):
        out["rel"] = max(_rel(zmodel, ref), out["swa"], out["ema"])
    return out


def averaged_batchnorm(rank, stage):
    """AveragedModel of a BatchNorm model under broadcast_buffers=True, swa_utils.update_bn on
    the copy, and the copy run, saved and loaded by rank 0 alone, with gradients (evaluating or
    fine-tuning the averaged model on one rank): the copy keeps the model's hooks (stage 3's
    gathers and state-dict hooks, the buffer broadcast), which must leave it alone; training
    goes on as DDP's after."""
    def make():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 8))
    ref = make()
    zmodel, zopt = _zero(make(), stage, broadcast_buffers=True)
    ddp = DDP(ref, broadcast_buffers=True)
    ref_opt = models.reference_adamw(ddp.parameters(), lr=1e-2, weight_decay=0.1)
    inside = zero_py.gathered if stage == 3 else (lambda m: contextlib.nullcontext())
    gen = torch.Generator().manual_seed(rank)
    ref_avg = AveragedModel(ref)
    with inside(zmodel):
        z_avg = AveragedModel(zmodel)
    worst = 0.0
    for k in range(3):
        _step_both(((ddp, ref_opt), (zmodel, zopt)), models.mlp_batch(gen))
        ref_avg.update_parameters(ref)
        with inside(zmodel):
            z_avg.update_parameters(zmodel)
        if k == 1:
            loader = [models.mlp_batch(torch.Generator().manual_seed(9 + i))[0]
                      for i in range(2)]
            update_bn(loader, ref_avg)
            update_bn(loader, z_avg)
            worst = max(worst, models.max_rel_diff(z_avg.module[1].running_var,
                                                   ref_avg.module[1].running_var))
            if rank == 0:
                for avg in (ref_avg, z_avg):
                    avg(loader[0]).square().mean().backward()
                worst = max(worst, _rel(z_avg.module, ref_avg.module),
                            *(models.max_rel_diff(a.grad, b.grad) for a, b in
                              zip(z_avg.parameters(), ref_avg.parameters())))
                # its state dict, saved and loaded by this rank alone, is its own
                z_avg.module.load_state_dict(ref_avg.module.state_dict())
                saved = z_avg.module.state_dict()
                worst = max(worst, *(models.max_rel_diff(saved[k].float(), v.float())
                                     for k, v in ref_avg.module.state_dict().items()))
    with inside(zmodel):
        worst = max(worst, _rel(zmodel, ref), _rel(z_avg.module, ref_avg.module))
    return {"rel": worst}


def _rel_named(zmodel: nn.Module, ref: nn.Module) -> float:
    """_rel by name, over full values (gathered under stage 3)."""
    with zero_py.gathered(zmodel) if stage_of(zmodel) == 3 else contextlib.nullcontext():
        got = {n: p.detach().clone() for n, p in zmodel.named_parameters()}
    return max(models.max_rel_diff(got[n], p) for n, p in ref.named_parameters())


def stage_of(model: nn.Module) -> int:
    return 3 if getattr(model, "_zero_py", None) is not None else 1


def _hooked_mlp() -> nn.Module:
    """An MLP whose Linears carry forward hooks registered before the optimizer, as
    torch.nn.utils does: the old-style weight_norm (a pre-hook computing weight from weight_g
    and weight_v), prune (a pre-hook computing weight from weight_orig and a mask), a
    user's pre-hook that reads the module's bias, and one on the root that scales the input
    by a parameter of the root's."""
    torch.manual_seed(0)
    m = models.MLP()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the old-style weight_norm
        nn.utils.weight_norm(m.fc1)
    prune.l1_unstructured(m.fc2, "weight", amount=0.3)
    m.head.register_forward_pre_hook(lambda mod, args: (args[0] + mod.bias.mean(),))
    m.scale = nn.Parameter(torch.linspace(0.5, 1.5, 16))  # the root unit's, stage 3
    m.register_forward_pre_hook(lambda mod, args: (args[0] * mod.scale,))
    return m


def unit_forward_hooks(rank, stage):
    """Under stage 3 with every Linear a unit, the hooks above ran before the unit's gather,
    on shard slices: weight_norm's corrupted the heap (free(): invalid next size, SIGABRT),
    prune's and the user's raised a raw shape or 'got a gradient while its unit is not
    gathered' error. A forward hook registered after initialize (with_kwargs, always_call)
    ran after the unit was freed: a norm it logged was the slice's, and a term it added to
    the output was refused at backward, as was a pre-hook registered after it with
    prepend=True (it ran before the gather). The root's pre-hook ran before the root was
    gathered: the rank whose slice of `scale` did not broadcast raised, and its peer waited in
    the forward's gathers (a hang). Now every hook on a unit runs while it is gathered, as
    DDP's do (the model cannot be deep-copied: torch refuses weight_norm's)."""
    ref = _hooked_mlp()
    ddp = DDP(ref)
    ref_opt = models.reference_adamw(ddp.parameters(), lr=1e-2, weight_decay=0.1)
    zmodel, zopt = _zero(_hooked_mlp(), stage,
                         **({"wrap_policy": {nn.Linear}} if stage == 3 else {}))
    norms = {}
    for m in (ref, zmodel):
        def logged(mod, args, kwargs, out, m=m):
            with torch.no_grad():
                norms.setdefault(id(m), []).append(float(mod.weight.norm()))
            return out + 0.1 * mod.bias.sum()
        m.fc2.register_forward_hook(logged, with_kwargs=True, always_call=True)
        m.fc1.register_forward_pre_hook(lambda mod, args: (args[0] - mod.bias.mean(),),
                                        prepend=True)
    gen = torch.Generator().manual_seed(rank)
    worst = 0.0
    for _ in range(4):
        _step_both([(ddp, ref_opt), (zmodel, zopt)], models.mlp_batch(gen))
        worst = max(worst, _rel_named(zmodel, ref))
    return {"rel": worst, "norms": (norms[id(ref)], norms[id(zmodel)])}


def vector_loaded_in_gathered(rank, stage):
    """An EMA kept as one vector (parameters_to_vector) loaded into the model with
    vector_to_parameters inside gathered(model, modifier_rank=0), which replaces each
    parameter's .data: stage 3 broadcast the gathered buffer instead, so the load was
    silently dropped (the model 1.0 off the loaded values, 1.1 after a step); stages 1-2
    refused the next step (the flat buffer the step updates no longer held the parameter).
    Now the new .data is what is broadcast and trained. Inside a read-only gathered() the
    load is dropped (stage 3) or kept on this rank (stages 1-2, where the step then refuses
    it): stage 3 refuses it at the block's exit, naming the parameter, and an in-place write
    there too (dropped silently before)."""
    ref, zmodel, zopt, ddp, ref_opt, gen = _pair(rank, stage)
    _step_both([(ddp, ref_opt), (zmodel, zopt)], models.mlp_batch(gen))
    with torch.no_grad():
        ema = parameters_to_vector(ref.parameters()) * 0.5 + 0.01
        vector_to_parameters(ema.clone(), ref.parameters())
        refused = None
        try:  # read-only: the block's edits are dropped, which was silent for this one
            with zero_py.gathered(zmodel):
                vector_to_parameters(ema.clone(), zmodel.parameters())
        except RuntimeError as exc:
            refused = str(exc)
        written, trained = None, None
        if stage == 3:  # an in-place write, dropped as silently before
            try:
                with zero_py.gathered(zmodel):
                    zmodel.fc2.weight.mul_(2.0)
            except RuntimeError as exc:
                written = str(exc)
            # a training step inside the block: its backward named a parameter "unused" and
            # said to tie or register it where it is used
            with torch.enable_grad():
                try:
                    with zero_py.gathered(zmodel):
                        models.mlp_loss(zmodel, models.mlp_batch(gen)).backward()
                except RuntimeError as exc:
                    trained = str(exc)
            zopt.zero_grad()
        with zero_py.gathered(zmodel, modifier_rank=0):
            vector_to_parameters(ema.clone(), zmodel.parameters())
    loaded = _rel_named(zmodel, ref)
    _step_both([(ddp, ref_opt), (zmodel, zopt)], models.mlp_batch(gen))
    return {"rel": max(loaded, _rel_named(zmodel, ref)), "refused": refused,
            "written": written, "trained": trained}


def stage3_functional_and_prune(rank):
    """Under stage 3, torch.func.functional_call with tensors other than the model's own
    Parameters (per-sample gradients under torch.func.grad/vmap, a MAML inner step) and a
    weight pruned after initialize were refused on every rank with a message about casts
    and moves ("replaced by another Parameter", "was removed") that named neither. Now each
    is named, with what to do; training goes on after the refused functional_call."""
    ref, zmodel, zopt, ddp, ref_opt, gen = _pair(rank, 3)
    out = {"refused": []}
    x, y = models.mlp_batch(gen)
    params = {n: p.detach() for n, p in zmodel.named_parameters()}
    try:  # one sample's gradient, as torch.func.vmap(torch.func.grad(loss)) takes it
        torch.func.grad(lambda ps: models.mlp_loss(
            lambda t: torch.func.functional_call(zmodel, ps, (t,)), (x[:1], y[:1])))(params)
    except RuntimeError as exc:
        out["refused"].append(str(exc))
    _step_both([(ddp, ref_opt), (zmodel, zopt)], models.mlp_batch(gen))
    out["rel"] = _rel_named(zmodel, ref)
    with zero_py.gathered(zmodel, modifier_rank=0):
        prune.l1_unstructured(zmodel.fc2, "weight", amount=0.3)
    try:
        models.mlp_loss(zmodel, models.mlp_batch(gen))
    except RuntimeError as exc:
        out["refused"].append(str(exc))
    return out


def _all(rank, world_size, tmp):
    out = {}
    for how, stage, mixed in MOMENTUM_RECORD:
        out[("momentum_record", how, stage, mixed)] = momentum_record_kept(rank, stage, how,
                                                                           mixed, tmp)
    for stage in (1, 2, 3):
        for again in (False, True):
            out[("clip_backward", stage, again)] = clip_then_backward(rank, stage, again)
        out[("clip_backward", stage, "torch")] = clip_then_backward(rank, stage, True, True)
    for stage in (1, 2):
        out[("adagrad", stage)] = adagrad_group_accumulator(rank, stage)
    for stage in (1, 2, 3):
        out[("orders", stage)] = call_orders(rank, stage)
    # offloaded: the host's copy of the gradient shard is what the step reads (zero_grad(False)
    # between backward and step must zero it too)
    for stage, overlap in ((2, 1.0), (3, 0.0)):
        out[("orders", stage, "offload")] = call_orders(rank, stage, offload_optimizer="cpu",
                                                        overlap_step=overlap)
        out[("buffers", stage, True)] = buffers(rank, stage, True)
    out[("buffers", 2, False)] = buffers(rank, 2, False)
    for stage in (1, 2):
        out[("add_group", stage)] = add_param_group(rank, stage)
        out[("add_group", stage, "amsgrad")] = add_param_group(rank, stage, amsgrad=True)
    for stage in (1, 2, 3):
        out[("unit_hooks", stage)] = unit_forward_hooks(rank, stage)
    for stage in (1, 2, 3):
        out[("vector_loaded", stage)] = vector_loaded_in_gathered(rank, stage)
    out[("functional_prune", 3)] = stage3_functional_and_prune(rank)
    for stage in (1, 2, 3):
        out[("averaged", stage)] = averaged_model_and_step_hooks(rank, stage)
        out[("averaged_bn", stage)] = averaged_batchnorm(rank, stage)
        out[("state", stage)] = state_view_and_hooks(rank, stage)
        for case in CHANGES:
            out[("changed", stage, case)] = changed_hyperparameters(rank, stage, case)
    return out


def test_torch_idioms_match_ddp(tmp_path):
    results = distributed.run(_all, 2, str(tmp_path), timeout=240)
    for rank, res in enumerate(results):
        for key, r in res.items():
            where = f"{key} rank {rank}"
            if "rel" in r:
                assert r["rel"] <= RTOL, f"{where}: differs from DDP by {r['rel']:.2e}"
        for key in [k for k in res if k[0] == "orders"]:
            # the reference moved on exactly the steps torch.optim updates: not after a
            # zero_grad() that followed backward, nor on a step before any backward
            assert res[key]["moved"] == [False, True, False, False, True, True,
                                                        True, True, False, True]
        for key in [k for k in res if k[0] == "clip_backward"]:
            for got in res[key]["norms"]:  # the norms returned are torch's: DDP's, then ours
                half = len(got) // 2
                for a, b in zip(got[:half], got[half:]):
                    assert abs(a - b) <= 1e-5 * a, (key, got)
        for stage in (1, 2):
            warned = res[("adagrad", stage)]["warned"]
            assert len(warned) == 1 and "constructor" in warned[0], warned
            for key in (("add_group", stage), ("add_group", stage, "amsgrad")):
                assert res[key]["groups"] == 2
                assert res[key]["lr"] == [1e-2, 5e-3]
                assert res[key]["full_lr"] in (None, ("float64" if "amsgrad" in key else "float",
                                                      5e-3)), res[key]["full_lr"]
                assert res[key]["keys"] in (None, res[key]["ref_keys"]), res[key]
                assert res[key]["viewed"] and all(a == b for a, b in res[key]["viewed"]), \
                    res[key]["viewed"]
        read_only = res[("vector_loaded", 3)]["refused"] or ""
        assert "'fc1.weight' (unit '(the root module)') (and 5 more) was replaced inside a " \
            "read-only `zero_py.gathered(model)`" in read_only, read_only
        assert "modifier_rank=0" in read_only
        trained = res[("vector_loaded", 3)]["trained"] or ""
        assert "a backward of a forward run inside `zero_py.gathered(model)`" in trained and \
            "Run the training forward and backward outside the block" in trained, trained
        written = res[("vector_loaded", 3)]["written"] or ""
        assert "'fc2.weight' (unit '(the root module)') was written in place inside a " \
            "read-only `zero_py.gathered(model)`" in written and "modifier_rank=0" in written, \
            written
        functional, pruned = res[("functional_prune", 3)]["refused"]
        if _TORCH < (2, 6) and "doesn't have storage" in functional:
            pass  # torch 2.4's functorch wrappers have no storage: torch refuses them first
        else:
            assert "'fc1.weight' is a plain tensor in this forward" in functional, functional
            assert "torch.func.functional_call" in functional and "stage 1 or 2" in functional
        assert "'fc2.weight' is now registered as 'fc2.weight_orig'" in pruned, pruned
        assert "torch.nn.utils.prune" in pruned
        for stage in (1, 2, 3):
            ref_norms, got = res[("unit_hooks", stage)]["norms"]
            assert len(got) == len(ref_norms) == 4  # the hook saw full weights, DDP's
            assert all(abs(a - b) <= RTOL * a for a, b in zip(got, ref_norms)), (got, ref_norms)
            st = res[("state", stage)]
            assert st["held"] == st["len"] > 0
            assert st["note"] == "post"
            assert st["full_note"] == ("post" if rank == 0 else None)
            assert st["calls"] == ["pre", ("load-pre", "post"), "load-post", "pre"]
            av = res[("averaged", stage)]
            assert av["lr"] == 0.05  # SWALR annealed to swa_lr
            for error in av["copy_refused"]:
                assert "ZeroOptimizer cannot be copied or pickled" in error, error
            # each step hook once per step, the pre-hook's lr used in that step (rel above)
            assert av["calls"] == [("global", "ZeroOptimizer"), ("pre", "ZeroOptimizer", 1, 1e-2),
                                   ("post", "ZeroOptimizer", 1),
                                   ("global", "ZeroOptimizer"), ("pre", "ZeroOptimizer", 1, 0.05),
                                   ("post", "ZeroOptimizer", 1)]
            assert [c[0] for c in av["ref_calls"]] == [c[0] for c in av["calls"]]
            if stage == 3:
                assert "copy.deepcopy would copy parameter 'fc1.weight'" in av["plain_copy"]
                assert "with zero_py.gathered(model):" in av["plain_copy"]
    # every rank holds its own slices, and together the ranks hold every element once
    for stage in (1, 2, 3):
        total = sum(p.numel() for p in models.MLP().parameters())
        assert sum(r[("state", stage)]["covered"] for r in results) == total
    # buffers: rank 0's at construction (rank 1 had others), for every stage
    for key in [k for k in results[0] if k[0] == "buffers"]:
        for a, b in zip(results[0][key]["synced"], results[1][key]["synced"]):
            assert torch.equal(a, b), key
