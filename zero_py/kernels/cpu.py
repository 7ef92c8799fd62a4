"""The CPU kernel family of the C core (zero_py._C): fused optimizer steps and gradient
statistics over segment tables of host addresses (kernels/table.py builds and checks them).

One call, one thread team, updates a whole shard. Addresses come from tensors the caller
checked: contiguous, on the CPU, of the dtypes the kernels expect.
"""

from __future__ import annotations

from array import array
from typing import Optional, Sequence

from zero_py._native import _C
from zero_py.kernels.table import group_rows


def cpu_isa() -> str:
    """The instruction set the C kernels dispatch to on this CPU: avx512, avx2 or scalar."""
    return _C.cpu_isa()


def default_threads() -> int:
    """Threads the C kernels use: ZP_NUM_THREADS, else the CPUs this process may run on."""
    return _C.default_threads()


def optim_step_segments(rows: array, groups: Sequence[list], n_threads: Optional[int] = None
                        ) -> None:
    """Runs the fused step over a segment table: `rows` is an array('q') of OPT_SEGMENT_FIELDS
    per segment, `groups` a list of OPT_GROUP_FIELDS-float rows."""
    _C.opt_step(rows, group_rows(groups), 0 if n_threads is None else int(n_threads))


def grad_stats_segments(rows: array, grad_dtype: int, norm_type: float,
                        n_threads: Optional[int] = None) -> tuple:
    """(sum of |g|^norm_type, or max |g| for inf; whether any element is inf/nan) over the grads
    of a segment table (only grad and numel of each row are read)."""
    return _C.grad_stats(rows, int(grad_dtype), float(norm_type),
                         0 if n_threads is None else int(n_threads))
