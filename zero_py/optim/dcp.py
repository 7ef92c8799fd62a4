"""torch.distributed.checkpoint.state_dict (DCP's get_/set_optimizer_state_dict and
get_/set_state_dict, as FSDP2 and torchtitan-style training code call them) over a
ZeroOptimizer.

Those functions read and load an optimizer through its own state_dict() / load_state_dict() and
map its parameter indices to fully qualified names; they know how to gather only FSDP's and
DTensor's shards. ZeroOptimizer.state_dict() is this rank's shard (its slices, flattened), so
DCP would hand back each rank's slices under the full names: partial state that looks whole. So:

- ZeroOptimizer.state_dict() called by DCP gives the full torch-format dict (as
  consolidate_state_dict() does) on every rank: get_optimizer_state_dict then holds torch.optim's
  values whatever the stage and StateDictOptions (full_state_dict=False included: the tensors
  are plain and replicated, so DCP's save writes each once). It costs the full optimizer state
  on every rank for the call (zero_py.save_checkpoint writes each rank's shard instead). An
  optimizer with a loss scaler is refused there: DCP keeps only "state" and "param_groups", so
  the scaler's state would be lost silently.
- load_state_dict() maps the dict's parameter keys through its param groups by position, as
  torch.optim does, so DCP's dicts keyed by names load (set_optimizer_state_dict, with
  full_state_dict or not).
- DCP first "initializes" an optimizer that holds no state by assigning zero gradients
  (param.grad = zeros_like(param)) and stepping with lr 0. Under stage 3 a parameter is its
  shard slice then, so that step cannot run; under stages 1-2 it is collective, and a rank
  that holds state of no parameter would run it alone (a hang). ZeroOptimizer.step() called by
  it drops those gradients and does nothing, at every stage: the optimizer stays as it was
  (where torch.optim's would take one step of lr 0: its step count 1, its moments 0).
  set_optimizer_state_dict(full_state_dict=True) then reads the optimizer's state dict to
  place the loaded values where its own are: one without state shows it placeholders in that
  call only (with_placeholders), which load_state_dict drops.
- A parameter without elements has nothing to shard and no state in zero_py, where
  torch.optim keeps a step count and empty moments for it. Full dicts carry that state
  (empty_param_state) and the loader's placeholders name it: DCP refuses a dict without it
  into a torch.optim optimizer, and its own loader fails on a loaded key the optimizer's dict
  lacks.

The callers are recognized by their frames (the module and the function), the only hook DCP
leaves a non-FSDP optimizer.
"""

from __future__ import annotations

import inspect
import sys
import weakref
from typing import Optional

DCP_MODULE = "torch.distributed.checkpoint.state_dict"
_DEPTH = 6  # torch's step/state_dict wrappers sit between DCP's frame and ours


def caller(names) -> Optional[str]:
    """The name of the first function of DCP's state_dict module among `names` found in the
    few frames above the caller of this function, or None."""
    frame = sys._getframe(2)
    for _ in range(_DEPTH):
        if frame is None:
            return None
        if frame.f_globals.get("__name__") == DCP_MODULE and frame.f_code.co_name in names:
            return frame.f_code.co_name
        frame = frame.f_back
    return None


def loading() -> bool:
    """Whether set_optimizer_state_dict is on the stack (it reads the optimizer's state dict
    to place the loaded values)."""
    frame = sys._getframe(1)
    while frame is not None:
        if (frame.f_globals.get("__name__") == DCP_MODULE
                and frame.f_code.co_name == "_load_optim_state_dict"):
            return True
        frame = frame.f_back
    return False


LOSS_SCALER_MESSAGE = (
    "torch.distributed.checkpoint's get_optimizer_state_dict / get_state_dict keep only the "
    "optimizer state dict's 'state' and 'param_groups', so this ZeroOptimizer's loss scaler "
    "state would be lost: save with zero_py.save_checkpoint(path, model, optimizer), or take "
    "optimizer.consolidate_state_dict() (which carries 'loss_scaler')")


