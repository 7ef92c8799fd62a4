"""The CUDA kernels of the C core (zero_py._cuda), on device tensors: the fused optimizer
family, gradient statistics and segment copies (pack, unpack, cast).

Same tables as the CPU family (kernels.py): segment rows of addresses (array('q'), now of
device memory) and group rows. Every call enqueues on the current stream of the tensors'
device and returns at once; its table reaches the device through a workspace allocated here
from PyTorch's caching allocator on that stream (so it is not reused before the kernel ran).
The same tables run through the kernels' own code on host memory with the *_emulate
functions: the CPU test suite checks the device algorithms with them.

zero_py._cuda is a module of its own, built when nvcc was found, linked with the static CUDA
runtime; `import zero_py` never needs it. unavailable_reason() says why the CUDA path cannot run
here (module not built, torch without CUDA, no device), in words that say what to change.
"""

from __future__ import annotations

import functools
import struct
from array import array
from typing import Optional, Sequence

import torch

from zero_py import kernels

# Row layout of copy_segments: src, dst (0 src = zeros), numel, src_dtype, dst_dtype,
# scale (the float32's bits).
COPY_FIELDS = 6


@functools.lru_cache(maxsize=None)
def _import_native():
    try:
        from zero_py import _cuda
    except ImportError as exc:
        return None, (f"zero_py._cuda is not built or does not load ({exc}); rebuild with nvcc "
                      "on PATH (`make build`, or ZP_CUDA=1 pip install .) to get the CUDA path")
    return _cuda, None


def native_module():
    """zero_py._cuda, or None when it is not built (import-level check only)."""
    return _import_native()[0]


@functools.lru_cache(maxsize=None)
def unavailable_reason() -> Optional[str]:
    """None when the CUDA kernels can run here; else why not."""
    mod, why = _import_native()
    if mod is None:
        return why
    if not torch.cuda.is_available():
        build = torch.version.cuda
        return (f"torch {torch.__version__} sees no CUDA device" +
                ("" if build else " (a CPU-only build of torch)"))
    try:
        n = mod.device_count()
    except RuntimeError as exc:
        return f"zero_py._cuda cannot use the GPU: {exc}"
    if n < 1:
        return "zero_py._cuda sees no CUDA device"
    return None


def is_available() -> bool:
    return unavailable_reason() is None


def native():
    """zero_py._cuda, checked usable; RuntimeError with the reason otherwise."""
    why = unavailable_reason()
    if why is not None:
        raise RuntimeError(f"the CUDA path of zero_py is unavailable: {why}")
    return _import_native()[0]


def _emulator():
    mod = native_module()
    if mod is None:
        raise RuntimeError(_import_native()[1])
    return mod


def _stream_ptr(device: torch.device, stream) -> int:
    s = torch.cuda.current_stream(device) if stream is None else stream
    return s.cuda_stream


def _workspace(device: torch.device, nbytes: int) -> torch.Tensor:
    return torch.empty(max(int(nbytes), 16), dtype=torch.uint8, device=device)


def _device_of(device) -> torch.device:
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"the CUDA kernels run on cuda devices, not {device}")
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


# ---- table calls -------------------------------------------------------------------------------

def optim_step_segments(rows: array, groups: Sequence[list], device, *,
                        scale: Optional[torch.Tensor] = None, stream=None) -> None:
    """The fused step over a segment table of device addresses (kernels.optim_step_segments'
    rows). scale: an optional 1-element fp32 tensor on the device that multiplies every group's
    grad_scale; inf or NaN there skips the update (nothing is written)."""
    mod = native()
    device = _device_of(device)
    flat_groups = _group_rows(groups)
    scale_ptr = 0
    if scale is not None:
        if scale.device != device or scale.dtype != torch.float32 or scale.numel() != 1:
            raise ValueError(f"scale must be a 1-element float32 tensor on {device}, got "
                             f"{scale.dtype} with {scale.numel()} elements on {scale.device}")
        scale_ptr = scale.data_ptr()
    n_rows = len(rows) // kernels.OPT_SEGMENT_FIELDS
    with torch.cuda.device(device):
        ws = _workspace(device, mod.opt_workspace_bytes(n_rows))
        mod.opt_step(rows, flat_groups, scale_ptr, ws.data_ptr(), ws.numel(),
                     _stream_ptr(device, stream))


