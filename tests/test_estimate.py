"""zero_py.estimate_memory, checked three ways:

- against the library's own accounting: every term of ZeroOptimizer.memory_report() after
  real training steps, stages 1-3 at 1, 2 and 4 gloo ranks, and variants (bf16 parameters
  with fp32 masters, Lion, SGD with momentum, a persistence threshold, a smaller bucket);
- against measured memory: the growth of each rank's peak resident set (VmHWM) over two
  training steps, from before the model was built, within 10% of the estimated total.
  Resident memory is live memory only if freed blocks go back to the kernel, so the ranks run
  with glibc's mmap threshold fixed at 64 KiB (as tests/test_meta_build_memory.py does), and
  with ZP_SHM=0: a shared-memory gather file is resident in every rank that reads it, while
  the accounting (rightly) charges each rank its own share;
- against the ZeRO paper's closed forms for a bare parameter count (16 psi / N, ...).
"""

import gc
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import distributed
import zero_py
from zero_py.tools.estimate import estimate_memory, format_table

LAYERS, WIDTH = 24, 362   # 3.1M parameters: 12.6 MB in fp32; one unit is 0.5 MB
WORLDS = (1, 2, 4)
TOLERANCE = 0.10


class Stack(nn.Module):
    def __init__(self, layers=LAYERS, width=WIDTH):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _status_bytes(key):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def _build(stage, layers, width, dtype=torch.float32, optimizer=torch.optim.AdamW, **kw):
    torch.manual_seed(0)
    model = Stack(layers, width).to(dtype)
    if stage == 3:
        kw.setdefault("wrap_policy", {nn.Linear})
    return zero_py.initialize(model, optimizer, stage=stage, lr=1e-3, **kw)


def _steps(model, opt, width, dtype, n):
    x = torch.randn(4, width, dtype=dtype)
    for _ in range(n):
        model(x).float().sum().backward()
        opt.step()
        opt.zero_grad()


def _measure(rank, world_size):
    """Each stage's peak RSS growth and memory_report() on this rank."""
    for stage in (1, 2, 3):  # one-time costs (gloo buffers, the native library, thread pools)
        model, opt = _build(stage, 2, 16)
        _steps(model, opt, 16, torch.float32, 1)
        del model, opt
    out = {}
    for stage in (1, 2, 3):
        gc.collect()
        dist.barrier()
        before = _status_bytes("VmRSS")
        model, opt = _build(stage, LAYERS, WIDTH)
        _steps(model, opt, WIDTH, torch.float32, 1)  # optimizer states exist from here
        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS: the peak of construction is not a training peak
        _steps(model, opt, WIDTH, torch.float32, 2)
        out[stage] = {"growth": _status_bytes("VmHWM") - before,
                      "report": opt.memory_report()}
        del model, opt
        gc.collect()
        dist.barrier()
    return out


VARIANTS = {
    "bf16-adamw-s1": dict(stage=1, dtype=torch.bfloat16),
    "bf16-lion-s2": dict(stage=2, dtype=torch.bfloat16, optimizer=zero_py.Lion),
    "sgd-momentum-s2-small-buckets": dict(stage=2, optimizer=torch.optim.SGD,
                                          bucket_bytes=2**20, momentum=0.9),
    "bf16-s3-persistent-biases": dict(stage=3, dtype=torch.bfloat16,
                                      persistence_threshold=1000),
    "s3-fp32-reduce": dict(stage=3, dtype=torch.bfloat16, grad_reduce_dtype=torch.float32),
    "bf16-s2-offload-cpu": dict(stage=2, dtype=torch.bfloat16, offload_optimizer="cpu",
                                grad_reduce_dtype=torch.float32),
    "bf16-s3-offload-cpu-params": dict(stage=3, dtype=torch.bfloat16, offload_optimizer="cpu",
                                       offload_params="cpu"),
    "s1-offload-nvme": dict(stage=1, offload_optimizer="nvme"),
    "bf16-s3-offload-nvme-params": dict(stage=3, dtype=torch.bfloat16, offload_optimizer="nvme",
                                        offload_params="nvme"),
}


def _variants(rank, world_size):
    import tempfile

    out = {}
    for name, kw in VARIANTS.items():
        kw = dict(kw)
        stage, dtype = kw.pop("stage"), kw.pop("dtype", torch.float32)
        if kw.get("offload_optimizer") == "nvme":
            kw["offload_dir"] = tempfile.mkdtemp(prefix="zp-estimate-")
        model, opt = _build(stage, 6, 64, dtype, **kw)
        _steps(model, opt, 64, dtype, 2)
        out[name] = opt.memory_report()
        del model, opt
    return out


def _estimate_variant(name, world):
    kw = dict(VARIANTS[name])
    stage, dtype = kw.pop("stage"), kw.pop("dtype", torch.float32)
    opt = kw.pop("optimizer", torch.optim.AdamW)
    est_kw = {k: kw.pop(k) for k in ("bucket_bytes", "persistence_threshold",
                                     "grad_reduce_dtype", "offload_params") if k in kw}
    if "offload_optimizer" in kw:
        est_kw["offload"] = kw.pop("offload_optimizer")
    model = Stack(6, 64).to(dtype)
    return estimate_memory(model, world, stage, dtype, optimizer=opt, optimizer_kwargs=kw,
                           shared_memory=False,
                           wrap_policy={nn.Linear} if stage == 3 else None, **est_kw)


