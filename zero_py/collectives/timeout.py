"""How long a collective of a process group may take: the timeout its user gave it.

torch.distributed keeps the timeout passed to init_process_group / new_group in each backend's
options; zero_py's own groups (the stage-3 gather channel), its shared-memory waits and its NCCL
communicators take theirs from the group they serve, so no wait outlives what the user asked
for. ZP_SHM_TIMEOUT_S still overrides the shared-memory waits.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist


def group_timeout(group: Optional[dist.ProcessGroup]) -> timedelta:
    """The timeout of `group` (None: the default group), as its backend holds it; torch's
    default for the backend where the backend does not say."""
    group = group if group is not None else dist.group.WORLD
    for device in ("cpu", "cuda"):
        try:
            backend = group._get_backend(torch.device(device))
        except (RuntimeError, AttributeError, ValueError):
            continue
        timeout = getattr(getattr(backend, "options", None), "_timeout", None)
        if isinstance(timeout, timedelta) and timeout.total_seconds() > 0:
            return timeout
    try:
        return dist.distributed_c10d._get_default_timeout(dist.get_backend(group))
    except (RuntimeError, AttributeError, ValueError):
        return dist.distributed_c10d.default_pg_timeout


def group_timeout_s(group: Optional[dist.ProcessGroup]) -> float:
    return group_timeout(group).total_seconds()
