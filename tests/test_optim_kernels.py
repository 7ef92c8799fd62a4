"""The fused optimizer kernels (kernels.optim_step_flat) against their torch.optim twins and the
pure-PyTorch oracles (zero_py/optim_reference.py); grad_stats_flat against vector_norm.

Twins: torch.optim runs on an fp32 copy whose .grad is the widened (and scaled) gradient the
kernel sees; 100 steps of random gradients spanning five orders of magnitude, param_out
poisoned (NaN or random bits) before every call. Tolerances, for parameters of unit scale:

- master vs torch's param: atol 1e-6 (measured: <= 3.6e-7 for Adam/AdamW/Adagrad, whatever
  the grad dtype). SGD matches torch bit for bit; it is asserted exactly when torch runs its
  AVX2/AVX-512 kernels (which fuse multiply-adds as the kernel does). Adam* and Adagrad cannot
  be bitwise: torch's fp32 sqrt (MKL) is one ulp off on ~0.7% of inputs, the kernel's is
  IEEE; Adam* also keep the fp32 AdamW kernel's order (about one ulp per step).
- states: rtol 1e-5 with atol 1e-8 (m, momentum) or 1e-12 (v, sum). Measured: momentum and
  Adagrad's sum exact; v within 1 ulp; m needs atol 4.5e-9 where Adam's L2 term adds
  weight_decay * (the master's difference) to the gradient.
- param_out: exactly master rounded (RNE) to its dtype, and within one ulp of the dtype
  (bf16 2^-7, fp16 2^-10 relative; fp32 as master) of torch's param cast to it.
- Lion (no torch twin) and every kernel vs its oracle (30 steps): bitwise when torch fuses
  (the oracle reproduces the kernel op for op, stochastic rounding included), else rtol 1e-6.
- grad_stats_flat vs torch.linalg.vector_norm in float64: rtol 1e-12 (exact for inf).
"""

import math
from array import array

import pytest
import torch

from zero_py import kernels
from zero_py.testing.reference import grad_stats_reference, optim_step_reference, sr_key

TORCH_FUSES = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
STEPS = 100


def _grads(n, gen, dtype=torch.float32):
    scale = 10.0 ** torch.randint(-5, 1, (n,), generator=gen).float()
    return (torch.randn(n, generator=gen) * scale).to(dtype)


def _poison(t, step):
    if t is None:
        return
    if step % 2:
        t.fill_(float("nan"))
    else:  # random bit patterns (NaNs, infs and numbers)
        t.view(torch.int16 if t.element_size() == 2 else torch.int32).random_()


def _states(kind, n, **kw):
    """Kernel states for `kind`, initialised as torch would."""
    if kind in (kernels.OPT_ADAMW, kernels.OPT_ADAM):
        st = [torch.zeros(n), torch.zeros(n), torch.zeros(n) if kw.get("amsgrad") else None]
    elif kind == kernels.OPT_SGD:
        st = [torch.full((n,), float("nan")) if kw.get("beta1") else None, None, None]
    elif kind == kernels.OPT_ADAGRAD:
        st = [torch.full((n,), kw.pop("initial_accumulator_value", 0.0)), None, None]
    else:
        st = [torch.zeros(n), None, None]
    return st