@pytest.fixture(scope="module")
def measured():
    mp = pytest.MonkeyPatch()
    mp.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    mp.setenv("MALLOC_TRIM_THRESHOLD_", "65536")
    mp.setenv("ZP_SHM", "0")
    try:
        return {n: distributed.run(_measure, n) for n in WORLDS}
    finally:
        mp.undo()


def _check_terms(est, rep, where):
    """Each estimated term against memory_report's (stage 3's working set is in its params)."""
    pairs = {"params": (est.params + est.working_set, rep["params"]),
             "grads": (est.grads, rep["grads"]),
             "optimizer_states": (est.optimizer_states, rep["optimizer_states"])}
    offloaded = {"host": (est.host, rep["host_optimizer_states"] + rep["host_grads"]
                          + rep["host_params"]),
                 "nvme": (est.nvme, rep["nvme_optimizer_states"] + rep["nvme_params"])}
    for term, (e, r) in offloaded.items():
        assert abs(e - r) <= TOLERANCE * max(r, 1), (
            f"{where}: estimated {term} {e / 1e6:.3f} MB, memory_report() says {r / 1e6:.3f} MB")
    for term, (e, r) in pairs.items():
        assert abs(e - r) <= TOLERANCE * max(r, 1), (
            f"{where}: estimated {term} {e / 1e6:.3f} MB, memory_report() says {r / 1e6:.3f} MB")
    total = sum(r for _, r in pairs.values())
    assert abs(est.total - total) <= TOLERANCE * total


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("stage", (1, 2, 3))
def test_matches_memory_report(measured, stage, world):
    est = estimate_memory(Stack().to("meta"), world, stage, shared_memory=False,
                          wrap_policy={nn.Linear} if stage == 3 else None)
    for rank, res in enumerate(measured[world]):
        _check_terms(est, res[stage]["report"], f"stage {stage}, rank {rank} of {world}")


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("stage", (1, 2, 3))
def test_matches_resident_memory(measured, stage, world):
    est = estimate_memory(Stack().to("meta"), world, stage, shared_memory=False,
                          wrap_policy={nn.Linear} if stage == 3 else None)
    for rank, res in enumerate(measured[world]):
        growth = res[stage]["growth"]
        err = growth / est.total - 1
        assert abs(err) <= TOLERANCE, (
            f"stage {stage}, rank {rank} of {world}: peak RSS grew {growth / 1e6:.2f} MB over "
            f"two steps, the estimate is {est.total / 1e6:.2f} MB ({100 * err:+.1f}%)")


@pytest.mark.parametrize("world", (1, pytest.param(4, marks=pytest.mark.slow)))
def test_variants_match_memory_report(world):
    env = {"ZP_SHM": "0"}
    mp = pytest.MonkeyPatch()
    for k, v in env.items():
        mp.setenv(k, v)
    try:
        res = distributed.run(_variants, world)
    finally:
        mp.undo()
    for name in VARIANTS:
        est = _estimate_variant(name, world)
        for rank, reports in enumerate(res):
            _check_terms(est, reports[name], f"{name}, rank {rank} of {world}")


def _tiny_gpt():
    from zero_py.examples.demo import TinyGPT

    torch.manual_seed(0)
    return TinyGPT(256, n_layer=4, n_head=4, d_model=128, block_size=64)


def _gpt_reports(rank, world_size):
    from zero_py.examples.demo import Block

    out = {}
    for stage in (1, 2, 3):
        kw = {"wrap_policy": {Block}} if stage == 3 else {}
        model, opt = zero_py.initialize(_tiny_gpt(), stage=stage, lr=1e-3, **kw)
        x = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(rank))
        for _ in range(2):
            _, loss = model(x, x)
            loss.backward()
            opt.step()
            opt.zero_grad()
        out[stage] = opt.memory_report()
        del model, opt
    return out


def test_gpt_with_tied_embeddings_matches_memory_report():
    """A transformer: tied embeddings in the root unit (gathered throughout stage 3), blocks as
    units, LayerNorms and biases beside the weights; with the shared-memory gathers on."""
    from zero_py.examples.demo import Block

    res = distributed.run(_gpt_reports, 4)
    for stage in (1, 2, 3):
        est = estimate_memory(_tiny_gpt().to("meta"), 4, stage,
                              wrap_policy={Block} if stage == 3 else None)
        for rank, reports in enumerate(res):
            _check_terms(est, reports[stage], f"TinyGPT stage {stage}, rank {rank} of 4")


