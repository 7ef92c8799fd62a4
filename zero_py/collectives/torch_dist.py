"""The torch.distributed executor: carries out the schedule's collectives on any ProcessGroup.

Every call is asynchronous and returns a handle with wait(); the caller decides when to wait,
so reductions overlap with backward. Works with gloo (CPU), NCCL and MPI groups.

On gloo (CPU), all-gather and reduce-scatter are built from point-to-point messages (each rank
sends every peer its chunk and receives theirs, all in flight at once): gloo's own collectives
go through its process group's worker threads and, for reduce-scatter, through extra copies.
Side by side (benchmarks/gloo_collectives.py, numbers in benchmarks/RESULTS.md), from 3.2 MB
up the messages take 0.4-0.75x the time of all_gather_into_tensor and 0.3-0.5x that of
reduce_scatter_tensor, at 2 and 4 ranks; at 0.4 MB they win at 4 ranks and lose at 2 (1.2 ms
against 0.7 for the all-gather), where the whole exchange is a millisecond either way.
The reduce-scatter receives the first peer's copy of this rank's chunk straight into the
output and the others' into a scratch buffer ((world_size - 2) chunks: none at 2 ranks; kept for
reuse and counted by scratch_peak_bytes), and adds them in rank order, so the result does not
depend on arrival order. Other backends get reduce_scatter_tensor and all_gather_into_tensor;
where a backend has no reduce-scatter, the reduction is an all-reduce of the input and a copy of
this rank's chunk.

all_to_all (equal chunks; the quantized reduce-scatter's exchange, collectives/quantized.py) is
point-to-point messages on gloo too, all_to_all_single elsewhere.

Every call returns a Work named after the operation ("reduce-scatter of 4096 float32 elements");
callers that know the bucket or unit rename it. A collective that fails (a peer died, or the
group's timeout passed: `timeout_s`, what the user gave init_process_group or new_group) raises a
CollectiveError naming it, at the call or at wait().

Every collective is counted in `stats` (stats.py: calls and bytes per kind under the ring
model, which the point-to-point forms move exactly), once it has been issued.
"""

from __future__ import annotations

from typing import List, Optional

import torch
import torch.distributed as dist

from zero_py.collectives import shm
from zero_py.collectives.arguments import check_all_to_all, overlaps
from zero_py.collectives.pool import BufferPool
from zero_py.collectives.shm import HostAllGather
from zero_py.collectives.stats import CommStats
from zero_py.collectives.timeout import group_timeout, group_timeout_s
from zero_py.collectives.work import AllOf, Work, issue

# torch 2.13 renamed the flat-tensor collectives (*_single) and deprecated the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

# tags of zero_py's point-to-point messages on gloo: far from small user tags (gloo keeps
# collectives on slots of their own)
_P2P_TAG_ALL_GATHER = 0x5A500000
_P2P_TAG_REDUCE_SCATTER = 0x5A510000
_P2P_TAG_ALL_TO_ALL = 0x5A520000


