"""BetweenUses: the class of a stage-3 parameter while it is its shard slice.

Between the uses of its unit a stage-3 parameter is this rank's 1-D slice of its value
(sharding/storage.py). Reading it is safe (printing, cloning, an EMA, torch.save). Computing
with it and backpropagating is not: a loss that adds `model.blocks[0].fc.weight.pow(2).sum()`
outside blocks[0]'s forward would differentiate the slice, not the parameter, and autograd
fails with a raw shape error ("Function PowBackward0 returned an invalid gradient at index 0 -
got [2048] but expected shape compatible with [128, 32]"), from a node that is not even the
culprit when the use came before the forward. The gradient cannot be made right cheaply
either: each rank holds a different piece, and the piece's gradient is not the parameter's.

So ShardedParams.free() gives such a parameter this class (a subclass of nn.Parameter, so
isinstance checks hold), and _expose() gives it back nn.Parameter: only while a parameter is
its slice do torch calls on it go through __torch_function__ below (about 3 us each). That
hook runs the call as torch would; where the call records autograd history for the
parameter, it runs it once more on an alias (the same storage, a leaf of its own) whose
gradient hook raises an error naming the parameter and saying what to do, so

- the error comes, on every rank alike, only if that result is really backpropagated (a
  norm logged without torch.no_grad() costs nothing more);
- the parameter's own gradient accumulator never sees the slice, so its uses inside the
  forward keep working and the error is the first one that backward meets;
- a torch call that fails on the slice (e.g. a parameter used inside another unit's forward,
  which no wrap policy can see) says that the parameter was its shard slice there.

An in-place write into such a parameter (`p.mul_(0.9)`, `p[0] = 1`, `nn.init.normal_(p)`,
`out=p`) is refused, naming the parameter: it would reach this rank's slice only, not the
optimizer's master, and be lost at the next step. Writes go through zero_py.gathered(model,
modifier_rank=0) or load_state_dict (whose hooks let their own copies through: writes_allowed).

copy.deepcopy of such a parameter (of the model: AveragedModel, an EMA teacher) is refused,
naming it: the copy would be a model of slices. Copy inside zero_py.gathered(model).

full_numel(): inside the block, numel() of such a parameter is its full count (the model's
num_parameters() under stage 3; see zero_py.api). Nothing else changes what torch returns.
"""

from __future__ import annotations

import contextlib
from typing import List

import torch
import torch.nn as nn
from torch._C import DisableTorchFunctionSubclass

_full_numel = [False]  # inside full_numel()
_writes_allowed = [0]  # inside writes_allowed(): zero_py's own writes (a state-dict load)


class BetweenUses(nn.Parameter):
    """A stage-3 parameter while it is its shard slice (see the module docstring)."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if not all(issubclass(cls, t) for t in types):
            return NotImplemented  # another subclass's own override decides (as torch's)
        kwargs = kwargs or {}
        written = None if _writes_allowed[0] else _written(func, args, kwargs)
        if written is not None:
            raise RuntimeError(_write_refusal(written, func))
        with DisableTorchFunctionSubclass():
            if func is torch.Tensor.numel and _full_numel[0] and len(args) == 1:
                shape = getattr(args[0], "_zero_py_shape", None)
                if shape is not None:
                    return _numel(shape)
            try:
                out = func(*args, **kwargs)
            except RuntimeError as exc:
                used = _params_in(args, kwargs)
                if not used:
                    raise
                raise RuntimeError(f"{exc}\n\n{_note(used)}") from exc
            if torch.is_grad_enabled() and _has_history(out):
                used = [p for p in _params_in(args, kwargs) if p.requires_grad]
                if used:
                    # again on aliases whose gradient raises: the parameter's own gradient
                    # accumulator must not see the slice (the first result is dropped, and
                    # with it any accumulator it made)
                    aliases = {id(p): _alias(p) for p in used}
                    out = func(*_swap(args, aliases), **_swap(kwargs, aliases))
        return out

    def __deepcopy__(self, memo):
        # A copy of the slice would be a model of 1-D pieces (empty on some ranks) that no
        # forward takes and whose state_dict is this rank's piece: AveragedModel(model), an EMA
        # teacher or a snapshot would average or save slices without a word.
        raise RuntimeError(_copy_refusal(self))


@contextlib.contextmanager
def full_numel():
    """Inside the block, numel() of a stage-3 parameter between uses is its full count."""
    before, _full_numel[0] = _full_numel[0], True
    try:
        yield
    finally:
        _full_numel[0] = before


@contextlib.contextmanager
def writes_allowed():
    """Inside the block, in-place writes into parameters between uses are let through: a
    stage-3 load_state_dict, whose pre-hook gives torch each rank's slice to copy in and
    whose post-hook then syncs the optimizer's masters."""
    _writes_allowed[0] += 1
    try:
        yield
    finally:
        _writes_allowed[0] -= 1


