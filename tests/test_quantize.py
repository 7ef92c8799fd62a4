"""Block quantization (zero_py.kernels.quantize, csrc/kernels/cpu/quantize.c) against a slow
reference written from the definition in torch ops: every instruction set and thread count,
int8 and int4, fp32 and bf16, partial last blocks, zero and non-finite blocks, accumulation."""


import pytest
import torch

from zero_py.kernels.quantize import dequantize, quantize, quantized_bytes
from zero_py.testing.reference import sr_bits, sr_key


def reference_quantize(x: torch.Tensor, block: int, bits: int, noise=None):
    """noise=(seed, stream): stochastic rounding, quantize.h's definition with convert.h's
    noise (zero_py.testing.reference's sr_key and sr_bits; n < 2**32 here)."""
    qmax = 127.0 if bits == 8 else 7.0
    x = x.float().reshape(-1)
    qs, scales = [], []
    key = None if noise is None else sr_key(noise[0], noise[1], 0)
    for lo in range(0, x.numel(), block):
        b = x[lo:lo + block]
        absmax = b.abs().max()
        if not torch.isfinite(b).all():
            qs.append(torch.zeros_like(b, dtype=torch.int32))
            scales.append(float("nan"))
        elif absmax == 0:
            qs.append(torch.zeros_like(b, dtype=torch.int32))
            scales.append(0.0)
        else:
            inv = torch.tensor(qmax, dtype=torch.float32) / absmax
            if key is None:
                qs.append(torch.round(b * inv).clamp(-qmax, qmax).to(torch.int32))
            else:
                y = b * inv
                f = torch.floor(y)
                r = sr_bits(key, torch.arange(lo, lo + b.numel())).to(torch.float32)
                up = ((y - f) * 65536.0 > r).to(torch.float32)
                qs.append((f + up).clamp(-qmax, qmax).to(torch.int32))
            scales.append(float(absmax / torch.tensor(qmax, dtype=torch.float32)))
    q = torch.cat(qs) if qs else torch.zeros(0, dtype=torch.int32)
    scales = torch.tensor(scales, dtype=torch.float32)
    if bits == 8:
        return q.to(torch.int8), scales
    if q.numel() % 2:
        q = torch.cat([q, torch.zeros(1, dtype=torch.int32)])
    packed = (q[0::2] & 0xF) | ((q[1::2] & 0xF) << 4)
    return packed.to(torch.uint8), scales


def reference_dequantize(q, scales, n, block, bits):
    if bits == 8:
        v = q.to(torch.float32)
    else:
        b = q.to(torch.int32)
        v = torch.stack([b & 0xF, b >> 4], dim=1).reshape(-1)[:n]
        v = torch.where(v >= 8, v - 16, v).to(torch.float32)
    s = scales.repeat_interleave(block)[:n]
    return v * s


