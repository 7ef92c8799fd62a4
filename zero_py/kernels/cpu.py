"""The CPU kernel family of the C core (zero_py._C): fused optimizer steps and gradient
statistics over segment tables of host addresses (kernels/table.py builds and checks them).

One call, one thread team, updates a whole shard. Addresses come from tensors the caller
checked: contiguous, on the CPU, of the dtypes the kernels expect.
"""

from __future__ import annotations

from array import array
from typing import Optional, Sequence, Tuple

import torch

from zero_py._native import _C
from zero_py.kernels.table import group_rows


def cpu_isa() -> str:
    """The instruction set the C kernels dispatch to on this CPU: avx512, avx2 or scalar."""
    return _C.cpu_isa()


def cpu_tuning() -> dict:
    """What the next call of the C kernels will use: {"isa": avx512/avx2/scalar, "vendor":
    intel/amd/other, "prefetch_bytes": software prefetch distance per stream (0: none),
    "prefetch_into": l2/l1, "split": blocks/static, "stream_min_bytes": a write-only output
    (16-bit param_out) this large gets streaming stores, 0: never}. ZP_CPU_ISA,
    ZP_CPU_PREFETCH, ZP_CPU_SPLIT and ZP_CPU_STREAM override the defaults
    (csrc/kernels/cpu/tuning.h)."""
    return _C.cpu_tuning()


STREAM_ACCESS = {"read": 1, "write": 2, "update": 3}


def stream_bound(streams: Sequence[Tuple[torch.Tensor, str]],
                 n_threads: Optional[int] = None) -> None:
    """The optimizer family's physical bound: one pass over `streams`, (tensor, access) pairs
    with access "read", "update" (read and stored back unchanged) or "write" (zeroed), with no
    math and the kernels' threads, split, ISA and prefetch. All tensors are contiguous CPU
    tensors of 2- or 4-byte elements with the same numel."""
    rows = array("q")
    numel = None
    for t, access in streams:
        if access not in STREAM_ACCESS:
            raise ValueError(f"stream access {access!r}: choose read, update or write")
        if t.device.type != "cpu" or not t.is_contiguous() or t.element_size() not in (2, 4):
            raise ValueError("stream_bound: streams must be contiguous CPU tensors of 2- or "
                             "4-byte elements")
        if numel is not None and t.numel() != numel:
            raise ValueError(f"stream_bound: every stream needs {numel} elements, got "
                             f"{t.numel()}")
        numel = t.numel()
        rows.extend((t.data_ptr(), t.element_size(), STREAM_ACCESS[access]))
    if numel is None:
        raise ValueError("stream_bound: no streams")
    _C.stream_bound(rows, numel, 0 if n_threads is None else int(n_threads))


def copy_tensors(pairs: Sequence[Tuple[torch.Tensor, torch.Tensor]],
                 n_threads: Optional[int] = None) -> None:
    """dst.copy_(src) for every (dst, src) pair in one call on the kernels' threads: contiguous
    CPU tensors of one dtype and size per pair, no destination overlapping any source or
    other destination (checked in C; an error copies nothing)."""
    rows = array("q")
    for dst, src in pairs:
        if dst.device.type != "cpu" or src.device.type != "cpu" or not dst.is_contiguous() \
                or not src.is_contiguous():
            raise ValueError("copy_tensors: contiguous CPU tensors only")
        if dst.dtype != src.dtype or dst.numel() != src.numel():
            raise ValueError(f"copy_tensors: {src.dtype} x {src.numel()} into {dst.dtype} x "
                             f"{dst.numel()}: a pair needs one dtype and size")
        rows.extend((dst.data_ptr(), src.data_ptr(), dst.numel() * dst.element_size()))
    _C.copy_spans(rows, 0 if n_threads is None else int(n_threads))


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
