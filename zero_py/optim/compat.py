"""torch idioms over a sharded optimizer: what works, and loud refusals for what cannot.

- StateView: `optimizer.state`, read-only. state[p] is this rank's part of p's optimizer state:
  each per-element tensor (exp_avg, exp_avg_sq, momentum_buffer, ...) is the rank's slice of
  the flattened parameter, a 1-D view of the live state (optimizer.owned_range(p) says which
  elements), plus "step" and, for bf16/fp16 parameters, the fp32 "master_param" slice. A
  parameter with no elements on this rank, or before its first step, has an empty state, as a
  torch.optim optimizer's state before its first step.
- Ownership: a parameter belongs to one ZeroOptimizer (its .data is a view of that optimizer's
  flat buffer, its gradient hooks feed that optimizer's reducer). A second optimizer over it is
  refused; once the owner is garbage-collected its hooks are removed and the parameter is free.
- torch.nn.utils.clip_grad_norm_ / clip_grad_value_ over parameters a ZeroOptimizer manages:
  under stage 1 param.grad holds this rank's unreduced gradient, under stages 2-3 it is None
  (each rank keeps only its shard), so torch's own clipping would clip by the wrong norm or, on
  no gradient at all, return 0 and clip nothing. clip_grad_norm_ over every parameter one
  ZeroOptimizer trains (model.parameters(), as a DDP script calls it; frozen ones and ones
  without a gradient may be among them) is that optimizer's clip_grad_norm_, the same total
  norm and the same clipping as torch's under DDP. Over some of them only, or beside other
  parameters that have gradients, and clip_grad_value_ always, they are refused, pointing to
  optimizer.clip_grad_norm_. So is torch >= 2.6's split of clip_grad_norm_ (torchtitan's:
  total = get_total_norm(grads), then clip_grads_with_norm_(parameters, max_norm, total)),
  whose total norm is of this rank's param.grad (unreduced, or none: 0, clipping nothing).
  The guard wraps those functions in torch.nn.utils when the first ZeroOptimizer is built;
  for any other parameters they run unchanged.
- Parameters the step could not update, which torch.optim would: step() refuses them
  (refuse_detached_params) rather than leave them as they are.
- nn.Module.zero_grad (model.zero_grad(), which Hugging Face's Trainer and many scripts call
  instead of optimizer.zero_grad()): under stages 2-3 param.grad is None after backward and the
  gradients live in the optimizer's shard, which torch's own zero_grad cannot reach, so the
  next step would add them in again. The method is wrapped (install_module_zero_grad, when the
  first ZeroOptimizer is built) to also call optimizer.zero_grad(set_to_none) of every
  ZeroOptimizer whose parameters the module holds; a module holding only some of them, while
  that optimizer holds gradients, is refused (a shard cannot be zeroed for some parameters),
  and so is one under stage 1 once the step's gradients were reduced (by clip_grad_norm_):
  the step would apply them still.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import Mapping
from types import MappingProxyType
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn.utils
import torch.nn.utils.clip_grad
from torch.utils.hooks import RemovableHandle

from zero_py.sharding.memory_order import MemoryOrder

# id(parameter) -> (weakref to it, weakref to its ZeroOptimizer). A registry, not an attribute
# on the parameter: an attribute would travel with torch.save(model) (a weakref cannot be
# pickled) and with copy.deepcopy(model) (the copy would look owned). An entry leaves when its
# parameter dies, before that id can be reused.
_OWNERS: Dict[int, Tuple[weakref.ref, weakref.ref]] = {}


# -- ownership ----------------------------------------------------------------------------------

def owner_of(p: torch.Tensor):
    """The live ZeroOptimizer that manages p, or None."""
    entry = _OWNERS.get(id(p))
    if entry is None or entry[0]() is not p:
        return None
    return entry[1]()


def left_sharded(p: torch.Tensor) -> bool:
    """Whether p is a stage-3 shard slice that no live optimizer manages: what a stage-3
    initialize that failed after sharding leaves (a deep copy made inside gathered() is full
    size, and a live model's parameters have their optimizer)."""
    shape = getattr(p, "_zero_py_shape", None)
    return shape is not None and tuple(p.shape) != tuple(shape) and owner_of(p) is None


class ModelManager:
    """model._zero_py, set by zero_py.initialize: the optimizer that manages the model. A copy
    of the model (copy.deepcopy: torch.optim.swa_utils.AveragedModel, an EMA teacher) or a
    pickle of it (torch.save(model)) is an ordinary model whose parameters no optimizer
    manages, so the reference follows neither: the copy's _zero_py is None (a deep copy of
    the optimizer itself was a broken half, and made initialize(copy) say "already
    managed").

    A stage-3 model needs its optimizer (its engine gathers the parameters), so it holds it;
    a stages 1-2 model's parameters are plain tensors, so it holds the optimizer weakly
    (`weak`): dropping the optimizer then removes its gradient hooks, as for a ZeroOptimizer
    built directly. (Held strongly, a dropped stage-2 optimizer lived on with the model and
    its hooks took every later gradient into its shard: plain training of the model with
    torch.optim silently did nothing, and a new initialize was refused.)"""

    __slots__ = ("_optimizer",)

    def __init__(self, optimizer, weak: bool = False):
        self._optimizer = weakref.ref(optimizer) if weak else (lambda: optimizer)

    @property
    def optimizer(self):
        return self._optimizer()

    def __deepcopy__(self, memo):
        return None

    def __reduce__(self):
        return type(None), ()


def manager_of(model):
    """The ZeroOptimizer that zero_py.initialize gave `model`, or None."""
    return getattr(getattr(model, "_zero_py", None), "optimizer", None)


def check_unowned(params, name_of, mine=None) -> None:
    """Raises ValueError if a live ZeroOptimizer (other than `mine`) already manages one of
    `params`; changes nothing."""
    for p in params:
        owner = owner_of(p)
        if owner is not None and owner is not mine:
            raise ValueError(
                f"parameter {name_of(p)} is already managed by another ZeroOptimizer (its values "
                "live in that optimizer's flat buffer and its gradients feed that optimizer): "
                "give each parameter to one optimizer, with param groups for different "
                "settings; to replace an optimizer, build the new one over a fresh model (or "
                "load a state dict), or delete the old one and run gc.collect() first")


def claim(optimizer, params) -> None:
    for p in params:
        key = id(p)
        _OWNERS[key] = (weakref.ref(p, lambda _, key=key: _OWNERS.pop(key, None)),
                        weakref.ref(optimizer))


def capture_hooks(params, build):
    """Runs build() and returns (its result, handles of the post-accumulate-grad hooks it
    registered on `params`), so that they can be removed later (the reducer keeps none)."""
    before = [set((p._post_accumulate_grad_hooks or {}).keys()) for p in params]
    result = build()
    handles: List[RemovableHandle] = []
    for p, old in zip(params, before):
        hooks = p._post_accumulate_grad_hooks or {}
        for key in hooks.keys() - old:
            handle = RemovableHandle(hooks)
            handle.id = key
            handles.append(handle)
    return result, handles


def release_on_collect(optimizer, handles: List[RemovableHandle]) -> weakref.finalize:
    """Removes the hooks in `handles` (the list itself: the optimizer may replace its
    contents) when `optimizer` is garbage-collected (a dead optimizer's reducer must not keep
    taking the parameters' gradients)."""
    return weakref.finalize(optimizer, _remove_all, handles)


def _remove_all(handles: List[RemovableHandle]) -> None:
    for h in handles:
        h.remove()


# -- optimizer.state ------------------------------------------------------------------------------

class StateView(Mapping):
    """Read-only mapping parameter -> this rank's state of it (see the module docstring)."""

    def __init__(self, optimizer):
        self._opt = weakref.ref(optimizer)

    def _index(self, p) -> int:
        opt = self._opt()
        i = opt._param_index.get(id(p)) if opt is not None and isinstance(p, torch.Tensor) \
            else None
        if i is None:
            raise KeyError("not a parameter of this ZeroOptimizer")
        return i

    def __getitem__(self, p) -> Mapping:
        i = self._index(p)
        return MappingProxyType(self._opt()._param_state(i))

    def __contains__(self, p) -> bool:
        try:
            return bool(self._opt()._param_state(self._index(p), read=False))
        except KeyError:
            return False

    def __iter__(self) -> Iterator[torch.Tensor]:
        opt = self._opt()
        if opt is None:
            return iter(())
        return iter([p for i, p in enumerate(opt._all_params)
                     if opt._param_state(i, read=False)])

    def __len__(self) -> int:
        return sum(1 for _ in self)

    def __repr__(self) -> str:
        return f"ZeroOptimizer.state: this rank's state of {len(self)} parameters"


# -- torch.nn.utils guards ------------------------------------------------------------------------

_CLIP_MESSAGE = (
    "torch.nn.utils.{fn} got parameters managed by a ZeroOptimizer (stage {stage}): {why}, "
    "so torch's function would clip {effect}. Use optimizer.clip_grad_norm_(max_norm, "
    "norm_type) instead, after backward and before step(): it clips every rank's gradients "
    "together and returns the same total norm as torch's function under DDP "
    "(torch.nn.utils.clip_grad_norm_ over every parameter the optimizer trains, e.g. "
    "model.parameters(), is the same call)")


_SPLIT_CLIP_MESSAGE = (
    "torch.nn.utils.clip_grad_norm_ got parameters of {what}: no one optimizer's "
    "clip_grad_norm_ is torch's call under DDP here, since each clips its own parameters by "
    "their own norm, not by the norm of them all. For the total norm of them all: first "
    "n_k = opt_k.clip_grad_norm_(float('inf')) for each ZeroOptimizer (its norm, nothing "
    "clipped) and n_k = torch.nn.utils.clip_grad_norm_(ps, float('inf')) for parameters "
    "outside zero_py (their gradients reduced by you); then total = (sum of n_k ** 2) ** 0.5, "
    "c = min(1, max_norm / (total + 1e-6)), and opt_k.clip_grad_norm_(n_k * c) for each "
    "ZeroOptimizer and p.grad.mul_(c) for the others")


def _split_over_optimizers(params: List[torch.Tensor]) -> Optional[str]:
    """What `params` span, where that is more than one ZeroOptimizer, or one beside gradients
    that no ZeroOptimizer manages (a model split over two optimizers); else None."""
    owners = {id(owner_of(p)) for p in params if owner_of(p) is not None}
    foreign = any(owner_of(p) is None and p.grad is not None for p in params)
    if len(owners) > 1:
        return f"{len(owners)} ZeroOptimizers" + (" and others with gradients" if foreign
                                                  else "")
    if owners and foreign:
        return "a ZeroOptimizer and parameters with gradients outside it"
    return None


def _whole_optimizer(params: List[torch.Tensor]):
    """The ZeroOptimizer whose every trained parameter is in `params` or frozen now
    (requires_grad=False: a fine-tuning script clips [p for p in model.parameters() if
    p.requires_grad] while some layers are frozen, which torch's norm under DDP takes alike, a
    frozen layer having no gradient), where the others there have no gradient (frozen, or
    unused); else None."""
    owners = {}
    for p in params:
        owner = owner_of(p)
        if owner is not None:
            owners[id(owner)] = owner
        elif p.grad is not None:
            return None  # a gradient outside every ZeroOptimizer: its norm is this rank's
    if len(owners) != 1:
        return None
    (owner,) = owners.values()
    given = {id(p) for p in params}
    return owner if all(id(p) in given or not p.requires_grad
                        for p in owner._flat.params) else None


def _clip_through_owner(original):
    """clip_grad_norm_ as a DDP script calls it, over model.parameters(): the owner's."""
    signature = inspect.signature(original)

    def clip(params, *args, **kwargs):
        bound = signature.bind(params, *args, **kwargs)
        bound.apply_defaults()
        a = bound.arguments
        owner = _whole_optimizer(params)
        given = {id(p) for p in params}
        left_out = [i for i, p in enumerate(owner._flat.params) if id(p) not in given]
        return owner.clip_grad_norm_(a["max_norm"], a.get("norm_type", 2.0),
                                     a.get("error_if_nonfinite", False), _left_out=left_out)
    return clip


def _guard(fn_name: str, original):
    through_owner = _clip_through_owner(original) if fn_name == "clip_grad_norm_" else None

    @functools.wraps(original)
    def guarded(parameters, *args, **kwargs):
        params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        if through_owner is not None and _whole_optimizer(params) is not None:
            return through_owner(params, *args, **kwargs)
        split = _split_over_optimizers(params) if fn_name == "clip_grad_norm_" else None
        if split is not None:
            raise RuntimeError(_SPLIT_CLIP_MESSAGE.format(what=split))
        for p in params:
            owner = owner_of(p)
            if owner is not None:
                stage = owner.stage
                why = ("param.grad holds this rank's gradient before it is reduced across ranks"
                       if stage == 1 else
                       "each rank keeps only its shard of the gradients and param.grad is None")
                effect = "by each rank's own norm" if stage == 1 else "nothing and return 0"
                if fn_name == "clip_grads_with_norm_":  # torch >= 2.6's clip_grad_norm_ split
                    effect = ("each rank's unreduced gradient, by a total norm that "
                              "torch.nn.utils.get_total_norm took of it" if stage == 1 else
                              "nothing (torch.nn.utils.get_total_norm of their param.grad "
                              "gives 0)")
                raise RuntimeError(_CLIP_MESSAGE.format(fn=fn_name, stage=stage, why=why,
                                                        effect=effect))
        return original(params, *args, **kwargs)
    guarded._zero_py_guard = True
    return guarded


def install_clip_guards() -> None:
    """Wraps torch.nn.utils.clip_grad_norm_, clip_grad_value_ and (torch >= 2.6)
    clip_grads_with_norm_ (once)."""
    for name in ("clip_grad_norm_", "clip_grad_value_", "clip_grads_with_norm_"):
        current = getattr(torch.nn.utils, name, None)
        if current is None or getattr(current, "_zero_py_guard", False):
            continue
        guarded = _guard(name, current)
        setattr(torch.nn.utils, name, guarded)
        if getattr(torch.nn.utils.clip_grad, name, None) is current:
            setattr(torch.nn.utils.clip_grad, name, guarded)


# -- nn.Module.zero_grad -------------------------------------------------------------------------

def _module_zero_grad(original):
    @functools.wraps(original)
    def zero_grad(self, set_to_none: bool = True) -> None:
        # the optimizers holding some of this module's parameters, checked before anything
        # changes: a refusal leaves every gradient as it was
        held: Dict[int, Tuple[object, set]] = {}
        for p in self.parameters():
            opt = owner_of(p)
            if opt is not None:
                held.setdefault(id(opt), (opt, set()))[1].add(id(p))
        for opt, ids in held.values():
            managed = opt._flat.params
            if opt.stage == 1 and len(ids) < len(managed) and opt._reducer.finished:
                raise RuntimeError(
                    f"zero_py: {type(self).__name__}.zero_grad() was called on a module that "
                    f"holds {len(ids)} of the {len(managed)} parameters of a stage-1 "
                    "ZeroOptimizer after its gradients were reduced for this step (by "
                    "optimizer.clip_grad_norm_()), so step() would still apply theirs; zero "
                    "them before clipping, or call optimizer.zero_grad()")
            if opt.stage >= 2 and len(ids) < len(managed) and opt._holds_gradients():
                raise RuntimeError(
                    f"zero_py: {type(self).__name__}.zero_grad() was called on a module that "
                    f"holds {len(ids)} of the {len(managed)} parameters of a ZeroOptimizer "
                    f"(stage {opt.stage}). That optimizer keeps their gradients in its "
                    "shard (param.grad is None after backward), which cannot be zeroed for "
                    "some parameters only; call optimizer.zero_grad(), or zero_grad() on a "
                    "module that holds all of its parameters (the whole model), or give these "
                    "parameters an optimizer of their own")
        original(self, set_to_none)
        for opt, ids in held.values():
            if len(ids) == len(opt._flat.params):
                opt.zero_grad(set_to_none=set_to_none)
    zero_grad._zero_py_guard = True
    return zero_grad


def install_module_zero_grad() -> None:
    """Wraps nn.Module.zero_grad (once): model.zero_grad() also zeroes the gradients that a
    ZeroOptimizer keeps for the module's parameters (see the module docstring)."""
    current = torch.nn.Module.zero_grad
    if not getattr(current, "_zero_py_guard", False):
        torch.nn.Module.zero_grad = _module_zero_grad(current)


GRAD_SCALER_MESSAGE = (
    "torch.amp.GradScaler cannot drive a ZeroOptimizer: it looks for inf/nan in param.grad, "
    "which holds no reduced gradient here (stage 2-3: None; stage 1: this rank's own). Use "
    "zero_py's loss scaler, the same policy as GradScaler: ZeroOptimizer(..., "
    "loss_scaler=zero_py.LossScaler()) (or initialize(..., loss_scaler=...)), then "
    "optimizer.scale_loss(loss).backward(); optimizer.step(): a step whose gradients overflow "
    "on any rank is skipped on every rank")


def refuse_detached_params(opt) -> None:
    """Refuses, rather than silently leaves as they are, the parameters the step could not
    update that torch.optim would: under stages 1-2 one whose .data was replaced (it no
    longer aliases its flat buffer); one given with requires_grad=False and unfrozen since
    (requires_grad_(True), as fine-tuning does), which is laid out nowhere (stages 1-2) or
    in the frozen storage (stage 3), so nothing would reduce or update it; under stage 3
    one cast, moved or replaced after zero_py.initialize (Stage3Engine.check_model), which
    the next gather would silently undo. Before any collective of the step, so every rank
    that changed them alike raises at one point."""
    engine = getattr(opt, "_engine", None)
    if engine is not None:
        problem = engine.check_model()
        if problem is not None:
            raise RuntimeError(problem)
    if not opt._flat.params_sharded:
        moved = opt._flat.moved_params()
        if moved:
            i = moved[0]
            p = opt._flat.params[i]
            if tuple(p.shape) != opt._flat.param_shapes[i]:  # not writable in place
                raise RuntimeError(
                    f"zero_py: parameter {opt._name(p)} has shape {tuple(p.shape)}, but it had "
                    f"shape {opt._flat.param_shapes[i]} when the optimizer was built: it was "
                    "resized since (e.g. model.resize_token_embeddings), and stages 1-2 keep "
                    "every parameter in a flat buffer laid out then; resize the model before "
                    "zero_py.initialize / ZeroOptimizer")
            more = f" (and of {len(moved) - 1} more)" if len(moved) > 1 else ""
            was = opt._flat.buffers[opt._flat.bucket_buffer[opt._flat.param_bucket[i]]]
            if p.dtype != was.dtype or p.device != was.device:
                # model.half() / .to(...) after construction: the advice for a replaced .data
                # (write in place) cannot apply, a cast cannot be written into the buffer
                raise RuntimeError(
                    f"zero_py: parameter {opt._name(p)}{more} is {p.dtype} on {p.device}, but "
                    f"it was {was.dtype} on {was.device} when the optimizer was built: the "
                    "model was cast or moved since (model.half(), model.to(torch.bfloat16), "
                    "model.double(), model.to(device)), which gives each parameter new "
                    "storage outside the flat buffers that stages 1-2 update, so it would "
                    "never train again. Cast and move the model before zero_py.initialize / "
                    "ZeroOptimizer (or save a checkpoint and load it into a cast model)")
            now, built = MemoryOrder.of(p), opt._flat.param_orders[i]
            if now.element_order != built.element_order:  # the copy a conversion made
                raise RuntimeError(
                    f"zero_py: parameter {opt._name(p)}{more} was converted to another memory "
                    f"format after the optimizer was built (it is {now.describe()}, it was "
                    f"{built.describe()}: model.to(memory_format=...)), which gives each "
                    "parameter new storage outside the flat buffers that stages 1-2 update, "
                    "so it would never train again. Convert the model before "
                    "zero_py.initialize / ZeroOptimizer: every parameter keeps the memory "
                    "format it has then")
            raise RuntimeError(
                f"zero_py: the .data of parameter {opt._name(p)}{more} was replaced after "
                "the optimizer was built (`p.data = t`, or "
                "torch.nn.utils.vector_to_parameters); stages 1-2 keep every parameter in a "
                "flat buffer that the step updates, so it would never change again. Write "
                "new values in place instead: `with torch.no_grad(): p.copy_(t)`. A move to "
                "the device the model is on copies it too where torch names that device "
                "otherwise: `model.to(\"cpu:0\")` of a CPU model, as transformers.Trainer "
                "does when it is built (train with zero_py.integrations.hf_trainer."
                "ZeroTrainer)")
    for p in opt._left_out:
        if p.requires_grad:
            if opt._flat.params_sharded:
                how = ("under stage 3 give it requires_grad=True at zero_py.initialize, in "
                       "a param group of its own with lr=0, and raise that lr when it "
                       "should train")
            else:
                how = ("leave it out of the optimizer's params and add it with "
                       "optimizer.add_param_group({'params': [...]}) between step() and "
                       "the backward where it starts to train")
            raise RuntimeError(
                f"zero_py: parameter {opt._name(p)} had requires_grad=False when the "
                "optimizer was built, so it is not sharded, reduced or updated, and it "
                f"now requires grad; to train it, {how}")
