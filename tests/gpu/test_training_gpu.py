"""ZeRO training on a GPU against single-GPU torch training, same seed and data:

- stages 1 and 2 on the native NCCL executor at world size 1, fp32 (AdamW; loss per step and
  every parameter after 24 steps within 1e-5 relative: the two differ only in the optimizer's
  op order) and bf16 parameters with fp32 masters (against torch training bf16 parameters
  from fp32 masters by hand; within 2e-2 relative: bf16 rounding of the forward);
- several ranks on one GPU (gloo over CUDA tensors, the torch.distributed executor): stage 2
  against DDP, each rank's shard, states and masters on the device, and peak memory per rank;
- stage 3 (zero_py.initialize(model, AdamW, stage=3, wrap_policy={Block})) on a GPT with tied
  embeddings, at world size 1 in a process whose world is a one-rank NCCL group (executor
  "auto": the native NCCL executor), against the same model trained by torch.optim.AdamW on
  one GPU: fp32 (loss per step and every parameter after 10 steps within 1e-5 relative, and
  model.state_dict() after training equal to the reference's within 1e-5), bf16 parameters
  with fp32 masters (against torch.optim.AdamW on fp32 masters, tests/test_mixed_precision.py's
  MasterAdamW; within 1e-2 loss, 2e-2 parameters), optimizer.clip_grad_norm_ against
  torch.nn.utils.clip_grad_norm_ (norms within 1e-5, clipping active), gradient accumulation
  over 3 micro-batches with no_sync() for all but the last against plain accumulation;
- stage 3 at 2 ranks sharing the GPU through a gloo group against DDP, fp32: with executor
  "auto" (zero_py's torch.distributed executor over gloo, CUDA tensors) and with a test-only
  executor object that runs gloo on host copies (the engine on CUDA, whatever gloo can do with
  device memory); and the torch.distributed executor's all-gather and reduce-scatter of CUDA
  tensors over gloo on their own, which the "auto" case stands on.

The stage-3 processes run attention in SDPA's math backend, whose CUDA kernels are
deterministic, so the reference and zero_py compute the same forward and backward and differ
only by what is under test (torch documents the memory-efficient backend's backward as
nondeterministic).
"""

import copy
import gc
import os
import tempfile
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP

import distributed
import models
import zero_py
from zero_py.collectives import TorchDistExecutor, Work
from zero_py.examples.demo import Block

DEV = torch.device("cuda", 0)
STEPS = 24


def _batch_to(batch, device):
    return tuple(t.to(device) for t in batch)


@pytest.mark.parametrize("model_name", ["mlp", "gpt"])
@pytest.mark.parametrize("stage", [1, 2])
def test_fp32_stages_on_nccl_match_single_gpu_torch(single_rank_group, model_name, stage):
    make, batch_fn, loss_fn = models.MODELS[model_name]
    torch.manual_seed(0)
    ref = make().to(DEV)
    zmodel = copy.deepcopy(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.1)
    zopt = zero_py.ZeroOptimizer(zmodel.parameters(), torch.optim.AdamW, stage=stage, lr=3e-3,
                                 weight_decay=0.1, bucket_bytes=4096, executor="nccl")
    assert type(zopt.executor).__name__ == "NcclExecutor" and zopt.uses_fused_kernel
    assert zopt._flat.n_buckets > 1
    gen = torch.Generator().manual_seed(1000)
    for step in range(STEPS):
        batch = _batch_to(batch_fn(gen), DEV)
        ref_loss = loss_fn(ref, batch)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss = loss_fn(zmodel, batch)
        loss.backward()
        zopt.step()
        zopt.zero_grad()
        rel = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
        assert rel <= 1e-5, f"step {step}: loss differs by {rel:.2e}"
    for (name, a), b in zip(zmodel.named_parameters(), ref.parameters()):
        assert a.device == DEV
        assert models.max_rel_diff(a, b) <= 1e-5, name
    for t in zopt._update.states:
        assert t.device == DEV


