"""PeerMemory: each rank's tensors in a /dev/shm file that every rank of the host maps, so a
rank can read its peers' tensors without their taking part (a one-sided read).

Stage 3 keeps its shards here when every rank of the group runs on this host (gloo, CPU
tensors): a unit can then be gathered by one rank alone (a no_grad forward that only rank 0
runs, or a unit one rank reaches out of the common order), by copying every rank's piece out of
its file, with no collective.

Each file starts with a version (int64): the owner publishes 2 * updates when its tensors hold the
values of `updates` completed updates and 2 * updates + 1 while it makes one (release order, the
C core's zp_flag_publish); a reader waits, with acquire loads (zp_flags_wait_ge), until a peer's
version reaches its own even one, so it never copies a piece half-updated or from an earlier
update. An update is an optimizer step, or a write every rank makes outside one (stage 3:
load_state_dict, gathered(modifier_rank=...), load_checkpoint; ShardedParams.begin_write). A
peer can lag (it is still in its step or load) but never lead a reader that has made its own:
its next step needs this rank's part in the step's collectives. The files are unlinked once
every rank mapped them.
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Dict, List, Optional

import torch
import torch.distributed as dist

from zero_py._native import _C
from zero_py.collectives import shm

_HEADER = 64  # bytes before the tensors: the version, alone on its cache line
_CHECK_PEERS_S = 0.5


class PeerMemory:
    """Every rank's tensors of the sizes `numels` ({dtype: elements}, equal on every rank);
    tensors(rank) are rank's (this rank's writable, the peers' to read)."""

    def __init__(self, files: List[torch.Tensor], numels: Dict[torch.dtype, int], rank: int,
                 pids: List[int], timeout_s: float):
        self.rank = rank
        self.pids = pids
        self.timeout_s = timeout_s
        self._versions = [f[:8].view(torch.int64) for f in files]
        self._tensors: List[Dict[torch.dtype, torch.Tensor]] = []
        for f in files:
            at, views = _HEADER, {}
            for dtype, n in numels.items():
                nbytes = n * dtype.itemsize
                views[dtype] = f[at:at + nbytes].view(dtype)
                at += -(-nbytes // _HEADER) * _HEADER
            self._tensors.append(views)

    @staticmethod
    def create(executor, numels: Dict[torch.dtype, int]) -> Optional["PeerMemory"]:
        """Collective over executor's group. None on every rank alike where it cannot work:
        not a gloo group of CPU tensors whose ranks share this host, ZP_SHM=0, or no room."""
        group = getattr(executor, "group", None)
        if (executor.world_size == 1 or not getattr(executor, "shared_memory", False)
                or executor.device.type != "cpu" or not shm.enabled()
                or "gloo" not in str(dist.get_backend(group)).lower()):
            return None
        if not shm.same_host(group):
            return None
        ws, me = executor.world_size, executor.rank
        nbytes = _HEADER + sum(-(-n * d.itemsize // _HEADER) * _HEADER for d, n in numels.items())
        name = uuid.uuid4().int >> 66
        path = f"/dev/shm/zero_py-peer-{name:x}-{os.getpid()}"
        ok = 1
        try:
            with open(path, "wb") as f:
                f.truncate(nbytes)  # zeros
                os.posix_fallocate(f.fileno(), 0, nbytes)  # no room: fail now, not SIGBUS later
        except OSError:
            ok = 0
            if os.path.exists(path):
                os.unlink(path)
        rows = torch.zeros(ws, 3, dtype=torch.int64)
        rows[me] = torch.tensor([name, os.getpid(), ok], dtype=torch.int64)
        dist.all_reduce(rows, group=group)  # every rank's file and whether it was made
        if not all(int(v) for v in rows[:, 2]):
            if ok:
                os.unlink(path)
            return None
        files = [torch.from_file(f"/dev/shm/zero_py-peer-{int(rows[q, 0]):x}-{int(rows[q, 1])}",
                                 shared=True, size=nbytes, dtype=torch.uint8) for q in range(ws)]
        dist.barrier(group=group)  # every rank mapped every file: the names can go
        os.unlink(path)
        return PeerMemory(files, numels, me, [int(p) for p in rows[:, 1]], executor.timeout_s)

    def tensors(self, rank: int) -> Dict[torch.dtype, torch.Tensor]:
        return self._tensors[rank]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._tensors[self.rank].values())

    # -- versions -----------------------------------------------------------------------------

    def publish_version(self, version: int) -> None:
        """This rank's tensors hold step version//2's values (even), or are being updated
        (odd)."""
        _C.flag_publish(self._versions[self.rank].data_ptr(), int(version))

    def version(self, rank: int) -> int:
        return int(self._versions[rank][0])

    def wait_for_peers(self, what: str) -> None:
        """Waits until every peer's tensors hold the values of this rank's (even) version: at
        most the group's timeout, no longer than it takes to see a late peer's exit."""
        mine = self.version(self.rank)
        deadline = time.monotonic() + self.timeout_s
        for q in range(len(self._versions)):
            if q == self.rank:
                continue
            addr = self._versions[q].data_ptr()
            while True:
                try:
                    _C.flags_wait(addr, 1, 1, mine, max(min(deadline - time.monotonic(),
                                                            _CHECK_PEERS_S), 1e-3))
                    break
                except RuntimeError:
                    if shm._process_gone(self.pids[q]):
                        raise RuntimeError(f"zero_py: {what}: rank {q} (pid {self.pids[q]}) "
                                           "exited") from None
                    if time.monotonic() >= deadline:
                        raise RuntimeError(
                            f"zero_py: {what}: rank {q}'s shards stayed at update "
                            f"{self.version(q) // 2} (this rank's are at update {mine // 2}: "
                            f"steps and loads) for {self.timeout_s:g} s, the process group's "
                            "timeout; it is stuck or dead, or did not make the same steps and "
                            "loads (load_state_dict goes on every rank)") from None
            if self.version(q) != mine:
                raise RuntimeError(
                    f"zero_py: {what}: rank {q}'s shards are at update {self.version(q) // 2}, "
                    f"ahead of this rank's update {mine // 2}: the ranks ran different numbers of "
                    "optimizer steps or loads (load_state_dict goes on every rank)")
