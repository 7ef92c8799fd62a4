"""CPU optimizer kernels of the C core, and the pure-PyTorch AdamW reference.

The fused family (csrc/kernels/cpu/optim.h) takes a table of segments (contiguous runs sharing
a param group and a step count), so one call, one thread team, updates a whole shard.
Addresses are taken from tensors this module or its caller checked: contiguous, on the CPU,
of the dtypes the kernels expect. optim_reference.py holds the oracles of the other kinds.
"""

from __future__ import annotations

import math
from array import array
from typing import Optional, Sequence

import torch

from zero_py._native import _C

def cpu_isa() -> str:
    """The instruction set the C kernels dispatch to on this CPU: avx512, avx2 or scalar."""
    return _C.cpu_isa()


def default_threads() -> int:
    """Threads the C kernels use: ZP_NUM_THREADS, else the CPUs this process may run on."""
    return _C.default_threads()


def adamw_step_flat(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
                    exp_avg_sq: torch.Tensor, *, step: int, lr: float, beta1: float = 0.9,
                    beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 1e-2,
                    grad_scale: float = 1.0, n_threads: Optional[int] = None) -> None:
    """One AdamW step, in place, on whole contiguous fp32 CPU tensors (torch.optim.AdamW math):
    the fused family's AdamW with an fp32 parameter as its own master.

    `step` is the step count after this update (1 on the first call)."""
    for name, t in (("param", param), ("grad", grad)):
        if isinstance(t, torch.Tensor) and t.dtype != torch.float32:
            raise ValueError(f"{name} must be a contiguous float32 CPU tensor, got {t.dtype}")
    optim_step_flat(OPT_ADAMW, param, grad, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=beta1,
                    beta2=beta2, eps=eps, weight_decay=weight_decay, grad_scale=grad_scale,
                    n_threads=n_threads)


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


# ---- the fused optimizer family (csrc/kernels/cpu/optim.h) ----------------------------------

# Kinds, dtypes and flags: the values of zp_opt_kind, zp_dtype and ZP_OPT_* in optim.h.
OPT_ADAMW, OPT_ADAM, OPT_SGD, OPT_ADAGRAD, OPT_LION = 0, 1, 2, 3, 4
OPT_KIND_NAMES = ("adamw", "adam", "sgd", "adagrad", "lion")
F32, BF16, F16 = 0, 1, 2
MAXIMIZE, AMSGRAD, NESTEROV, STOCHASTIC_ROUNDING = 1, 2, 4, 8
# Row layouts shared with csrc/python/module.c (opt_step, grad_stats).
OPT_SEGMENT_FIELDS = 10  # master, grad, state0, state1, state2, param_out (0 = none), numel,
#                          step, group, unused
OPT_GROUP_FIELDS = 11  # kind, grad_dtype, param_dtype, flags, lr, beta1, beta2, eps,
#                        weight_decay, grad_scale, seed

_DTYPE_CODES = {torch.float32: F32, torch.bfloat16: BF16, torch.float16: F16}
# Per kind: (beta1, beta2, eps) defaults, as torch.optim (SGD: momentum, dampening; Adagrad:
# lr_decay, unused) and Lion's paper.
_OPT_DEFAULTS = {OPT_ADAMW: (0.9, 0.999, 1e-8), OPT_ADAM: (0.9, 0.999, 1e-8),
                 OPT_SGD: (0.0, 0.0, 0.0), OPT_ADAGRAD: (0.0, 0.0, 1e-10),
                 OPT_LION: (0.9, 0.99, 0.0)}

# What state0, state1, state2 hold for each kind (torch.optim's state keys).
_STATE_NAMES = {OPT_ADAMW: ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
                OPT_ADAM: ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
                OPT_SGD: ("momentum_buffer", "-", "-"), OPT_ADAGRAD: ("sum", "-", "-"),
                OPT_LION: ("exp_avg", "-", "-")}


def dtype_code(dtype: torch.dtype) -> int:
    """The kernels' code of a torch dtype: F32, BF16 or F16."""
    try:
        return _DTYPE_CODES[dtype]
    except KeyError:
        raise ValueError(f"the fused kernels handle float32, bfloat16 and float16, not {dtype}"
                         ) from None