def _data(n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.logspace(-3, 3, n).roll(seed)
    return x.to(dtype)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,block", [(1000, 64), (4096, 256), (777, 32), (1, 2), (130_001, 4096)])
def test_matches_the_reference(bits, dtype, n, block):
    x = _data(n, dtype, n % 7)
    x[: min(block, n)] = 0.0  # a zero block
    q, s = quantize(x, block, bits)
    rq, rs = reference_quantize(x, block, bits)
    assert torch.equal(q, rq)
    assert torch.equal(s, rs)
    y = dequantize(q, s, n, block, bits)
    assert torch.equal(y, reference_dequantize(q, s, n, block, bits))
    # the error is within half a quantization step of each block (and fp32 rounding)
    step = s.repeat_interleave(block)[:n]
    assert bool(((y - x.float()).abs() <= step * (0.5 + 1e-5) + 1e-6).all())
    yb = dequantize(q, s, n, block, bits, dtype=torch.bfloat16)
    assert torch.equal(yb, reference_dequantize(q, s, n, block, bits).to(torch.bfloat16))
    acc = torch.randn(n)
    want = acc + y
    dequantize(q, s, n, block, bits, out=acc, accumulate=True)
    assert torch.equal(acc, want)
    assert quantized_bytes(n, block, bits) == q.numel() + 4 * s.numel()


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,block", [(1000, 64), (777, 32), (1, 2), (130_001, 4096)])
def test_stochastic_rounding_matches_the_reference(bits, dtype, n, block):
    x = _data(n, dtype, n % 7)
    x[: min(block, n)] = 0.0  # a zero block
    noise = (12345 + bits, 2 ** 40 + n)
    q, s = quantize(x, block, bits, noise=noise)
    rq, rs = reference_quantize(x, block, bits, noise)
    assert torch.equal(q, rq)
    assert torch.equal(s, rs)
    # within one step of each block; the same noise gives the same bits, another does not
    y = dequantize(q, s, n, block, bits)
    step = s.repeat_interleave(block)[:n]
    assert bool(((y - x.float()).abs() <= step * (1 + 1e-5) + 1e-6).all())
    assert torch.equal(quantize(x, block, bits, noise=noise)[0], q)
    if n > block:
        assert not torch.equal(quantize(x, block, bits, noise=(noise[0] + 1, noise[1]))[0], q)
        assert not torch.equal(quantize(x, block, bits, noise=(noise[0], noise[1] + 1))[0], q)


@pytest.mark.parametrize("bits", [8, 4])
def test_stochastic_rounding_is_unbiased_where_nearest_is_not(bits):
    """Values a fraction of a step apart from the grid: rounded to nearest, a block's values
    below half a step are lost every time (the bias qgZ's int4 gradients suffer from);
    stochastically, their mean over many roundings is the value."""
    qmax = 127 if bits == 8 else 7
    g = torch.Generator().manual_seed(3)
    n, block, k = 4096, 256, 400
    x = torch.rand(n, generator=g) * 0.9 - 0.45  # within half a step of zero ...
    x[::block] = qmax  # ... once each block's scale is 1
    x[1::block] = -qmax + 0.3
    nearest = dequantize(*quantize(x, block, bits), n, block, bits)
    mean = torch.zeros(n, dtype=torch.float64)
    for seed in range(k):
        mean += dequantize(*quantize(x, block, bits, noise=(seed, 7)), n, block, bits)
    mean /= k
    # the rounding error of one value has a standard deviation of at most half a step
    assert float((mean - x).abs().max()) < 5 * 0.5 / k ** 0.5
    assert float((mean - x).abs().mean()) < 0.02
    assert float((nearest - x).abs().mean()) > 0.2  # nearest drops them all


def test_non_finite_blocks_stay_visible():
    x = torch.randn(300)
    x[10], x[150] = float("inf"), float("nan")
    q, s = quantize(x, 100, 8)
    assert torch.isnan(s[:2]).all() and torch.isfinite(s[2])
    y = dequantize(q, s, 300, 100, 8)
    assert torch.isnan(y[:200]).all() and torch.isfinite(y[200:]).all()


def test_errors():
    x = torch.randn(100)
    with pytest.raises(ValueError, match="bits must be 8 or 4"):
        quantize(x, 10, 3)
    with pytest.raises(ValueError, match="even"):
        quantize(x, 11, 4)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        quantize(x.half(), 10, 8)
    q, s = quantize(x, 10, 8)
    with pytest.raises(ValueError, match="accumulate"):
        dequantize(q, s, 100, 10, 8, accumulate=True)
    with pytest.raises(ValueError, match="scales must be"):
        dequantize(q, s[:3], 100, 10, 8)


def test_every_instruction_set_and_thread_count_gives_the_same_bits(monkeypatch):
    """ZP_CPU_ISA caps the bodies; the kernels read it at each call (tuning.c), so one process
    sets it in turn. An instruction set this CPU lacks falls to the next one down."""
    from zero_py import kernels

    g = torch.Generator().manual_seed(5)
    x = torch.randn(300_001, generator=g) * 10
    results = {}
    for isa in ("scalar", "avx2", "avx512"):
        monkeypatch.setenv("ZP_CPU_ISA", isa)
        if kernels.cpu_isa() in results:
            continue
        out = []
        for bits in (8, 4):
            for t in (1, 2, 3):
                for noise in (None, (99, 5)):
                    q, s = quantize(x, 256, bits, n_threads=t, noise=noise)
                    y = dequantize(q, s, x.numel(), 256, bits, n_threads=t)
                    out.append(torch.cat([q.view(torch.uint8).float(), s, y]))
        results[kernels.cpu_isa()] = torch.cat(out)
    assert "scalar" in results
    for isa, got in results.items():
        assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(results["scalar"])), isa