# name: (kind, torch class, torch kwargs, kernel kwargs, torch state keys)
TWINS = {
    "adamw": (kernels.OPT_ADAMW, torch.optim.AdamW, dict(lr=1e-3, weight_decay=1e-2),
              dict(lr=1e-3, weight_decay=1e-2, grad_scale=0.5), ("exp_avg", "exp_avg_sq")),
    "adamw_amsgrad_maximize": (
        kernels.OPT_ADAMW, torch.optim.AdamW,
        dict(lr=3e-2, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.3, amsgrad=True, maximize=True),
        dict(lr=3e-2, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.3, amsgrad=True,
             maximize=True), ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")),
    "adam_l2_beta1_0.3": (kernels.OPT_ADAM, torch.optim.Adam,
                          dict(lr=1e-2, betas=(0.3, 0.9), weight_decay=0.1),
                          dict(lr=1e-2, beta1=0.3, beta2=0.9, weight_decay=0.1),
                          ("exp_avg", "exp_avg_sq")),
    "adam_amsgrad_maximize": (kernels.OPT_ADAM, torch.optim.Adam,
                              dict(lr=1e-3, amsgrad=True, maximize=True, weight_decay=1e-3),
                              dict(lr=1e-3, amsgrad=True, maximize=True, weight_decay=1e-3),
                              ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")),
    "sgd": (kernels.OPT_SGD, torch.optim.SGD, dict(lr=0.1), dict(lr=0.1), ()),
    "sgd_momentum_dampening_wd": (
        kernels.OPT_SGD, torch.optim.SGD,
        dict(lr=1e-2, momentum=0.9, dampening=0.1, weight_decay=1e-2),
        dict(lr=1e-2, beta1=0.9, beta2=0.1, weight_decay=1e-2, grad_scale=2.0),
        ("momentum_buffer",)),
    "sgd_nesterov_maximize": (
        kernels.OPT_SGD, torch.optim.SGD,
        dict(lr=1e-2, momentum=0.8, nesterov=True, maximize=True, weight_decay=1e-3),
        dict(lr=1e-2, beta1=0.8, nesterov=True, maximize=True, weight_decay=1e-3),
        ("momentum_buffer",)),
    "adagrad_lr_decay_wd_init": (
        kernels.OPT_ADAGRAD, torch.optim.Adagrad,
        dict(lr=1e-2, lr_decay=1e-2, weight_decay=0.05, initial_accumulator_value=0.1),
        dict(lr=1e-2, beta1=1e-2, weight_decay=0.05, initial_accumulator_value=0.1),
        ("sum",)),
    "adagrad_maximize": (kernels.OPT_ADAGRAD, torch.optim.Adagrad,
                         dict(lr=0.1, maximize=True, eps=1e-6),
                         dict(lr=0.1, maximize=True, eps=1e-6), ("sum",)),
}

_ULP = {torch.float32: 0.0, torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}


def _run_twin(name, grad_dtype, out_dtype, n, threads=1, steps=STEPS):
    kind, cls, torch_kw, kernel_kw, keys = TWINS[name]
    kernel_kw = dict(kernel_kw)
    gen = torch.Generator().manual_seed(n + 17 * len(name))
    p0 = torch.randn(n, generator=gen)
    ref = p0.clone().requires_grad_(True)
    opt = cls([ref], **torch_kw)
    st = _states(kind, n, **kernel_kw)
    kernel_kw.pop("initial_accumulator_value", None)
    master = p0.clone()
    out = torch.empty(n, dtype=out_dtype)
    scale = kernel_kw.get("grad_scale", 1.0)
    for step in range(1, steps + 1):
        g = _grads(n, gen, grad_dtype)
        g_before = g.clone()
        ref.grad = g.float() * scale
        opt.step()
        _poison(out, step)
        kernels.optim_step_flat(kind, master, g, *st, out, step=step, n_threads=threads,
                                **kernel_kw)
        assert torch.equal(g, g_before), "the kernel must not write the gradient"
    want = ref.detach()
    if kind == kernels.OPT_SGD and TORCH_FUSES:
        assert torch.equal(master, want), f"max diff {(master - want).abs().max()}"
    torch.testing.assert_close(master, want, rtol=0, atol=1e-6)
    state = opt.state[ref]
    for key, mine in zip(keys, st):
        atol = 1e-12 if key in ("exp_avg_sq", "max_exp_avg_sq", "sum") else 1e-8
        torch.testing.assert_close(mine, state[key], rtol=1e-5, atol=atol, msg=key)
    assert torch.equal(out, master.to(out_dtype)), "param_out is not master rounded (RNE)"
    if out_dtype != torch.float32:
        gap = (out.float() - want.to(out_dtype).float()).abs()
        assert bool((gap <= _ULP[out_dtype] * want.abs().clamp_min(2.0 ** -14)).all())


@pytest.mark.parametrize("out_dtype", DTYPES, ids=lambda d: f"out_{str(d)[6:]}")
@pytest.mark.parametrize("grad_dtype", DTYPES, ids=lambda d: f"grad_{str(d)[6:]}")
@pytest.mark.parametrize("name", list(TWINS))
def test_kernel_matches_its_torch_optim_twin(name, grad_dtype, out_dtype):
    _run_twin(name, grad_dtype, out_dtype, n=1031)


@pytest.mark.parametrize("name", ["adamw_amsgrad_maximize", "sgd_nesterov_maximize",
                                  "adagrad_lr_decay_wd_init"])
def test_kernel_matches_its_twin_on_many_threads(name):
    _run_twin(name, torch.bfloat16, torch.bfloat16, n=140_001, threads=None, steps=20)


ORACLE_CASES = {
    "adamw": ("adamw", dict(weight_decay=0.1)),
    "adamw_amsgrad_maximize_beta1_0.3": ("adamw", dict(amsgrad=True, maximize=True, beta1=0.3)),
    "adam_l2_beta1_0": ("adam", dict(weight_decay=0.1, beta1=0.0)),
    "sgd_momentum": ("sgd", dict(beta1=0.9, beta2=0.1, weight_decay=0.01)),
    "sgd_nesterov": ("sgd", dict(beta1=0.9, nesterov=True, maximize=True)),
    "adagrad": ("adagrad", dict(beta1=0.01, weight_decay=0.1, initial_accumulator_value=0.1)),
    "lion": ("lion", dict(weight_decay=0.1, grad_scale=0.25)),
    "lion_maximize": ("lion", dict(beta1=0.95, beta2=0.98, maximize=True)),
}


@pytest.mark.parametrize("out_dtype", DTYPES, ids=lambda d: f"out_{str(d)[6:]}")
@pytest.mark.parametrize("grad_dtype", DTYPES, ids=lambda d: f"grad_{str(d)[6:]}")
@pytest.mark.parametrize("case", list(ORACLE_CASES))
def test_kernel_matches_its_oracle(case, grad_dtype, out_dtype):
    """Every kind (Lion has no torch twin) against the op-by-op oracle, bf16 param_out with
    stochastic rounding (a new seed every step)."""
    kind_name, kw = ORACLE_CASES[case]
    kind = kernels.opt_kind(kind_name)
    kw = dict(kw)
    n = 1031
    gen = torch.Generator().manual_seed(n)
    p0 = torch.randn(n, generator=gen)
    a = [p0.clone()] + _states(kind, n, **kw)
    kw.pop("initial_accumulator_value", None)
    b = [t.clone() if t is not None else None for t in a]
    out_a, out_b = torch.empty(n, dtype=out_dtype), torch.empty(n, dtype=out_dtype)
    sr = out_dtype == torch.bfloat16
    for step in range(1, 31):
        g = _grads(n, gen, grad_dtype)
        _poison(out_a, step)
        hp = dict(step=step, lr=1e-2, stochastic_rounding=sr, seed=1000 + step, **kw)
        kernels.optim_step_flat(kind, a[0], g, *a[1:], out_a, **hp)
        optim_step_reference(kind, b[0], g, *b[1:], out_b, **hp)
    for x, y in zip(a + [out_a], b + [out_b]):
        if x is None:
            continue
        if TORCH_FUSES:
            assert torch.equal(x.view(torch.int16) if x.element_size() == 2 else x,
                               y.view(torch.int16) if y.element_size() == 2 else y)
        else:
            torch.testing.assert_close(x.float(), y.float(), rtol=1e-6, atol=1e-7)


def test_stochastic_rounding_is_unbiased_and_thread_independent():
    n = 300_001
    gen = torch.Generator().manual_seed(9)
    # lr 0, no decay: master stays x, param_out is x rounded stochastically
    x = 1.0 + torch.rand(n, generator=gen) * 2.0 ** -7  # between two bf16 neighbours
    outs = []
    for threads in (1, 2, 3):
        out = torch.full((n,), float("nan"), dtype=torch.bfloat16)
        kernels.optim_step_flat("sgd", x.clone(), torch.zeros(n), param_out=out, step=1, lr=0.0,
                                stochastic_rounding=True, seed=123, n_threads=threads)
        outs.append(out)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    lo = x.to(torch.bfloat16, copy=True)
    lo = torch.where(lo.float() > x, lo.float() - 2.0 ** -7, lo.float())
    assert bool(((outs[0].float() == lo) | (outs[0].float() == lo + 2.0 ** -7)).all())
    # the mean rounding error over 300K elements: sigma ~ 2^-7 / sqrt(12 n) ~ 4e-6
    assert abs(float((outs[0].float() - x).double().mean())) < 3e-5
    # a different seed gives different noise; RNE would be biased on this data
    other = torch.empty(n, dtype=torch.bfloat16)
    kernels.optim_step_flat("sgd", x.clone(), torch.zeros(n), param_out=other, step=1, lr=0.0,
                            stochastic_rounding=True, seed=124)
    assert float((other != outs[0]).float().mean()) > 0.2
    assert sr_key(123, 0, 0) != sr_key(124, 0, 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("p", [1.0, 2.0, 3.0, math.inf])
def test_grad_stats_matches_vector_norm(dtype, p):
    gen = torch.Generator().manual_seed(int(p) if p != math.inf else 99)
    grads = [_grads(n, gen, dtype) for n in (1, 1000, 300_001, 17, 65_537)]
    sum_pow, bad = kernels.grad_stats_flat(grads, norm_type=p)
    assert bad is False
    full = torch.cat([g.double() for g in grads])
    norm = sum_pow if math.isinf(p) else sum_pow ** (1.0 / p)
    want = float(torch.linalg.vector_norm(full, ord=p))
    assert norm == pytest.approx(want, rel=0 if math.isinf(p) else 1e-12)
    assert sum_pow == pytest.approx(grad_stats_reference(grads, p)[0], rel=1e-12)
    for threads in (1, 2, 3):
        assert kernels.grad_stats_flat(grads, p, n_threads=threads)[0] == sum_pow


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bad", ["inf", "-inf", "nan"])
def test_grad_stats_detects_inf_and_nan(dtype, bad):
    grads = [torch.randn(n).to(dtype) for n in (5, 70_000, 33)]
    grads[1][12_345] = float(bad)
    for p in (1.0, 2.0, 3.0, math.inf):
        sum_pow, nonfinite = kernels.grad_stats_flat(grads, norm_type=p)
        assert nonfinite is True
        assert math.isnan(sum_pow) if bad == "nan" else sum_pow == math.inf
    assert kernels.grad_stats_flat([], 2.0) == (0.0, False)


def _isa_workload():
    """Every kind on several dtype pairs, 3 steps; and grad_stats. Returns all outputs."""
    out = {}
    n = 20_011
    for kind, kw in [("adamw", dict(amsgrad=True)), ("adam", dict(weight_decay=0.1, beta1=0.3)),
                     ("sgd", dict(beta1=0.9, nesterov=True)), ("adagrad", dict(beta1=0.1)),
                     ("lion", dict(weight_decay=0.1))]:
        for gd, od in [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                       (torch.float16, torch.float16), (torch.float32, torch.bfloat16)]:
            gen = torch.Generator().manual_seed(0)
            t = [torch.randn(n, generator=gen)] + [torch.rand(n, generator=gen) for _ in range(3)]
            o = torch.empty(n, dtype=od)
            for s in range(1, 4):
                grad = torch.randn(n, generator=gen).to(gd)
                kernels.optim_step_flat(kind, t[0], grad, *t[1:], o, step=s, lr=1e-2, seed=s,
                                        stochastic_rounding=od == torch.bfloat16 and s % 2 == 0,
                                        n_threads=s, **kw)
            out[(kind, str(gd), str(od))] = [x.clone() for x in t + [o.float()]]
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(20_011, generator=gen).to(d) for d in DTYPES]
    out["stats"] = [kernels.grad_stats_flat([g], p) for g in grads
                    for p in (1.0, 2.0, 2.5, math.inf)]
    return out


def test_every_instruction_set_gives_the_same_bits(monkeypatch):
    """ZP_CPU_ISA caps the dispatch (read at every call): avx512, avx2 and scalar bodies must
    agree bit for bit."""
    outs = {}
    for isa in ("avx512", "avx2", "scalar"):
        monkeypatch.setenv("ZP_CPU_ISA", isa)
        outs[kernels.cpu_isa()] = _isa_workload()
    monkeypatch.delenv("ZP_CPU_ISA")
    assert "scalar" in outs
    first = outs["scalar"]
    for isa, out in outs.items():
        assert out["stats"] == first["stats"], f"{isa}: grad_stats differs"
        for key, tensors in out.items():
            if key != "stats":
                for x, y in zip(tensors, first[key]):
                    assert torch.equal(x, y), f"{isa} differs from scalar on {key}"


def _flat(**over):
    n = over.pop("n", 8)
    args = dict(kind="adamw", master=torch.randn(n), grad=torch.randn(n), state0=torch.zeros(n),
                state1=torch.zeros(n), step=1, lr=1e-3)
    args.update(over)
    kernels.optim_step_flat(args.pop("kind"), args.pop("master"), args.pop("grad"), **args)


@pytest.mark.parametrize("over,match", [
    (dict(master=torch.randn(8).half()), "master must be a contiguous float32 CPU tensor"),
    (dict(grad=torch.ones(8, dtype=torch.int32)), "grad must be a contiguous float32 or bfloat16"),
    (dict(grad=torch.randn(9)), "grad has 9 elements, expected 8"),
    (dict(grad=torch.randn(16)[::2]), "contiguous=False"),
    (dict(state1=None), r"adamw needs state1 \(exp_avg_sq\)"),
    (dict(amsgrad=True), r"needs state2 \(max_exp_avg_sq\)"),
    (dict(state0=torch.zeros(8, dtype=torch.float64)), "state0 must be a contiguous float32"),
    (dict(param_out=torch.zeros(8, dtype=torch.float64)), "param_out must be"),
    (dict(lr=-1.0), r"lr must be finite and >= 0, got -1"),
    (dict(beta1=1.0), r"beta1 must be in \[0, 1\), got 1"),
    (dict(eps=-1e-8), "eps must be finite and >= 0"),
    (dict(weight_decay=float("nan")), "weight_decay must be finite"),
    (dict(grad_scale=float("inf")), "grad_scale must be finite"),
    (dict(kind="sgd", beta1=0.0, nesterov=True), r"nesterov needs momentum > 0 \(got 0\)"),
    (dict(kind="sgd", amsgrad=True, state2=torch.zeros(8)), "amsgrad is for adam/adamw only"),
    (dict(kind="sgd", beta1=0.9, state0=None), r"sgd needs state0 \(momentum_buffer\)"),
    (dict(stochastic_rounding=True, param_out=torch.zeros(8, dtype=torch.float16)),
     "stochastic rounding needs a bf16 param_out"),
    (dict(kind="adagrad", beta1=-0.1), r"lr_decay \(beta1\) must be finite and >= 0"),
    (dict(step=0), "step must be an int >= 1"),
    (dict(kind="rmsprop"), "unknown optimizer kind 'rmsprop'"),
    (dict(seed=-1), "seed must be in"),
])
def test_bad_inputs_raise_value_error(over, match):
    with pytest.raises(ValueError, match=match):
        _flat(**over)


def test_bad_tables_and_stats_inputs_raise_value_error():
    with pytest.raises(ValueError, match="segments must be int64 rows of 10"):
        kernels.optim_step_segments(array("q", [0] * 9), [])
    with pytest.raises(ValueError, match="group row 0 has 10 fields, expected 11"):
        kernels.optim_step_segments(array("q"), [[0.0] * 10])
    with pytest.raises(ValueError, match="unknown kind -1"):
        kernels.optim_step_segments(array("q"), [[1.5] + [0.0] * 10])
    # the binding's own check of a row's seed names the value (its message used to end in a
    # literal "%g": PyErr_Format has no %g)
    with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\*\*53\], got "
                                         r"1\.2e\+18$"):
        kernels.optim_step_segments(array("q"), [[0.0] * 10 + [1.2e18]])
    with pytest.raises(IndexError, match="segment 0 names group 3"):
        kernels.optim_step_segments(array("q", [0, 0, 0, 0, 0, 0, 1, 1, 3, 0]), [])
    with pytest.raises(ValueError, match="one dtype per call"):
        kernels.grad_stats_flat([torch.randn(3), torch.randn(3).half()])
    with pytest.raises(ValueError, match="norm_type must be > 0"):
        kernels.grad_stats_flat([torch.randn(3)], norm_type=0.0)
    with pytest.raises(ValueError, match="float32, bfloat16 and float16"):
        kernels.dtype_code(torch.float64)


