"""The kernel face: one fused optimizer step and one gradient-statistics pass over a segment
table, run by the family of the tensors' device.

    table.py  the rows both families read (segment_row, opt_group_row, flat_step_table)
    cpu.py    the CPU family (zero_py._C: SIMD + threads, synchronous)
    cuda.py   the CUDA family (zero_py._cuda: one launch on the current stream, asynchronous)

Callers build one table and call optim_step_segments / grad_stats here with the device; the
test oracles are in zero_py.testing.reference.
"""

from __future__ import annotations

import math
from array import array
from typing import Dict, Optional, Sequence

import torch

from zero_py.kernels import cpu
from zero_py.kernels.cpu import (copy_tensors, cpu_isa, cpu_tuning, default_threads,
                                 stream_bound)
from zero_py.kernels.table import (AMSGRAD, BF16, F16, F32, MAXIMIZE, NESTEROV,
                                   OPT_ADAGRAD, OPT_ADAM, OPT_ADAMW, OPT_GROUP_FIELDS,
                                   OPT_KIND_NAMES, OPT_LION, OPT_SEGMENT_FIELDS, OPT_SGD,
                                   STOCHASTIC_ROUNDING, check_tensor, dtype_code,
                                   flat_step_table, grad_rows, opt_flags, opt_group_row, opt_kind,
                                   segment_row)

__all__ = ["AMSGRAD", "BF16", "F16", "F32", "MAXIMIZE", "NESTEROV", "OPT_ADAGRAD", "OPT_ADAM",
           "OPT_ADAMW", "OPT_GROUP_FIELDS", "OPT_KIND_NAMES", "OPT_LION", "OPT_SEGMENT_FIELDS",
           "OPT_SGD", "STOCHASTIC_ROUNDING", "adamw_step_flat", "copy_tensors", "cpu_isa",
           "cpu_tuning",
           "default_threads", "dtype_code", "flat_step_table", "grad_stats", "grad_stats_flat",
           "grad_stats_segments", "opt_flags", "opt_group_row", "opt_kind", "optim_step_flat",
           "optim_step_segments", "segment_row", "stream_bound"]

grad_stats_segments = cpu.grad_stats_segments  # host tables; grad_stats() for any device


def _cuda():
    from zero_py.kernels import cuda  # imported on first use: CPU runs never load _cuda
    return cuda


def optim_step_segments(rows: array, groups: Sequence[list],
                        device: Optional[torch.device] = None, *, n_threads: Optional[int] = None,
                        scale: Optional[torch.Tensor] = None, stream=None) -> None:
    """The fused step over a segment table of addresses on `device` (default: the CPU).

    CPU: synchronous, `n_threads` threads (None: default_threads()). CUDA: one launch on
    `stream` (default: the device's current stream); `scale`, a 1-element fp32 device tensor,
    multiplies every group's grad_scale and skips the update when inf or NaN."""
    device = torch.device("cpu") if device is None else torch.device(device)
    if device.type == "cuda":
        _cuda().optim_step_segments(rows, groups, device, scale=scale, stream=stream)
        return
    if scale is not None or stream is not None:
        raise ValueError("scale and stream apply to CUDA tables only")
    cpu.optim_step_segments(rows, groups, n_threads)


def grad_stats(tables: Dict[torch.dtype, array], norm_type: float,
               device: Optional[torch.device] = None, *, n_threads: Optional[int] = None
               ) -> torch.Tensor:
    """Statistics of the gradients of `tables` ({grad dtype: segment table}) as 2 float64 on
    `device`: [sum of |g|^norm_type (max |g| for inf), 1.0 if any element is inf or NaN].
    On CUDA nothing waits for the device. Deterministic on both."""
    device = torch.device("cpu") if device is None else torch.device(device)
    if device.type == "cuda":
        out = torch.zeros(2, dtype=torch.float64, device=device)
        for k, (dtype, rows) in enumerate(tables.items()):
            _cuda().grad_stats_segments(rows, dtype_code(dtype), norm_type, out,
                                        accumulate=k > 0)
        return out
    total, nonfinite = 0.0, False
    for dtype, rows in tables.items():
        part, bad = cpu.grad_stats_segments(rows, dtype_code(dtype), norm_type,
                                            n_threads=n_threads)
        if math.isinf(norm_type):  # max() would drop a NaN part: it compares
            total = part if math.isnan(part) or part > total else total
        else:
            total += part
        nonfinite = nonfinite or bool(bad)
    return torch.tensor([total, float(nonfinite)], dtype=torch.float64)


