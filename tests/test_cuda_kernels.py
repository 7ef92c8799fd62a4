"""The CUDA kernels' own code, run on the host (zero_py._cuda's *_emulate functions), against
the CPU family and torch: no GPU needed, so CI checks the device algorithms (row search, tiles,
4-element vector and tail paths, coefficients, conversions, rounding noise, the statistics'
reduction) on every run. tests/gpu/ runs the same kernels on a device.

- optimizer family: bit for bit equal to zero_py._C's CPU family (itself checked against
  torch.optim in test_optim_kernels.py) on multi-row tables with misaligned rows, tails, empty
  rows, several groups and step counts, every kind, flag, grad and param dtype, param_out
  poisoned before each step;
- statistics: against torch.linalg.vector_norm in float64 (rtol 1e-12; max exact), flags;
- copies: pack, unpack and cast against torch's casts, bit for bit.
Also: the C validation of the device entry points, and what a machine without a GPU reports.
"""

import math
import struct
from array import array

import pytest
import torch

from zero_py import kernels
from zero_py.kernels import cuda

pytestmark = pytest.mark.skipif(cuda.native_module() is None,
                                reason=str(cuda._import_native()[1]))

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INT_VIEW = {4: torch.int32, 2: torch.int16}


def _bits(t):
    return t.view(INT_VIEW[t.element_size()])


def _assert_bits(a, b, what):
    if not torch.equal(_bits(a), _bits(b)):
        bad = (_bits(a) != _bits(b)).nonzero().flatten()
        i = int(bad[0])
        raise AssertionError(f"{what}: {bad.numel()} elements differ, first at {i}: "
                             f"{a[i].item()!r} vs {b[i].item()!r}")


# Rows: (element offset, numel, group, step). Offsets that are not multiples of 4 force the
# one-element path; lengths around the tile (1024) exercise tails and tile boundaries.
ROWS = [(0, 1030, 0, 3), (1031, 0, 0, 1), (1031, 3, 1, 1), (1040, 4096, 1, 7), (5137, 1, 0, 2),
        (5140, 2047, 0, 3), (7191, 777, 1, 1)]
TOTAL = 7191 + 777 + 9


class _World:
    """One set of flat buffers and the segment table over them."""

    def __init__(self, gen, kind, grad_dtype, param_dtype, n_states, fill_states):
        self.master = torch.randn(TOTAL, generator=gen)
        self.grad = torch.empty(TOTAL, dtype=grad_dtype)
        self.states = [fill_states(torch.empty(TOTAL)) for _ in range(n_states)]
        self.out = None if param_dtype is None else torch.empty(TOTAL, dtype=param_dtype)

    def clone(self):
        twin = object.__new__(_World)
        twin.master = self.master.clone()
        twin.grad = self.grad.clone()
        twin.states = [s.clone() for s in self.states]
        twin.out = None if self.out is None else self.out.clone()
        return twin

    def rows(self):
        rows = array("q")
        for off, n, group, step in ROWS:
            def at(t, off=off):
                return 0 if t is None else t.data_ptr() + off * t.element_size()
            st = [at(s) for s in self.states] + [0] * (3 - len(self.states))
            rows.extend((at(self.master), at(self.grad), *st, at(self.out), n, step, group, 0))
        return rows

    def tensors(self):
        return [self.master, *self.states] + ([] if self.out is None else [self.out])


CASES = [
    # kind, flags, hyperparameters of group 0 and group 1 (beta1, beta2, eps, wd)
    ("adamw", {}, (0.9, 0.999, 1e-8, 0.1), (0.8, 0.99, 1e-6, 0.0)),
    ("adamw", {"amsgrad": True, "maximize": True}, (0.9, 0.999, 1e-8, 0.01), (0.3, 0.9, 0.0, 0.2)),
    ("adam", {}, (0.9, 0.999, 1e-8, 0.05), (0.5, 0.95, 1e-3, 0.0)),
    ("adam", {"amsgrad": True}, (0.9, 0.999, 1e-8, 0.0), (0.9, 0.999, 1e-8, 0.3)),
    ("sgd", {}, (0.9, 0.1, 0.0, 0.01), (0.0, 0.0, 0.0, 0.0)),
    ("sgd", {"nesterov": True, "maximize": True}, (0.9, 0.0, 0.0, 0.01), (0.5, 0.0, 0.0, 0.0)),
    ("adagrad", {}, (0.01, 0.0, 1e-10, 0.1), (0.0, 0.0, 1e-6, 0.0)),
    ("lion", {}, (0.9, 0.99, 0.0, 0.1), (0.95, 0.98, 0.0, 0.0)),
]