def grad_stats_segments(rows: array, grad_dtype: int, norm_type: float, out: torch.Tensor, *,
                        accumulate: bool = False, stream=None) -> None:
    """Statistics of the grads of a segment table into `out` (2 float64 on the device):
    out[0] = sum of |g|^norm_type (max |g| for inf; NaN if any NaN), out[1] = 1.0 if any
    element is inf or NaN. accumulate combines with what out holds. Deterministic."""
    mod = native()
    if out.dtype != torch.float64 or out.numel() != 2 or out.device.type != "cuda" \
            or not out.is_contiguous():
        raise ValueError(f"out must be 2 contiguous float64 values on a cuda device, got "
                         f"{out.dtype}, {out.numel()} elements on {out.device}")
    device = out.device
    n_rows = len(rows) // kernels.OPT_SEGMENT_FIELDS
    total = sum(rows[i * kernels.OPT_SEGMENT_FIELDS + 6] for i in range(n_rows))
    with torch.cuda.device(device):
        ws = _workspace(device, mod.grad_stats_workspace_bytes(n_rows, max(int(total), 0)))
        mod.grad_stats(rows, int(grad_dtype), float(norm_type), out.data_ptr(), bool(accumulate),
                       ws.data_ptr(), ws.numel(), _stream_ptr(device, stream))


def copy_segments(rows: array, device, *, stream=None) -> None:
    """One launch over a copy table (COPY_FIELDS per row, see copy_row)."""
    mod = native()
    device = _device_of(device)
    n_rows = len(rows) // COPY_FIELDS
    with torch.cuda.device(device):
        ws = _workspace(device, mod.copy_workspace_bytes(n_rows))
        mod.copy(rows, ws.data_ptr(), ws.numel(), _stream_ptr(device, stream))


def copy_row(src: Optional[int], dst: int, numel: int, src_dtype: int, dst_dtype: int,
             scale: float = 1.0) -> tuple:
    """One row of a copy table: addresses (src None or 0 = zeros), dtype codes, fp32 scale."""
    bits = struct.unpack("<I", struct.pack("<f", float(scale)))[0]
    return (int(src or 0), int(dst), int(numel), int(src_dtype), int(dst_dtype), bits)


def _group_rows(groups: Sequence[list]) -> array:
    for k, row in enumerate(groups):
        if len(row) != kernels.OPT_GROUP_FIELDS:
            raise ValueError(f"group row {k} has {len(row)} fields, expected "
                             f"{kernels.OPT_GROUP_FIELDS}")
    return array("d", [float(v) for row in groups for v in row])


# ---- the kernels' code on host memory (tests) ----------------------------------------------------

def optim_step_emulate(rows: array, groups: Sequence[list], scale: Optional[float] = None) -> None:
    """optim_step_segments' kernel, run block by block on the host over CPU addresses."""
    _emulator().opt_step_emulate(rows, _group_rows(groups), scale)


def grad_stats_emulate(rows: array, grad_dtype: int, norm_type: float,
                       before: Optional[tuple] = None) -> tuple:
    """grad_stats_segments' two kernels on the host: (sum_pow, flag), accumulated into `before`
    when given."""
    return _emulator().grad_stats_emulate(rows, int(grad_dtype), float(norm_type), before)


def copy_emulate(rows: array) -> None:
    _emulator().copy_emulate(rows)


# ---- tensor-level helpers ------------------------------------------------------------------------

def _check(name: str, t, device: Optional[torch.device], dtypes=None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device}")
    if dtypes is not None and t.dtype not in dtypes:
        raise ValueError(f"{name} has dtype {t.dtype}; the kernels take float32, bfloat16, "
                         "float16")