def test_bf16_stage_2_on_nccl_matches_fp32_master_torch(single_rank_group):
    make, batch_fn, loss_fn = models.MODELS["gpt"]
    torch.manual_seed(0)
    ref = make().to(DEV).to(torch.bfloat16)
    zmodel = copy.deepcopy(ref)
    masters = [p.detach().float().clone().requires_grad_() for p in ref.parameters()]
    ref_opt = torch.optim.AdamW(masters, lr=3e-3, weight_decay=0.1)
    zopt = zero_py.ZeroOptimizer(zmodel.parameters(), torch.optim.AdamW, stage=2, lr=3e-3,
                                 weight_decay=0.1, bucket_bytes=8192, executor="nccl",
                                 grad_reduce_dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    worst = 0.0
    for _ in range(STEPS):
        batch = _batch_to(batch_fn(gen), DEV)
        ref_loss = loss_fn(ref, batch)
        ref_loss.backward()
        for m, p in zip(masters, ref.parameters()):
            m.grad = p.grad.float()
            p.grad = None
        ref_opt.step()
        with torch.no_grad():
            for m, p in zip(masters, ref.parameters()):
                p.copy_(m)
        loss = loss_fn(zmodel, batch)
        loss.backward()
        zopt.step()
        zopt.zero_grad()
        worst = max(worst, abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()))
    assert worst <= 2e-2
    for a, b in zip(zmodel.parameters(), ref.parameters()):
        assert a.dtype == torch.bfloat16
        assert models.max_rel_diff(a.float(), b.float()) <= 2e-2


def _syncs_in_a_step(stage, n_layers, loss_scaler):
    """The host synchronisations (torch.cuda's sync debug mode) of one training step (forward,
    backward, step, zero_grad) of n_layers Linear layers on the native NCCL executor, after
    two warm-up steps: what each one was."""
    import warnings

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64) for _ in range(n_layers)]).to(DEV)
    scaler = zero_py.LossScaler() if loss_scaler else None
    if stage == 3:
        model, zopt = zero_py.initialize(model, torch.optim.AdamW, stage=3,
                                         wrap_policy={torch.nn.Linear}, executor="nccl",
                                         lr=1e-3, loss_scaler=scaler)
    else:
        zopt = zero_py.ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=stage,
                                     lr=1e-3, bucket_bytes=4096, executor="nccl",
                                     loss_scaler=scaler)
    x = torch.randn(8, 64, device=DEV)

    def step():
        zopt.scale_loss(model(x).pow(2).mean()).backward()
        zopt.step()
        zopt.zero_grad()

    step()
    step()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [str(w.message) for w in seen if "synchroniz" in str(w.message)]


@pytest.mark.parametrize("loss_scaler", [False, True])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_host_syncs_per_step_do_not_grow_with_the_model(single_rank_group, stage, loss_scaler):
    """No host synchronisation per parameter, bucket or unit: a step of 8 layers waits for the
    device as often as one of 2 (a blocking copy to the device, .item() or .tolist() on a
    device tensor in a per-bucket or per-unit path would add some)."""
    small = _syncs_in_a_step(stage, 2, loss_scaler)
    large = _syncs_in_a_step(stage, 8, loss_scaler)
    assert len(large) == len(small), (len(small), len(large), large)


