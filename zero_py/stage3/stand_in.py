"""Stand-ins: what an initializer replayed by meta_init.replay_init sees for a parameter it may
look at but must not write (one already stored as shards, or a real-device parameter of a
descendant): the full shape over one element. Every in-place call on one, torch's own or
through torch.nn.init, is refused with an error that names the parameter, or run on a
throwaway tensor of the same shape (see meta_init's module docstring for who sees what)."""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from zero_py.sharding.storage import full_shape


def fill_unset(t: torch.Tensor) -> torch.Tensor:
    """NaN in a floating-point value, so that an element no initializer writes is caught."""
    if t.dtype.is_floating_point or t.dtype.is_complex:
        t.fill_(float("nan"))
    return t


# -- stand-ins for parameters an initializer may see but not write -------------------------------

_IN_PLACE_DUNDERS = frozenset({
    "__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
    "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__",
    "__imatmul__", "__set__"})  # __set__: the `.data = ...` setter
# names ending in "_" that change no values
_NOT_WRITES = frozenset({"requires_grad_", "share_memory_", "detach_", "rename_", "retain_grad"})


class _StandInEntry:
    __slots__ = ("base", "param", "refuse")

    def __init__(self, base: torch.Tensor, param: str, refuse: bool):
        self.base = base  # the one element every view of the stand-in points at
        self.param = param
        self.refuse = refuse  # True: a write is an error; False: it goes to a throwaway


class StandIns:
    """The stand-ins of one initializer call, by the address of their one element."""

    def __init__(self, step: str, refusal: Callable[[str, str, str], str]):
        self.step = step  # e.g. "init_fn on 'transformer.h.0' (GPT2Block)", for errors
        self.refusal = refusal  # (step, parameter, operation) -> error message
        self.entries: Dict[int, _StandInEntry] = {}

    def make(self, p: nn.Parameter, name: str, refuse: bool,
             device: torch.device) -> nn.Parameter:
        base = fill_unset(torch.zeros(1, dtype=p.dtype, device=device))
        self.entries[base.untyped_storage().data_ptr()] = _StandInEntry(base, name, refuse)
        t = base.expand(full_shape(p)).as_subclass(_StandIn)
        return nn.Parameter(t, requires_grad=p.requires_grad)

    def entry(self, t) -> Optional[_StandInEntry]:
        if not isinstance(t, _StandIn):
            return None
        with torch._C.DisableTorchFunctionSubclass():
            return self.entries.get(t.untyped_storage().data_ptr())


active: List[StandIns] = []  # the call being replayed (replay_init is not reentrant)


def _written(func, args, kwargs) -> List[Tuple[str, object]]:
    """The tensors an overridable call writes: ('arg', position or key) for its self/first
    argument when the call is in place, ('out', i) for out= tensors."""
    name = getattr(func, "__name__", "")
    where: List[Tuple[str, object]] = []
    if name in _IN_PLACE_DUNDERS or (name.endswith("_") and not name.startswith("_")
                                    and name not in _NOT_WRITES):
        if args:
            where.append(("arg", 0))
        else:
            key = next((k for k in ("tensor", "self", "input") if k in kwargs), None)
            if key is not None:
                where.append(("arg", key))
    out = kwargs.get("out")
    if isinstance(out, torch.Tensor):
        where.append(("out", None))
    elif isinstance(out, (tuple, list)):
        where.extend(("out", i) for i in range(len(out)))
    return where


class _StandIn(torch.Tensor):
    """A parameter an initializer sees but must not change (see the module docstring): the full
    shape over one element; its views are stand-ins too, and every in-place call on one (torch's
    own or through torch.nn.init) is refused with an error that names the parameter, or run on a
    throwaway tensor of the same shape."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        stand_ins = active[-1] if active else None
        if stand_ins is not None:
            args = list(args)
            hit = None  # the throwaway written instead of the first stand-in written
            for kind, at in _written(func, args, kwargs):
                if kind == "arg":
                    t = args[at] if isinstance(at, int) else kwargs[at]
                else:
                    t = kwargs["out"] if at is None else kwargs["out"][at]
                entry = stand_ins.entry(t)
                if entry is None:
                    continue
                if entry.refuse:
                    raise ValueError(stand_ins.refusal(stand_ins.step, entry.param,
                                                       getattr(func, "__name__", repr(func))))
                if getattr(func, "__name__", "") == "__set__":
                    return None  # `.data = ...` on a real-device parameter: discarded
                with torch._C.DisableTorchFunctionSubclass():
                    tmp = torch.zeros(t.shape, dtype=t.dtype, device=t.device)
                hit = tmp if hit is None else hit
                if kind == "arg" and isinstance(at, int):
                    args[at] = tmp
                elif kind == "arg":
                    kwargs[at] = tmp
                elif at is None:
                    kwargs["out"] = tmp
                else:
                    outs = list(kwargs["out"])
                    outs[at] = tmp
                    kwargs["out"] = type(kwargs["out"])(outs)
            if hit is not None:  # the writes went to throwaways (drawing from the RNG as
                with torch._C.DisableTorchFunctionSubclass():  # writes to the real one would)
                    func(*args, **kwargs)
                return hit
        with torch._C.DisableTorchFunctionSubclass():
            ret = func(*args, **kwargs)
        return _wrap_views(ret, stand_ins)


def _wrap_views(ret, stand_ins: Optional[StandIns]):
    """Results that view a stand-in (p.data, p[0], p.view(...)) are stand-ins too; the rest
    (p.clone(), p.std(), shapes) are ordinary values."""
    if stand_ins is None:
        return ret
    if isinstance(ret, torch.Tensor) and not isinstance(ret, _StandIn):
        try:
            with torch._C.DisableTorchFunctionSubclass():
                ptr = ret.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):
            return ret
        return ret.as_subclass(_StandIn) if ptr in stand_ins.entries else ret
    if isinstance(ret, (tuple, list)) and any(isinstance(r, torch.Tensor) for r in ret):
        return type(ret)(_wrap_views(r, stand_ins) for r in ret)
    return ret
