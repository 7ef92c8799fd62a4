"""Asynchronous saves (save_checkpoint(..., async_save=True)): the AsyncSave handle, the save
in flight per optimizer (wait_pending), the gloo groups they finish on while training keeps
the optimizer's own group busy (async_executors) and the host copy of what they write
(host_copy)."""

from __future__ import annotations

import threading
import weakref
from typing import Any, Dict, List, Tuple

import torch
import torch.distributed as dist

from zero_py.checkpoint.offloaded import Span
from zero_py.checkpoint.reader import CheckpointError
from zero_py.collectives.timeout import group_timeout


def host_copy(tensors: List[Tuple[str, Any]]) -> List[Tuple[str, torch.Tensor]]:
    """An asynchronous save's copy of what it writes, taken before the call returns: tensors
    copied to host memory, Spans read from the NVMe offload file (the next step overwrites the
    records they come from)."""
    return [(name, t.materialize() if isinstance(t, Span) else t.detach().to("cpu", copy=True))
            for name, t in tensors]


class AsyncSave:
    """A save_checkpoint(..., async_save=True) in flight: the rank's file is written, and the
    checkpoint published, on a thread while training goes on. wait() returns the path, or
    raises the save's CheckpointError (on every rank). The next save_checkpoint or
    load_checkpoint with the same optimizer waits for it first; call wait() before
    torch.distributed.destroy_process_group()."""

    def __init__(self, path: str, thread: threading.Thread, outcome: Dict[str, Any]):
        self.path = path
        self._thread = thread
        self._outcome = outcome

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> str:
        self._thread.join()
        if self._outcome.get("error") is not None:
            raise CheckpointError(self._outcome["error"])
        return self.path


# per optimizer: the gloo group asynchronous saves finish on (training keeps the optimizer's
# own group busy meanwhile) and the save in flight
_async_groups: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
in_flight: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def wait_pending(opt) -> None:
    """Waits for opt's asynchronous save in flight, if any (its error is raised by its own
    wait(), not here: a later call must not fail for an earlier save)."""
    pending = in_flight.pop(opt, None)
    if pending is not None:
        pending._thread.join()


def async_executors(opt):
    """The gloo groups an asynchronous save of `opt` finishes on, made at its first one with
    the timeout of the optimizer's group (a peer that dies mid-save is noticed as soon as in
    training): (over the ranks of this rank's shard group, whose writing replica writes; over
    every rank of a hybrid run, or None without hybrid sharding). Every rank makes both, even
    where it does not write: torch names a group made with use_local_synchronization by its
    ranks and the number of groups the process has, so all ranks must keep making as many
    groups for later ones (the next optimizer's) to match."""
    pair = _async_groups.get(opt)
    if pair is None:
        from zero_py.collectives.torch_dist import TorchDistExecutor

        ex = opt.executor
        timeout = group_timeout(getattr(ex, "group", None))

        def executor(ranks):
            group = dist.new_group(ranks, backend="gloo", use_local_synchronization=True,
                                   timeout=timeout)
            return TorchDistExecutor(group, torch.device("cpu"))
        hybrid = getattr(ex, "world", None) is not None
        everyone = executor(list(range(dist.get_world_size()))) if hybrid else None
        shard = executor([ex.global_rank(r) for r in range(ex.world_size)])
        pair = _async_groups[opt] = (shard, everyone)
    return pair
