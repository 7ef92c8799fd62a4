"""Partitioned construction for stage 3: a model built on the meta device is materialized
module by module, so it never exists whole on a rank, and gets the values an ordinary build from
the same seed gives.

`realize_meta` swaps every meta parameter for one with the right shape and dtype and no storage;
zero_py.stage3 lays them out and shards them; `replay_init` then replays, one module at a time,
what the constructors did (each module's reset_parameters(), children first, with the RNG state
the constructor saw) and what an init_fn applied afterwards would do, and keeps only this rank's
pieces of each value (rank 0's values, broadcast, as with an ordinary build)."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Callable, Dict, List, Optional, Set

import torch
import torch.nn as nn

if TYPE_CHECKING:
    from zero_py.stage3.engine import Stage3Engine


def _shape(p: torch.Tensor) -> torch.Size:
    """p's real shape (a stage-3 parameter between uses is its 1-D shard slice)."""
    shape = getattr(p, "_zero_py_shape", None)
    return torch.Size(shape) if shape is not None else p.shape


def _post_order(model: nn.Module) -> List[nn.Module]:
    """Modules children first, as a constructor finishes them and as Module.apply visits them."""
    out: List[nn.Module] = []
    seen: Set[int] = set()

    def visit(m: nn.Module) -> None:
        if id(m) in seen:
            return
        seen.add(id(m))
        for child in m.children():
            visit(child)
        out.append(m)

    visit(model)
    return out


def realize_meta(model: nn.Module, device: torch.device) -> Set[int]:
    """Replaces every parameter on the meta device by a parameter on `device` with no storage
    behind it (the same object in every module that shares it); returns their ids. Values
    come later, from replay_init, one module at a time."""
    new: Dict[int, nn.Parameter] = {}
    for m in model.modules():
        for name, p in list(m._parameters.items()):
            if p is None or not p.is_meta:
                continue
            if id(p) not in new:
                # the right shape and dtype over one element (stride 0): nothing the size of
                # the parameter is allocated; build_flat points it at its gather buffer
                t = torch.empty(1, dtype=p.dtype, device=device).expand(p.shape)
                new[id(p)] = nn.Parameter(t, requires_grad=p.requires_grad)
            m._parameters[name] = new[id(p)]
    return {id(p) for p in new.values()}


@contextlib.contextmanager
def _scratch(module: nn.Module, values: Dict[str, torch.Tensor]):
    """Module with its direct parameters temporarily replaced by `values` (full tensors). An
    initializer that replaces a parameter (`self.weight = nn.Parameter(...)`) or its .data
    instead of filling it in place is followed: `values` gets the replacement on exit."""
    saved = dict(module._parameters)
    placed = {name: nn.Parameter(t, requires_grad=saved[name].requires_grad)
              for name, t in values.items()}
    # parameters built on a real device keep their values: the initializer gets copies
    others = {name: nn.Parameter(_throwaway(p), requires_grad=p.requires_grad)
              for name, p in saved.items() if p is not None and name not in values}
    try:
        module._parameters.update(placed)
        module._parameters.update(others)
        yield
        for name, t in placed.items():
            now = module._parameters.get(name)
            if now is t and now.data_ptr() == values[name].data_ptr():
                continue
            if now is None or tuple(now.shape) != tuple(values[name].shape):
                raise ValueError(
                    f"zero_py: initializing {type(module).__name__}.{name} replaced it by "
                    f"{'None' if now is None else tuple(now.shape)}; a parameter built on the "
                    f"meta device must keep its shape {tuple(values[name].shape)}")
            values[name] = now.detach().to(values[name].dtype)
    finally:
        module._parameters.clear()
        module._parameters.update(saved)


def _throwaway(p: torch.Tensor) -> torch.Tensor:
    """A copy of a real parameter for an initializer to write into; zeros where its values
    live only as shards now (its storage is released between gathers)."""
    t = p.detach()
    if tuple(t.shape) != tuple(_shape(p)) or (t.numel() and t.untyped_storage().nbytes() == 0):
        return torch.zeros(_shape(p), dtype=t.dtype, device=t.device)
    return t.clone()


