"""The torch.distributed executor: carries out the schedule's collectives on any ProcessGroup.

Every call is asynchronous and returns a handle with wait(); the caller decides when to wait,
so reductions overlap with backward. Works with gloo (CPU), NCCL and MPI groups.

On gloo (CPU) two collectives take faster forms than the flat ones, measured side by side by
benchmarks/gloo_collectives.py (numbers in benchmarks/RESULTS.md):
  reduce-scatter = all-reduce of the input (a scratch bucket) and a copy of this rank's chunk.
      gloo's reduce_scatter is slower at every size measured at 4 ranks (3.2 MB: 20.6 ms
      against 9.3 ms; 12.8 MB: 56.5 against 50.4) and reduce_scatter_tensor slower still
      (12.8 MB: 92.9 ms); at 2 ranks the list form wins only below 1 MB, by about 0.6 ms.
  all-gather of at least BROADCAST_ALL_GATHER_BYTES = one async broadcast per rank from its
      chunk, all in flight at once: all_gather_into_tensor takes 1.2-1.9x as long from 3.2 MB
      up (12.8 MB: 36.8 ms against 19.3 ms at 4 ranks, 18.2 against 9.8 at 2); below about
      1.6 MB the flat collective is faster and is kept.
Other backends get reduce_scatter_tensor and all_gather_into_tensor. Where a backend has no
reduce-scatter, the reduction falls back to the all-reduce form too.
"""

from __future__ import annotations

import ctypes
import io
from typing import Any, Callable, List, Optional

import torch
import torch.distributed as dist

# torch 2.13 renamed the flat-tensor collectives (*_single) and deprecated the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

BROADCAST_ALL_GATHER_BYTES = 2 * 2**20  # gloo: all-gathers this large use broadcasts (above)


class Pending:
    """A collective in flight; wait() finishes it and runs the follow-up, once."""

    __slots__ = ("_work", "_then")

    def __init__(self, work, then: Optional[Callable[[], None]] = None):
        self._work = work
        self._then = then

    def is_completed(self) -> bool:
        return self._work is None or self._work.is_completed()

    def wait(self) -> None:
        if self._work is not None:
            self._work.wait()
            self._work = None
        if self._then is not None:
            then, self._then = self._then, None
            then()


class PendingAll:
    """Several collectives in flight as one: wait() finishes them all."""

    __slots__ = ("_works",)

    def __init__(self, works):
        self._works = list(works)

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def wait(self) -> None:
        for w in self._works:
            w.wait()
        self._works = []


class TorchDistExecutor:
    def __init__(self, process_group: Optional[dist.ProcessGroup] = None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "zero_py needs torch.distributed: call torch.distributed.init_process_group() "
                "(e.g. under torchrun) before building the optimizer"
            )
        self.group = process_group if process_group is not None else dist.group.WORLD
        self.world_size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        gloo = dist.get_backend(self.group) == "gloo"
        self._native_reduce_scatter = not gloo  # gloo: the all-reduce form (see above)
        self._broadcast_all_gather = gloo

    def global_rank(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> Pending:
        """output = this rank's chunk of the sum of `input` over ranks. `input` is scratch:
        its contents are undefined afterwards (the gloo form sums into it)."""
        if self.world_size == 1:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return Pending(None)
        if self._native_reduce_scatter:
            try:
                return Pending(_reduce_scatter_flat(output, input, group=self.group,
                                                    async_op=True))
            except (RuntimeError, NotImplementedError) as exc:
                if "support" not in str(exc).lower():
                    raise
                self._native_reduce_scatter = False
        n = output.numel()
        lo = self.rank * n
        work = dist.all_reduce(input, group=self.group, async_op=True)
        return Pending(work, lambda: output.copy_(input[lo:lo + n]))

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> Pending:
        """output = the concatenation of every rank's `input` (input may alias its chunk)."""
        if self.world_size == 1:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return Pending(None)
        if (self._broadcast_all_gather
                and output.numel() * output.element_size() >= BROADCAST_ALL_GATHER_BYTES):
            chunks = output.chunk(self.world_size)
            mine = chunks[self.rank]
            if mine.data_ptr() != input.data_ptr():
                mine.copy_(input)
            return PendingAll(dist.broadcast(c, src=self.global_rank(k), group=self.group,
                                             async_op=True) for k, c in enumerate(chunks))
        return Pending(_all_gather_flat(output, input, group=self.group, async_op=True))

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> Pending:
        if self.world_size == 1:
            return Pending(None)
        return Pending(dist.all_reduce(tensor, op=op, group=self.group, async_op=True))

    def all_reduce_max(self, tensor: torch.Tensor) -> Pending:
        return self.all_reduce(tensor, dist.ReduceOp.MAX)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> Pending:
        if self.world_size == 1:
            return Pending(None)
        return Pending(dist.broadcast(tensor, src=self.global_rank(src), group=self.group,
                                      async_op=True))

    def gather_object(self, obj: Any, dst: int = 0) -> Optional[List[Any]]:
        """The list of every rank's `obj` on group rank `dst`, None elsewhere.

        Objects travel as torch.save bytes in uint8 tensors and are read back with
        weights_only=True (tensors, numbers, strings, containers: nothing that runs code).
        torch.distributed.gather_object is not used because it needs NumPy."""
        if self.world_size == 1:
            return [obj]
        buf = io.BytesIO()
        torch.save(obj, buf)
        payload = torch.frombuffer(bytearray(buf.getbuffer()), dtype=torch.uint8)
        sizes = torch.zeros(self.world_size, dtype=torch.int64)
        sizes[self.rank] = payload.numel()
        dist.all_reduce(sizes, group=self.group)
        padded = torch.zeros(int(sizes.max()), dtype=torch.uint8)
        padded[:payload.numel()] = payload
        out = [torch.empty_like(padded) for _ in range(self.world_size)] \
            if self.rank == dst else None
        dist.gather(padded, out, dst=self.global_rank(dst), group=self.group)
        if out is None:
            return None
        return [torch.load(io.BytesIO(ctypes.string_at(t.data_ptr(), int(n))), weights_only=True)
                for t, n in zip(out, sizes.tolist())]