# ---- run-time tuning (csrc/kernels/cpu/tuning.h): every path against torch.optim ----------

# (ZP_CPU_ISA, ZP_CPU_PREFETCH, ZP_CPU_SPLIT, ZP_CPU_STREAM): "1" streams every 16-bit
# param_out, "0" none
PATHS = [("avx512", "2048", "blocks", "1"), ("avx512", "0", "static", "0"),
         ("avx512", "2048:l1", "blocks", "1"), ("avx2", "2048", "blocks", "1"),
         ("avx2", "0", "blocks", "0"), ("avx2", "100:l1", "static", "1"),
         ("scalar", "2048", "blocks", "1")]


@pytest.mark.parametrize("isa,prefetch,split,stream", PATHS)
@pytest.mark.parametrize("name", ["adamw", "adam_amsgrad_maximize", "sgd_momentum_dampening_wd",
                                  "adagrad_maximize"])
def test_every_path_matches_its_torch_optim_twin(monkeypatch, name, isa, prefetch, split,
                                                 stream):
    """ZP_CPU_ISA forces the bodies, ZP_CPU_PREFETCH the prefetch distance, ZP_CPU_SPLIT the
    split, ZP_CPU_STREAM the streaming stores: each path on its own (not only compared with the
    others) matches torch.optim, on two threads (140K elements: three 64K blocks) and on a
    small tensor, fp32 and bf16 (and fp16 out)."""
    monkeypatch.setenv("ZP_CPU_ISA", isa)
    monkeypatch.setenv("ZP_CPU_PREFETCH", prefetch)
    monkeypatch.setenv("ZP_CPU_SPLIT", split)
    monkeypatch.setenv("ZP_CPU_STREAM", stream)
    tuning = kernels.cpu_tuning()
    assert tuning["prefetch_bytes"] == int(prefetch.split(":")[0]) and tuning["split"] == split
    assert tuning["prefetch_into"] == ("l1" if prefetch.endswith(":l1") else "l2")
    if isa != "avx512" or tuning["isa"] == "avx512":  # avx512 only where the CPU has it
        assert tuning["isa"] == isa or (isa == "avx2" and tuning["isa"] == "scalar")
    _run_twin(name, torch.float32, torch.float32, n=140_001, threads=2, steps=8)
    _run_twin(name, torch.bfloat16, torch.bfloat16, n=140_001, threads=2, steps=4)
    _run_twin(name, torch.bfloat16, torch.float16, n=1031, steps=8)