def optim_step_flat(kind, master: torch.Tensor, grad: torch.Tensor,
                    state0: Optional[torch.Tensor] = None, state1: Optional[torch.Tensor] = None,
                    state2: Optional[torch.Tensor] = None,
                    param_out: Optional[torch.Tensor] = None, *, step: int, lr: float,
                    beta1: Optional[float] = None, beta2: Optional[float] = None,
                    eps: Optional[float] = None, weight_decay: float = 0.0,
                    grad_scale: float = 1.0, maximize: bool = False, amsgrad: bool = False,
                    nesterov: bool = False, stochastic_rounding: bool = False, seed: int = 0,
                    n_threads: Optional[int] = None,
                    scale: Optional[torch.Tensor] = None) -> None:
    """One fused optimizer step, in place, on whole contiguous tensors of one device (CPU or
    CUDA: the same math and bits).

    kind: OPT_ADAMW/"adamw", OPT_ADAM, OPT_SGD, OPT_ADAGRAD or OPT_LION. master and the states
    are fp32; grad is fp32, bf16 or fp16; param_out (optional) receives master rounded to its
    dtype (fp32, bf16, fp16). States: Adam*: exp_avg, exp_avg_sq[, max_exp_avg_sq with amsgrad];
    SGD with momentum: momentum_buffer (not read at step 1); Adagrad: sum (set it to
    initial_accumulator_value before step 1); Lion: exp_avg. beta1/beta2 mean momentum/dampening
    for SGD and lr_decay/- for Adagrad; None takes the kind's default. `step` is the step count
    after this update (1 on the first call). n_threads: CPU only; scale: CUDA only (see
    optim_step_segments)."""
    rows, group = flat_step_table(
        kind, master, grad, state0, state1, state2, param_out, step=step, lr=lr, beta1=beta1,
        beta2=beta2, eps=eps, weight_decay=weight_decay, grad_scale=grad_scale,
        maximize=maximize, amsgrad=amsgrad, nesterov=nesterov,
        stochastic_rounding=stochastic_rounding, seed=seed)
    optim_step_segments(rows, [group], master.device, n_threads=n_threads, scale=scale)


def adamw_step_flat(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                    exp_avg_sq: torch.Tensor, *, step: int, lr: float, beta1: float = 0.9,
                    beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 1e-2,
                    grad_scale: float = 1.0, n_threads: Optional[int] = None) -> None:
    """One AdamW step, in place, on whole contiguous fp32 CPU tensors (torch.optim.AdamW math):
    the fused family's AdamW with an fp32 parameter as its own master.

    `step` is the step count after this update (1 on the first call)."""
    for name, t in (("param", param), ("grad", grad)):
        check_tensor(name, t, torch.device("cpu"), (torch.float32,))
    optim_step_flat(OPT_ADAMW, param, grad, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=beta1,
                    beta2=beta2, eps=eps, weight_decay=weight_decay, grad_scale=grad_scale,
                    n_threads=n_threads)


def grad_stats_flat(grads: Sequence[torch.Tensor], norm_type: float = 2.0,
                    n_threads: Optional[int] = None) -> tuple:
    """(sum of |g|^norm_type over all elements, or max |g| when norm_type is inf; whether any
    element is inf or nan) for contiguous CPU gradients of one dtype. The norm is
    sum_pow ** (1 / norm_type) for finite norm_type. Accumulated in double; the result does
    not depend on the thread count."""
    grads = list(grads)
    if not grads:
        return 0.0, False
    for i, g in enumerate(grads):
        if isinstance(g, torch.Tensor) and g.dtype != grads[0].dtype:
            raise ValueError(f"grads[{i}] has dtype {g.dtype}, grads[0] {grads[0].dtype}: one "
                             "dtype per call")
    (dtype, rows), = grad_rows(grads, torch.device("cpu")).items()
    return cpu.grad_stats_segments(rows, dtype_code(dtype), norm_type, n_threads)
