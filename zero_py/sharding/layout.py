"""The flat layout: the C planner's answer for a list of parameters, and what follows from it.

zero_py._C.layout_plan (csrc/layout/layout.h) puts parameters in buckets (runs of one param
group and one dtype), pads every bucket so it splits into world_size equal, aligned pieces, and
gives rank r piece r of every bucket. FlatLayout answers the questions that follow: where
bucket b lives, which piece of it this rank owns, and which slice of each parameter falls into
this rank's pieces (ShardSlice). It holds no storage: sharding/storage.py does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch

from zero_py._native import _C
from zero_py.sharding.memory_order import MemoryOrder


@dataclass(frozen=True)
class ShardSlice:
    """The part of one parameter that lies in this rank's piece of its bucket.

    Elements [param_lo, param_hi) of the flattened parameter sit at [piece_lo, piece_hi) of
    the piece (piece coordinates) and at shard_lo .. of the rank's shard space."""

    param: int  # index into FlatParams.params
    bucket: int
    param_lo: int
    param_hi: int
    piece_lo: int
    shard_lo: int

    @property
    def numel(self) -> int:
        return self.param_hi - self.param_lo

    @property
    def piece_hi(self) -> int:
        return self.piece_lo + self.numel


class FlatLayout:
    """The C plan for a list of parameters, and what follows from it; holds no storage.

    `groups[i]` is parameter i's param group. `layout_keys[i]` (default: its group) is what the
    planner buckets by: parameters with different keys never share a bucket (stage 3 keys by
    unit and group, so that a unit is whole buckets)."""

    def __init__(self, params: Sequence[torch.nn.Parameter], groups: Sequence[int],
                 world_size: int, rank: int, align_bytes: int, bucket_bytes: int,
                 layout_keys: Optional[Sequence[int]] = None,
                 device: Optional[torch.device] = None):
        self.params = list(params)
        self.world_size = world_size
        self.rank = rank
        # device: where an empty layout (a stage-3 model with no trainable parameter) lives
        self.device = self.params[0].device if self.params else torch.device(device)
        # sizes as planned: stage 3 later shows a parameter as its shard slice between uses
        self.param_numel: List[int] = [p.numel() for p in self.params]
        self.param_shapes: List[tuple] = [tuple(p.shape) for p in self.params]
        # the order of each parameter's elements in its flat range (memory_order.py); a stand-in
        # for a parameter built on the meta device (stage3/meta_init.py) carries the meta one's
        self.param_orders: List[MemoryOrder] = [
            getattr(p, "_zero_py_memory_order", None) or MemoryOrder.of(p) for p in self.params]
        dtypes: List[torch.dtype] = []
        for p in self.params:
            if p.dtype not in dtypes:
                dtypes.append(p.dtype)
        self.dtypes = dtypes
        buffer_of = [dtypes.index(p.dtype) for p in self.params]
        keys = list(groups) if layout_keys is None else list(layout_keys)
        plan = _C.layout_plan(list(self.param_numel), keys, buffer_of,
                              [p.element_size() for p in self.params], world_size, align_bytes,
                              bucket_bytes) if self.params else _empty_plan(world_size,
                                                                            align_bytes)
        self.plan = plan
        self.param_bucket: List[int] = plan["param_bucket"]
        self.param_offset: List[int] = plan["param_offset"]
        self.bucket_buffer: List[int] = plan["bucket_buffer"]
        self.bucket_numel: List[int] = plan["bucket_numel"]
        self.bucket_shard_numel: List[int] = plan["bucket_shard_numel"]
        self.bucket_flat_offset: List[int] = plan["bucket_flat_offset"]
        self.bucket_shard_offset: List[int] = plan["bucket_shard_offset"]
        starts = plan["bucket_param_start"]
        self.bucket_params: List[List[int]] = [
            plan["bucket_params"][starts[b]:starts[b + 1]] for b in range(len(self.bucket_numel))]
        self.bucket_group: List[int] = [groups[ps[0]] for ps in self.bucket_params]
        self.shard_numel: int = plan["shard_numel"]
        self.padding_numel: int = plan["padding_numel"]
        self.n_buckets = len(self.bucket_numel)
        self.bucket_gaps: List[List[tuple]] = [self._gaps(b) for b in range(self.n_buckets)]
        self.slices: List[ShardSlice] = self._shard_slices()
        self.slices_of_bucket: Dict[int, List[ShardSlice]] = {b: [] for b in range(self.n_buckets)}
        for s in self.slices:
            self.slices_of_bucket[s.bucket].append(s)
        self.slice_of_param: Dict[int, ShardSlice] = {s.param: s for s in self.slices}

    def bucket_piece(self, b: int) -> torch.Tensor:
        """This rank's piece of bucket b's parameter values."""
        raise NotImplementedError

    def shaped(self, i: int, flat: torch.Tensor) -> torch.Tensor:
        """Parameter i's flat range (1-D, memory order) as a view of its shape and strides."""
        return self.param_orders[i].shaped(flat)

    def flat_of(self, i: int, t: torch.Tensor) -> torch.Tensor:
        """A tensor of parameter i's shape (a gradient, a value, a state) as its flat range:
        1-D in the parameter's memory order."""
        return self.param_orders[i].flat(t)

    def shard_range(self, b: int) -> range:
        """Where bucket b's piece sits in the rank's shard space."""
        lo = self.bucket_shard_offset[b]
        return range(lo, lo + self.bucket_shard_numel[b])

    def bucket_dtype(self, b: int) -> torch.dtype:
        return self.dtypes[self.bucket_buffer[b]]

    def _gaps(self, b: int) -> List[tuple]:
        """Element ranges of bucket b that belong to no parameter (alignment and tail padding)."""
        gaps, end = [], 0
        for i in self.bucket_params[b]:
            if self.param_offset[i] > end:
                gaps.append((end, self.param_offset[i]))
            end = self.param_offset[i] + self.param_numel[i]
        if end < self.bucket_numel[b]:
            gaps.append((end, self.bucket_numel[b]))
        return gaps

    def _shard_slices(self) -> List[ShardSlice]:
        out = []
        for b in range(self.n_buckets):
            n = self.bucket_shard_numel[b]
            piece_lo, piece_hi = self.rank * n, (self.rank + 1) * n
            for i in self.bucket_params[b]:
                lo = self.param_offset[i]
                hi = lo + self.param_numel[i]
                a, z = max(lo, piece_lo), min(hi, piece_hi)
                if a < z:
                    out.append(ShardSlice(i, b, a - lo, z - lo, a - piece_lo,
                                          self.bucket_shard_offset[b] + a - piece_lo))
        return out


def _empty_plan(world_size: int, align_bytes: int) -> dict:
    """The plan of no parameters (the C planner refuses an empty list): no bucket, no buffer,
    an empty shard. A stage-3 model with no trainable parameter has this trainable layout."""
    plan: dict = {k: [] for k in ("param_bucket", "param_offset", "bucket_group",
                                  "bucket_buffer", "bucket_numel", "bucket_shard_numel",
                                  "bucket_flat_offset", "bucket_shard_offset", "bucket_params",
                                  "buffer_numel")}
    plan.update(bucket_param_start=[0], shard_numel=0, padding_numel=0, world_size=world_size,
                align_bytes=align_bytes)
    return plan
