"""Slow pure-PyTorch oracles of the fused optimizer kernels (csrc/kernels/cpu/optim.h).

`optim_step_reference` takes the arguments of `kernels.optim_step_flat` and performs the same
update one torch op at a time, in the kernel's order, which is torch.optim's single-tensor
order (for Adam/AdamW: v = addcmul(v*b2, g, g, 1-b2), denom = sqrt(v) / sqrt(bc2) + eps,
p = addcdiv(p, m, denom, -lr/bc1)). Where the kernel uses a fused
multiply-add, the oracle uses `add(x, alpha=a)` / `addcmul`, which torch's AVX2/AVX-512 CPU
kernels compute fused too; on a torch running its `default` (non-SIMD) kernels they round
twice, so the oracle then agrees to a few ulps instead of bitwise.

Square roots are taken in double and rounded to fp32, which is the correctly rounded fp32 sqrt
(as the kernel's SQRTPS): torch's own fp32 CPU sqrt (MKL) is one ulp off on ~0.7% of inputs,
which is why no IEEE kernel matches torch.optim's Adam/Adagrad bit for bit.

Stochastic rounding is reproduced bit for bit: the same counter-based hash of (seed, segment
index, element index) as convert.h, in int64 arithmetic.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from zero_py import kernels

_M32 = 0xFFFFFFFF
_M64 = 0xFFFFFFFFFFFFFFFF


def _mix64(x: int) -> int:
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & _M64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & _M64
    x ^= x >> 31
    return x


def sr_key(seed: int, stream: int, index_hi: int) -> int:
    """convert.h's zp_sr_key: 32 bits from (seed, stream = segment index, element index >> 32)."""
    k = _mix64((seed + 0x9E3779B97F4A7C15) & _M64)
    k = _mix64(k ^ ((stream * 0xD1B54A32D192ED03 + 1) & _M64))
    k = _mix64(k ^ ((index_hi * 0x8CB92BA72F3D8DD7 + 2) & _M64))
    return k >> 32


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2^32 for int64 tensors holding uint32 values, without int64 overflow."""
    lo = (x & 0xFFFF) * c
    hi = (((x >> 16) * c) & 0xFFFF) << 16
    return (lo + hi) & _M32


def sr_bits(key: int, index: torch.Tensor) -> torch.Tensor:
    """convert.h's zp_sr_bits on an int64 tensor of element indices (bits 0-31 used)."""
    x = (_mul32(index & _M32, 0x9E3779B1) + key) & _M32
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    x = x ^ (x >> 16)
    return x >> 16


