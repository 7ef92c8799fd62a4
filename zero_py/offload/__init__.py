"""Offload: the optimizer's shard in host memory (ZeRO-Offload).

    copies.py  CopyQueue: device <-> host copies beside the caller (a CUDA stream, or a thread)
    host.py    HostShard: fp32 masters, the gradient copy and the staging of an offloaded
               optimizer, and its bucket-by-bucket step
    written.py WrittenParams: which fp32 parameters (stages 1-2) were written in place since
               their masters, copies under offload, last followed them
    nvme.py    NvmeStore: fp32 masters and states in a file under offload_dir, streamed
               through a ring of aligned buffers by the direct-I/O engine
    param_store.py  ParamStore: stage-3 parameter shards in a file under offload_dir
               (offload_params="nvme"), a record per bucket, read for gathers and updated
               bucket by bucket by the step, through a small ring

ZeroOptimizer(offload_optimizer="cpu") builds a HostShard; offload_optimizer="nvme" an
NvmeStore (through optim/streamed.py); see docs/offload.md.
"""

from __future__ import annotations

from typing import Optional

from zero_py.offload.copies import Copy, CopyQueue
from zero_py.offload.host import HostShard, host_threads
from zero_py.offload.nvme import NvmeStore, check_offload_dir
from zero_py.offload.param_store import ParamStore

OFFLOAD_OPTIMIZER = (None, "none", "cpu", "nvme")

__all__ = ["Copy", "CopyQueue", "HostShard", "NvmeStore", "OFFLOAD_OPTIMIZER", "ParamStore",
           "check_offload_dir", "check_offload_optimizer", "host_threads"]


def check_offload_optimizer(value, offload_dir=None) -> Optional[str]:
    """offload_optimizer= as None, "cpu" or "nvme"; a clear error for a bad value, or for
    "nvme" without a usable offload_dir (and for an offload_dir without "nvme")."""
    if value not in OFFLOAD_OPTIMIZER:
        raise ValueError(f"offload_optimizer must be None, 'none', 'cpu' (the fp32 masters and "
                         f"optimizer states in host memory, the step on the CPU) or 'nvme' "
                         f"(in files under offload_dir), got {value!r}")
    if value == "nvme":
        check_offload_dir(offload_dir)
    elif offload_dir is not None:
        raise ValueError("offload_dir applies to offload_optimizer='nvme' only; pass "
                         "offload_optimizer='nvme' with it, or drop it")
    return None if value == "none" else value