def describe(p: torch.Tensor) -> str:
    """A parameter in words, for errors: its name and unit (set by zero_py.initialize)."""
    return getattr(p, "_zero_py_describe", None) or "(unnamed)"


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _params_in(args, kwargs) -> List[torch.Tensor]:
    """The parameters between uses among the arguments (and inside lists and tuples of them:
    torch.cat, torch.stack)."""
    found = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, (list, tuple)):
            found += [t for t in a if isinstance(t, BetweenUses)]
        elif isinstance(a, BetweenUses):
            found.append(a)
    return found


# in-place methods that write no values (a flag, the memory it lives in)
_NOT_WRITES = {"requires_grad_", "share_memory_", "retain_grad", "pin_memory"}
_INPLACE_DUNDERS = {"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__",
                    "__ifloordiv__", "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__",
                    "__ilshift__", "__irshift__", "__imatmul__"}


def _written(func, args, kwargs):
    """The parameter between uses that this call writes into, if any: the first argument of
    an in-place call (`p.mul_(0.9)`, `p[0] = 1`, `p += x`, `nn.init.normal_(p)`,
    `torch._foreach_mul_([p, ...], 2)`), or its `out=`."""
    out = kwargs.get("out")
    if isinstance(out, BetweenUses):
        return out
    name = getattr(func, "__name__", "")
    if name in _NOT_WRITES or not (name in _INPLACE_DUNDERS
                                   or (name.endswith("_") and not name.startswith("__"))):
        return None
    # torch.nn.init's functions pass their tensor by keyword
    first = args[0] if args else next(iter(kwargs.values()), None)
    if isinstance(first, (list, tuple)):
        return next((t for t in first if isinstance(t, BetweenUses)), None)
    return first if isinstance(first, BetweenUses) else None


def _write_refusal(p: torch.Tensor, func) -> str:
    return (
        f"zero_py stage 3: {getattr(func, '__name__', func)} would write into parameter "
        f"{describe(p)} between the uses of its unit, where it is {_slice_words(p)}: the "
        "write would reach this rank's piece only and be lost at the next gather (or undone "
        "by the next step). Write full values inside `with zero_py.gathered(model, "
        "modifier_rank=0):` (rank 0's edit is broadcast and reaches the optimizer's masters), "
        "load them with model.load_state_dict(sd) on every rank, or initialize the weights "
        "before zero_py.initialize.")


def _copy_refusal(p: torch.Tensor) -> str:
    return (
        f"zero_py stage 3: copy.deepcopy would copy parameter {describe(p)} between the uses "
        f"of its unit, where it is {_slice_words(p)}: the copy would hold this rank's piece, "
        "not the model (no forward takes it, and its state_dict is a slice). Copy the model "
        "inside `with zero_py.gathered(model):` (e.g. `swa_model = "
        "torch.optim.swa_utils.AveragedModel(model)` or an EMA teacher), and read it there "
        "too (`with zero_py.gathered(model): swa_model.update_parameters(model)`); for the "
        "values alone, model.state_dict() is full.")


def _has_history(out) -> bool:
    if isinstance(out, torch.Tensor):
        return out.grad_fn is not None
    if isinstance(out, (list, tuple)):
        return any(isinstance(t, torch.Tensor) and t.grad_fn is not None for t in out)
    return False


def _swap(obj, aliases):
    if isinstance(obj, dict):
        return {k: _swap(v, aliases) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        swapped = [aliases.get(id(t), t) if isinstance(t, torch.Tensor) else _swap(t, aliases)
                   for t in obj]
        return tuple(swapped) if isinstance(obj, tuple) else swapped
    return aliases.get(id(obj), obj) if isinstance(obj, torch.Tensor) else obj


def _alias(p: torch.Tensor) -> torch.Tensor:
    alias = p.detach().requires_grad_(True)
    message = _refusal(p)

    def refuse(grad):
        raise RuntimeError(message)
    alias.register_hook(refuse)
    return alias


def _slice_words(p: torch.Tensor) -> str:
    shape = tuple(getattr(p, "_zero_py_shape", ()) or ())
    return (f"this rank's 1-D shard slice ({p.numel()} of the {_numel(shape)} elements of its "
            f"shape {shape})")


def _refusal(p: torch.Tensor) -> str:
    return (
        f"zero_py stage 3: parameter {describe(p)} was used outside the forward of its unit, "
        f"where it is {_slice_words(p)}, and backward reached that use: stage 3 cannot give "
        "it a gradient there (each rank holds another piece, and DDP would differentiate the "
        "whole parameter). Compute with it inside the forward: inside the forward of the "
        "module that registers it (a unit's parameters are whole only while that unit runs; "
        "the root unit's and persistent ones stay whole from the model's forward to the end "
        "of its backward, so a loss may use those after the forward), or for a weight penalty "
        "use the optimizer's weight_decay. To read values between steps, without a gradient, "
        "use `with zero_py.gathered(model):`.")


def _note(used: List[torch.Tensor]) -> str:
    p = used[0]
    return (f"zero_py stage 3: parameter {describe(p)} was passed to this call outside the "
            f"forward of its unit, where it is {_slice_words(p)}. Use it inside the forward of "
            "the module that registers it (no wrap policy can see a parameter used by a "
            "module of another unit: register or tie it there, or keep both in one unit), or "
            "read its full value inside `with zero_py.gathered(model):`.")