def _ranks_on_one_gpu(rank, world_size):
    torch.cuda.set_device(0)
    make, batch_fn, loss_fn = models.MODELS["mlp"]
    torch.manual_seed(0)
    ref = make().to(DEV)
    zmodel = copy.deepcopy(ref)
    ddp = DDP(ref)
    ref_opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3, weight_decay=0.1)
    torch.cuda.reset_peak_memory_stats()
    zopt = zero_py.ZeroOptimizer(zmodel.parameters(), torch.optim.AdamW, stage=2, lr=3e-3,
                                 weight_decay=0.1, bucket_bytes=4096, executor="torch")
    gen = torch.Generator().manual_seed(1000 + rank)
    worst = 0.0
    for _ in range(12):
        batch = _batch_to(batch_fn(gen), DEV)
        ref_loss = loss_fn(ddp, batch)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss = loss_fn(zmodel, batch)
        loss.backward()
        zopt.step()
        zopt.zero_grad()
        worst = max(worst, abs(loss.item() - ref_loss.item()) / abs(ref_loss.item()))
    param_rel = max(models.max_rel_diff(a, b) for a, b in zip(zmodel.parameters(),
                                                                ref.parameters()))
    return {"loss_rel": worst, "param_rel": param_rel,
            "devices": sorted({str(t.device) for t in zopt._update.states}
                              | {str(t.device) for t in zopt._reducer.grads.tensors.values()}),
            "report": zopt.memory_report(), "shard_numel": zopt._flat.shard_numel,
            "peak_bytes": torch.cuda.max_memory_allocated()}


@pytest.mark.parametrize("world_size", [2, 4])
def test_several_ranks_on_one_gpu_shard_on_device(world_size, capsys):
    results = distributed.run(_ranks_on_one_gpu, world_size)
    numels = [r["shard_numel"] for r in results]
    for rank, r in enumerate(results):
        assert r["devices"] == ["cuda:0"], r["devices"]
        assert r["loss_rel"] <= 1e-5 and r["param_rel"] <= 1e-5, (rank, r)
        rep = r["report"]
        # each rank keeps 1/world of the AdamW states (plus padding)
        assert rep["optimizer_states"] <= rep["ddp_optimizer_states"] / world_size * 1.25 + 4096
    assert len(set(numels)) == 1
    with capsys.disabled():
        print(f"\npeak CUDA memory per rank at {world_size} ranks (MiB): " +
              ", ".join(f"{r['peak_bytes'] / 2**20:.1f}" for r in results))


# -- stage 3 -----------------------------------------------------------------------------------

STEPS_3 = 10
LR = dict(lr=3e-3, weight_decay=0.1)
RTOL = 1e-5
MAX_NORM = 0.5  # below this model's gradient norms (about 0.6 to 1.4 over the first steps)
MICRO_BATCHES = 3


class _GPT(models.TiedGPT):
    """models.TiedGPT with its positions made on the input's device (TiedGPT's forward makes
    them on the CPU, which a CUDA model cannot index with)."""

    def forward(self, idx, targets=None):
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 targets.reshape(-1))


def _gpt_batch(gen, device, vocab=32, block=16, batch=4):
    idx = torch.randint(0, vocab, (batch, block + 1), generator=gen)
    return idx[:, :-1].to(device), idx[:, 1:].to(device)


def _rel(a, b) -> float:
    return abs(float(a) - float(b)) / abs(float(b))


def _math_attention():
    """SDPA's math backend (deterministic CUDA kernels), for the whole process."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    ctx = sdpa_kernel([SDPBackend.MATH])
    ctx.__enter__()  # left open: the process ends after the scenarios


def _stage3_pair(device, dtype=None, executor="auto"):
    """The reference GPT on `device` and zero_py's stage-3 copy of it (same initial values)."""
    torch.manual_seed(0)
    ref = _GPT().to(device)
    if dtype is not None:
        ref = ref.to(dtype)
    zm = copy.deepcopy(ref)
    zm, zopt = zero_py.initialize(zm, torch.optim.AdamW, stage=3, wrap_policy={Block},
                                  executor=executor, **LR)
    return ref, zm, zopt


def _full_rel(zm, ref) -> float:
    """Largest relative difference between zero_py's full parameters and the reference's."""
    with zero_py.gathered(zm):
        pairs = list(zip(zm.named_parameters(), ref.named_parameters()))
        assert all(a[0] == b[0] for a, b in pairs), "parameter names differ"
        return max(models.max_rel_diff(a.float(), b.float()) for (_, a), (_, b) in pairs)