def _n_states(kind, flags, momentum):
    if kind in ("adamw", "adam"):
        return 3 if flags.get("amsgrad") else 2
    if kind == "sgd":
        return 1 if momentum else 0
    return 1


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("grad_dtype", DTYPES)
@pytest.mark.parametrize("param_dtype", [None, torch.float32, torch.bfloat16, torch.float16])
def test_optimizer_family_emulation_equals_cpu_family(case, grad_dtype, param_dtype):
    kind, flags, hp0, hp1 = CASES[case]
    if kind == "sgd" and flags.get("nesterov") and hp1[0] == 0.0:
        pytest.skip("nesterov needs momentum")
    gen = torch.Generator().manual_seed(1000 * case + 7)
    k = kernels.opt_kind(kind)
    momentum = hp0[0] if kind == "sgd" else 1.0
    # SGD with momentum in one group needs the buffer in every row (the kernel checks rows)
    n_states = _n_states(kind, flags, momentum)
    fill = (lambda t: t.uniform_(0.0, 0.1, generator=gen)) if kind == "adagrad" else \
        (lambda t: t.normal_(0.0, 0.01, generator=gen).abs_() if kind != "sgd" else
         t.normal_(0.0, 0.01, generator=gen))
    cpu = _World(gen, k, grad_dtype, param_dtype, n_states, fill)
    emu = cpu.clone()
    sr = param_dtype == torch.bfloat16
    for step in range(3):
        grad = (torch.randn(TOTAL, generator=gen) *
                10.0 ** torch.randint(-4, 1, (TOTAL,), generator=gen).float()).to(grad_dtype)
        cpu.grad.copy_(grad)
        emu.grad.copy_(grad)
        if cpu.out is not None:  # poison: NaN on odd steps, random bits on even ones
            if step % 2:
                cpu.out.fill_(float("nan"))
            else:
                _bits(cpu.out).random_(generator=gen)
            emu.out.copy_(cpu.out)
        groups = []
        pdt = kernels.F32 if param_dtype is None else kernels.dtype_code(param_dtype)
        for g, hp in enumerate((hp0, hp1)):
            b1, b2, eps, wd = hp
            fl = kernels.opt_flags(flags.get("maximize", False), flags.get("amsgrad", False),
                                   flags.get("nesterov", False), sr and g == 1)
            groups.append(kernels.opt_group_row(k, kernels.dtype_code(grad_dtype), pdt, fl,
                                                1e-2 * (g + 1), b1, b2, eps, wd,
                                                grad_scale=0.5 + step, seed=11 + step))
        kernels.optim_step_segments(cpu.rows(), groups, n_threads=2)
        cuda.optim_step_emulate(emu.rows(), groups)
        for name, a, b in zip(("master", "state0", "state1", "state2", "param_out"),
                              cpu.tensors(), emu.tensors()):
            _assert_bits(a, b, f"step {step} {name}")


def test_device_scale_multiplies_and_skips():
    gen = torch.Generator().manual_seed(3)
    n = 3001
    master, grad = torch.randn(n, generator=gen), torch.randn(n, generator=gen).bfloat16()
    m, v = torch.zeros(n), torch.zeros(n)
    out = torch.empty(n, dtype=torch.bfloat16)
    a = [t.clone() for t in (master, grad, m, v, out)]
    b = [t.clone() for t in (master, grad, m, v, out)]
    kernels.optim_step_flat("adamw", a[0], a[1], a[2], a[3], None, a[4], step=1, lr=1e-2,
                            weight_decay=0.1, grad_scale=0.75 * 0.25)
    rows, group = kernels.flat_step_table("adamw", b[0], b[1], b[2], b[3], None, b[4], step=1,
                                       lr=1e-2, weight_decay=0.1, grad_scale=0.75)
    cuda.optim_step_emulate(rows, [group], scale=0.25)  # 0.75 * 0.25 is exact in float
    for x, y, name in zip(a, b, ("master", "grad", "m", "v", "out")):
        _assert_bits(x, y, name)
    before = [t.clone() for t in b]
    for bad in (float("inf"), float("nan")):
        cuda.optim_step_emulate(rows, [group], scale=bad)
        for x, y, name in zip(before, b, ("master", "grad", "m", "v", "out")):
            _assert_bits(x, y, f"scale {bad}: {name} was written")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("norm_type", [2.0, 1.0, 3.0, math.inf])
