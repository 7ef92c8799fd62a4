"""CommStats: the bytes an executor's collectives move, counted per collective kind.

Every executor holds one (`executor.stats`, labelled after its group: "shard", "shard.gather"
for stage 3's gather channel, "replicate" for a hybrid-sharding replicate group) and records
each public collective when it is issued: one call, and the bytes this rank sends and receives
under the ring model below. The model is what a bandwidth-optimal (ring) algorithm moves per
rank, whatever the transport did: gloo's point-to-point all-gather, reduce-scatter and
all-to-all (torch_dist.py) send and receive exactly this; NCCL's rings (and its grouped sends
and receives for the all-to-all) do; the shared-memory all-gather copies the same bytes through
/dev/shm instead of a network. Counters only grow; a window (StepWindow:
ZeroOptimizer.comm_stats()) is the difference of two snapshots.

For a full buffer of B bytes over N ranks (the reduce-scatter's input, the all-gather's output,
the all-to-all's input, the all-reduced or broadcast tensor):

    reduce_scatter, all_gather   sent = received = B(N-1)/N
    all_to_all                   sent = received = B(N-1)/N  (a chunk to and from each peer)
    all_reduce                   sent = received = 2 B(N-1)/N  (a reduce-scatter, an all-gather)
    broadcast                    a ring from the root: every rank but the root receives B;
                                 every rank but the root's predecessor, (root - 1) mod N, sends B

B(N-1)/N is rounded down to whole bytes (exact for reduce-scatter, all-gather and all-to-all,
whose buffers split into N equal chunks; an all-reduce of 6 bytes over 4 ranks counts 2 x 4).
all_reduce_max counts as an all_reduce. At N = 1 a call moves 0 bytes and is still counted.

Control: the small bookkeeping messages (the ranks' pass and step counts, the mask of which
parameters got a gradient, the gradient statistics, stage 3's unit order, the ranks' agreement
digests) are issued inside `control()` and booked under the kind "control", whichever
collective carries them; every other kind is payload. The flag is the issuing thread's, not an
executor's, so a wrapper that hands a collective to another executor (a hybrid mesh's world
group) books it as control too. Only issue calls go inside the block: a wait there could start
other collectives (a wrapper's follow-ups), which would be booked as control.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Dict, Iterable, List, Optional

KINDS = ("reduce_scatter", "all_gather", "all_reduce", "broadcast", "all_to_all")
CONTROL = "control"
FIELDS = ("calls", "bytes_sent", "bytes_received")

# {label: {kind: {"calls": .., "bytes_sent": .., "bytes_received": ..}}}
Counts = Dict[str, Dict[str, Dict[str, int]]]

# control() depth, per thread: stage 3's hooks may run on autograd's device threads
_local = threading.local()


def ring_bytes(kind: str, nbytes: int, world_size: int, rank: int = 0,
               root: Optional[int] = None) -> tuple:
    """(bytes sent, bytes received) by group rank `rank` for one collective of `kind` over a
    full buffer of `nbytes` (the module docstring's rule)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if not (isinstance(nbytes, int) and nbytes >= 0):
        raise ValueError(f"nbytes must be an int >= 0, got {nbytes!r}")
    if not (isinstance(world_size, int) and world_size >= 1 and 0 <= rank < world_size):
        raise ValueError(f"rank {rank!r} is not a rank of a group of {world_size!r}")
    n = world_size
    if kind == "broadcast":
        if root is None or not 0 <= root < n:
            raise ValueError(f"broadcast: root {root!r} is not a rank of a group of {n}")
        if n == 1:
            return 0, 0
        sent = 0 if rank == (root - 1) % n else nbytes
        received = 0 if rank == root else nbytes
        return sent, received
    share = nbytes * (n - 1) // n
    if kind == "all_reduce":
        share *= 2
    return share, share


class CommStats:
    """Calls and bytes of one executor's collectives, per kind (see the module docstring).
    `label`: the group's name in ZeroOptimizer.comm_stats()."""

    def __init__(self, label: str = "shard"):
        if not (isinstance(label, str) and label):
            raise ValueError(f"label must be a non-empty str, got {label!r}")
        self.label = label
        self._counts: Dict[str, List[int]] = {}  # kind -> [calls, bytes sent, bytes received]

    def record(self, kind: str, nbytes: int, world_size: int, rank: int = 0,
               root: Optional[int] = None) -> None:
        """One collective of `kind` over a full buffer of `nbytes`, by group rank `rank`."""
        sent, received = ring_bytes(kind, nbytes, world_size, rank, root)
        if getattr(_local, "control", 0):
            kind = CONTROL
        c = self._counts.setdefault(kind, [0, 0, 0])
        c[0] += 1
        c[1] += sent
        c[2] += received

    def snapshot(self) -> Dict[str, Dict[str, int]]:
        """{kind: {"calls", "bytes_sent", "bytes_received"}}, totals since construction."""
        return {kind: dict(zip(FIELDS, c)) for kind, c in self._counts.items()}


@contextlib.contextmanager
def control():
    """Collectives this thread issues inside the block are booked as "control", by every
    executor."""
    _local.control = getattr(_local, "control", 0) + 1
    try:
        yield
    finally:
        _local.control -= 1


def totals(executors: Iterable) -> Counts:
    """Every executor's snapshot by label (each executor once; executors that share a label
    are added up; executor objects without stats are left out)."""
    out: Counts = {}
    seen = set()
    for ex in executors:
        stats = getattr(ex, "stats", None)
        if not isinstance(stats, CommStats) or id(stats) in seen:
            continue
        seen.add(id(stats))
        group = out.setdefault(stats.label, {})
        for kind, c in stats.snapshot().items():
            mine = group.setdefault(kind, dict.fromkeys(FIELDS, 0))
            for f in FIELDS:
                mine[f] += c[f]
    return out


def add(a: Counts, b: Counts) -> Counts:
    """a + b."""
    out: Counts = {label: {kind: dict(c) for kind, c in kinds.items()}
                   for label, kinds in a.items()}
    for label, kinds in b.items():
        for kind, c in kinds.items():
            mine = out.setdefault(label, {}).setdefault(kind, dict.fromkeys(FIELDS, 0))
            for f in FIELDS:
                mine[f] += c[f]
    return out


def difference(after: Counts, before: Counts) -> Counts:
    """after - before, leaving out the kinds (and labels) with no call in between."""
    out: Counts = {}
    for label, kinds in after.items():
        for kind, c in kinds.items():
            b = before.get(label, {}).get(kind, {})
            d = {f: c[f] - b.get(f, 0) for f in FIELDS}
            if d["calls"]:
                out.setdefault(label, {})[kind] = d
    return out


class StepWindow:
    """The counts between two marks of some executors: ZeroOptimizer's last step, from the
    end of one step() (or construction) to the end of the next. `executors()` lists them
    (called at each mark, so an executor added later, e.g. a replicate group's, is seen)."""

    def __init__(self, executors):
        self._executors = executors
        self._mark = totals(executors())
        self.last: Counts = {}
        self._outside = 0  # depth of outside() blocks

    @contextlib.contextmanager
    def outside(self):
        """What is issued inside the block (a checkpoint's, a state dict's collectives) belongs
        to no step: the window's start moves past it, as past construction's broadcasts. The
        outermost block counts it, once."""
        self._outside += 1
        before = totals(self._executors()) if self._outside == 1 else None
        try:
            yield
        finally:
            self._outside -= 1
            if before is not None:
                self._mark = add(self._mark, difference(totals(self._executors()), before))

    def mark(self) -> None:
        """Starts the window now (what came before belongs to no step)."""
        self._mark = totals(self._executors())

    def close(self) -> None:
        """Ends the window now: `last` becomes its counts, and the next window starts."""
        now = totals(self._executors())
        self.last = difference(now, self._mark)
        self._mark = now
