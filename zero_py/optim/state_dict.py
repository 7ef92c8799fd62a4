"""Optimizer state dicts: per-rank shard dicts, and the full torch-format dict stitched from them.

A shard dict is torch's format (state keyed by parameter index, param_groups with index lists)
whose per-element state tensors hold only the rank's slice of each parameter, flattened, plus a
"zero_py" entry that says which slice: meta["slices"][index] = (lo, hi) over the flattened
parameter. Scalar state (a 0-dim tensor, a number) is the same on every rank.

check_loadable() checks a dict against an optimizer before load_state_dict takes any of it:
the entries, the param groups, the class that saved it, and every state tensor's shape (a
one-element or otherwise broadcastable tensor is refused, never spread over a parameter).
"""

from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from zero_py.optim.update import optional_state
from zero_py.sharding.memory_order import MemoryOrder

FORMAT_VERSION = 1


def is_shard_dict(state_dict: dict) -> bool:
    return isinstance(state_dict, dict) and "zero_py" in state_dict


def is_sliced(value, lo: int, hi: int) -> bool:
    """Whether a state value is per-element (sliced) rather than scalar."""
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == hi - lo


def merge_shards(shards: Sequence[dict], orders: Dict[int, MemoryOrder]) -> dict:
    """One full torch-format state dict from every rank's shard dict; `orders` holds each
    parameter's shape and memory order (the slices are ranges of it in that order), and each
    state tensor comes out with the parameter's shape and strides, as torch.optim's."""
    full: Dict[int, dict] = {}
    covered: Dict[int, int] = {}
    for shard in shards:
        slices = shard["zero_py"]["slices"]
        for index, state in shard["state"].items():
            lo, hi = slices[index]
            numel = math.prod(orders[index].shape)
            dst = full.setdefault(index, {})
            covered[index] = covered.get(index, 0) + (hi - lo)
            for key, value in state.items():
                if is_sliced(value, lo, hi):
                    buf = dst.get(key)
                    if buf is None:
                        buf = dst[key] = torch.zeros(numel, dtype=value.dtype)
                    buf[lo:hi] = value
                elif key not in dst:
                    dst[key] = value.clone() if isinstance(value, torch.Tensor) else value
    for index, n in covered.items():
        if n != math.prod(orders[index].shape):
            raise RuntimeError(f"zero_py: shards cover {n} of parameter {index}'s "
                               f"{math.prod(orders[index].shape)} elements; a rank's state is "
                               "missing")
        for key, value in full[index].items():
            if isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == n:
                full[index][key] = orders[index].shaped(value)
    return {"state": full, "param_groups": [dict(g) for g in shards[0]["param_groups"]]}


def slice_full_state(state: dict, lo: int, hi: int, order: MemoryOrder) -> dict:
    """This rank's slice of one parameter's torch-format state: elements [lo, hi) in the
    parameter's memory order, whatever the strides of the loaded tensors."""
    out = {}
    numel = math.prod(order.shape)
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == numel:
            out[key] = order.flat(value)[lo:hi]
        else:
            out[key] = value
    return out


_SHARD_META_KEYS = ("format", "world_size", "rank", "optimizer", "slices")


def dim_orders(opt) -> Dict[int, List[int]]:
    """{parameter index: its dim order} for the optimizer's parameters that are not row-major:
    a shard dict's slices are ranges in that order."""
    return {opt._managed_index[i]: list(order.dim_order)
            for i, order in enumerate(opt._flat.param_orders) if not order.row_major}


def check_dim_orders(saved: dict, opt) -> None:
    """A shard dict's slices hold elements in the memory order its parameters had; refuses one
    saved with another order (a model converted with .to(memory_format=...) on one side)."""
    if not isinstance(saved, dict):
        raise ValueError(f"zero_py: the shard state dict's 'dim_orders' must be a dict "
                         f"{{parameter index: dim order}}, got {type(saved).__name__}; load the "
                         "dict that state_dict() returned, whole")
    saved = {str(k): v for k, v in saved.items()}
    for k, mine in enumerate(opt._flat.param_orders):
        index = opt._managed_index[k]
        try:
            theirs = MemoryOrder.from_dim_order(mine.shape, saved.get(str(index)))
        except ValueError as exc:
            raise ValueError(f"zero_py: the shard state dict's parameter {index}: {exc}; load "
                             "the dict that state_dict() returned, whole") from None
        if theirs.element_order != mine.element_order:
            raise ValueError(
                f"zero_py: the shard state dict holds parameter {index} in memory order "
                f"{theirs.describe()}, this optimizer's parameter {index} is "
                f"{mine.describe()}: convert the model to the memory format it was saved with "
                "(model.to(memory_format=...)) before building the optimizer, or save with "
                "consolidate_state_dict() and load the full dict")


