"""MemoryOrder: the order in which a parameter's elements sit in its flat range.

A parameter whose strides are dense and non-overlapping keeps them under every stage, as under
DDP and torch.optim (a channels_last convolution weight stays channels_last, so cuDNN needs no
conversion per call). Its flat range then holds its elements in memory order: the order of
`t.permute(dim_order)`, `dim_order` being its dims from the largest stride to the smallest,
which is contiguous. A row-major parameter has the identity order, and its flat range is
`t.reshape(-1)` as it always was. Everything elementwise (reduce-scatter, the optimizer's
update, norms) never looks at the order; everything that turns a flat range into a tensor of
the parameter's shape, or back, goes through flat() and shaped() here, so a state dict, a
checkpoint or a gathered view holds the logical tensor whatever the order.

A parameter that is not dense (an expanded or sliced view) becomes row-major, as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Tuple

import torch


@dataclass(frozen=True)
class MemoryOrder:
    """Where the elements of a tensor of `shape` sit: `dim_order` lists its dims from the
    outermost in memory to the innermost; `strides` are the strides of its view (the
    parameter's own, for a non-row-major one)."""

    shape: Tuple[int, ...]
    dim_order: Tuple[int, ...]
    strides: Tuple[int, ...]

    @classmethod
    def of(cls, t: torch.Tensor) -> "MemoryOrder":
        """The memory order `t` has, with its own strides (those of its dims of size 1 too,
        which a contiguous tensor may have of any value); row-major when it is not dense."""
        shape = tuple(t.shape)
        strides = tuple(t.stride())
        order = dim_order_of(strides)
        if t.numel() <= 1 or not _dense_in(shape, strides, order):
            return cls.row_major_of(shape)
        return cls(shape, order, strides)

    @classmethod
    def row_major_of(cls, shape: Sequence[int]) -> "MemoryOrder":
        shape = tuple(int(d) for d in shape)
        return cls(shape, tuple(range(len(shape))), _row_major_strides(shape))

    @classmethod
    def from_dim_order(cls, shape: Sequence[int], dim_order) -> "MemoryOrder":
        """The dense order of a tensor of `shape` whose dims nest as `dim_order` (outermost
        first; None: row-major), as a checkpoint's manifest or a shard state dict records it.
        Raises ValueError when `dim_order` is not an order of the dims."""
        shape = tuple(int(d) for d in shape)
        if dim_order is None:
            return cls.row_major_of(shape)
        if not (isinstance(dim_order, (list, tuple)) and all(
                isinstance(d, int) and not isinstance(d, bool) for d in dim_order)
                and sorted(dim_order) == list(range(len(shape)))):
            raise ValueError(f"dim order {dim_order!r} is not an order of the dims of a tensor "
                             f"of shape {list(shape)}")
        strides, n = [0] * len(shape), 1
        for d in reversed(dim_order):
            strides[d] = n
            n *= max(shape[d], 1)
        return cls(shape, tuple(dim_order), tuple(strides))

    @property
    def row_major(self) -> bool:
        return self.element_order == tuple(d for d, n in enumerate(self.shape) if n != 1)

    @property
    def element_order(self) -> Tuple[int, ...]:
        """dim_order without the dims of size 1, which move no element (their strides are
        arbitrary): two orders with the same element_order place every element alike."""
        return tuple(d for d in self.dim_order if self.shape[d] != 1)

    def flat(self, t: torch.Tensor) -> torch.Tensor:
        """A tensor of this shape (any strides) as 1-D in this memory order: a view when `t`
        already has this order, a copy otherwise."""
        if self.row_major:
            return t.reshape(-1)
        return t.permute(self.dim_order).reshape(-1)

    def shaped(self, flat: torch.Tensor) -> torch.Tensor:
        """A 1-D tensor in this memory order as a view of this shape (with these strides)."""
        if self.strides == _row_major_strides(self.shape):
            return flat.view(self.shape)
        return flat.as_strided(self.shape, self.strides, flat.storage_offset())

    def describe(self) -> str:
        """In words, for errors: "row-major" or e.g. "dim order [0, 2, 3, 1] (channels_last)"."""
        if self.row_major:
            return "row-major (contiguous)"
        name = {(0, 2, 3, 1): " (channels_last)", (0, 2, 3, 4, 1): " (channels_last_3d)"}
        return f"dim order {list(self.dim_order)}{name.get(self.dim_order, '')}"


def _row_major_strides(shape: Tuple[int, ...]) -> Tuple[int, ...]:
    strides, n = [], 1
    for d in reversed(shape):
        strides.append(n)
        n *= max(d, 1)
    return tuple(reversed(strides))


def dim_order_of(strides: Sequence[int]) -> Tuple[int, ...]:
    """Dims from the largest stride to the smallest (ties in index order)."""
    return tuple(sorted(range(len(strides)), key=lambda d: (-strides[d], d)))


def _dense_in(shape, strides, order) -> bool:
    """Whether a tensor of `shape` and `strides` covers one dense block, dims nested in
    `order` (each dim's stride the product of the sizes inside it): non-overlapping and
    dense."""
    n = 1
    for d in reversed(order):
        if shape[d] != 1 and strides[d] != n:
            return False
        n *= shape[d]
    return True