class TorchDistExecutor:
    """The collectives of one process group through torch.distributed. `device`: where its
    tensors live (default: the CPU for gloo, the current CUDA device otherwise).
    shared_memory: all-gathers of CPU tensors on a gloo group whose ranks share this host go
    through shared memory (collectives/shm.py; ZP_SHM=0 turns it off).
    label: the group's name in the byte counts (`stats`, ZeroOptimizer.comm_stats())."""

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None,
                 device: Optional[torch.device] = None, shared_memory: bool = False,
                 label: str = "shard"):
        self.stats = CommStats(label)
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "zero_py needs torch.distributed: call torch.distributed.init_process_group() "
                "(e.g. under torchrun) before building the optimizer"
            )
        self.group = process_group if process_group is not None else dist.group.WORLD
        self.world_size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        backend = str(dist.get_backend(self.group)).lower()
        if device is None:
            device = torch.device("cpu") if "gloo" in backend or not torch.cuda.is_available() \
                else torch.device("cuda", torch.cuda.current_device())
        self.device = torch.device(device)
        self._p2p = backend == "gloo"  # the point-to-point forms (above)
        self._native_reduce_scatter = True
        self._peers = [self.global_rank(r) for r in range(self.world_size)]
        self._scratch: Optional[BufferPool] = None  # the reduce-scatter's receive buffers
        # all-gathers of CPU tensors through /dev/shm when every rank is on this host
        # (collectives/shm.py; stage 3's gather channel asks for it)
        self.shared_memory = bool(shared_memory)
        self._shm = None  # HostAllGather, False where it cannot run, None before deciding
        self.timeout_s = group_timeout_s(self.group)  # the user's, for the shared-memory waits

    @property
    def reduce_scatter_keeps_input(self) -> bool:
        """Whether reduce_scatter leaves its input as it was (all but the all-reduce fallback)."""
        return self._p2p or self._native_reduce_scatter or self.world_size == 1

    @property
    def scratch_peak_bytes(self) -> int:
        """The most bytes of reduce-scatter receive buffers alive at once."""
        return self._scratch.peak_bytes if self._scratch is not None else 0

    @property
    def shared_bytes(self) -> int:
        """This rank's share of the shared-memory all-gather's file (0 when not used)."""
        return self._shm.scratch_bytes if self._shm else 0

    def _host_all_gather(self) -> Optional[HostAllGather]:
        """The shared-memory all-gather when every rank of the group is on this host (decided
        at the first all-gather, which every rank makes), else None."""
        if self._shm is None:
            usable = self.shared_memory and shm.enabled() and shm.same_host(self.group)
            self._shm = HostAllGather(self) if usable else False
        return self._shm or None

    def global_rank(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank)

    def _check_group(self) -> None:
        """Refuses a collective on a group destroy_process_group() destroyed (an optimizer
        kept across a new init_process_group), which torch refused with "Group ... is not
        registered" (and the shared-memory all-gather did not refuse at all)."""
        live = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_map", None)
        if live is not None and self.group not in live:
            raise ValueError(  # as torch's, and not taken for a failed collective
                "zero_py: this optimizer's process group was destroyed "
                "(torch.distributed.destroy_process_group()); an optimizer cannot move to a "
                "new one: after init_process_group, build a new optimizer (for stage 3, over "
                "a new model: load the weights saved before into it)")

    @staticmethod
    def _size(t: torch.Tensor) -> str:
        return f"{t.numel()} {str(t.dtype).replace('torch.', '')} elements"

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> Work:
        """output = this rank's chunk of the sum of `input` over ranks. `input` is scratch:
        its contents are undefined afterwards (the all-reduce fallback sums into it)."""
        self._check_group()
        work = issue(f"reduce-scatter of {self._size(input)}", self._reduce_scatter, output,
                     input)
        self._count("reduce_scatter", input)
        return work

    def _count(self, kind: str, full: torch.Tensor, root: Optional[int] = None) -> None:
        self.stats.record(kind, full.numel() * full.element_size(), self.world_size, self.rank,
                          root)

    def _reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> Work:
        work = self._direct(self._p2p_reduce_scatter, output, input)
        if work is not None:
            return work
        if self._native_reduce_scatter:
            try:
                return Work(_reduce_scatter_flat(output, input, group=self.group,
                                                    async_op=True))
            except (RuntimeError, NotImplementedError) as exc:
                if "support" not in str(exc).lower():
                    raise
                self._native_reduce_scatter = False
        n = output.numel()
        lo = self.rank * n
        work = dist.all_reduce(input, group=self.group, async_op=True)
        return Work(work, lambda: output.copy_(input[lo:lo + n]))

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> Work:
        """output = the concatenation of every rank's `input` (input may alias its chunk)."""
        self._check_group()
        work = issue(f"all-gather of {self._size(output)}", self._all_gather, output, input)
        self._count("all_gather", output)
        return work

    def _all_gather(self, output: torch.Tensor, input: torch.Tensor) -> Work:
        if self._p2p and self.world_size > 1 and output.device.type == "cpu":
            shm = self._host_all_gather()
            work = shm.all_gather(output, input) if shm is not None else None
            if work is not None:
                return work
        work = self._direct(self._p2p_all_gather, output, input)
        if work is not None:
            return work
        return Work(_all_gather_flat(output, input, group=self.group, async_op=True))

    def _direct(self, p2p_form, output: torch.Tensor, input: torch.Tensor) -> Optional[Work]:
        """The all-gather or reduce-scatter without the group's collective: a copy at world
        size 1, the point-to-point form on gloo (through host copies for device tensors);
        None where the group's own collective runs."""
        if self.world_size == 1:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return Work(None)
        if not self._p2p:
            return None
        if output.device.type != "cpu":
            return self._through_host(p2p_form, output, input)
        return p2p_form(output, input)

    # -- point-to-point forms (gloo) -------------------------------------------------------------

    @staticmethod
    def _through_host(form, output: torch.Tensor, input: torch.Tensor) -> Work:
        """A point-to-point form on device tensors (e.g. several ranks sharing a GPU through
        gloo): gloo's send and receive move host memory only, so the input is copied to the
        host, the messages run there, and the result is copied back at wait()."""
        host_out = torch.empty(output.shape, dtype=output.dtype)
        work = form(host_out, input.cpu())
        return Work(work, lambda: output.copy_(host_out))

    def _exchange(self, sends, recvs, tag: int) -> list:
        """Every peer's message in flight: sends[k] goes to group rank k, recvs[k] is filled
        from group rank k (this rank's entries are skipped). Peers are visited from the next
        rank on, so no two ranks start with the same peer."""
        works = []
        n, me = self.world_size, self.rank
        for step in range(1, n):
            dst, src = (me + step) % n, (me - step) % n
            works.append(dist.isend(sends[dst], self._peers[dst], group=self.group, tag=tag))
            works.append(dist.irecv(recvs[src], self._peers[src], group=self.group, tag=tag))
        return works

    def _p2p_all_gather(self, output: torch.Tensor, input: torch.Tensor) -> Work:
        chunks = output.chunk(self.world_size)
        mine = chunks[self.rank]
        if mine.data_ptr() != input.data_ptr():
            mine.copy_(input)
        sends = [input] * self.world_size
        return Work(AllOf(self._exchange(sends, chunks, _P2P_TAG_ALL_GATHER), group_timeout(
            self.group)))

    def _p2p_reduce_scatter(self, output: torch.Tensor, input: torch.Tensor) -> Work:
        n, me = self.world_size, self.rank
        numel = output.numel()
        mine = input[me * numel:(me + 1) * numel]
        # the first peer in rank order is received straight into output (unless output is
        # this rank's chunk of input), the others into scratch: none at 2 ranks
        first = 1 if me == 0 else 0
        direct = not overlaps(output, input)
        others = [r for r in range(n) if r != me and not (direct and r == first)]
        scratch = None
        if others:
            if self._scratch is None:
                self._scratch = BufferPool(input.device)
            scratch = self._scratch.take(len(others) * numel, input.dtype)
        recvs: List[Optional[torch.Tensor]] = [None] * n
        for k, r in enumerate(others):
            recvs[r] = scratch[k * numel:(k + 1) * numel]
        if direct:
            recvs[first] = output
        works = self._exchange(list(input.chunk(n)), recvs, _P2P_TAG_REDUCE_SCATTER)

        def finish() -> None:
            # the sum in rank order, whatever order the messages arrived in (a + b == b + a
            # exactly, so starting from output = the first peer's part changes nothing)
            own = mine if direct else mine.clone()  # output may be mine: keep a copy
            parts = recvs[:me] + [own] + recvs[me + 1:]
            if direct:
                output.add_(parts[1] if first == 0 else parts[0])
            else:
                torch.add(parts[0], parts[1], out=output)
            for part in parts[2:]:
                output.add_(part)
            if scratch is not None:
                self._scratch.give(scratch)
        return Work(AllOf(works, group_timeout(self.group)), finish)

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> Work:
        """Chunk r of `input` goes to rank r; chunk r of `output` comes from rank r (equal
        chunks; the quantized reduce-scatter's one hop). Point-to-point messages on gloo,
        all_to_all_single elsewhere."""
        check_all_to_all(output, input, self.world_size)
        self._check_group()
        work = issue(f"all-to-all of {self._size(input)}", self._all_to_all, output, input)
        self._count("all_to_all", input)
        return work

    def _all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> Work:
        if self.world_size == 1 or self._p2p:
            form = self._p2p_all_to_all
            if self.world_size > 1 and output.device.type != "cpu":
                return self._through_host(form, output, input)
            return form(output, input)
        return Work(dist.all_to_all_single(output, input, group=self.group, async_op=True))

    def _p2p_all_to_all(self, output: torch.Tensor, input: torch.Tensor) -> Work:
        sends, recvs = input.chunk(self.world_size), output.chunk(self.world_size)
        recvs[self.rank].copy_(sends[self.rank])
        if self.world_size == 1:
            return Work(None)
        return Work(AllOf(self._exchange(list(sends), list(recvs), _P2P_TAG_ALL_TO_ALL),
                          group_timeout(self.group)))

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> Work:
        self._check_group()
        work = Work(None) if self.world_size == 1 else issue(
            f"all-reduce of {self._size(tensor)}", dist.all_reduce, tensor, op, self.group, True)
        self._count("all_reduce", tensor)
        return work

    def all_reduce_max(self, tensor: torch.Tensor) -> Work:
        return self.all_reduce(tensor, dist.ReduceOp.MAX)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> Work:
        if not 0 <= src < self.world_size:
            raise ValueError(f"broadcast: src {src} is not a rank of this group of "
                             f"{self.world_size}")
        self._check_group()
        work = Work(None) if self.world_size == 1 else issue(
            f"broadcast of {self._size(tensor)} from rank {src}", dist.broadcast, tensor,
            self.global_rank(src), self.group, True)
        self._count("broadcast", tensor, src)
        return work