def check_structure(state_dict: dict) -> None:
    """The entries every loadable dict has, with the right types."""
    missing = [k for k in ("state", "param_groups") if k not in state_dict]
    if missing:
        raise ValueError(f"zero_py: the optimizer state dict lacks {missing}: load the dict that "
                         "state_dict() or consolidate_state_dict() returned (or a torch.optim "
                         "optimizer's state_dict()), whole")
    if not isinstance(state_dict["state"], dict):
        raise ValueError("zero_py: the state dict's 'state' must be a dict {parameter index: "
                         f"state}}, got {type(state_dict['state']).__name__}")
    groups = state_dict["param_groups"]
    if not isinstance(groups, list) or not all(
            isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups):
        raise ValueError("zero_py: the state dict's 'param_groups' must be a list of dicts, each "
                         "with a 'params' list")
    if is_shard_dict(state_dict):
        meta = state_dict["zero_py"]
        lacking = [k for k in _SHARD_META_KEYS if not isinstance(meta, dict) or k not in meta]
        if lacking:
            raise ValueError(f"zero_py: the shard state dict's 'zero_py' entry lacks {lacking}; "
                             "load the dict that state_dict() returned, whole")
        if meta["format"] != FORMAT_VERSION:
            raise ValueError(f"zero_py: shard state dict format {meta['format']!r}, this version "
                             f"reads {FORMAT_VERSION}")


def state_index(key, n_params: int) -> int:
    """A 'state' key as a parameter index, checked against the optimizer's parameter count."""
    try:
        index = int(key)
    except (TypeError, ValueError):
        raise ValueError(f"zero_py: the state dict's 'state' key {key!r} is neither a "
                         "parameter index nor a key its param_groups' 'params' list: the dict "
                         "was saved for other parameters") from None
    if not 0 <= index < n_params:
        raise ValueError(f"zero_py: the state dict holds state for parameter {index}, this "
                         f"optimizer has {n_params} parameters; the model differs")
    return index


def _hashable(key) -> bool:
    try:
        hash(key)
    except TypeError:
        return False
    return True


def saved_positions(saved_groups: List[dict]) -> Dict[object, int]:
    """{key of a parameter in the dict's param groups: its position over the groups}: as
    torch.optim's load_state_dict, a 'state' key names the parameter at the position its key
    holds in the param groups, whatever the key is (an index, or the name under which
    torch.distributed.checkpoint's state dicts keep it)."""
    out: Dict[object, int] = {}
    at = 0
    for g in saved_groups:
        for key in g["params"]:
            if _hashable(key):
                out.setdefault(key, at)
            at += 1
    return out


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_optimizer_class(saved_groups: List[dict], defaults: dict, name: str) -> None:
    """A torch-format dict of another optimizer class: its param groups lack the numeric
    hyperparameters this class has (SGD's have no betas, AdamW's no momentum). Flags and
    keys that LR schedulers or users add are not compared."""
    numeric = [k for k, v in defaults.items()
               if _is_number(v) or (isinstance(v, tuple) and v and all(map(_is_number, v)))]
    for k, g in enumerate(saved_groups):
        lacking = [key for key in numeric if key not in g]
        if lacking:
            raise ValueError(f"zero_py: param group {k} of the state dict has no {lacking}, "
                             f"which {name} has: it was saved by another optimizer class; build "
                             "the optimizer with the class the state was saved with")


def _scalar(value) -> Optional[float]:
    if _is_number(value):
        return float(value)
    if (isinstance(value, torch.Tensor) and value.numel() == 1 and value.dim() <= 1
            and not value.is_meta):  # a meta tensor has no value to read
        return float(value.reshape(()))
    return None