STATELESS_MESSAGE = (
    "this ZeroOptimizer holds no state yet, and its optimizer class ({cls}) cannot be stepped "
    "on a stand-in to tell which state it keeps, so the optimizer state dict that "
    "torch.distributed.checkpoint's get_state_dict / get_optimizer_state_dict returns holds "
    "none: a dcp.load into it loads no optimizer state, and the run resumes with fresh "
    "moments and step counts. To resume, build the dict to load into after the optimizer has "
    "stepped, or use zero_py.load_checkpoint, or load a full dict (torch.load) with "
    "set_optimizer_state_dict")


# where a stateless optimizer shows DCP's loader the entries a loaded state will have
# (a float: DCP's walks take only plain types; the object itself is the mark)


class _Placeholder(float):
    def __repr__(self) -> str:
        return "<zero_py placeholder>"


PLACEHOLDER = _Placeholder("nan")
# the key of the placeholder state tensor that shows the loader the optimizer's device
DEVICE_MARKER = "zero_py.dcp_device"


def _stand_in_state(opt, settings: Optional[dict] = None) -> Optional[dict]:
    """The state optimizer_class keeps for one parameter after one step (on a two-element
    stand-in with a zero gradient) with `settings` (a param group's; the defaults if None),
    or None where it cannot run on a stand-in."""
    import torch

    settings = opt.defaults if settings is None else settings
    key = repr(sorted((k, repr(v)) for k, v in settings.items() if k != "params"))
    cache = opt.__dict__.setdefault("_dcp_stand_in", {})
    if key not in cache:
        try:
            # on the parameters' device: an optimizer class made for CUDA tensors only (a
            # third-party fused one) could not be stepped on a CPU stand-in
            device = getattr(getattr(opt, "_flat", None), "device", None)
            p = torch.nn.Parameter(torch.zeros(2, device=device))
            p.grad = torch.zeros(2, device=device)
            takes = inspect.signature(opt.optimizer_class.__init__).parameters
            stand_in = opt.optimizer_class([p], **{k: v for k, v in settings.items()
                                                   if k in takes and k != "params"},
                                           **getattr(opt, "_class_kwargs", {}))
            stand_in.step()
            cache[key] = dict(stand_in.state[p])
        except Exception:  # an optimizer that cannot run on a stand-in
            cache[key] = None
    return cache[key]


def _state_keys(opt) -> list:
    """The keys of the state optimizer_class keeps per parameter, or ["step"] where the
    stand-in cannot tell."""
    state = _stand_in_state(opt)
    return ["step"] if state is None else list(state)


def empty_params(opt) -> list:
    """Indices of the trainable parameters without elements: zero_py lays out and keeps
    nothing for them (there is nothing to shard), where torch.optim keeps a state for them."""
    managed = set(opt._managed_index)
    return [i for i, p in enumerate(opt._all_params)
            if i not in managed and p.requires_grad and p.numel() == 0]


def empty_param_state(opt, p, step: int) -> Optional[dict]:
    """The state torch.optim holds for parameter p without elements after `step` steps with a
    gradient: empty tensors of p's shape and the step count. A full dict needs it: DCP's
    set_optimizer_state_dict into a torch.optim optimizer refuses a dict without state for
    a parameter that requires gradients ("Missing optimizer state for parameter")."""
    import torch

    template = _stand_in_state(opt)
    if template is None:
        return None
    out = {}
    for key, value in template.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            out[key] = torch.zeros(p.shape, dtype=p.dtype)
        elif key == "step":
            out[key] = (torch.tensor(float(step), dtype=value.dtype)
                        if isinstance(value, torch.Tensor) else step)
        else:
            out[key] = value
    return out


# master_param templates handed to DCP (ids of NaN-filled tensors; see template_state)
_MASTER_TEMPLATES: "weakref.WeakValueDictionary[int, object]" = weakref.WeakValueDictionary()