def _u16_to(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int64 tensor of uint16 codes -> a tensor of `dtype` with those bits."""
    return torch.where(t >= 0x8000, t - 0x10000, t).to(torch.int16).view(dtype)


def round_bf16_stochastic(x: torch.Tensor, seed: int, segment_index: int = 0) -> torch.Tensor:
    """x (fp32) rounded to bf16 as the kernel does with STOCHASTIC_ROUNDING."""
    flat = x.reshape(-1)
    index = torch.arange(flat.numel(), dtype=torch.int64)
    bits = flat.view(torch.int32).to(torch.int64) & _M32
    noise = torch.empty_like(index)
    for hi in range(0, (flat.numel() - 1 >> 32) + 1 if flat.numel() else 0):
        part = slice(hi << 32, (hi + 1) << 32)
        noise[part] = sr_bits(sr_key(seed, segment_index, hi), index[part])
    out = ((bits + noise) >> 16) & 0xFFFF
    out = torch.where(torch.isnan(flat), torch.full_like(out, 0x7FC0), out)
    return _u16_to(out, torch.bfloat16).reshape(x.shape)


def _sqrt(t: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 sqrt (double has more than 2 * 24 + 2 bits: no double rounding)."""
    return t.double().sqrt().float()


def optim_step_reference(kind, master: torch.Tensor, grad: torch.Tensor,
                         state0: Optional[torch.Tensor] = None,
                         state1: Optional[torch.Tensor] = None,
                         state2: Optional[torch.Tensor] = None,
                         param_out: Optional[torch.Tensor] = None, *, step: int, lr: float,
                         beta1: Optional[float] = None, beta2: Optional[float] = None,
                         eps: Optional[float] = None, weight_decay: float = 0.0,
                         grad_scale: float = 1.0, maximize: bool = False, amsgrad: bool = False,
                         nesterov: bool = False, stochastic_rounding: bool = False, seed: int = 0,
                         segment_index: int = 0, n_threads: Optional[int] = None) -> None:
    """The oracle of kernels.optim_step_flat: same arguments, same in-place effects."""
    del n_threads
    k = kernels.opt_kind(kind)
    b1d, b2d, epsd = kernels.table.OPT_DEFAULTS[k]
    beta1 = b1d if beta1 is None else beta1
    beta2 = b2d if beta2 is None else beta2
    eps = epsd if eps is None else eps
    wd = weight_decay
    g = grad.float().mul(grad_scale)
    if maximize:
        g = g.neg()
    if k in (kernels.OPT_ADAMW, kernels.OPT_ADAM):
        if k == kernels.OPT_ADAM and wd != 0:
            g = g.add(master, alpha=wd)
        p = master.mul(1.0 - lr * wd) if k == kernels.OPT_ADAMW else master.clone()
        state0.lerp_(g, 1.0 - beta1)
        state1.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        vv = state1
        if amsgrad:
            torch.maximum(state2, state1, out=state2)
            vv = state2
        denom = _sqrt(vv).div(math.sqrt(1.0 - beta2 ** step)).add(eps)
        master.copy_(p.addcdiv(state0, denom, value=-(lr / (1.0 - beta1 ** step))))
    elif k == kernels.OPT_SGD:
        if wd != 0:
            g = g.add(master, alpha=wd)
        if beta1 != 0:
            if step == 1:
                state0.copy_(g)
            else:
                state0.mul_(beta1).add_(g, alpha=1.0 - beta2)
            g = g.add(state0, alpha=beta1) if nesterov else state0
        master.add_(g, alpha=-lr)
    elif k == kernels.OPT_ADAGRAD:
        if wd != 0:
            g = g.add(master, alpha=wd)
        clr = lr / (1.0 + (step - 1) * beta1)
        state0.addcmul_(g, g, value=1.0)
        master.addcdiv_(g, _sqrt(state0).add_(eps), value=-clr)
    else:  # Lion
        c = state0.mul(beta1).add_(g, alpha=1.0 - beta1)
        master.mul_(1.0 - lr * wd).add_(c.sign(), alpha=-lr)
        state0.mul_(beta2).add_(g, alpha=1.0 - beta2)
    if param_out is not None:
        if param_out.dtype == torch.bfloat16 and stochastic_rounding:
            param_out.copy_(round_bf16_stochastic(master, seed, segment_index))
        else:
            param_out.copy_(master.to(param_out.dtype))


def grad_stats_reference(grads: Sequence[torch.Tensor], norm_type: float = 2.0) -> tuple:
    """The oracle of kernels.grad_stats_flat: (sum of |g|^p or max |g|, any inf/nan), in
    float64. A NaN anywhere makes the first value NaN, as in the kernel."""
    flat = torch.cat([g.reshape(-1).double() for g in grads]) if grads else torch.zeros(0)
    a = flat.abs()
    nonfinite = bool((~torch.isfinite(flat)).any())
    if math.isinf(norm_type):
        value = float(a.max()) if a.numel() else 0.0
    else:
        value = float(a.pow(norm_type).sum())
    if bool(torch.isnan(flat).any()):
        value = math.nan
    return value, nonfinite


def adamw_reference(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                    exp_avg_sq: torch.Tensor, *, step: int, lr: float, beta1: float = 0.9,
                    beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 1e-2,
                    grad_scale: float = 1.0) -> None:
    """The slow pure-PyTorch oracle of kernels.adamw_step_flat: the same update, one op at a
    time."""
    g = grad * grad_scale
    param.mul_(1.0 - lr * weight_decay)
    exp_avg.lerp_(g, 1.0 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
    step_size = lr / (1.0 - beta1 ** step)
    denom = (exp_avg_sq.sqrt() / math.sqrt(1.0 - beta2 ** step)).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)