def test_prefetch_distance_and_streaming_stores_do_not_change_bits(monkeypatch):
    outs = []
    for prefetch, stream in [("0", "0"), ("64", "1"), ("100", "0"), ("2048", "1"),
                             ("65536", "0"), ("2048:l1", "1"), ("100:l1", "0")]:
        monkeypatch.setenv("ZP_CPU_PREFETCH", prefetch)
        monkeypatch.setenv("ZP_CPU_STREAM", stream)
        outs.append(_isa_workload())
    for out in outs[1:]:
        for key, tensors in out.items():
            if key == "stats":
                assert tensors == outs[0]["stats"]
            else:
                for x, y in zip(tensors, outs[0][key]):
                    assert torch.equal(x, y), f"{key} depends on the prefetch distance"


def test_cpu_tuning_defaults_and_overrides(monkeypatch):
    monkeypatch.delenv("ZP_CPU_ISA", raising=False)
    monkeypatch.delenv("ZP_CPU_PREFETCH", raising=False)
    t = kernels.cpu_tuning()
    assert t["vendor"] in ("intel", "amd", "other")
    assert t["isa"] == kernels.cpu_isa() in ("avx512", "avx2", "scalar")
    assert t["prefetch_bytes"] == 2048 and t["split"] == "blocks"
    assert t["stream_min_bytes"] == 4 << 20
    if t["vendor"] == "amd":  # the vendor default: 256-bit bodies on AMD (tuning.h)
        assert t["isa"] in ("avx2", "scalar")
    assert t["prefetch_into"] == "l2"
    for bad in ("-1", "abc", "9" * 30, "2048x", ":l1", "2048:l3"):  # ignored: the default stays
        monkeypatch.setenv("ZP_CPU_PREFETCH", bad)
        assert kernels.cpu_tuning()["prefetch_bytes"] == 2048
    monkeypatch.setenv("ZP_CPU_PREFETCH", "0")
    assert kernels.cpu_tuning()["prefetch_bytes"] == 0
    monkeypatch.setenv("ZP_CPU_PREFETCH", "4096:l1")
    assert kernels.cpu_tuning()["prefetch_bytes"] == 4096
    assert kernels.cpu_tuning()["prefetch_into"] == "l1"
    monkeypatch.setenv("ZP_CPU_ISA", "scalar")
    assert kernels.cpu_isa() == "scalar" and kernels.cpu_tuning()["isa"] == "scalar"


