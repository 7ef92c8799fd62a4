"""new_local_group: a process group made by its members only (new_group's
use_local_synchronization=True), under a name every member computes alike.

torch names such a group from a count of this process's own groups: len(_world.pg_names) up
to torch 2.13 (hashed with the ranks), _world.group_count from 2.14. Those counts differ
between ranks as soon as one rank made a group the others did not: a stage-3 model over a
subgroup makes its gather channel on that subgroup's members only. Members whose counts
differed then rendezvoused under different names and waited for each other for ever (4 ranks:
a stage-3 model on ranks {2, 3} but not on {0, 1}, then a stage-3 model over the world: hung
in the world channel's new_group); from torch 2.14 the members' count also moves past the
others', so the user's next new_group (every rank) hung the same way.

Here the name comes from what the members agree on instead: the parent group's name (its
members rendezvoused under it), the timeout, and how many channels this process made for that
parent and timeout before (the members make them at the same calls: initialize is collective
over the parent). torch's own count is left alone.
"""

from __future__ import annotations

import datetime
from typing import Dict, List

import torch.distributed as dist

# "parent name/timeout" -> groups made for it in this process (also across
# destroy_process_group(): a new world's groups get names its stale store keys never had)
_MADE: Dict[str, int] = {}


def new_local_group(ranks: List[int], parent, backend, timeout: datetime.timedelta):
    """dist.new_group(ranks, backend, timeout, use_local_synchronization=True), named from
    `parent` (the group the caller's members agreed on) rather than from torch's count."""
    c10d = dist.distributed_c10d
    naming = getattr(c10d, "_process_group_name", None)
    name_of = getattr(c10d, "_get_process_group_name", None)
    if naming is None or name_of is None:  # another torch: its own naming
        return dist.new_group(ranks, backend=backend, timeout=timeout,
                              use_local_synchronization=True)
    key = f"{name_of(parent)}/{timeout.total_seconds():g}"
    made = _MADE.get(key, 0)
    _MADE[key] = made + 1
    name = f"zero_py.channel/{key}/{made}"

    def agreed_name(_ranks, use_hashed_name):
        return name

    c10d._process_group_name = agreed_name
    try:
        return dist.new_group(ranks, backend=backend, timeout=timeout,
                              use_local_synchronization=True)
    finally:
        c10d._process_group_name = naming
