"""The executor seam: who carries out the schedules' collectives, for every stage and device.

An executor has `world_size`, `rank`, `device`, `group`, `global_rank(r)` and asynchronous
collectives that return a Work (work.py): reduce_scatter(output, input),
all_gather(output, input), all_reduce(tensor, op), all_reduce_max(tensor),
broadcast(tensor, src), and `stats`, a CommStats counting their calls and bytes (stats.py).
Two exist:

    torch_dist.py  TorchDistExecutor: any torch.distributed ProcessGroup (gloo on the CPU, with
                   point-to-point forms of all-gather and reduce-scatter; NCCL; MPI)
    nccl.py        NcclExecutor: zero_py's own NCCL communicator (CUDA builds), collectives on
                   a dedicated stream ordered by events

hybrid.py      HybridExecutor: a 2-D mesh (shard groups x replicate groups) seen from the
                   shard group; make_hybrid_executor() builds and checks it

make_executor() picks one; channel() gives a second executor over the same ranks whose
collectives never interleave with the first's (stage 3 gathers on it); gather_object()
(objects.py) moves Python objects over either.
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch
import torch.distributed as dist

from zero_py.collectives.hybrid import HybridExecutor, make_hybrid_executor
from zero_py.collectives.local_group import new_local_group
from zero_py.collectives.nccl import NcclExecutor, unavailable_reason
from zero_py.collectives.objects import gather_object
from zero_py.collectives.pool import BufferPool
from zero_py.collectives.stats import CommStats
from zero_py.collectives.timeout import group_timeout, group_timeout_s
from zero_py.collectives.torch_dist import TorchDistExecutor
from zero_py.collectives.work import AllOf, CollectiveError, Work, issue, named

__all__ = ["AllOf", "BufferPool", "CollectiveError", "CommStats", "HybridExecutor",
           "NcclExecutor", "TorchDistExecutor", "Work", "channel", "gather_object",
           "group_timeout", "group_timeout_s", "issue", "make_executor", "make_hybrid_executor",
           "named"]

_REQUIRED = ("reduce_scatter", "all_gather", "all_reduce", "broadcast", "world_size", "rank")


def make_executor(process_group: Optional[dist.ProcessGroup], device: torch.device,
                  executor="auto", label: str = "shard"):
    """The executor for parameters on `device`: executor is "nccl", "torch", an executor object,
    or "auto": the NCCL executor for CUDA parameters in a group whose backend is NCCL (the
    usual torchrun set-up; it falls back to the torch.distributed executor, with a warning,
    where the NCCL executor cannot run), the torch.distributed executor otherwise (CPU
    parameters, or a gloo group over CUDA tensors, e.g. several ranks on one GPU). label: the
    group's name in the byte counts (stats.py; e.g. "replicate" for hybrid sharding's
    replicate group); an executor object keeps its own."""
    device = torch.device(device)
    if not isinstance(executor, str):
        for name in _REQUIRED:
            if not hasattr(executor, name):
                raise TypeError(f"executor must be 'auto', 'nccl', 'torch' or an executor "
                                f"object; {type(executor).__name__} has no {name}")
        return executor
    if executor not in ("auto", "nccl", "torch"):
        raise ValueError(f"executor must be 'auto', 'nccl', 'torch' or an executor object, got "
                         f"{executor!r}")
    on_cuda = device.type == "cuda"
    torch_device = device if on_cuda else None
    if executor == "auto":
        if not on_cuda or not dist.is_initialized() or "nccl" not in str(
                dist.get_backend(process_group)).lower():
            return TorchDistExecutor(process_group, torch_device, label=label)
        why = unavailable_reason()
        if why is not None:
            warnings.warn(f"zero_py: the native NCCL executor is unavailable ({why}); using "
                          "the torch.distributed executor", RuntimeWarning, stacklevel=3)
            return TorchDistExecutor(process_group, torch_device, label=label)
        return NcclExecutor(process_group, device, label=label)
    if executor == "torch":
        return TorchDistExecutor(process_group, torch_device, label=label)
    if not on_cuda:
        raise ValueError(f"executor='nccl' needs CUDA parameters; these are on {device}")
    return NcclExecutor(process_group, device, label=label)


def channel(executor):
    """A second executor over the same ranks whose collectives are ordered independently of
    `executor`'s: a communicator of its own (NCCL), or a process group of its own made by the
    group's members only (torch.distributed: works for subgroups too). At world size 1, or for
    an executor object of the caller's, the executor itself. Its byte counts are labelled
    `<executor's label>.gather` ("shard.gather")."""
    if isinstance(executor, HybridExecutor):  # gathers stay in the shard group
        return executor.with_shard(channel(executor.shard))
    if executor.world_size == 1:
        return executor
    if isinstance(executor, NcclExecutor):
        return NcclExecutor(executor.group, executor.device, executor.timeout,
                            label=executor.stats.label + ".gather")
    if isinstance(executor, TorchDistExecutor):
        group = _channel_group(executor)
        # stage 3 gathers on this channel: through shared memory where the ranks share a host
        return TorchDistExecutor(group, executor.device, shared_memory=True,
                                 label=executor.stats.label + ".gather")
    return executor


# (user's group, its timeout) -> the channel group made for it. torch.distributed keeps every
# group until destroy_process_group(), so a new group per stage-3 model leaked its sockets and
# gloo's threads (5 descriptors, 3 threads at 2 ranks) for each model a process built and
# dropped (a notebook, a hyperparameter search). Models over one group share its channel: its
# collectives are issued in program order on every rank, as the user's group's are.
_CHANNEL_GROUPS: list = []


def _channel_group(executor) -> dist.ProcessGroup:
    live = getattr(getattr(dist.distributed_c10d, "_world", None), "pg_map", None)
    if live is not None:  # destroy_process_group() dropped them: a new world needs new ones
        _CHANNEL_GROUPS[:] = [e for e in _CHANNEL_GROUPS if e[0] in live and e[2] in live]
    timeout = group_timeout(executor.group)
    for parent, parent_timeout, group in _CHANNEL_GROUPS:
        if parent is executor.group and parent_timeout == timeout:
            return group
    ranks = [executor.global_rank(r) for r in range(executor.world_size)]
    # the user's timeout, not new_group's default (30 min): a dead peer must not hold the
    # gathers longer than it holds the user's own collectives
    # named as its members agree (local_group.py): torch's own name, from this process's count
    # of groups, differed between ranks after a subgroup's channel and hung the rendezvous
    group = new_local_group(ranks, executor.group, dist.get_backend(executor.group), timeout)
    if live is not None:  # without the registry a stale group could not be told apart
        _CHANNEL_GROUPS.append((executor.group, timeout, group))
    return group