def _where(zm, zopt) -> dict:
    """Where zero_py keeps the model's state between steps."""
    states = getattr(zopt._update, "states", None) or []
    return {"executor": type(zopt.executor).__name__,
            "shard_devices": sorted({str(p.device) for p in zm.parameters()}),
            "between_uses_1d": all(p.dim() == 1 for p in zm.parameters()),
            "state_devices": sorted({str(t.device) for t in states}),
            "tied": zm.lm_head.weight is zm.tok_emb.weight,
            "units": len(zopt._engine.units)}


def s3_fp32(device):
    ref, zm, zopt = _stage3_pair(device)
    ref_opt = torch.optim.AdamW(ref.parameters(), **LR)
    gen = torch.Generator().manual_seed(1000)
    loss_rel = 0.0
    for _ in range(STEPS_3):
        idx, tgt = _gpt_batch(gen, device)
        ref_loss = ref(idx, tgt)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss = zm(idx, tgt)
        loss.backward()
        zopt.step()
        zopt.zero_grad()
        loss_rel = max(loss_rel, _rel(loss.item(), ref_loss.item()))
    out = {"loss_rel": loss_rel, "param_rel": _full_rel(zm, ref), **_where(zm, zopt)}
    sd, ref_sd = zm.state_dict(), ref.state_dict()  # full values, on every rank
    out["sd_keys"] = list(sd) == list(ref_sd)
    out["sd_shapes"] = all(k in sd and tuple(sd[k].shape) == tuple(v.shape)
                           for k, v in ref_sd.items())
    out["sd_rel"] = max(models.max_rel_diff(sd[k], v) for k, v in ref_sd.items() if k in sd)
    out["sd_devices"] = sorted({str(v.device) for v in sd.values()})
    return out


def s3_bf16(device):
    from test_mixed_precision import MasterAdamW  # torch.optim.AdamW on fp32 masters

    ref, zm, zopt = _stage3_pair(device, dtype=torch.bfloat16)
    ref_opt = MasterAdamW(ref.parameters(), **LR)
    gen = torch.Generator().manual_seed(1)
    loss_rel = 0.0
    for _ in range(STEPS_3):
        idx, tgt = _gpt_batch(gen, device)
        losses = []
        for model, opt in ((ref, ref_opt), (zm, zopt)):
            loss = model(idx, tgt)
            loss.float().backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        loss_rel = max(loss_rel, _rel(losses[1], losses[0]))
    with zero_py.gathered(zm):
        dtypes = sorted({str(p.dtype) for p in zm.parameters()})
    masters = list(zopt._masters.tensors.values())
    return {"loss_rel": loss_rel, "param_rel": _full_rel(zm, ref), "dtypes": dtypes,
            "master_dtypes": sorted({str(t.dtype) for t in masters}),
            "master_devices": sorted({str(t.device) for t in masters}), **_where(zm, zopt)}


def s3_clip(device):
    ref, zm, zopt = _stage3_pair(device)
    ref_opt = torch.optim.AdamW(ref.parameters(), **LR)
    gen = torch.Generator().manual_seed(2)
    norm_rel, clipped = 0.0, 0
    for _ in range(STEPS_3):
        idx, tgt = _gpt_batch(gen, device)
        ref(idx, tgt).backward()
        ref_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM))
        ref_opt.step()
        ref_opt.zero_grad()
        zm(idx, tgt).backward()
        norm = float(zopt.clip_grad_norm_(MAX_NORM))
        zopt.step()
        zopt.zero_grad()
        norm_rel = max(norm_rel, _rel(norm, ref_norm))
        clipped += ref_norm > MAX_NORM
    return {"norm_rel": norm_rel, "clipped_steps": clipped, "param_rel": _full_rel(zm, ref),
            **_where(zm, zopt)}


