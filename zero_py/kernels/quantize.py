"""Block quantization of communication buffers (ZeRO++: int8 weights, int8/int4 gradients),
the C kernels of csrc/kernels/cpu/quantize.h on CPU tensors.

    q, scales = quantize(x, block=256, bits=8)           # x: fp32 or bf16, any shape
    y = dequantize(q, scales, x.numel(), block=256, bits=8, dtype=torch.float32)
    dequantize(q, scales, n, 256, 8, out=acc, accumulate=True)   # acc += x' (fp32)

Per block of `block` elements: scale = max|x| / Q (Q = 127, or 7 for int4), q = rint(x * Q /
max|x|) clamped to [-Q, Q] (or, with noise=(seed, stream), rounded stochastically: up with
the probability of the fraction, so that the mean of q * scale is x); a block holding an inf or
a NaN gets scale NaN (it dequantizes to NaN: an overflow stays visible). int4 packs two values
per byte (low nibble first); its block must be even. Same bits on every instruction set and
thread count. The wire layout of a quantized buffer is (q bytes, then the fp32 scales):
quantized_bytes() gives its size.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from zero_py._native import _C
from zero_py.kernels.table import check_tensor, dtype_code

_IN_DTYPES = (torch.float32, torch.bfloat16)


def _n_blocks(n: int, block: int) -> int:
    return (n + block - 1) // block if n else 0


def quantized_bytes(n: int, block: int, bits: int) -> int:
    """Bytes of n values quantized: the values (n or ceil(n / 2)) and one fp32 scale a block."""
    return (n if bits == 8 else (n + 1) // 2) + 4 * _n_blocks(n, block)


def _threads(n_threads: Optional[int]) -> int:
    return 0 if n_threads is None else int(n_threads)


def quantize(x: torch.Tensor, block: int = 256, bits: int = 8,
             n_threads: Optional[int] = None, q: Optional[torch.Tensor] = None,
             scales: Optional[torch.Tensor] = None,
             noise: Optional[Tuple[int, int]] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """(q, scales): q int8 of x.numel() values (bits=8) or uint8 of ceil(n/2) packed pairs
    (bits=4), scales fp32 of one per block. x: a contiguous fp32 or bf16 tensor, on the CPU
    (the C kernels) or a CUDA device (kernels.cuda: the same bits). q= and scales= (both or
    neither): where to write them, e.g. views of a message buffer. noise=(seed, stream), two
    integers in [0, 2**64): stochastic rounding (unbiased: each value rounds up with the
    probability of its fraction), its noise a function of (seed, stream, element index) only;
    None rounds to nearest even."""
    n = x.numel()
    if noise is not None:
        seed, stream = (int(v) for v in noise)
        if not (0 <= seed < 2 ** 64 and 0 <= stream < 2 ** 64):
            raise ValueError(f"noise must be (seed, stream) in [0, 2**64), got {noise!r}")
    if (q is None) != (scales is None):
        raise ValueError("quantize takes q= and scales= together, or neither")
    if q is None:
        q = torch.empty(n if bits == 8 else (n + 1) // 2,
                        dtype=torch.int8 if bits == 8 else torch.uint8, device=x.device)
        scales = torch.empty(_n_blocks(n, max(int(block), 1)), dtype=torch.float32,
                             device=x.device)
    _check_packed(q, scales, n, block, bits, x.device)
    if x.is_cuda:
        from zero_py.kernels import cuda  # CUDA runs only
        cuda.quantize(x, int(block), int(bits), q, scales, noise=noise)
        return q, scales
    check_tensor("x", x, torch.device("cpu"), _IN_DTYPES)
    if noise is None:
        _C.quantize(x.data_ptr(), dtype_code(x.dtype), n, int(block), int(bits), q.data_ptr(),
                    scales.data_ptr(), _threads(n_threads))
    else:
        _C.quantize_sr(x.data_ptr(), dtype_code(x.dtype), n, int(block), int(bits),
                       q.data_ptr(), scales.data_ptr(), seed, stream, _threads(n_threads))
    return q, scales


def _check_packed(q: torch.Tensor, scales: torch.Tensor, n: int, block: int, bits: int,
                  device: torch.device) -> None:
    want_q = n if bits == 8 else (n + 1) // 2
    if q.device != device or not q.is_contiguous() or q.numel() != want_q \
            or q.element_size() != 1:
        raise ValueError(f"q must be {want_q} contiguous bytes on {device} for {n} values of "
                         f"{bits} bits, got {q.dtype} x {q.numel()} on {q.device}")
    want_s = _n_blocks(n, max(int(block), 1))
    if scales.dtype != torch.float32 or scales.numel() != want_s \
            or not scales.is_contiguous() or scales.device != device:
        raise ValueError(f"scales must be {want_s} contiguous float32 on {device} (one per "
                         f"block of {block}), got {scales.dtype} x {scales.numel()} on "
                         f"{scales.device}")


def dequantize(q: torch.Tensor, scales: torch.Tensor, n: int, block: int = 256, bits: int = 8,
               dtype: torch.dtype = torch.float32, out: Optional[torch.Tensor] = None,
               accumulate: bool = False, n_threads: Optional[int] = None) -> torch.Tensor:
    """The n values of (q, scales) as `dtype` (fp32 or bf16), into `out` when given; with
    accumulate=True (fp32 out) they are added to out."""
    _check_packed(q, scales, n, block, bits, q.device)
    if out is None:
        if accumulate:
            raise ValueError("accumulate=True needs out= (the fp32 tensor to add to)")
        out = torch.empty(n, dtype=dtype, device=q.device)
    check_tensor("out", out, q.device, _IN_DTYPES)
    if out.numel() != n:
        raise ValueError(f"out has {out.numel()} elements, not {n}")
    if q.is_cuda:
        from zero_py.kernels import cuda
        if accumulate and out.dtype != torch.float32:
            raise ValueError("dequantize: accumulate needs a float32 output")
        cuda.dequantize(q, scales, n, int(block), int(bits), out, bool(accumulate))
        return out
    _C.dequantize(q.data_ptr(), scales.data_ptr(), n, int(block), int(bits), out.data_ptr(),
                  dtype_code(out.dtype), bool(accumulate), _threads(n_threads))
    return out