def _bits(t):
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32).clone()


@pytest.mark.parametrize("isa", ["avx512", "avx2", "scalar"])
@pytest.mark.parametrize("n", [1, 17, 1000, 140_003])
def test_stream_bound_moves_every_stream_and_changes_nothing(monkeypatch, isa, n):
    """The bound reads and stores back every byte of its streams: read and update streams keep
    their bits (NaNs included), write streams are zeroed, for every ISA, both splits."""
    monkeypatch.setenv("ZP_CPU_ISA", isa)
    monkeypatch.setenv("ZP_CPU_SPLIT", "static" if n % 2 else "blocks")
    monkeypatch.setenv("ZP_CPU_STREAM", "1" if n > 100 else "0")
    monkeypatch.setenv("ZP_CPU_PREFETCH", "2048:l1" if n == 1000 else "2048")
    gen = torch.Generator().manual_seed(n)
    streams = []
    for dtype, access in [(torch.float32, "read"), (torch.bfloat16, "read"),
                          (torch.float32, "update"), (torch.float32, "update"),
                          (torch.bfloat16, "update"), (torch.float32, "write"),
                          (torch.bfloat16, "write")]:
        t = torch.empty(n, dtype=dtype)
        t.view(torch.int16 if t.element_size() == 2 else torch.int32).random_(generator=gen)
        streams.append((t, access))
    before = [_bits(t) for t, _ in streams]
    for threads in (1, 2, 3):
        kernels.stream_bound(streams, n_threads=threads)
        for (t, access), b in zip(streams, before):
            if access == "write":
                assert bool((_bits(t) == 0).all())
            else:
                assert torch.equal(_bits(t), b), f"{access} stream changed"


