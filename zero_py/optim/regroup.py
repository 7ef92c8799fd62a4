"""add_param_group after construction (stages 1-2): the flat layout rebuilt with a new group.

The planner forms buckets per param group, walking the parameters from last to first, so a
group appended after the others gets buckets of its own and every parameter already laid out
keeps its buckets, offsets and, on every rank, the same slice. The rebuild therefore moves
each old slice's optimizer state and fp32 master locally (no communication beyond the new
parameters' values, broadcast from rank 0, and the ranks' agreement on the new group); a
slice that moved would be a planner change, reported as a bug rather than mis-assigned.
The old reducer's gradient hooks are removed and a new reducer is built over the new layout:
hence only between step() and the next backward.
"""

from __future__ import annotations

import torch

from zero_py.optim import agreement, compat
from zero_py.optim.update import (fused_kind, refuse_unhonoured_options,
                                  warn_ignored_group_options)
from zero_py.sharding.storage import FlatParams


def add_param_group(opt, param_group: dict) -> None:
    """optimizer.add_param_group after construction (see ZeroOptimizer.add_param_group)."""
    if opt._flat.params_sharded:
        raise RuntimeError(
            "zero_py stage 3 lays the parameters out at zero_py.initialize, so "
            "add_param_group cannot add one later: pass the parameters to unfreeze in a "
            "param group of their own from the start (initialize(..., params=[{'params': "
            "base}, {'params': later, 'lr': 0.0}]) with requires_grad=True), then raise "
            "that group's lr when they should train")
    if opt.offload_optimizer == "nvme":
        raise RuntimeError("add_param_group after construction is not supported with "
                           "offload_optimizer='nvme'; give every param group at construction "
                           "(a group to train later with lr=0, raised when it should train)")
    if opt._reducer.pass_open or opt._reducer.passes_since_step:
        raise RuntimeError("add_param_group rebuilds the flat layout: call it between "
                           "optimizer.step() and the next backward, not with gradients "
                           "pending")
    if not isinstance(param_group, dict) or "params" not in param_group:
        raise TypeError("add_param_group takes a dict with a 'params' entry, e.g. "
                        "{'params': layer.parameters(), 'lr': 1e-4}")
    params = param_group["params"]
    params = [params] if isinstance(params, torch.Tensor) else list(params)
    compat.check_unowned([q[1] if isinstance(q, tuple) else q for q in params], opt._name,
                         mine=opt)
    # torch's checks and defaults on a scratch copy: nothing changes if they fail
    scratch = torch.optim.Optimizer.__new__(torch.optim.Optimizer)
    scratch.defaults, scratch.state = opt.defaults, {}
    scratch.param_groups = [{k: v for k, v in g.items() if k in ("params", "param_names")}
                            for g in opt.param_groups]
    torch.optim.Optimizer.add_param_group(scratch, {**param_group, "params": params})
    group = scratch.param_groups[-1]
    new = [p for p in group["params"] if p.requires_grad and p.numel() > 0]
    for i, p in enumerate(new):
        opt._check_param(p, len(opt._all_params) + i)
    if any(p.device != opt._flat.device for p in new):
        raise ValueError(f"the new parameters must be on {opt._flat.device}, the device of "
                         "the others")
    refuse_unhonoured_options([group], f"param group {len(opt.param_groups)}")
    kind = fused_kind(opt.optimizer_class, opt.param_groups + [group])
    warn_ignored_group_options(opt.optimizer_class, opt.defaults, [group])
    keys = None  # the fused update's state keys over the new groups: the kept ones, then
    if kind == opt._kind and kind is not None:  # SGD's momentum buffer where a momentum is on
        try:  # that no step has used yet (added_state)
            keys = opt._update.keys + opt._state_to_add(opt.param_groups + [group], [group])
        except ValueError:
            keys = None
    if kind != opt._kind or (kind is not None and keys is None):
        raise ValueError("the new group's options need another update path or other state "
                         "than this optimizer keeps (e.g. amsgrad, momentum, a tensor lr): "
                         "give every group the same kind of options at construction")
    gi = len(opt.param_groups)
    start = len(opt._all_params)
    agreement.check(opt.executor, [("add_param_group", {
        k: v for k, v in group.items() if k != "params"})] + [
        agreement.param_entry(start + i, opt._names.get(id(p)), p)
        for i, p in enumerate(group["params"])], "ZeroOptimizer.add_param_group")
    with torch.no_grad():
        saved = {s.param: opt._slice_state(s) for s in opt._flat.slices}
        counts = list(opt._step_count)
        old = opt._flat
        managed = list(old.params) + new
        groups_of = [old.bucket_group[old.param_bucket[i]] for i in range(len(old.params))]
        groups_of += [gi] * len(new)
        storage = FlatParams(managed, groups_of, opt.executor.world_size,
                             opt.executor.rank, opt._align_bytes, opt._bucket_bytes)
        for s in storage.slices:
            if s.param < len(old.params):
                was = old.slice_of_param.get(s.param)
                if was is None or (was.param_lo, was.param_hi) != (s.param_lo, s.param_hi):
                    raise RuntimeError("zero_py: the rebuilt layout moved a parameter's "
                                       "slice; this is a bug, please report it")
        residuals = _kept_residuals(opt._reducer.residuals(), old, storage)
        fresh = [b for b in range(storage.n_buckets)
                 if any(i >= len(old.params) for i in storage.bucket_params[b])]
        pending = [opt.executor.broadcast(storage.bucket_region(b), 0) for b in fresh]
        for work in pending:
            work.wait()
        for h in opt._hook_handles:
            h.remove()
        opt._hook_handles.clear()
        opt.param_groups.append(group)
        opt._all_params += group["params"]
        opt._managed_index += [start + k for k, p in enumerate(group["params"])
                                if p.requires_grad and p.numel() > 0]
        had_grad = opt._had_grad
        # SGD: the parameters stepped only without momentum so far (their state has no buffer)
        no_buffer = set(getattr(opt._update, "no_momentum_yet", ()))
        opt._build(storage, opt._step_count + [0] * len(new))
        # grad_error_feedback: what rounding lost is still owed to the next contributions of
        # the buckets kept (a new reducer starts without residuals, which dropped it)
        opt._reducer.set_residuals(residuals)
        opt._had_grad[:len(had_grad)] = had_grad
        if keys is not None:
            opt._update.keys = keys
            opt._update.no_momentum_yet = no_buffer
        opt.sync_master_from_params()
        opt._allocate_states([s for s in storage.slices if saved.get(s.param)])
        for s in storage.slices:
            st = saved.get(s.param)
            if st:
                views = opt._state_views(s)
                if views is None:
                    opt._install_slice(s, st)
                    continue
                for key, view in views.items():
                    if key in st:
                        view.copy_(st[key])
                    else:  # SGD's momentum buffer of a parameter that has none yet
                        view.zero_()
        opt._step_count[:len(counts)] = counts
        for name, q in zip(group.get("param_names", ()), group["params"]):
            opt._names.setdefault(id(q), name)
        frozen = [p for p in group["params"] if not (p.requires_grad and p.numel() > 0)]
        for p in frozen:
            if p.numel() > 0:
                opt.executor.broadcast(p.data, 0).wait()
    compat.claim(opt, new)


def _kept_residuals(residuals: dict, old: FlatParams, storage: FlatParams) -> dict:
    """The error-feedback residuals of the old layout's buckets, by their index in the new
    one: a bucket kept (the same parameters, the same elements) keeps its residual, whose
    chunks follow the bucket's layout; the new group's buckets start without one."""
    index = {(tuple(storage.bucket_params[b]), storage.bucket_numel[b]): b
             for b in range(storage.n_buckets)}
    kept = {}
    for b, r in residuals.items():
        nb = index.get((tuple(old.bucket_params[b]), old.bucket_numel[b]))
        if nb is None:
            raise RuntimeError("zero_py: the rebuilt layout changed a bucket; this is a bug, "
                               "please report it")
        kept[nb] = r
    return kept