def opt_kind(kind) -> int:
    """A kind given as OPT_* or as its name ("adamw", "adam", "sgd", "adagrad", "lion")."""
    if isinstance(kind, str) and kind.lower() in OPT_KIND_NAMES:
        return OPT_KIND_NAMES.index(kind.lower())
    if isinstance(kind, int) and not isinstance(kind, bool) and 0 <= kind < len(OPT_KIND_NAMES):
        return kind
    raise ValueError(f"unknown optimizer kind {kind!r}; use one of {OPT_KIND_NAMES} or OPT_*")


def opt_group_row(kind: int, grad_dtype: int, param_dtype: int, flags: int, lr: float,
                  beta1: float, beta2: float, eps: float, weight_decay: float,
                  grad_scale: float = 1.0, seed: int = 0) -> list:
    """One row of the groups table (see OPT_GROUP_FIELDS); seed must be in [0, 2**53]."""
    return [float(kind), float(grad_dtype), float(param_dtype), float(flags), float(lr),
            float(beta1), float(beta2), float(eps), float(weight_decay), float(grad_scale),
            float(int(seed))]


def optim_step_segments(rows: array, groups: Sequence[list], n_threads: Optional[int] = None
                        ) -> None:
    """Runs the fused step over a segment table built by the caller: `rows` is an array('q') of
    OPT_SEGMENT_FIELDS per segment, `groups` a list of OPT_GROUP_FIELDS-float rows."""
    for k, row in enumerate(groups):
        if len(row) != OPT_GROUP_FIELDS:
            raise ValueError(f"group row {k} has {len(row)} fields, expected {OPT_GROUP_FIELDS}")
    flat_groups = array("d", [float(v) for row in groups for v in row])
    _C.opt_step(rows, flat_groups, 0 if n_threads is None else int(n_threads))


def grad_stats_segments(rows: array, grad_dtype: int, norm_type: float,
                        n_threads: Optional[int] = None) -> tuple:
    """(sum of |g|^norm_type, or max |g| for inf; whether any element is inf/nan) over the grads
    of a segment table (only grad and numel of each row are read)."""
    return _C.grad_stats(rows, int(grad_dtype), float(norm_type),
                         0 if n_threads is None else int(n_threads))


def _check_opt_tensor(name: str, t, numel: int, dtypes: Sequence[torch.dtype]) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu" or t.dtype not in dtypes or not t.is_contiguous():
        want = " or ".join(str(d).replace("torch.", "") for d in dtypes)
        raise ValueError(f"{name} must be a contiguous {want} CPU tensor, got dtype={t.dtype}, "
                         f"device={t.device}, contiguous={t.is_contiguous()}")
    if t.numel() != numel:
        raise ValueError(f"{name} has {t.numel()} elements, expected {numel} (same as master)")


def opt_flags(maximize: bool = False, amsgrad: bool = False, nesterov: bool = False,
              stochastic_rounding: bool = False) -> int:
    return ((MAXIMIZE if maximize else 0) | (AMSGRAD if amsgrad else 0)
            | (NESTEROV if nesterov else 0) | (STOCHASTIC_ROUNDING if stochastic_rounding else 0))