def test_stream_bound_rejects_bad_streams():
    x = torch.zeros(8)
    with pytest.raises(ValueError, match="choose read, update or write"):
        kernels.stream_bound([(x, "copy")])
    with pytest.raises(ValueError, match="2- or 4-byte elements"):
        kernels.stream_bound([(x.double(), "read")])
    with pytest.raises(ValueError, match="every stream needs 8 elements, got 9"):
        kernels.stream_bound([(x, "read"), (torch.zeros(9), "update")])
    with pytest.raises(ValueError, match="no streams"):
        kernels.stream_bound([])
    with pytest.raises(ValueError, match="1 to 8 int64 rows"):
        kernels.stream_bound([(x, "read")] * 9)


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_streaming_stores_at_every_alignment(monkeypatch, isa, out_dtype):
    """param_out starting at every 2-byte offset of a line: the streaming path writes its
    unaligned head with plain stores and gives the bits of the plain path, SR included."""
    monkeypatch.setenv("ZP_CPU_ISA", isa)
    n = 5000
    gen = torch.Generator().manual_seed(5)
    master0, grad = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    for offset in range(0, 33, 3):
        outs = []
        for stream in ("0", "1"):
            monkeypatch.setenv("ZP_CPU_STREAM", stream)
            base = torch.full((n + 40,), float("nan"), dtype=out_dtype)
            out = base[offset:offset + n]
            kernels.optim_step_flat("sgd", master0.clone(), grad, param_out=out, step=1,
                                    lr=0.1, stochastic_rounding=out_dtype == torch.bfloat16,
                                    seed=offset)
            outs.append(base)
        assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16)), offset