def s3_accumulation(device):
    """MICRO_BATCHES micro-batches per step, zero_py's no_sync() around all but the last;
    the reference accumulates them in param.grad."""
    ref, zm, zopt = _stage3_pair(device)
    ref_opt = torch.optim.AdamW(ref.parameters(), **LR)
    gen = torch.Generator().manual_seed(3)
    for _ in range(STEPS_3):
        micro = [_gpt_batch(gen, device) for _ in range(MICRO_BATCHES)]
        for idx, tgt in micro:
            (ref(idx, tgt) / MICRO_BATCHES).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        for k, (idx, tgt) in enumerate(micro):
            if k < MICRO_BATCHES - 1:
                with zopt.no_sync():
                    (zm(idx, tgt) / MICRO_BATCHES).backward()
            else:
                (zm(idx, tgt) / MICRO_BATCHES).backward()
        zopt.step()
        zopt.zero_grad()
    return {"param_rel": _full_rel(zm, ref), **_where(zm, zopt)}


ONE_RANK_SCENARIOS = {"fp32": s3_fp32, "bf16": s3_bf16, "clip": s3_clip,
                      "accumulation": s3_accumulation}


def _one_rank_stage3(device_name):
    """Every one-rank scenario in this process; a failing scenario gives its traceback and the
    others still run."""
    from zero_py.collectives import nccl

    device = torch.device(device_name)
    _math_attention()
    out = {"nccl_unavailable": nccl.unavailable_reason() if device.type == "cuda" else "CPU"}
    for name, fn in ONE_RANK_SCENARIOS.items():
        try:
            out[name] = fn(device)
        except Exception:
            out[name] = {"error": traceback.format_exc()}
        try:
            gc.collect()
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
        except Exception:  # a CUDA error is sticky: report it where it showed, run no more
            out[name] = {"error": out[name].get("error", "") + "\nafter the scenario:\n"
                         + traceback.format_exc()}
            for later in ONE_RANK_SCENARIOS:
                out.setdefault(later, {"error": f"not run: the CUDA context broke in {name}"})
            break
    return out


def _one_rank_worker(index, backend, fn, store_path, out_path, args):
    if backend == "nccl":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, store=dist.FileStore(store_path, 1), rank=0, world_size=1)
    try:
        result = fn(*args)
        torch.save({"ok": True, "result": result}, out_path)
        del result
    except BaseException:
        torch.save({"ok": False, "error": traceback.format_exc()}, out_path)
        raise
    finally:
        gc.collect()  # the optimizers (their communicators) before the group
        dist.destroy_process_group()


def run_one_rank(fn, *args, backend="nccl", timeout=600):
    """fn(*args) in a fresh process (spawn) whose world is a one-rank `backend` group made
    through a FileStore, as a one-GPU job's init_process_group("nccl") makes it; returns what
    fn returns."""
    with tempfile.TemporaryDirectory(prefix="zp_one_rank_") as tmp:
        out_path = os.path.join(tmp, "result.pt")
        ctx = mp.start_processes(_one_rank_worker,
                                 args=(backend, fn, os.path.join(tmp, "store"), out_path, args),
                                 nprocs=1, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=1):
                if time.monotonic() > deadline:
                    for p in ctx.processes:
                        p.kill()
                    raise AssertionError(f"the one-rank process still runs after {timeout} s")
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
            raise AssertionError(f"the one-rank process failed:\n{exc}") from None
        out = torch.load(out_path, weights_only=False)
        if not out["ok"]:
            raise AssertionError(f"the one-rank process failed:\n{out['error']}")
        return out["result"]


@pytest.fixture(scope="module")
def one_rank():
    return run_one_rank(_one_rank_stage3, str(DEV))


def _scenario(results, name) -> dict:
    r = results[name]
    assert "error" not in r, f"scenario {name} raised:\n{r.get('error')}"
    return r