_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def pack(tensors: Sequence[torch.Tensor], bucket: torch.Tensor, offsets: Sequence[int],
         scale: float = 1.0, gaps: Sequence[tuple] = ()) -> None:
    """bucket[offsets[i]:offsets[i] + numel] = tensors[i] * scale, cast to bucket's dtype, and
    zeros over `gaps` ((lo, hi) element ranges): one launch on the current stream."""
    _check("bucket", bucket, None, _FLOATS)
    rows = array("q")
    dcode, esize = kernels.dtype_code(bucket.dtype), bucket.element_size()
    for i, (t, off) in enumerate(zip(tensors, offsets)):
        _check(f"tensors[{i}]", t, bucket.device, _FLOATS)
        if off < 0 or off + t.numel() > bucket.numel():
            raise IndexError(f"tensors[{i}] ({t.numel()} elements at {off}) does not fit the "
                             f"bucket of {bucket.numel()}")
        rows.extend(copy_row(t.data_ptr(), bucket.data_ptr() + off * esize, t.numel(),
                             kernels.dtype_code(t.dtype), dcode, scale))
    for lo, hi in gaps:
        if not 0 <= lo <= hi <= bucket.numel():
            raise IndexError(f"gap ({lo}, {hi}) is outside the bucket of {bucket.numel()}")
        rows.extend(copy_row(None, bucket.data_ptr() + lo * esize, hi - lo, dcode, dcode))
    copy_segments(rows, bucket.device)


def unpack(bucket: torch.Tensor, tensors: Sequence[torch.Tensor], offsets: Sequence[int],
           scale: float = 1.0) -> None:
    """tensors[i] = bucket[offsets[i]:offsets[i] + numel] * scale, cast to each tensor's dtype:
    one launch on the current stream."""
    _check("bucket", bucket, None, _FLOATS)
    rows = array("q")
    scode, esize = kernels.dtype_code(bucket.dtype), bucket.element_size()
    for i, (t, off) in enumerate(zip(tensors, offsets)):
        _check(f"tensors[{i}]", t, bucket.device, _FLOATS)
        if off < 0 or off + t.numel() > bucket.numel():
            raise IndexError(f"tensors[{i}] ({t.numel()} elements at {off}) does not fit the "
                             f"bucket of {bucket.numel()}")
        rows.extend(copy_row(bucket.data_ptr() + off * esize, t.data_ptr(), t.numel(), scode,
                             kernels.dtype_code(t.dtype), scale))
    copy_segments(rows, bucket.device)


def cast(src: torch.Tensor, dst: torch.Tensor, scale: float = 1.0) -> None:
    """dst = src * scale in dst's dtype (round to nearest even), one launch."""
    _check("src", src, None, _FLOATS)
    _check("dst", dst, src.device, _FLOATS)
    if src.numel() != dst.numel():
        raise ValueError(f"src has {src.numel()} elements, dst {dst.numel()}")
    copy_segments(array("q", copy_row(src.data_ptr(), dst.data_ptr(), src.numel(),
                                      kernels.dtype_code(src.dtype),
                                      kernels.dtype_code(dst.dtype), scale)), src.device)


def optim_step_flat(kind, master: torch.Tensor, grad: torch.Tensor,
                    state0: Optional[torch.Tensor] = None, state1: Optional[torch.Tensor] = None,
                    state2: Optional[torch.Tensor] = None,
                    param_out: Optional[torch.Tensor] = None, *, step: int, lr: float,
                    beta1: Optional[float] = None, beta2: Optional[float] = None,
                    eps: Optional[float] = None, weight_decay: float = 0.0,
                    grad_scale: float = 1.0, maximize: bool = False, amsgrad: bool = False,
                    nesterov: bool = False, stochastic_rounding: bool = False, seed: int = 0,
                    scale: Optional[torch.Tensor] = None) -> None:
    """kernels.optim_step_flat on whole contiguous tensors of one CUDA device (same arguments,
    same math and bits), plus `scale` (see optim_step_segments)."""
    rows, group = flat_step_table(
        kind, master, grad, state0, state1, state2, param_out, step=step, lr=lr, beta1=beta1,
        beta2=beta2, eps=eps, weight_decay=weight_decay, grad_scale=grad_scale,
        maximize=maximize, amsgrad=amsgrad, nesterov=nesterov,
        stochastic_rounding=stochastic_rounding, seed=seed)
    optim_step_segments(rows, [group], master.device, scale=scale)