@pytest.mark.parametrize("isa", ["avx512", "avx2"])
@pytest.mark.parametrize("kind", ["adamw", "sgd", "adagrad", "lion"])
def test_bf16_bodies_at_every_alignment_match_the_chunked_path(monkeypatch, isa, kind):
    """A bf16 gradient and a bf16 param_out take each kind's fused body (widened and narrowed
    in registers), streaming or not; the scalar ISA takes the chunked path. param_out and the
    states at every 2-byte offset of a line, a length that leaves a tail: the same bits."""
    n = 5000
    gen = torch.Generator().manual_seed(6)
    master0, grad = torch.randn(n, generator=gen), torch.randn(n, generator=gen).bfloat16()
    states0 = [torch.rand(n, generator=gen) for _ in range(2)]
    for offset in range(0, 33, 5):
        outs = []
        for path, stream in ((isa, "0"), (isa, "1"), ("scalar", "0")):
            monkeypatch.setenv("ZP_CPU_ISA", path)
            monkeypatch.setenv("ZP_CPU_STREAM", stream)
            base = torch.full((n + 40,), float("nan"), dtype=torch.bfloat16)
            out = base[offset:offset + n]
            master = master0.clone()
            states = [s.clone() for s in states0] if kind == "adamw" else [states0[0].clone()]
            for step in (1, 2):
                kernels.optim_step_flat(kind, master, grad, *states, param_out=out, step=step,
                                        lr=0.05, weight_decay=0.1)
            outs.append([base.view(torch.int16), master] + states)
        for other in outs[1:]:
            for x, y in zip(outs[0], other):
                assert torch.equal(x, y), (kind, isa, offset)