def _check_where(results, r):
    """Executor "auto" in an NCCL group: the native NCCL executor wherever it can run (else
    the torch.distributed one, with a warning); shards and AdamW states on the GPU."""
    want = "NcclExecutor" if results["nccl_unavailable"] is None else "TorchDistExecutor"
    assert r["executor"] == want, (r["executor"], results["nccl_unavailable"])
    assert r["shard_devices"] == [str(DEV)] and r["between_uses_1d"], r
    assert r["state_devices"] == [str(DEV)], r
    assert r["tied"] and r["units"] == 4, r  # the root and 3 blocks


def test_stage3_fp32_on_nccl_matches_single_gpu_torch(one_rank):
    r = _scenario(one_rank, "fp32")
    _check_where(one_rank, r)
    assert r["loss_rel"] <= RTOL, r
    assert r["param_rel"] <= RTOL, r


def test_stage3_state_dict_after_training_equals_single_gpu_torch(one_rank):
    r = _scenario(one_rank, "fp32")
    assert r["sd_keys"] and r["sd_shapes"], r
    assert r["sd_devices"] == [str(DEV)], r
    assert r["sd_rel"] <= RTOL, r


def test_stage3_bf16_on_nccl_matches_fp32_master_torch(one_rank):
    r = _scenario(one_rank, "bf16")
    _check_where(one_rank, r)
    assert r["dtypes"] == ["torch.bfloat16"], r
    assert r["master_dtypes"] == ["torch.float32"] and r["master_devices"] == [str(DEV)], r
    assert r["loss_rel"] <= 1e-2, r
    assert r["param_rel"] <= 2e-2, r


def test_stage3_clip_grad_norm_on_nccl_matches_torch(one_rank):
    r = _scenario(one_rank, "clip")
    _check_where(one_rank, r)
    assert r["clipped_steps"] >= STEPS_3 // 2, r  # clipping was active, not a no-op
    assert r["norm_rel"] <= RTOL, r
    assert r["param_rel"] <= RTOL, r


def test_stage3_gradient_accumulation_with_no_sync_on_nccl(one_rank):
    r = _scenario(one_rank, "accumulation")
    _check_where(one_rank, r)
    assert r["param_rel"] <= RTOL, r


# -- stage 3, two ranks sharing the GPU through gloo ---------------------------------------------

class HostStagedExecutor:
    """A test-only executor object (the seam's third form, see zero_py/collectives/): gloo's
    collectives on host copies of the tensors, copied back into them at wait(). It lets the
    stage-3 engine run on CUDA tensors at several ranks whatever gloo does with device
    memory."""

    def __init__(self, device):
        self.inner = TorchDistExecutor(None, torch.device("cpu"))
        self.device = torch.device(device)
        self.world_size, self.rank = self.inner.world_size, self.inner.rank
        self.group = self.inner.group

    def global_rank(self, group_rank):
        return self.inner.global_rank(group_rank)

    @staticmethod
    def _host(t):
        return t.detach().to("cpu", copy=True)

    def reduce_scatter(self, output, input):
        host_in = self._host(input)
        host_out = torch.empty(output.shape, dtype=output.dtype)
        work = self.inner.reduce_scatter(host_out, host_in)
        return Work(work, lambda: output.copy_(host_out), keep=(host_in, host_out))

    def all_gather(self, output, input):
        host_in = self._host(input)
        host_out = torch.empty(output.shape, dtype=output.dtype)
        work = self.inner.all_gather(host_out, host_in)
        return Work(work, lambda: output.copy_(host_out), keep=(host_in, host_out))

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM):
        host = self._host(tensor)
        return Work(self.inner.all_reduce(host, op), lambda: tensor.copy_(host), keep=(host,))

    def all_reduce_max(self, tensor):
        return self.all_reduce(tensor, dist.ReduceOp.MAX)

    def broadcast(self, tensor, src=0):
        host = self._host(tensor)
        return Work(self.inner.broadcast(host, src), lambda: tensor.copy_(host), keep=(host,))


