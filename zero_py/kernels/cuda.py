"""The CUDA kernels of the C core (zero_py._cuda), on device tensors: the fused optimizer
family, gradient statistics and segment copies (copy tables, cast).

Same tables as the CPU family (kernels/table.py): segment rows of addresses (array('q'),
now of device memory) and group rows. Every call enqueues on the current stream of the tensors'
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

from zero_py.kernels import table
from zero_py.kernels.table import FLOAT_DTYPES as _FLOATS, group_rows as _group_rows

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


def _workspace(device: torch.device, nbytes: int, stream=None) -> torch.Tensor:
    """A launch's device workspace (its table, its partial sums). Freed when the call returns
    while the launch may not have run yet (uploads do not wait: csrc/kernels/cuda/upload.cu):
    safe on the current stream, whose later work comes after it; on another stream the caching
    allocator is told that stream uses it."""
    ws = torch.empty(max(int(nbytes), 16), dtype=torch.uint8, device=device)
    if stream is not None:
        ws.record_stream(stream)
    return ws


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
    n_rows = len(rows) // table.OPT_SEGMENT_FIELDS
    with torch.cuda.device(device):
        ws = _workspace(device, mod.opt_workspace_bytes(n_rows), stream)
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
    n_rows = len(rows) // table.OPT_SEGMENT_FIELDS
    total = sum(rows[i * table.OPT_SEGMENT_FIELDS + table.SEGMENT_NUMEL] for i in range(n_rows))
    with torch.cuda.device(device):
        ws = _workspace(device, mod.grad_stats_workspace_bytes(n_rows, max(int(total), 0)),
                        stream)
        mod.grad_stats(rows, int(grad_dtype), float(norm_type), out.data_ptr(), bool(accumulate),
                       ws.data_ptr(), ws.numel(), _stream_ptr(device, stream))


def copy_segments(rows: array, device, *, stream=None) -> None:
    """One launch over a copy table (COPY_FIELDS per row, see copy_row)."""
    mod = native()
    device = _device_of(device)
    n_rows = len(rows) // COPY_FIELDS
    with torch.cuda.device(device):
        ws = _workspace(device, mod.copy_workspace_bytes(n_rows), stream)
        mod.copy(rows, ws.data_ptr(), ws.numel(), _stream_ptr(device, stream))


def copy_row(src: Optional[int], dst: int, numel: int, src_dtype: int, dst_dtype: int,
             scale: float = 1.0) -> tuple:
    """One row of a copy table: addresses (src None or 0 = zeros), dtype codes, fp32 scale."""
    bits = struct.unpack("<I", struct.pack("<f", float(scale)))[0]
    return (int(src or 0), int(dst), int(numel), int(src_dtype), int(dst_dtype), bits)


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

_check = table.check_tensor


def cast(src: torch.Tensor, dst: torch.Tensor, scale: float = 1.0) -> None:
    """dst = src * scale in dst's dtype (round to nearest even), one launch."""
    _check("src", src, None, _FLOATS)
    _check("dst", dst, src.device, _FLOATS)
    if src.numel() != dst.numel():
        raise ValueError(f"src has {src.numel()} elements, dst {dst.numel()}")
    copy_segments(array("q", copy_row(src.data_ptr(), dst.data_ptr(), src.numel(),
                                      table.dtype_code(src.dtype),
                                      table.dtype_code(dst.dtype), scale)), src.device)


def grad_stats_flat(grads: Sequence[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """(sum of |g|^norm_type, or max |g| for inf; 1.0 if any inf/nan) as 2 float64 on the grads'
    device, for contiguous CUDA gradients of any of the three dtypes (one launch pair per
    dtype). Nothing waits for the device."""
    grads = list(grads)
    if not grads:
        raise ValueError("grad_stats_flat needs at least one gradient (for its device)")
    from zero_py import kernels  # the face dispatches by device
    return kernels.grad_stats(table.grad_rows(grads, grads[0].device), norm_type,
                              _device_of(grads[0].device))


# ---- block quantization (csrc/kernels/cuda/quantize.cu; kernels/quantize.py checks the sizes) ----

_QDTYPES = (torch.float32, torch.bfloat16)


def quantize(x: torch.Tensor, block: int, bits: int, q: torch.Tensor, scales: torch.Tensor,
             *, noise=None, stream=None) -> None:
    """The C kernel's quantization of a CUDA tensor into q and scales, on x's current stream;
    noise=(seed, stream): its stochastic rounding (kernels.quantize.quantize), the same bits."""
    _check("x", x, None, _QDTYPES)
    device = _device_of(x.device)
    with torch.cuda.device(device):
        native().quantize(x.data_ptr(), table.dtype_code(x.dtype), x.numel(), int(block),
                          int(bits), q.data_ptr(), scales.data_ptr(), *_noise_args(noise),
                          _stream_ptr(device, stream))


def _noise_args(noise) -> tuple:
    """(stochastic, seed, stream) for the bindings' quantize."""
    return (False, 0, 0) if noise is None else (True, int(noise[0]), int(noise[1]))


def dequantize(q: torch.Tensor, scales: torch.Tensor, n: int, block: int, bits: int,
               out: torch.Tensor, accumulate: bool = False, *, stream=None) -> None:
    """out = (or +=, fp32) the n values of (q, scales) on the device, on the current stream."""
    device = _device_of(q.device)
    with torch.cuda.device(device):
        native().dequantize(q.data_ptr(), scales.data_ptr(), int(n), int(block), int(bits),
                            out.data_ptr(), table.dtype_code(out.dtype), bool(accumulate),
                            _stream_ptr(device, stream))


def quantize_emulate(x: torch.Tensor, block: int, bits: int, noise=None):
    """The CUDA kernel's code on a CPU tensor: (q, scales) as kernels.quantize.quantize gives
    (noise=(seed, stream): with its stochastic rounding)."""
    _check("x", x, torch.device("cpu"), _QDTYPES)
    n = x.numel()
    q = torch.empty(n if bits == 8 else (n + 1) // 2,
                    dtype=torch.int8 if bits == 8 else torch.uint8)
    scales = torch.empty((n + block - 1) // block if block > 0 else 0, dtype=torch.float32)
    _emulator().quantize_emulate(x.data_ptr(), table.dtype_code(x.dtype), n, int(block),
                                 int(bits), q.data_ptr(), scales.data_ptr(), *_noise_args(noise))
    return q, scales


def dequantize_emulate(q: torch.Tensor, scales: torch.Tensor, n: int, block: int, bits: int,
                       out: torch.Tensor, accumulate: bool = False) -> torch.Tensor:
    """The CUDA kernel's dequantization on CPU tensors."""
    _check("out", out, torch.device("cpu"), _QDTYPES, n)
    _emulator().dequantize_emulate(q.data_ptr(), scales.data_ptr(), int(n), int(block),
                                   int(bits), out.data_ptr(), table.dtype_code(out.dtype),
                                   bool(accumulate))
    return out