@pytest.mark.parametrize("kind", ["adamw", "sgd", "adagrad", "lion"])
def test_bf16_bodies_narrow_nan_and_inf_as_the_scalar_path(monkeypatch, kind):
    """Non-finite gradients (NaN of either sign, +-inf) through each ISA's fused bf16 body: the
    masters, states and bf16 parameters (NaN made 0x7FC0, infinities kept) equal the scalar
    path's bits, streaming or not."""
    n = 4099
    gen = torch.Generator().manual_seed(11)
    grad = torch.randn(n, generator=gen)
    at = torch.randperm(n, generator=gen)[:400]
    grad[at[:100]], grad[at[100:200]] = float("nan"), -float("nan")
    grad[at[200:300]], grad[at[300:]] = float("inf"), -float("inf")
    grad = grad.bfloat16()
    master0 = torch.randn(n, generator=gen)
    states0 = [torch.rand(n, generator=gen) for _ in range(2)]
    outs = []
    for isa, stream in (("scalar", "0"), ("avx2", "0"), ("avx2", "1"), ("avx512", "0"),
                        ("avx512", "1")):
        monkeypatch.setenv("ZP_CPU_ISA", isa)
        monkeypatch.setenv("ZP_CPU_STREAM", stream)
        master, out = master0.clone(), torch.empty(n, dtype=torch.bfloat16)
        states = [s.clone() for s in states0] if kind == "adamw" else [states0[0].clone()]
        kernels.optim_step_flat(kind, master, grad, *states, param_out=out, step=1, lr=0.05,
                                weight_decay=0.1)
        outs.append((isa, [out.view(torch.int16), master.view(torch.int32)]
                     + [s.view(torch.int32) for s in states]))
    # Lion's sign update leaves a parameter unchanged where its gradient is NaN
    assert outs[0][1][0].eq(0x7FC0).any() or kind == "lion", "the workload makes no NaN"
    assert not all(torch.isfinite(t.view(torch.float32)).all() for t in outs[0][1][1:])
    for isa, tensors in outs[1:]:
        for x, y in zip(outs[0][1], tensors):
            assert torch.equal(x, y), (kind, isa)


def test_copy_tensors_equals_torch_copy_and_refuses_bad_pairs():
    """kernels.copy_tensors (the offloaded early step's backups) against torch's copy: several
    pairs in one call, sizes around the C side's 1 MiB blocks, at 1 and 2 threads; bad pairs
    raise and copy nothing."""
    g = torch.Generator().manual_seed(5)
    sizes = [0, 3, (1 << 18) - 1, 1 << 18, (1 << 18) + 7, 900_001]
    for threads in (1, 2):
        src = [torch.randn(n, generator=g) for n in sizes] + [torch.randn(77).bfloat16()]
        dst = [torch.full_like(t, float("nan")) for t in src]
        kernels.copy_tensors(list(zip(dst, src)), n_threads=threads)
        for d, s in zip(dst, src):
            assert torch.equal(d, s)
    a, b = torch.randn(100, generator=g), torch.zeros(100)
    with pytest.raises(ValueError, match="overlaps"):
        kernels.copy_tensors([(b[:50], a[:50]), (b[40:90], a[50:])])
    with pytest.raises(ValueError, match="overlaps"):
        kernels.copy_tensors([(a[:50], a[25:75])])
    assert torch.equal(b, torch.zeros(100))
    with pytest.raises(ValueError, match="one dtype and size"):
        kernels.copy_tensors([(b[:10], a[:11])])
    with pytest.raises(ValueError, match="contiguous"):
        kernels.copy_tensors([(b[::2], a[:50])])


def _adamw_bits(seed: int, n: int, threads: int) -> torch.Tensor:
    """Ten fused AdamW steps on seeded data, on `threads` of the kernels' pool; the master."""
    g = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=g)
    m, v = torch.zeros(n), torch.zeros(n)
    for step in range(1, 11):
        kernels.optim_step_flat("adamw", master, torch.randn(n, generator=g), m, v, step=step,
                                lr=1e-3, weight_decay=0.1, n_threads=threads)
    return master


def _adamw_in_child(seed, n, threads, queue):
    # torch's own OpenMP pool does not survive fork() (its large randn hangs in the child,
    # with or without zero_py): keep torch on this thread; ours must start afresh
    torch.set_num_threads(1)
    queue.put(_adamw_bits(seed, n, threads).numpy().tobytes())


def test_kernels_from_several_threads_and_after_fork_give_the_same_bits():
    """The kernels' persistent thread pool (csrc/common/parallel.c) under Python's use of it:
    four Python threads calling at once (one holds the pool, the others run on threads of
    their own), then a forked child (whose pool starts afresh) calling after the parent's pool
    has run; every result equals the same steps run alone, bit for bit."""
    import multiprocessing
    import threading

    n = 300_000  # several of the kernels' blocks: more than one thread takes part
    want = {seed: _adamw_bits(seed, n, 2) for seed in range(4)}
    got = {}

    def run(seed):
        got[seed] = _adamw_bits(seed, n, 2)

    threads = [threading.Thread(target=run, args=(seed,)) for seed in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert sorted(got) == list(range(4))
    for seed in range(4):
        assert torch.equal(got[seed], want[seed]), seed
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_adamw_in_child, args=(1, n, 2, queue))
    child.start()
    try:
        out = queue.get(timeout=120)
    finally:
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
    assert child.exitcode == 0
    assert out == want[1].numpy().tobytes()
