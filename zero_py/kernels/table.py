"""The tables both kernel families read: segment rows, group rows, codes and their checks.

A fused optimizer step (csrc/kernels/optim_common.h: zp_opt_segment, zp_opt_group) is one call
over a table of segments: contiguous runs of (fp32 master, gradient, up to three fp32 states,
optional parameter output) that share a param group and a step count. The CPU family
(kernels/cpu.py) and the CUDA family (kernels/cuda.py) read the same rows, so this module is
the one place that builds and checks them; kernels/__init__.py dispatches a table to the family
of its device.
"""

from __future__ import annotations

from array import array
from typing import Optional, Sequence

import torch

# Kinds, dtypes and flags: the values of zp_opt_kind, zp_dtype and ZP_OPT_* in optim_common.h.
OPT_ADAMW, OPT_ADAM, OPT_SGD, OPT_ADAGRAD, OPT_LION = 0, 1, 2, 3, 4
OPT_KIND_NAMES = ("adamw", "adam", "sgd", "adagrad", "lion")
F32, BF16, F16 = 0, 1, 2
MAXIMIZE, AMSGRAD, NESTEROV, STOCHASTIC_ROUNDING = 1, 2, 4, 8
# Row layouts shared with the bindings (csrc/python/module.c, cuda_module.c).
OPT_SEGMENT_FIELDS = 10  # master, grad, state0, state1, state2, param_out (0 = none), numel,
#                          step, group, unused
OPT_GROUP_FIELDS = 11  # kind, grad_dtype, param_dtype, flags, lr, beta1, beta2, eps,
#                        weight_decay, grad_scale, seed
SEGMENT_NUMEL = 6  # index of numel in a segment row

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_DTYPE_CODES = {torch.float32: F32, torch.bfloat16: BF16, torch.float16: F16}
# Per kind: (beta1, beta2, eps) defaults, as torch.optim (SGD: momentum, dampening; Adagrad:
# lr_decay, unused) and Lion's paper.
OPT_DEFAULTS = {OPT_ADAMW: (0.9, 0.999, 1e-8), OPT_ADAM: (0.9, 0.999, 1e-8),
                OPT_SGD: (0.0, 0.0, 0.0), OPT_ADAGRAD: (0.0, 0.0, 1e-10),
                OPT_LION: (0.9, 0.99, 0.0)}