def check_param_state(index: int, state, shape: Tuple[int, ...], keys: Optional[List[str]],
                      name: str, has_master: bool, optional: Sequence[str] = ()) -> None:
    """One parameter's loaded state: `shape` is what each per-element tensor must have (the
    parameter's shape in a full dict, its slice's (n,) in a shard dict); `keys` are the
    per-element tensors the fused kernels keep (None on the torch.optim path: then every tensor
    with dimensions is per-element), of which those in `optional` may be absent or None (SGD's
    momentum buffer: none yet). A one-element or other broadcastable tensor is refused: it
    would be spread over the parameter silently."""
    if not isinstance(state, dict):
        raise ValueError(f"zero_py: the state of parameter {index} must be a dict, got "
                         f"{type(state).__name__}")
    if not state:
        return
    if "step" in state:
        step = _scalar(state["step"])
        if step is None or not math.isfinite(step) or step < 0:
            raise ValueError(f"zero_py: parameter {index}'s 'step' must be a number >= 0 (or a "
                             f"one-element tensor), got {state['step']!r}")
    per_element = set(keys) if keys is not None else None
    if keys is not None:
        lacking = [k for k in keys if k not in state and k not in optional]
        if lacking:
            raise ValueError(f"zero_py: the state of parameter {index} lacks {lacking}, which "
                             f"{name} keeps: was it saved by another optimizer class or with other "
                             "options (e.g. amsgrad, momentum)?")
        foreign = [k for k, v in state.items() if k not in per_element and k not in
                   ("step", "master_param") and isinstance(v, torch.Tensor) and v.dim() > 0]
        if foreign:
            raise ValueError(f"zero_py: the state of parameter {index} holds {foreign}, which "
                             f"{name} does not keep: it was saved by another optimizer class or "
                             "with other options")
    for key, value in state.items():
        if key == "step":
            continue
        if key == "master_param" and not has_master:
            continue  # an fp32 parameter is its own master; the saved one is not needed
        if value is None and key in optional:
            continue
        tensor_expected = key == "master_param" or (
            key in per_element if per_element is not None else
            isinstance(value, torch.Tensor) and value.dim() > 0)
        if not tensor_expected:
            continue
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"zero_py: parameter {index}'s {key!r} must be a tensor, got "
                             f"{type(value).__name__}")
        if tuple(value.shape) != tuple(shape):
            raise ValueError(f"zero_py: parameter {index}'s {key!r} has shape "
                             f"{tuple(value.shape)}, expected {tuple(shape)}: the state dict "
                             "belongs to another model or layout")
        if not value.is_floating_point():
            raise ValueError(f"zero_py: parameter {index}'s {key!r} has dtype {value.dtype}, "
                             "expected a floating-point tensor")
        if value.is_meta:  # found by the copy into the shard, after the state was dropped
            raise ValueError(f"zero_py: parameter {index}'s {key!r} is on the meta device (it "
                             "has no values): load a state dict that holds the values")


def check_groups(saved: List[dict], current: List[dict]) -> None:
    if len(saved) != len(current):
        raise ValueError(f"zero_py: the state dict has {len(saved)} param groups, this optimizer "
                         f"has {len(current)}; load a state dict of the same model and groups")
    for k, (s, c) in enumerate(zip(saved, current)):
        if len(s["params"]) != len(c["params"]):
            raise ValueError(f"zero_py: param group {k} has {len(s['params'])} parameters in the "
                             f"state dict and {len(c['params'])} here; the model differs")