class _ScratchArena:
    """Room for one module's parameters at a time: one buffer per dtype, as large as the most
    any single module needs, allocated once and reused by every module of the replay.

    Allocating every module's values anew and freeing them was measured to leave most of a
    model resident under glibc's default settings: replaying a 67 MB model (16 Linear layers)
    at 4 ranks grew a rank's resident memory by up to 47 MB that stayed after the replay, all
    of it freed blocks in glibc's heap (its heap grew by about one module per module: small
    allocations made between two modules' values, such as tensor headers and collective work
    objects, are the likely reason a freed block is not reused whole). With one arena the
    replay holds one module at a time whatever the allocator does.
    """

    _ALIGN = 16  # elements: every value starts 64-byte aligned (in fp32)

    def __init__(self, order: List[nn.Module], todo: Set[int], device: torch.device):
        self._todo = todo
        need: Dict[torch.dtype, int] = {}
        for m in order:
            used: Dict[torch.dtype, int] = {}
            for p in m._parameters.values():
                if p is not None and id(p) in todo:
                    used[p.dtype] = used.get(p.dtype, 0) + self._round(_shape(p).numel())
            for dtype, n in used.items():
                need[dtype] = max(need.get(dtype, 0), n)
        self._buffers = {dtype: torch.empty(n, dtype=dtype, device=device)
                         for dtype, n in need.items()}

    @classmethod
    def _round(cls, n: int) -> int:
        return -(-n // cls._ALIGN) * cls._ALIGN

    def values(self, m: nn.Module) -> Dict[str, torch.Tensor]:
        """Tensors for m's parameters still to be filled, by name: views into the arena, valid
        until the next call (keep one longer with .clone()). Floating-point ones are filled
        with NaN, so a value no initializer wrote is caught when it is stored."""
        out: Dict[str, torch.Tensor] = {}
        at: Dict[torch.dtype, int] = {}
        for name, p in m._parameters.items():
            if p is None or id(p) not in self._todo:
                continue
            lo = at.get(p.dtype, 0)
            n = _shape(p).numel()
            out[name] = self._buffers[p.dtype][lo:lo + n].view(_shape(p))
            if p.dtype.is_floating_point or p.dtype.is_complex:
                out[name].fill_(float("nan"))
            at[p.dtype] = lo + self._round(n)
        return out


def replay_init(model: nn.Module, engine: Stage3Engine, todo: Set[int],
                init_fn: Optional[Callable[[nn.Module], None]]) -> None:
    """Fills the parameters realize_meta created, module by module, with the values an ordinary
    build from the same seed gives: each module's reset_parameters() in construction order
    (children first), then init_fn over the model as Module.apply(init_fn) would run it after
    construction. Only what was built on the meta device is initialized: parameters of a model
    built partly on a real device keep their values (initializers write into copies of them),
    and modules with nothing on the meta device are not reset again. Only one module's
    parameters are whole at a time, in one reused arena (a
    tied parameter stays whole from its first to its last owner); each value is broadcast from
    rank 0, as with an ordinary build, and only this rank's slice of it is kept. Meta buffers
    are materialized by the same replay and stay replicated."""
    storages = engine.storages
    order = _post_order(model)
    owners: Dict[int, List[nn.Module]] = {}
    for m in order:
        for p in m._parameters.values():
            if p is not None and id(p) in todo:
                owners.setdefault(id(p), []).append(m)
    device = engine.flat.device
    # every module's values are made in this one arena, in turn (see _ScratchArena)
    scratch = _ScratchArena(order, todo, device)

    names = {id(p): n for n, p in model.named_parameters()}

    def store(p: nn.Parameter, value: torch.Tensor) -> None:
        value = value.detach().contiguous()
        engine.flat.executor.broadcast(value, 0).wait()
        # rank 0's value on every rank: all of them raise, or none
        if (value.is_floating_point() or value.is_complex()) and bool(value.isnan().any()):
            raise ValueError(
                f"zero_py: parameter {names[id(p)]!r} (built on the meta device) was not "
                "initialized, or only in part: its module's reset_parameters()"
                + (" and init_fn leave" if init_fn is not None else " leaves")
                + " elements unwritten (or NaN); initialize every element, e.g. in init_fn")
        for storage in storages:  # the trainable or the frozen parameters'
            i = storage.index_of(p)
            if i is not None:
                s = storage.slice_of_param.get(i)
                if s is not None:
                    storage.shards.piece(s.bucket)[s.piece_lo:s.piece_hi].copy_(
                        value.reshape(-1)[s.param_lo:s.param_hi])

    def meta_buffers(m: nn.Module) -> None:
        for name, buf in list(m._buffers.items()):
            if buf is not None and buf.is_meta:
                m._buffers[name] = torch.empty(buf.shape, dtype=buf.dtype, device=device)

    filled: Set[int] = set()
    values: Dict[str, torch.Tensor] = {}
    snapshots: Dict[int, torch.Tensor] = {}
    with torch.no_grad():
        for m in order:  # pass 1: what the constructors did
            had_meta_buffers = any(b is not None and b.is_meta for b in m._buffers.values())
            meta_buffers(m)
            # a module built on a real device was initialized by its constructor already
            if not hasattr(m, "reset_parameters") or not (
                    had_meta_buffers or any(p is not None and id(p) in todo
                                            for p in m._parameters.values())):
                continue
            snapshots[id(m)] = torch.get_rng_state()
            values = scratch.values(m)
            with _scratch(m, values):
                m.reset_parameters()
            if init_fn is None:
                for name, p in m._parameters.items():
                    if p is not None and id(p) in todo and owners[id(p)][0] is m:
                        store(p, values[name])
                        filled.add(id(p))
        if init_fn is not None:  # pass 2: init_fn applied after construction
            carried: Dict[int, torch.Tensor] = {}
            for m in order:
                values = scratch.values(m)
                if id(m) in snapshots:  # this module's values after construction
                    state = torch.get_rng_state()
                    torch.set_rng_state(snapshots[id(m)])
                    with _scratch(m, values):
                        m.reset_parameters()
                    torch.set_rng_state(state)
                for name, p in m._parameters.items():
                    if p is not None and id(p) in carried:
                        values[name] = carried[id(p)]
                with _scratch(m, values):
                    init_fn(m)
                for name, p in m._parameters.items():
                    if p is None or id(p) not in todo:
                        continue
                    if owners[id(p)][-1] is m:
                        store(p, values[name])
                        carried.pop(id(p), None)
                        filled.add(id(p))
                    elif values[name] is not carried.get(id(p)):
                        # tied: kept whole until its last owner, outside the arena
                        carried[id(p)] = values[name].clone()
            filled |= set(owners)
    del scratch, values
    missing = [n for n, p in model.named_parameters() if id(p) in todo and id(p) not in filled]
    if missing:
        raise ValueError(
            f"zero_py: parameters {missing[:5]} were built on the meta device but no module that "
            "owns them has reset_parameters(), so their initial values are unknown; pass "
            "init_fn=fn (called on every module, children first, like model.apply(fn)) that "
            "initializes them")
    left = [n for n, b in model.named_buffers() if b.is_meta]
    if left:
        raise ValueError(f"zero_py: buffers {left[:5]} are still on the meta device; create "
                         "them on a real device in the constructor or set them in init_fn")
    for storage in storages:  # the persistent unit's full values, from the new pieces
        storage.publish(None, ())