def test_grad_stats_emulation_vs_vector_norm(dtype, norm_type):
    gen = torch.Generator().manual_seed(int(norm_type if math.isfinite(norm_type) else 9) + 5)
    sizes = [1, 4095, 4096, 4097, 0, 10000, 3]
    grads = [(torch.randn(s, generator=gen) *
              10.0 ** torch.randint(-3, 2, (s,), generator=gen).float()).to(dtype)
             for s in sizes]
    big = torch.zeros(sum(sizes) + 10, dtype=dtype)  # rows at odd offsets: one-element path
    rows, off, pieces = array("q"), 1, []
    for g in grads:
        big[off:off + g.numel()] = g
        pieces.append(big[off:off + g.numel()])
        rows.extend((0, big.data_ptr() + off * big.element_size(), 0, 0, 0, 0, g.numel(), 1, 0,
                     0))
        off += g.numel() + 1
    code = kernels.dtype_code(dtype)
    total, flag = cuda.grad_stats_emulate(rows, code, norm_type)
    ref = torch.linalg.vector_norm(torch.cat(pieces).double(), norm_type).item()
    ref = ref if math.isinf(norm_type) else ref ** norm_type
    assert flag == 0.0
    if math.isinf(norm_type):
        assert total == ref
    else:
        assert total == pytest.approx(ref, rel=1e-12)
    assert cuda.grad_stats_emulate(rows, code, norm_type) == (total, flag)  # deterministic
    # accumulate: a second table on top of the first
    again, _ = cuda.grad_stats_emulate(rows, code, norm_type, before=(total, 0.0))
    assert again == (total if math.isinf(norm_type) else total + total)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_grad_stats_emulation_flags_nonfinite(bad):
    g = torch.randn(9000)
    g[7777] = bad
    rows = array("q", (0, g.data_ptr(), 0, 0, 0, 0, g.numel(), 1, 0, 0))
    total, flag = cuda.grad_stats_emulate(rows, kernels.F32, 2.0)
    assert flag == 1.0
    assert math.isnan(total) if math.isnan(bad) else total == math.inf
    total, flag = cuda.grad_stats_emulate(rows, kernels.F32, math.inf)
    assert flag == 1.0 and (math.isnan(total) if math.isnan(bad) else total == math.inf)
    assert cuda.grad_stats_emulate(array("q"), kernels.F32, 2.0) == (0.0, 0.0)


def _copy_rows(pairs):
    rows = array("q")
    for src, src_off, dst, dst_off, n, scale in pairs:
        rows.extend(cuda.copy_row(
            None if src is None else src.data_ptr() + src_off * src.element_size(),
            dst.data_ptr() + dst_off * dst.element_size(), n,
            kernels.dtype_code(dst.dtype if src is None else src.dtype),
            kernels.dtype_code(dst.dtype), scale))
    return rows


@pytest.mark.parametrize("src_dtype", DTYPES)
@pytest.mark.parametrize("dst_dtype", DTYPES)
@pytest.mark.parametrize("scale", [1.0, 0.25, 1.0 / 3.0])
def test_copy_emulation_packs_and_casts_like_torch(src_dtype, dst_dtype, scale):
    gen = torch.Generator().manual_seed(17)
    sizes = [5, 1024, 1, 2049, 0, 333]
    srcs = [(torch.randn(s, generator=gen) * 100).to(src_dtype) for s in sizes]
    bucket = torch.empty(sum(sizes) + 3 * len(sizes), dtype=dst_dtype)
    _bits(bucket).random_(generator=gen)
    pairs, off, where = [], 1, []
    for s in srcs:
        pairs.append((s, 0, bucket, off, s.numel(), scale))
        where.append(off)
        off += s.numel() + 2
    pairs.append((None, 0, bucket, 0, 1, 1.0))  # a gap: zeros
    cuda.copy_emulate(_copy_rows(pairs))
    assert _bits(bucket[0:1]).item() == 0
    for s, o in zip(srcs, where):
        want = s if (scale == 1.0 and s.dtype == dst_dtype) else (s.float() * scale).to(dst_dtype)
        _assert_bits(bucket[o:o + s.numel()], want, "pack")
    # unpack: back out of the bucket into fresh tensors of the source dtype
    outs = [torch.full_like(s, float("nan")) for s in srcs]
    cuda.copy_emulate(_copy_rows([(bucket, o, t, 0, t.numel(), 1.0) for t, o in zip(outs, where)]))
    for t, o in zip(outs, where):
        want = bucket[o:o + t.numel()]
        want = want if want.dtype == t.dtype else want.float().to(t.dtype)
        _assert_bits(t, want, "unpack")


