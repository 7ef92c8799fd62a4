"""The fused C AdamW (the family's AdamW on fp32 tensors) against torch.optim.AdamW and
against the pure-PyTorch oracle.

100 steps on random data of several sizes (odd tails, many threads), with gradients spanning
ten orders of magnitude. Tolerance: 1e-6 absolute on parameters of unit scale (measured:
~1.2e-7: the kernel follows torch's operation order, but torch's CPU sqrt is one ulp off on
about 1% of inputs; m and v agree exactly).
"""

import pytest
import torch

from zero_py import kernels
from zero_py.testing.reference import adamw_reference

ATOL = 1e-6


def _grads(n, gen):
    scale = 10.0 ** torch.randint(-8, 2, (n,), generator=gen).float()
    return torch.randn(n, generator=gen) * scale


@pytest.mark.parametrize("n,threads", [(1, 1), (37, 1), (4099, 2), (300_001, None)])
@pytest.mark.parametrize("hp", [dict(lr=1e-3, weight_decay=1e-2),
                                dict(lr=3e-2, beta1=0.8, beta2=0.95, eps=1e-6, weight_decay=0.3)])
def test_c_adamw_matches_torch_adamw_over_100_steps(n, threads, hp):
    gen = torch.Generator().manual_seed(n)
    p = torch.randn(n, generator=gen)
    ref = p.clone().requires_grad_(True)
    opt = torch.optim.AdamW([ref], lr=hp["lr"], betas=(hp.get("beta1", 0.9),
                            hp.get("beta2", 0.999)), eps=hp.get("eps", 1e-8),
                            weight_decay=hp["weight_decay"])
    m, v = torch.zeros(n), torch.zeros(n)
    for step in range(1, 101):
        g = _grads(n, gen)
        g_before = g.clone()
        ref.grad = g.clone()
        opt.step()
        kernels.adamw_step_flat(p, g, m, v, step=step, n_threads=threads, **hp)
        assert torch.equal(g, g_before), "the kernel must not write the gradient"
    state = opt.state[ref]
    torch.testing.assert_close(p, ref.detach(), rtol=0, atol=ATOL)
    torch.testing.assert_close(m, state["exp_avg"], rtol=1e-6, atol=1e-12)
    torch.testing.assert_close(v, state["exp_avg_sq"], rtol=1e-5, atol=1e-20)


def test_c_adamw_matches_the_pytorch_oracle():
    gen = torch.Generator().manual_seed(7)
    n = 100_003
    a = [torch.randn(n, generator=gen), None, torch.zeros(n), torch.zeros(n)]
    b = [t.clone() if t is not None else None for t in a]
    for step in range(1, 21):
        g = _grads(n, gen)
        kernels.adamw_step_flat(a[0], g, a[2], a[3], step=step, lr=1e-2, grad_scale=0.5)
        adamw_reference(b[0], g, b[2], b[3], step=step, lr=1e-2, grad_scale=0.5)
    torch.testing.assert_close(a[0], b[0], rtol=0, atol=ATOL)
    torch.testing.assert_close(a[2], b[2], rtol=1e-6, atol=1e-12)


def test_c_adamw_threads_agree_bitwise():
    gen = torch.Generator().manual_seed(3)
    n = 1 << 18
    base = [torch.randn(n, generator=gen), _grads(n, gen), torch.rand(n, generator=gen),
            torch.rand(n, generator=gen)]
    outs = []
    for threads in (1, 2, 3):
        p, g, m, v = (t.clone() for t in base)
        kernels.adamw_step_flat(p, g, m, v, step=3, lr=1e-2, n_threads=threads)
        outs.append(torch.cat([p, m, v]))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_cpu_isa_is_reported():
    assert kernels.cpu_isa() in ("avx512", "avx2", "scalar")
    assert kernels.default_threads() >= 1


@pytest.mark.parametrize("bad,match", [(dict(lr=-1.0), "lr must be"),
                                       (dict(beta1=1.0), "beta1 must be in"),
                                       (dict(eps=-1e-8), "eps must be"),
                                       (dict(weight_decay=float("nan")), "weight_decay")])
def test_c_adamw_rejects_bad_hyperparameters(bad, match):
    t = [torch.randn(8) for _ in range(4)]
    with pytest.raises(ValueError, match=match):
        kernels.adamw_step_flat(*t, step=1, **{"lr": 1e-3, **bad})


def test_c_adamw_rejects_bad_tensors():
    t = [torch.randn(8) for _ in range(4)]
    with pytest.raises(ValueError, match="contiguous float32 CPU tensor"):
        kernels.adamw_step_flat(t[0].double(), *t[1:], step=1, lr=1e-3)
    with pytest.raises(ValueError, match="expected 8"):
        kernels.adamw_step_flat(t[0], torch.randn(9), *t[2:], step=1, lr=1e-3)
    with pytest.raises(ValueError, match="step"):
        kernels.adamw_step_flat(*t, step=0, lr=1e-3)


def _isa_run():
    g = torch.Generator().manual_seed(0)
    n = 100_003
    p, gr, m, v = (torch.randn(n, generator=g), torch.randn(n, generator=g), torch.zeros(n),
                   torch.zeros(n))
    for s in range(1, 6):
        kernels.adamw_step_flat(p, gr, m, v, step=s, lr=1e-2, weight_decay=0.1)
    return torch.cat([p, m, v])


def test_every_instruction_set_gives_the_same_bits(monkeypatch):
    """ZP_CPU_ISA caps the dispatch: avx512, avx2 and scalar bodies must agree bit for bit.
    The kernels read it at each call (tuning.c), so one process sets it in turn; an
    instruction set this CPU lacks falls to the next one down (said by cpu_isa())."""
    outs = {}
    for isa in ("avx512", "avx2", "scalar"):
        monkeypatch.setenv("ZP_CPU_ISA", isa)
        got = kernels.cpu_isa()
        if got not in outs:
            outs[got] = _isa_run()
    assert "scalar" in outs
    first = next(iter(outs.values()))
    for isa, out in outs.items():
        assert torch.equal(out, first), f"{isa} differs"
