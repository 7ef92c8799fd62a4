"""FlatParams: where parameter values live in stages 1-2.

Every managed parameter's .data is a view into one flat buffer per dtype, laid out as the plan
says; every rank holds every value, and owns one piece per bucket. It answers the storage
contract (sharding/storage.py): publish(), param_bytes() and describe_bucket().
"""

from __future__ import annotations

from typing import Dict, List, Sequence

import torch

from zero_py.collectives.work import issue
from zero_py.sharding.layout import FlatLayout


class FlatParams(FlatLayout):
    """Managed parameters in flat buffers; rank `rank` of `world_size` owns one piece per bucket."""

    shards_frozen = False  # frozen parameters stay whole, outside the storage
    params_sharded = False  # every rank holds every parameter's full value

    def __init__(self, params: Sequence[torch.nn.Parameter], groups: Sequence[int],
                 world_size: int, rank: int, align_bytes: int, bucket_bytes: int):
        super().__init__(params, groups, world_size, rank, align_bytes, bucket_bytes)
        self.buffers = [torch.zeros(n, dtype=self.dtypes[k], device=self.device)
                        for k, n in enumerate(self.plan["buffer_numel"])]
        with torch.no_grad():
            for i, p in enumerate(self.params):
                view = self.param_view(i)
                view.copy_(self.flat_of(i, p.data))
                p.data = self.shaped(i, view)  # the parameter keeps its strides

    # -- where things live --------------------------------------------------------------------

    def bucket_region(self, b: int) -> torch.Tensor:
        """Bucket b inside its flat buffer (all ranks' pieces)."""
        lo = self.bucket_flat_offset[b]
        return self.buffers[self.bucket_buffer[b]][lo:lo + self.bucket_numel[b]]

    def bucket_piece(self, b: int) -> torch.Tensor:
        """This rank's piece of bucket b, a view into the flat buffer."""
        n = self.bucket_shard_numel[b]
        return self.bucket_region(b)[self.rank * n:(self.rank + 1) * n]

    def param_view(self, i: int) -> torch.Tensor:
        """Parameter i as a 1-D view into its flat buffer."""
        b = self.param_bucket[i]
        lo = self.bucket_flat_offset[b] + self.param_offset[i]
        return self.buffers[self.bucket_buffer[b]][lo:lo + self.param_numel[i]]

    def owned_values(self, i: int) -> torch.Tensor:
        """This rank's slice of parameter i (the part its shard owns), a 1-D view; empty
        where the rank owns none of it."""
        s = self.slice_of_param.get(i)
        view = self.param_view(i)
        return view[s.param_lo:s.param_hi] if s is not None else view[:0]

    def moved_params(self) -> List[int]:
        """The parameters whose .data is no longer their view into the flat buffer (replaced by
        `p.data = t`, as torch.nn.utils.vector_to_parameters does): the update and its all-gather
        write the flat buffer, so such a parameter would never change again."""
        bases = [(buf.data_ptr(), buf.element_size()) for buf in self.buffers]
        moved = []
        for i, p in enumerate(self.params):
            b = self.param_bucket[i]
            base, size = bases[self.bucket_buffer[b]]
            at = base + (self.bucket_flat_offset[b] + self.param_offset[i]) * size
            if p.data_ptr() != at or p.dtype != self.buffers[self.bucket_buffer[b]].dtype:
                moved.append(i)
        return moved

    def describe_bucket(self, b: int) -> str:
        """Bucket b in words, for errors: its index and its parameters' (in the order given)."""
        ps = self.bucket_params[b]
        span = f"parameter {ps[0]}" if len(ps) == 1 else f"parameters {min(ps)}-{max(ps)}"
        return f"bucket {b} ({span})"

    # -- collectives over the whole layout -----------------------------------------------------

    def all_gather(self, executor, buckets: Sequence[int]) -> None:
        """Every rank's updated pieces of `buckets` into every rank's flat buffers."""
        pending = [issue(f"all-gather of the updated parameters of {self.describe_bucket(b)} "
                         "in step()", executor.all_gather, self.bucket_region(b),
                         self.bucket_piece(b)) for b in buckets]
        for work in pending:
            work.wait()

    def is_gathered(self, b: int) -> bool:
        """Bucket b's full values exist: always, in stages 1-2."""
        return True

    def publish(self, executor, buckets: Sequence[int]) -> None:
        """After an update of this rank's pieces of `buckets`: every rank's parameters."""
        self.all_gather(executor, buckets)

    def param_bytes(self, frozen: Sequence[torch.Tensor]) -> Dict[str, int]:
        """memory_report's parameter terms: the flat buffers (padding included) and the frozen
        parameters (whole on every rank)."""
        frozen_bytes = sum(p.numel() * p.element_size() for p in frozen)
        buffers = sum(self.bucket_numel[b] * self.bucket_dtype(b).itemsize
                      for b in range(self.n_buckets))
        exact = sum(n * p.element_size() for n, p in zip(self.param_numel, self.params))
        return {"params": buffers + frozen_bytes, "ddp_params": exact + frozen_bytes,
                "padding": buffers - exact, "host_params": 0, "nvme_params": 0}

    def broadcast(self, executor, src: int = 0) -> None:
        """Make every rank's parameters equal to rank `src`'s."""
        pending = [issue(f"broadcast of rank {src}'s parameters ({buf.dtype}) at construction",
                         executor.broadcast, buf, src) for buf in self.buffers]
        for work in pending:
            work.wait()