def template_state(opt, full: dict) -> Optional[dict]:
    """`full` (a stateless optimizer's full dict, for get_state_dict) with the state every
    trainable parameter will have once stepped, zero-filled: the template that dcp.load fills
    in place in the torchtitan-style resume. torch.optim's gets it from DCP's zero step
    (which zero_py skips); without it the load would bring no optimizer state. Keys, shapes
    and dtypes are those of the full dict after a step: the state optimizer_class keeps under
    each group's settings (none where it keeps none, as SGD without momentum), in fp32 (the
    state is over the fp32 masters), the step 0 (a template left unloaded loads as a fresh
    state), and master_param for bf16/fp16 parameters, NaN-filled and remembered: one that no
    load replaced is dropped by load_state_dict, so the master follows the parameter (a
    dcp.load with allow_partial_load from a dict without masters) instead of being zero.
    None where the optimizer class cannot run on a stand-in."""
    import torch

    state = dict(full["state"])
    group_of = {}
    for g, group in enumerate(opt.param_groups):
        for p in group["params"]:
            group_of[id(p)] = g
    # the parameters' full shapes (under stage 3 a parameter is its shard slice)
    shapes = dict(zip(opt._managed_index, opt._flat.param_shapes))
    for i in opt._managed_index:
        p, shape = opt._all_params[i], torch.Size(shapes[i])
        kept = _stand_in_state(opt, opt.param_groups[group_of[id(p)]])
        if kept is None:
            return None
        st = {}
        for key, value in kept.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                st[key] = torch.zeros(shape, dtype=torch.float32)
            elif key == "step":
                st[key] = (torch.tensor(0.0, dtype=value.dtype)
                           if isinstance(value, torch.Tensor) else 0)
            else:
                st[key] = value
        if not st:
            continue
        if p.dtype != torch.float32:
            master = torch.full(shape, float("nan"), dtype=torch.float32)
            _MASTER_TEMPLATES[id(master)] = master
            st["master_param"] = master
        state[i] = st
    return {**full, "state": {k: state[k] for k in sorted(state)}}


def _unloaded_template(v) -> bool:
    return _MASTER_TEMPLATES.get(id(v)) is v and bool(v.isnan().all())


def with_placeholders(opt, full: dict) -> dict:
    """`full` (the optimizer's full dict, for set_optimizer_state_dict(full_state_dict=True)),
    with placeholders where a parameter has no state yet: DCP's loader places a loaded scalar
    state ("step") only where the optimizer's own dict has it (after the zero step it takes,
    which ZeroOptimizer skips), and asserts that some state tensor shows the device.
    load_state_dict drops every placeholder a loaded value did not replace."""
    import torch

    keys = _state_keys(opt)
    state = dict(full["state"])
    # parameters without elements too: a DDP run's dict holds their state (step counts), and
    # DCP's loader, which copies every loaded scalar, fails on a key the optimizer's own dict
    # lacks (KeyError 'state.<name>.step'); load_state_dict ignores what lands there
    for i in [*opt._managed_index, *empty_params(opt)]:
        if not state.get(i):
            state[i] = {k: PLACEHOLDER for k in keys}
    if not any(isinstance(v, torch.Tensor) and v.dim() > 0
               for st in state.values() for v in st.values()) and opt._managed_index:
        i = opt._managed_index[0]
        state[i] = {**state[i], DEVICE_MARKER: torch.zeros(1, device=opt._all_params[i].device)}
    return {**full, "state": state}


def drop_placeholders(state_dict: dict) -> dict:
    """`state_dict` without with_placeholders' entries (a parameter left with no other state
    has none)."""
    state = state_dict.get("state")
    if not isinstance(state, dict):
        return state_dict

    def placeholder(key, v) -> bool:
        return (v is PLACEHOLDER or key == DEVICE_MARKER
                or (key == "master_param" and _unloaded_template(v)))

    if not any(isinstance(st, dict) and any(placeholder(k, v) for k, v in st.items())
               for st in state.values()):
        return state_dict
    kept = {}
    for k, st in state.items():
        if isinstance(st, dict):
            st = {key: v for key, v in st.items() if not placeholder(key, v)}
            if not st:
                continue
        kept[k] = st
    return {**state_dict, "state": kept}