def flat_step_table(kind, master: torch.Tensor, grad: torch.Tensor,
                    state0: Optional[torch.Tensor] = None, state1: Optional[torch.Tensor] = None,
                    state2: Optional[torch.Tensor] = None,
                    param_out: Optional[torch.Tensor] = None, *, step: int, lr: float,
                    beta1: Optional[float] = None, beta2: Optional[float] = None,
                    eps: Optional[float] = None, weight_decay: float = 0.0,
                    grad_scale: float = 1.0, maximize: bool = False, amsgrad: bool = False,
                    nesterov: bool = False, stochastic_rounding: bool = False,
                    seed: int = 0) -> tuple:
    """(segment rows, group row) of one step over whole tensors on master's device, checked as
    kernels.optim_step_flat checks CPU tensors: for optim_step_segments on CUDA tensors, or
    optim_step_emulate on CPU ones."""
    k = kernels.opt_kind(kind)
    _check("master", master, None, (torch.float32,))
    device, n = master.device, master.numel()
    _check("grad", grad, device, _FLOATS)
    b1d, b2d, epsd = kernels._OPT_DEFAULTS[k]
    beta1 = b1d if beta1 is None else beta1
    beta2 = b2d if beta2 is None else beta2
    eps = epsd if eps is None else eps
    given = {"state0": state0, "state1": state1, "state2": state2}
    for name, t in list(given.items()) + [("param_out", param_out), ("grad", grad)]:
        if t is None:
            continue
        _check(name, t, device, _FLOATS if name in ("param_out", "grad") else (torch.float32,))
        if t.numel() != n:
            raise ValueError(f"{name} has {t.numel()} elements, expected {n} (same as master)")
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"step must be an int >= 1 (the step count after this update), got "
                         f"{step!r}")
    if not 0 <= int(seed) <= 2 ** 53:
        raise ValueError(f"seed must be in [0, 2**53], got {seed}")
    ptrs = [0 if t is None else t.data_ptr() for t in (state0, state1, state2, param_out)]
    rows = array("q", [master.data_ptr(), grad.data_ptr(), *ptrs, n, int(step), 0, 0])
    param_dtype = kernels.F32 if param_out is None else kernels.dtype_code(param_out.dtype)
    flags = kernels.opt_flags(maximize, amsgrad, nesterov, stochastic_rounding)
    group = kernels.opt_group_row(k, kernels.dtype_code(grad.dtype), param_dtype, flags, lr, beta1,
                                  beta2, eps, weight_decay, grad_scale, seed)
    return rows, group


def grad_stats_flat(grads: Sequence[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """(sum of |g|^norm_type, or max |g| for inf; 1.0 if any inf/nan) as 2 float64 on the grads'
    device, for contiguous CUDA gradients of any of the three dtypes (one launch pair per
    dtype). Nothing waits for the device."""
    grads = list(grads)
    if not grads:
        raise ValueError("grad_stats_flat needs at least one gradient (for its device)")
    device = grads[0].device
    by_dtype = {}
    for i, g in enumerate(grads):
        _check(f"grads[{i}]", g, device, _FLOATS)
        by_dtype.setdefault(g.dtype, array("q")).extend(
            (0, g.data_ptr(), 0, 0, 0, 0, g.numel(), 1, 0, 0))
    out = torch.zeros(2, dtype=torch.float64, device=device)
    for k, (dtype, rows) in enumerate(by_dtype.items()):
        grad_stats_segments(rows, kernels.dtype_code(dtype), norm_type, out, accumulate=k > 0)
    return out