def test_copy_emulation_moves_nan_payloads_unchanged():
    x = torch.tensor([0x7FC00001, 0x7F800001, 0xFFC12345 - 2**32, 0x00000001, 0x80000000 - 2**32],
                     dtype=torch.int32).view(torch.float32)
    y = torch.zeros_like(x)
    cuda.copy_emulate(_copy_rows([(x, 0, y, 0, 5, 1.0)]))
    _assert_bits(x, y, "raw copy")
    h = torch.zeros(5, dtype=torch.bfloat16)
    cuda.copy_emulate(_copy_rows([(x, 0, h, 0, 5, 1.0)]))
    assert _bits(h)[:3].tolist() == [0x7FC0] * 3  # NaN -> 0x7FC0, as torch casts it
    _assert_bits(h[3:], x[3:].to(torch.bfloat16), "denormal, -0")


# ---- validation and machines without a GPU -------------------------------------------------------

def test_device_entry_points_validate_like_the_cpu_family():
    master, grad = torch.zeros(8), torch.zeros(8)
    rows = array("q", (master.data_ptr(), grad.data_ptr(), 0, 0, 0, 0, 8, 1, 0, 0))
    bad = kernels.opt_group_row(kernels.OPT_ADAMW, 0, 0, 0, 1e-3, 1.5, 0.9, 1e-8, 0.0)
    with pytest.raises(ValueError) as cpu_err:
        kernels.optim_step_segments(rows, [bad])
    mod = cuda.native_module()
    flat = array("d", bad)
    with pytest.raises(ValueError) as dev_err:
        mod.opt_step(rows, flat, 0, 0, 0, 0)  # fails before touching any device
    assert str(dev_err.value) == str(cpu_err.value) and "beta1" in str(dev_err.value)
    with pytest.raises(ValueError, match="beta1"):
        cuda.optim_step_emulate(rows, [bad])
    good = kernels.opt_group_row(kernels.OPT_SGD, 0, 0, 0, 1e-3, 0.0, 0.0, 0.0, 0.0)
    with pytest.raises(ValueError, match="workspace"):
        mod.opt_step(rows, array("d", good), 0, 0, 0, 0)
    with pytest.raises(ValueError, match="norm_type"):
        mod.grad_stats(rows, 0, -1.0, 16, False, 16, 4096, 0)
    with pytest.raises(ValueError, match="NULL dst"):
        mod.copy(array("q", cuda.copy_row(master.data_ptr(), 0, 8, 0, 0)), 16, 4096, 0)
    with pytest.raises(ValueError, match="scale"):
        cuda.copy_emulate(array("q", cuda.copy_row(master.data_ptr(), grad.data_ptr(), 8, 0, 0,
                                                   float("inf"))))
    with pytest.raises(ValueError, match="rows must be"):
        mod.copy(array("q", [1, 2, 3]), 16, 4096, 0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a GPU")
def test_without_a_gpu_every_entry_point_says_why():
    why = cuda.unavailable_reason()
    assert why is not None and not cuda.is_available()
    with pytest.raises(RuntimeError, match="CUDA path of zero_py is unavailable"):
        cuda.native()
    mod = cuda.native_module()
    with pytest.raises(RuntimeError, match="CUDA error"):
        mod.device_count()
    # a valid table reaches the CUDA runtime, which reports the missing driver: an exception,
    # never a crash
    master, grad = torch.zeros(8), torch.zeros(8)
    rows = array("q", (master.data_ptr(), grad.data_ptr(), 0, 0, 0, 0, 8, 1, 0, 0))
    good = kernels.opt_group_row(kernels.OPT_SGD, 0, 0, 0, 1e-3, 0.0, 0.0, 0.0, 0.0)
    with pytest.raises(RuntimeError, match="CUDA error"):
        mod.opt_step(rows, array("d", good), 0, 64, 4096, 0)


def test_copy_row_encodes_the_scale_as_float32_bits():
    row = cuda.copy_row(1, 2, 3, 0, 1, 0.1)
    assert row[:5] == (1, 2, 3, 0, 1)
    assert struct.unpack("<f", struct.pack("<I", row[5]))[0] == pytest.approx(0.1, rel=1e-7)
