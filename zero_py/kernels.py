"""CPU optimizer kernels of the C core, and the pure-PyTorch reference they are tested against.

The C AdamW takes a table of segments (contiguous fp32 runs sharing a param group and a step
count) so one call, one thread team, updates a whole shard. Addresses are taken here from
tensors this module has checked: contiguous fp32 on the CPU.
"""

from __future__ import annotations

import math
from array import array
from typing import Optional, Sequence

import torch

from zero_py._native import _C

# Row layouts shared with csrc/python/module.c.
SEGMENT_FIELDS = 8  # param, grad, exp_avg, exp_avg_sq addresses, numel, step, group, unused
GROUP_FIELDS = 6  # lr, beta1, beta2, eps, weight_decay, grad_scale


def cpu_isa() -> str:
    """The instruction set the C kernels dispatch to on this CPU: avx512, avx2 or scalar."""
    return _C.cpu_isa()


def default_threads() -> int:
    """Threads the C kernels use: ZP_NUM_THREADS, else the CPUs this process may run on."""
    return _C.default_threads()


def _check_flat(name: str, t: torch.Tensor, numel: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu" or t.dtype != torch.float32 or not t.is_contiguous():
        raise ValueError(
            f"{name} must be a contiguous float32 CPU tensor, got dtype={t.dtype}, "
            f"device={t.device}, contiguous={t.is_contiguous()}"
        )
    if t.numel() != numel:
        raise ValueError(f"{name} has {t.numel()} elements, expected {numel} (same as param)")


def adamw_group_row(lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                    grad_scale: float = 1.0) -> list:
    return [float(lr), float(beta1), float(beta2), float(eps), float(weight_decay),
            float(grad_scale)]


def adamw_step_segments(segments: array, groups: Sequence[list], n_threads: Optional[int] = None
                        ) -> None:
    """Runs the C AdamW over a segment table built by the caller (see SEGMENT_FIELDS)."""
    flat_groups = array("d", [v for row in groups for v in row])
    _C.adamw_step(segments, flat_groups, 0 if n_threads is None else int(n_threads))


def adamw_step_flat(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                    exp_avg_sq: torch.Tensor, *, step: int, lr: float, beta1: float = 0.9,
                    beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 1e-2,
                    grad_scale: float = 1.0, n_threads: Optional[int] = None) -> None:
    """One AdamW step, in place, on whole contiguous fp32 CPU tensors (torch.optim.AdamW math).

    `step` is the step count after this update (1 on the first call)."""
    n = param.numel()
    for name, t in (("param", param), ("grad", grad), ("exp_avg", exp_avg),
                    ("exp_avg_sq", exp_avg_sq)):
        _check_flat(name, t, n)
    segments = array("q", [param.data_ptr(), grad.data_ptr(), exp_avg.data_ptr(),
                           exp_avg_sq.data_ptr(), n, int(step), 0, 0])
    adamw_step_segments(
        segments, [adamw_group_row(lr, beta1, beta2, eps, weight_decay, grad_scale)], n_threads)


def adamw_reference(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                    exp_avg_sq: torch.Tensor, *, step: int, lr: float, beta1: float = 0.9,
                    beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 1e-2,
                    grad_scale: float = 1.0) -> None:
    """The slow pure-PyTorch oracle of adamw_step_flat: the same update, one op at a time."""
    g = grad * grad_scale
    param.mul_(1.0 - lr * weight_decay)
    exp_avg.lerp_(g, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    step_size = lr / (1.0 - beta1 ** step)
    denom = (exp_avg_sq.sqrt() / math.sqrt(1.0 - beta2 ** step)).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)