def check_loadable(opt, state_dict: dict):
    """Checks `state_dict` against ZeroOptimizer `opt` and returns what load_state_dict applies:
    (param groups with the loaded hyperparameters, is it a shard dict, {param index:
    state}, loss-scaler state or None). Changes nothing."""
    check_structure(state_dict)
    check_groups(state_dict["param_groups"], opt.param_groups)
    shard = is_shard_dict(state_dict)
    name = opt.optimizer_class.__name__
    if shard:
        meta = state_dict["zero_py"]
        if meta["optimizer"] != name:
            raise ValueError(f"this state dict was saved by a ZeroOptimizer over "
                             f"{meta['optimizer']}, this one runs {name}: build the "
                             "optimizer with the class the state was saved with")
        mine = {opt._managed_index[s.param]: (s.param_lo, s.param_hi)
                for s in opt._flat.slices}
        theirs = {int(k): tuple(v) for k, v in meta["slices"].items()}
        here = (opt.executor.world_size, opt.executor.rank)
        if (meta["world_size"], meta["rank"]) == here and theirs != mine:
            # the same place in the same world: the parameters differ (a script with several
            # optimizers, e.g. a GAN's generator's dict loaded into the discriminator's). The
            # message names no rank, so that every rank refuses with the same one.
            raise ValueError(
                "this shard state dict slices its parameters otherwise than this optimizer "
                "does: it is the dict of an optimizer over other parameters (another model's, "
                "or another optimizer's of this script: load each optimizer's own dict), or it "
                "was saved with other bucket settings or parameter dtypes (a bf16 model and an "
                "fp32 one have other layouts: save with consolidate_state_dict() and load the "
                "full dict to change them)")
        if (meta["world_size"], meta["rank"]) == here and theirs == mine:
            check_dim_orders(meta.get("dim_orders", {}), opt)
        if (meta["world_size"], meta["rank"]) != here or theirs != mine:
            raise ValueError(
                f"this shard state dict is rank {meta['rank']} of {meta['world_size']} with "
                f"another layout than rank {opt.executor.rank} of "
                f"{opt.executor.world_size} here; save with consolidate_state_dict() and "
                "load the full dict to change world size, bucket settings or parameter "
                "dtypes (a bf16 model and an fp32 one have other layouts)")
    else:
        check_optimizer_class(state_dict["param_groups"], opt.defaults, name)
    groups = opt._check_hyperparameters(state_dict["param_groups"])
    saved_state = {}
    numel = {opt._managed_index[k]: n for k, n in enumerate(opt._flat.param_numel)}
    shapes = {opt._managed_index[k]: tuple(shape)
              for k, shape in enumerate(opt._flat.param_shapes)}
    slices = {opt._managed_index[s.param]: s for s in opt._flat.slices}
    keys = opt._update.keys + opt._state_to_add(groups) if opt.uses_fused_kernel else None
    group_of = [g for g in groups for _ in g["params"]]  # by position, as torch numbers them
    positions = saved_positions(state_dict["param_groups"])
    for k, st in state_dict["state"].items():
        index = positions.get(k) if _hashable(k) else None
        if index is None:
            index = state_index(k, len(opt._all_params))
        if index not in numel:
            continue  # a parameter this optimizer keeps frozen: torch would ignore it too
        if shard:
            s = slices.get(index)
            if s is None:
                raise ValueError(f"the shard state dict holds state for parameter {index}, "
                                 "of which this rank holds no slice: it is another rank's")
            expected = (s.numel,)
        else:
            expected = shapes[index]
        check_param_state(index, st, expected, keys, name,
                          opt._masters.dtype_of[opt._flat.param_bucket[
                              opt._managed_of[index]]] is not None,
                          optional=optional_state(opt._kind, group_of[index]))
        saved_state[index] = st
    steps = state_dict.get("rounding_steps")
    if not shard and steps is not None and not (isinstance(steps, int)
                                                and not isinstance(steps, bool) and steps >= 0):
        raise ValueError(f"zero_py: the state dict's 'rounding_steps' (updates applied before "
                         f"consolidate_state_dict) must be an int >= 0, got {steps!r}")
    if state_dict.get("loss_scaler") and opt.loss_scaler is None:
        raise ValueError("zero_py: this state dict was saved with a loss scaler, this optimizer "
                         "has none (its scale and growth state would be dropped): build the "
                         "optimizer with loss_scaler=zero_py.LossScaler() to resume it, or drop "
                         "the dict's 'loss_scaler' entry to train without one")
    scaler = None
    if opt.loss_scaler is not None and state_dict.get("loss_scaler"):
        # the scaler's own check: a subclass's state (HysteresisLossScaler's) is kept whole
        scaler = opt.loss_scaler.check_state(state_dict["loss_scaler"])
    return groups, shard, saved_state, scaler