# -- the CUDA kernels' code (csrc/kernels/cuda/quantize.cu), run on the host ---------------------


def _emulator_or_skip():
    from zero_py.kernels import cuda
    if cuda.native_module() is None:
        pytest.skip("zero_py._cuda is not built (no nvcc at build time)")
    return cuda


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,block", [(1000, 64), (777, 32), (1, 2), (5000, 4096), (3001, 1000)])
def test_cuda_kernel_code_equals_the_c_kernels(bits, dtype, n, block):
    """The CUDA kernels' per-thread code and block reduction, emulated on the host, give the C
    kernels' bits: quantized bytes, scales, dequantized fp32 / bf16 and the fp32 accumulation."""
    if bits == 4 and block % 2:
        block += 1
    cuda = _emulator_or_skip()
    x = _data(n, dtype, n % 5)
    x[: min(block, n)] = 0.0
    if n > 2 * block:
        x[block + 3] = float("inf")  # a non-finite block
    q, s = quantize(x, block, bits)
    eq, es = cuda.quantize_emulate(x, block, bits)
    assert torch.equal(eq, q)
    assert torch.equal(es.view(torch.int32), s.view(torch.int32))  # NaN scales: same bits
    noise = (2 ** 63 + 11, 3)  # stochastic rounding: the same noise, the same bits
    sq, ss = quantize(x, block, bits, noise=noise)
    eq, es = cuda.quantize_emulate(x, block, bits, noise=noise)
    assert torch.equal(eq, sq) and not (n > block and torch.equal(sq, q))
    assert torch.equal(es.view(torch.int32), ss.view(torch.int32))
    for out_dtype in (torch.float32, torch.bfloat16):
        want = dequantize(q, s, n, block, bits, dtype=out_dtype)
        got = cuda.dequantize_emulate(q, s, n, block, bits, torch.empty(n, dtype=out_dtype))
        assert torch.equal(got.view(torch.int16 if out_dtype == torch.bfloat16 else torch.int32),
                           want.view(torch.int16 if out_dtype == torch.bfloat16 else torch.int32))
    acc = torch.randn(n)
    want = dequantize(q, s, n, block, bits, out=acc.clone(), accumulate=True)
    got = cuda.dequantize_emulate(q, s, n, block, bits, acc.clone(), accumulate=True)
    assert torch.equal(torch.nan_to_num(got), torch.nan_to_num(want))


def test_cuda_kernel_checks_match_the_c_kernels():
    cuda = _emulator_or_skip()
    with pytest.raises(ValueError, match="even"):
        cuda.quantize_emulate(torch.randn(10), 11, 4)
    with pytest.raises(ValueError, match="bits must be 8 or 4"):
        cuda.quantize_emulate(torch.randn(10), 10, 3)
    q, s = quantize(torch.randn(10), 10, 8)
    with pytest.raises(ValueError, match="accumulate"):
        cuda.dequantize_emulate(q, s, 10, 10, 8, torch.empty(10, dtype=torch.bfloat16), True)
