"""Offload: the optimizer's shard in host memory (ZeRO-Offload).

    copies.py  CopyQueue: device <-> host copies beside the caller (a CUDA stream, or a thread)
    host.py    HostShard: fp32 masters, the gradient copy and the staging of an offloaded
               optimizer, and its bucket-by-bucket step

ZeroOptimizer(offload_optimizer="cpu") builds a HostShard; see docs/offload.md.
"""

from __future__ import annotations

from zero_py.offload.copies import Copy, CopyQueue
from zero_py.offload.host import HostShard, host_threads

OFFLOAD_OPTIMIZER = (None, "none", "cpu")

__all__ = ["Copy", "CopyQueue", "HostShard", "OFFLOAD_OPTIMIZER", "check_offload_optimizer",
           "host_threads"]


def check_offload_optimizer(value) -> bool:
    """Whether `value` (offload_optimizer=) asks for offload; a clear error for a bad value."""
    if value not in OFFLOAD_OPTIMIZER:
        raise ValueError(f"offload_optimizer must be None, 'none' or 'cpu' (the fp32 masters and "
                         f"optimizer states in host memory, the step on the CPU), got {value!r}")
    return value == "cpu"
