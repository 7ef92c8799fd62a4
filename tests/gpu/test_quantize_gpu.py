"""Block quantization on a device (csrc/kernels/cuda/quantize.cu through
zero_py.kernels.quantize) against the C kernels on the CPU, bit for bit: int8 and int4, fp32
and bf16 inputs and outputs, partial and zero and non-finite blocks, the fp32 accumulation, and
the quantized collectives' packets on CUDA tensors (outputs poisoned before every launch)."""

import pytest
import torch

from zero_py.collectives.quantized import _pack, _unpack, packet_bytes
from zero_py.kernels.quantize import dequantize, quantize

DEV = torch.device("cuda", 0)


def _bits(t):
    """The bits of t, every NaN as one pattern: a block with an inf or a NaN dequantizes to NaN
    (q 0 times scale NaN), whose payload the GPU and x86 choose differently (0x7FFFFFFF and
    0x7FC00000): the contract is NaN there, not a payload."""
    if t.is_floating_point():
        t = torch.where(t.isnan(), torch.full_like(t, float("nan")), t)
    return t.view({4: torch.int32, 2: torch.int16, 1: torch.uint8}[t.element_size()])


def _data(n, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.logspace(-3, 3, n).roll(seed)
    return x.to(dtype)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,block", [(1000, 64), (777, 32), (1, 2), (130_001, 4096),
                                     (1 << 20, 256), (70_000, 65_536)])
def test_device_quantization_equals_the_c_kernels(bits, dtype, n, block):
    x = _data(n, dtype, n % 7)
    x[: min(block, n)] = 0.0
    if n > 2 * block:
        x[block + 1] = float("nan")
    q, s = quantize(x, block, bits)
    xd = x.to(DEV)
    qd = torch.full_like(q, 0x55, device=DEV)
    sd = torch.full_like(s, float("nan"), device=DEV)
    quantize(xd, block, bits, q=qd, scales=sd)
    torch.cuda.synchronize()
    assert torch.equal(_bits(qd.cpu()), _bits(q))
    assert torch.equal(_bits(sd.cpu()), _bits(s))
    noise = (2 ** 62 + n, 9)  # stochastic rounding: the C kernel's bits too
    sq, ss = quantize(x, block, bits, noise=noise)
    quantize(xd, block, bits, q=qd, scales=sd, noise=noise)
    torch.cuda.synchronize()
    assert torch.equal(_bits(qd.cpu()), _bits(sq))
    assert torch.equal(_bits(sd.cpu()), _bits(ss))
    quantize(xd, block, bits, q=qd, scales=sd)  # back to nearest for the rest
    for out_dtype in (torch.float32, torch.bfloat16):
        want = dequantize(q, s, n, block, bits, dtype=out_dtype)
        out = torch.full((n,), float("nan"), dtype=out_dtype, device=DEV)
        dequantize(qd, sd, n, block, bits, out=out)
        assert torch.equal(_bits(out.cpu()), _bits(want))
    acc = torch.randn(n)
    want = dequantize(q, s, n, block, bits, out=acc.clone(), accumulate=True)
    got = dequantize(qd, sd, n, block, bits, out=acc.to(DEV), accumulate=True)
    assert torch.equal(_bits(got.cpu()), _bits(want))


@pytest.mark.parametrize("bits", [8, 4])
def test_packets_on_the_device_equal_the_cpu_packets(bits):
    n, block = 10_001, 128
    x = _data(n, torch.float32, 3)
    p = packet_bytes(n, block, bits)
    host = torch.zeros(p, dtype=torch.uint8)
    dev = torch.zeros(p, dtype=torch.uint8, device=DEV)
    _pack(x, host, block, bits)
    _pack(x.to(DEV), dev, block, bits)
    assert torch.equal(dev.cpu(), host)
    out_h, out_d = torch.empty(n), torch.empty(n, device=DEV)
    _unpack(host, n, block, bits, out_h)
    _unpack(dev, n, block, bits, out_d)
    assert torch.equal(_bits(out_d.cpu()), _bits(out_h))