def _stage3_ranks_on_one_device(rank, world_size, kind, device_name):
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    _math_attention()
    executor = "auto" if kind == "auto" else HostStagedExecutor(device)
    ref, zm, zopt = _stage3_pair(device, executor=executor)
    ddp = DDP(ref)
    ref_opt = torch.optim.AdamW(ddp.parameters(), **LR)
    gen = torch.Generator().manual_seed(100 + rank)
    loss_rel = 0.0
    for _ in range(STEPS_3):
        idx, tgt = _gpt_batch(gen, device)
        losses = []
        for model, opt in ((ddp, ref_opt), (zm, zopt)):
            loss = model(idx, tgt)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        loss_rel = max(loss_rel, _rel(losses[1], losses[0]))
    return {"loss_rel": loss_rel, "param_rel": _full_rel(zm, ref), **_where(zm, zopt),
            "local_numel": sum(p.numel() for p in zm.parameters()),
            "full_numel": sum(zero_py.full_shape(p).numel() for p in zm.parameters())}


def _torch_executor_on_device(rank, world_size, device_name):
    """zero_py's torch.distributed executor on a gloo group, device tensors: each collective
    against the value it must give (what the "auto" case below runs on)."""
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    ex = TorchDistExecutor(None, device)
    n = 1000
    out = {}
    chunks = [torch.arange(n, dtype=torch.float32) + 10_000 * r for r in range(world_size)]
    gathered = torch.full((n * world_size,), float("nan"), device=device)
    try:
        ex.all_gather(gathered, chunks[rank].to(device)).wait()
        out["all_gather"] = bool(torch.equal(gathered.cpu(), torch.cat(chunks)))
    except Exception as exc:
        out["all_gather"] = f"{type(exc).__name__}: {exc}"
    full = [torch.arange(n * world_size, dtype=torch.float32) * (r + 1)
            for r in range(world_size)]
    mine = torch.full((n,), float("nan"), device=device)
    try:
        ex.reduce_scatter(mine, full[rank].to(device)).wait()
        want = sum(full)[rank * n:(rank + 1) * n]
        out["reduce_scatter"] = bool(torch.equal(mine.cpu(), want))
    except Exception as exc:
        out["reduce_scatter"] = f"{type(exc).__name__}: {exc}"
    t = torch.full((n,), float(rank + 1), device=device)
    ex.all_reduce(t).wait()
    out["all_reduce"] = bool((t.cpu() == sum(range(1, world_size + 1))).all())
    return out


def test_torch_executor_collectives_of_cuda_tensors_over_gloo():
    """The executor "auto" picks for a gloo group: its all-gather and reduce-scatter are gloo
    point-to-point messages, which must carry CUDA tensors correctly (or fail with a clear
    error, reported here per collective). A short timeout: should gloo wait on a message that
    never comes, this fails in 2 minutes rather than 5."""
    for rank, r in enumerate(distributed.run(_torch_executor_on_device, 2, str(DEV),
                                             timeout=120)):
        for coll, ok in r.items():
            assert ok is True, f"rank {rank}: {coll} of CUDA tensors over gloo: {ok}"


@pytest.mark.parametrize("kind", ["auto", "host_staged"])
def test_stage3_two_ranks_on_one_gpu_match_ddp(kind):
    results = distributed.run(_stage3_ranks_on_one_device, 2, kind, str(DEV), timeout=180)
    for rank, r in enumerate(results):
        assert r["executor"] == ("TorchDistExecutor" if kind == "auto"
                                 else "HostStagedExecutor"), r
        assert r["shard_devices"] == [str(DEV)] and r["between_uses_1d"], r
        assert r["state_devices"] == [str(DEV)], r
        assert r["tied"] and r["units"] == 4, r
        assert r["loss_rel"] <= RTOL and r["param_rel"] <= RTOL, (rank, r)
        assert r["local_numel"] < 0.6 * r["full_numel"], r  # sharded: about half each
    assert sum(r["local_numel"] for r in results) == results[0]["full_numel"]
