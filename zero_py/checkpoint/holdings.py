"""What one rank holds of a model and its ZeroOptimizer, by parameter name, for every stage.

A checkpoint is written and read by parameter name and flat element range, so that the stage
and world size that wrote it do not matter to the one that reads it. Elements are counted over
the parameter flattened in its memory order (sharding/memory_order.py: row-major, or e.g. dims
0, 2, 3, 1 for a channels_last one), the order its flat range and its pieces hold them in.
For every parameter of the model (tied parameters once, under their first name) Held says:

- which elements this rank saves, [lo, hi) of the flattened parameter: its slice of the flat
  layout (every stage), or for a parameter outside the optimizer's storage (frozen under stages
  1-2, or not given to the optimizer), an even split of the elements over the ranks;
- which elements a load reads, [load_lo, load_hi): the same slice for a parameter in the
  optimizer's storage (under stages 1-2 the storage's all-gather then gives every rank the
  rest, as after a step), the whole parameter for one outside it (replicated, read by every
  rank);
- the optimizer's ShardSlice for a trainable parameter (its masters and states cover exactly
  [lo, hi));
- under offload_params="nvme" (outside resident()), the storage whose parameter file holds the
  values, and the parameter's slice there: they are then in no tensor, so a save reads them
  from the file's records and a load writes them there (offloaded.py), and `values` and
  `load_into` are None.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn as nn

from zero_py.sharding.layout import ShardSlice
from zero_py.sharding.memory_order import MemoryOrder


@dataclass
class Held:
    name: str
    shape: tuple
    dtype: torch.dtype
    requires_grad: bool
    lo: int                 # elements [lo, hi) of the flattened parameter are saved here
    hi: int
    values: Optional[torch.Tensor]  # those elements, a live 1-D view (None: on_file)
    load_lo: int            # a load fills [load_lo, load_hi) ...
    load_hi: int
    load_into: Optional[torch.Tensor]  # ... into this live 1-D view (None: on_file)
    slice: Optional[ShardSlice]  # the optimizer's slice (trainable parameters), or None
    index: Optional[int]    # index in the optimizer's storage (trainable parameters), or None
    # (ShardedParams, its ShardSlice or None) when the values are only in its NVMe file
    on_file: Optional[Tuple[Any, Optional[ShardSlice]]] = None
    order: Optional[MemoryOrder] = None  # the order [lo, hi) count in (None: row-major)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def holdings(model: nn.Module, optimizer) -> Dict[str, Held]:
    """Every parameter of `model` as this rank holds it (see the module docstring)."""
    flat = optimizer._flat
    where = {}
    for storage in (flat, getattr(flat, "frozen_storage", None)):
        if storage is not None:
            for i, p in enumerate(storage.params):
                where[id(p)] = (storage, i)
    world, rank = optimizer.executor.world_size, optimizer.executor.rank
    out: Dict[str, Held] = {}
    seen = set()
    for name, p in model.named_parameters():
        seen.add(id(p))
        if id(p) in where:
            storage, i = where[id(p)]
            shape, numel = tuple(storage.param_shapes[i]), storage.param_numel[i]
            s = storage.slice_of_param.get(i)
            lo, hi = (s.param_lo, s.param_hi) if s is not None else (0, 0)
            on_file = (storage, s) if getattr(storage, "pieces_on_file", False) else None
            values = None if on_file else storage.owned_values(i)
            load = (lo, hi, values)  # stages 1-2: the storage's all-gather fills the rest
            trainable = storage is flat
            out[name] = Held(name, shape, p.dtype, p.requires_grad, lo, hi, values, *load,
                             s if trainable else None, i if trainable else None, on_file,
                             storage.param_orders[i])
            continue
        order = MemoryOrder.of(p)
        if order.row_major and not p.is_contiguous():
            raise ValueError(f"parameter {name} is not dense (it views part of a larger tensor); "
                             "checkpoints need dense parameters (call .data = "
                             "p.data.contiguous() on it)")
        full = order.flat(p.data)  # a view: a load writes the parameter through it
        numel = full.numel()
        lo, hi = numel * rank // world, numel * (rank + 1) // world
        out[name] = Held(name, tuple(p.shape), p.dtype, p.requires_grad, lo, hi, full[lo:hi],
                         0, numel, full, None, None, None, order)
    stray = [i for i, p in enumerate(flat.params) if id(p) not in seen]
    if stray:
        raise ValueError(f"the optimizer trains {len(stray)} parameter(s) that are not in the "
                         "model given (e.g. its parameter of shape "
                         f"{tuple(flat.param_shapes[stray[0]])}); pass the model whose "
                         "parameters the optimizer was built over")
    return out


def persistent_buffers(model: nn.Module) -> Dict[str, torch.Tensor]:
    """The buffers model.state_dict() would hold (non-persistent ones left out)."""
    out = {}
    for mod_name, mod in model.named_modules():
        skip = getattr(mod, "_non_persistent_buffers_set", set())
        for name, buf in mod.named_buffers(recurse=False):
            if buf is not None and name not in skip:
                key = f"{mod_name}.{name}" if mod_name else name
                out.setdefault(key, buf)
    return out