# What state0, state1, state2 hold for each kind (torch.optim's state keys).
STATE_NAMES = {OPT_ADAMW: ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
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


def opt_flags(maximize: bool = False, amsgrad: bool = False, nesterov: bool = False,
              stochastic_rounding: bool = False) -> int:
    return ((MAXIMIZE if maximize else 0) | (AMSGRAD if amsgrad else 0)
            | (NESTEROV if nesterov else 0) | (STOCHASTIC_ROUNDING if stochastic_rounding else 0))


def opt_group_row(kind: int, grad_dtype: int, param_dtype: int, flags: int, lr: float,
                  beta1: float, beta2: float, eps: float, weight_decay: float,
                  grad_scale: float = 1.0, seed: int = 0) -> list:
    """One row of the groups table (see OPT_GROUP_FIELDS); seed must be in [0, 2**53]."""
    return [float(kind), float(grad_dtype), float(param_dtype), float(flags), float(lr),
            float(beta1), float(beta2), float(eps), float(weight_decay), float(grad_scale),
            float(int(seed))]


def segment_row(numel: int, *, grad: int, master: int = 0, state0: int = 0, state1: int = 0,
                state2: int = 0, param_out: int = 0, step: int = 1, group: int = 0) -> tuple:
    """One row of a segment table (OPT_SEGMENT_FIELDS values): addresses (0 = none), the
    element count, the step count after the update and the row of its group. Gradient
    statistics read only `grad` and `numel`."""
    return (master, grad, state0, state1, state2, param_out, numel, step, group, 0)


def group_rows(groups: Sequence[list]) -> array:
    """The groups table as the bindings take it: OPT_GROUP_FIELDS doubles per row."""
    for k, row in enumerate(groups):
        if len(row) != OPT_GROUP_FIELDS:
            raise ValueError(f"group row {k} has {len(row)} fields, expected {OPT_GROUP_FIELDS}")
    return array("d", [float(v) for row in groups for v in row])


def check_tensor(name: str, t, device: Optional[torch.device], dtypes=None,
                 numel: Optional[int] = None) -> None:
    """A tensor a table may point at: contiguous, on `device` (None: any), of `dtypes`."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ((device is not None and t.device != device)
            or (dtypes is not None and t.dtype not in dtypes) or not t.is_contiguous()):
        want = "" if dtypes is None else " " + " or ".join(str(d).replace("torch.", "")
                                                            for d in dtypes)
        where = "" if device is None else (" CPU" if device.type == "cpu" else f" {device}")
        raise ValueError(f"{name} must be a contiguous{want}{where} tensor, got "
                         f"dtype={t.dtype}, device={t.device}, contiguous={t.is_contiguous()}")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{name} has {t.numel()} elements, expected {numel} (same as master)")


def flat_step_table(kind, master: torch.Tensor, grad: torch.Tensor,
                    state0: Optional[torch.Tensor] = None, state1: Optional[torch.Tensor] = None,
                    state2: Optional[torch.Tensor] = None,
                    param_out: Optional[torch.Tensor] = None, *, step: int, lr: float,
                    beta1: Optional[float] = None, beta2: Optional[float] = None,
                    eps: Optional[float] = None, weight_decay: float = 0.0,
                    grad_scale: float = 1.0, maximize: bool = False, amsgrad: bool = False,
                    nesterov: bool = False, stochastic_rounding: bool = False,
                    seed: int = 0) -> tuple:
    """(segment rows, group row) of one step over whole contiguous tensors on master's device,
    every argument checked (see kernels.optim_step_flat for their meaning)."""
    k = opt_kind(kind)
    n = master.numel() if isinstance(master, torch.Tensor) else -1
    check_tensor("master", master, master.device if isinstance(master, torch.Tensor) else None,
                 (torch.float32,))
    device = master.device
    check_tensor("grad", grad, device, FLOAT_DTYPES, n)
    b1d, b2d, epsd = OPT_DEFAULTS[k]
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
                             f"{name} ({STATE_NAMES[k][int(name[-1])]})")
    for name, t in given.items():
        if t is not None:
            check_tensor(name, t, device, (torch.float32,), n)
    if param_out is not None:
        check_tensor("param_out", param_out, device, FLOAT_DTYPES, n)
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"step must be an int >= 1 (the step count after this update), got "
                         f"{step!r}")
    if not 0 <= int(seed) <= 2 ** 53:
        raise ValueError(f"seed must be in [0, 2**53], got {seed}")
    ptr = [0 if t is None else t.data_ptr() for t in (state0, state1, state2, param_out)]
    rows = array("q", segment_row(n, master=master.data_ptr(), grad=grad.data_ptr(),
                                  state0=ptr[0], state1=ptr[1], state2=ptr[2], param_out=ptr[3],
                                  step=int(step)))
    param_dtype = F32 if param_out is None else dtype_code(param_out.dtype)
    flags = opt_flags(maximize, amsgrad, nesterov, stochastic_rounding)
    group = opt_group_row(k, dtype_code(grad.dtype), param_dtype, flags, lr, beta1, beta2, eps,
                          weight_decay, grad_scale, seed)
    return rows, group


def grad_rows(grads: Sequence[torch.Tensor], device: Optional[torch.device] = None) -> dict:
    """{dtype: segment table} over contiguous gradients (one table per dtype), checked."""
    out: dict = {}
    for i, g in enumerate(grads):
        check_tensor(f"grads[{i}]", g, device, FLOAT_DTYPES)
        out.setdefault(g.dtype, array("q")).extend(segment_row(g.numel(), grad=g.data_ptr()))
    return out