def test_a_model_with_no_trainable_parameter_matches_memory_report(single_rank_group):
    """Stage 3 shards a frozen model (a reference or teacher model) with nothing to reduce or
    update (defect: the estimate counted the gradient buckets of reductions that never run)."""
    torch.manual_seed(0)
    model, opt = zero_py.initialize(Stack(4, 64).requires_grad_(False), stage=3,
                                    wrap_policy={nn.Linear})
    x = torch.randn(4, 64, requires_grad=True)
    with torch.no_grad():
        model(x)
    model(x).sum().backward()  # gradients reach x only
    opt.step()
    est = estimate_memory(Stack(4, 64).requires_grad_(False).to("meta"), 1, 3,
                          shared_memory=False, wrap_policy={nn.Linear})
    assert est.grads == 0 and est.optimizer_states == 0
    _check_terms(est, opt.memory_report(), "a frozen Stack under stage 3")


def test_closed_forms_for_a_parameter_count():
    """The ZeRO paper's per-rank model states (K = 12 for mixed-precision Adam): 2 psi + 2 psi
    + K psi / N for stage 1, 2 psi + (2 + K) psi / N for stage 2 and (2 + 2 + K) psi / N for
    stage 3, plus zero_py's bounded buffers; DDP (2 + 2 + K) psi plus the copy of the gradients
    its reducer keeps in its buckets (gradient_as_bucket_view=False, memory_report's ddp_grads)."""
    psi, n, b = 7_000_000_000, 8, 2
    unit = psi // 32
    bucket = 25 * 2**20
    e = {s: estimate_memory(psi, n, s, "bf16", largest_unit=unit) for s in (1, 2, 3)}
    assert e[1].ddp == (2 + 2 * 2 + 12) * psi
    for s in (1, 2, 3):
        assert e[s].optimizer_states == pytest.approx(12 * psi / n, rel=1e-4)
    assert e[1].params == e[2].params == pytest.approx(2 * psi, rel=1e-4)
    # stage 1: full param.grad, the grad shard, three bucket buffers and two receive buffers
    assert e[1].grads == pytest.approx(2 * psi + 2 * psi / n + 3 * bucket
                                       + 2 * bucket * (n - 2) / n, rel=1e-4)
    assert e[2].grads == pytest.approx(2 * psi / n + 3 * bucket + 2 * bucket * (n - 2) / n,
                                       rel=1e-4)
    assert e[3].params == pytest.approx(2 * psi / n, rel=1e-4)
    assert e[3].grads == pytest.approx(2 * psi / n + 2 * unit * b + 2 * unit * b * (n - 2) / n,
                                       rel=1e-4)
    # two gathered units and this rank's share of the shared-memory ring
    assert e[3].working_set == pytest.approx(2 * unit * b + 2 * unit * b / n, rel=1e-4)
    assert e[3].total < e[2].total < e[1].total < e[1].ddp
    table = format_table(list(e.values()))
    assert "stage 3" in table and "DDP" in table and "total" in table


def test_a_model_on_the_meta_device_counts_like_the_model():
    with torch.device("meta"):
        meta = Stack(4, 32)
    real = Stack(4, 32)
    real.register_buffer("stat", torch.zeros(100))
    meta.register_buffer("stat", torch.zeros(100, device="meta"))
    a = estimate_memory(meta, 2, 3, wrap_policy={nn.Linear})
    b = estimate_memory(real, 2, 3, wrap_policy={nn.Linear})
    assert a == b
    assert a.param_count == sum(p.numel() for p in real.parameters())
    assert a.buffers == 400


def test_errors_say_what_to_change():
    with pytest.raises(ValueError, match="offload must be None, 'cpu' or 'nvme'"):
        estimate_memory(1e6, 2, 3, offload="disk")
    with pytest.raises(ValueError, match="offload_params applies to stage 3 only"):
        estimate_memory(1e6, 2, 2, offload_params="cpu")
    with pytest.raises(ValueError, match="stage must be 1, 2 or 3"):
        estimate_memory(1e6, 2, 4)
    with pytest.raises(ValueError, match="world_size"):
        estimate_memory(1e6, 0, 2)
    with pytest.raises(ValueError, match="state_bytes="):
        estimate_memory(1e6, 2, 2, optimizer="Adafactor")
    with pytest.raises(ValueError, match="dtype"):
        estimate_memory(1e6, 2, 2, dtype="int8")
    with pytest.raises(ValueError, match="whole number"):
        estimate_memory(1.5, 2, 2)


if __name__ == "__main__":
    # the numbers behind docs/tools.md: python tests/test_estimate.py
    os.environ.update(MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="65536", ZP_SHM="0")
    for n in WORLDS:
        res = distributed.run(_measure, n)
        for stage in (1, 2, 3):
            est = estimate_memory(Stack().to("meta"), n, stage, shared_memory=False,
                                  wrap_policy={nn.Linear} if stage == 3 else None)
            growth = [r[stage]["growth"] for r in res]
            errs = ", ".join(f"{100 * (g / est.total - 1):+.1f}%" for g in growth)
            print(f"{n} rank(s) stage {stage}: estimate {est.total / 1e6:.2f} MB, measured peak "
                  f"RSS growth {min(growth) / 1e6:.2f}-{max(growth) / 1e6:.2f} MB ({errs})")