def optim_step_flat(kind, master: torch.Tensor, grad: torch.Tensor,
                    state0: Optional[torch.Tensor] = None, state1: Optional[torch.Tensor] = None,
                    state2: Optional[torch.Tensor] = None,
                    param_out: Optional[torch.Tensor] = None, *, step: int, lr: float,
                    beta1: Optional[float] = None, beta2: Optional[float] = None,
                    eps: Optional[float] = None, weight_decay: float = 0.0,
                    grad_scale: float = 1.0, maximize: bool = False, amsgrad: bool = False,
                    nesterov: bool = False, stochastic_rounding: bool = False, seed: int = 0,
                    n_threads: Optional[int] = None) -> None:
    """One fused optimizer step, in place, on whole contiguous CPU tensors.

    kind: OPT_ADAMW/"adamw", OPT_ADAM, OPT_SGD, OPT_ADAGRAD or OPT_LION. master and the states
    are fp32; grad is fp32, bf16 or fp16; param_out (optional) receives master rounded to its
    dtype (fp32, bf16, fp16). States: Adam*: exp_avg, exp_avg_sq[, max_exp_avg_sq with amsgrad];
    SGD with momentum: momentum_buffer (not read at step 1); Adagrad: sum (set it to
    initial_accumulator_value before step 1); Lion: exp_avg. beta1/beta2 mean momentum/dampening
    for SGD and lr_decay/- for Adagrad; None takes the kind's default. `step` is the step count
    after this update (1 on the first call)."""
    k = opt_kind(kind)
    n = master.numel() if isinstance(master, torch.Tensor) else -1
    _check_opt_tensor("master", master, n, (torch.float32,))
    _check_opt_tensor("grad", grad, n, tuple(_DTYPE_CODES))
    b1d, b2d, epsd = _OPT_DEFAULTS[k]
    beta1 = b1d if beta1 is None else beta1
    beta2 = b2d if beta2 is None else beta2
    eps = epsd if eps is None else eps
    needed = {OPT_ADAMW: ("state0", "state1"), OPT_ADAM: ("state0", "state1"),
              OPT_SGD: ("state0",) if beta1 != 0 else (), OPT_ADAGRAD: ("state0",),
              OPT_LION: ("state0",)}[k]
    if amsgrad:
        needed += ("state2",)
    given = {"state0": state0, "state1": state1, "state2": state2}
    for name in needed:
        if given[name] is None:
            raise ValueError(f"{OPT_KIND_NAMES[k]}{' with amsgrad' if amsgrad else ''} needs "
                             f"{name} ({_STATE_NAMES[k][int(name[-1])]})")
    for name, t in given.items():
        if t is not None:
            _check_opt_tensor(name, t, n, (torch.float32,))
    if param_out is not None:
        _check_opt_tensor("param_out", param_out, n, tuple(_DTYPE_CODES))
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"step must be an int >= 1 (the step count after this update), got "
                         f"{step!r}")
    if not 0 <= int(seed) <= 2 ** 53:
        raise ValueError(f"seed must be in [0, 2**53], got {seed}")
    ptrs = [0 if t is None else t.data_ptr() for t in (state0, state1, state2, param_out)]
    rows = array("q", [master.data_ptr(), grad.data_ptr(), *ptrs, n, int(step), 0, 0])
    param_dtype = F32 if param_out is None else _DTYPE_CODES[param_out.dtype]
    flags = opt_flags(maximize, amsgrad, nesterov, stochastic_rounding)
    row = opt_group_row(k, _DTYPE_CODES[grad.dtype], param_dtype, flags, lr, beta1, beta2, eps,
                        weight_decay, grad_scale, seed)
    optim_step_segments(rows, [row], n_threads)


def grad_stats_flat(grads: Sequence[torch.Tensor], norm_type: float = 2.0,
                    n_threads: Optional[int] = None) -> tuple:
    """(sum of |g|^norm_type over all elements, or max |g| when norm_type is inf; whether any
    element is inf or nan) for contiguous CPU gradients of one dtype. The norm is
    sum_pow ** (1 / norm_type) for finite norm_type. Accumulated in double; the result does
    not depend on the thread count."""
    grads = list(grads)
    if not grads:
        return 0.0, False
    dtype = grads[0].dtype if isinstance(grads[0], torch.Tensor) else None
    rows = array("q")
    for i, g in enumerate(grads):
        if not isinstance(g, torch.Tensor):
            raise TypeError(f"grads[{i}] must be a torch.Tensor, got {type(g).__name__}")
        if g.dtype != dtype:
            raise ValueError(f"grads[{i}] has dtype {g.dtype}, grads[0] {dtype}: one dtype per "
                             "call")
        _check_opt_tensor(f"grads[{i}]", g, g.numel(), tuple(_DTYPE_CODES))
        rows.extend((0, g.data_ptr(), 0, 0, 0, 0, g.numel(), 1, 0, 0))
    return grad_stats_segments(rows, _DTYPE_CODES[dtype], norm_type, n_threads)
