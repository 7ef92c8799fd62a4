"""LR schedulers and Hugging Face's save_pretrained on zero_py, against DDP + torch.optim at 2
gloo ranks, from the same initial weights on the same random batches.

- Stages 1-2: save_pretrained by rank 0 alone (safetensors), from_pretrained of that directory
  holds the trained weights, which equal DDP's (tiny GPT-2 with tied embeddings, tiny Llama).
- transformers' get_linear_schedule_with_warmup / get_cosine_schedule_with_warmup driving a
  ZeroOptimizer with Trainer-style param groups (no weight decay for biases and LayerNorm
  weights), stages 1-3: each step's lr per group and the final weights; the cosine one also
  resumed from save_checkpoint(extra={"sched": ...}) after 2 of its 4 steps.
- torch.optim.lr_scheduler composites on a ZeroOptimizer, stages 1-3: SequentialLR (LinearLR
  warmup, then CosineAnnealingLR), ChainedScheduler, ReduceLROnPlateau stepped on a loss,
  LambdaLR with one lambda per param group, over two param groups (the first given as a
  generator, {"params": fc1.parameters()}); after 3 of 6 steps each one's state_dict() goes
  through zero_py.save_checkpoint(..., extra={"sched": ...}) / load_checkpoint into a fresh
  model, optimizer and scheduler, which go on as DDP's uninterrupted run (every step's lrs,
  the weights before the checkpoint and at the end).

Every scenario runs in one set of 2 processes. Tolerance 1e-5 relative (fp32); the Hugging Face
weights 1e-5 absolute, as in test_hf_models.py (GPT-2's attention key biases get a gradient that
is rounding noise, which Adam scales up to ~1e-6 differences in the order of summation).
"""

import math
import os

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import distributed
import models
import zero_py

HF_MISSING = models.hf_missing()
HAVE_HF = HF_MISSING is None
RTOL = 1e-5
WEIGHT_ATOL = 1e-5
VOCAB = 96
HF_STEPS = 4
STEPS, SPLIT = 6, 3  # torch schedulers: 6 steps, checkpointed after 3
TORCH_SCHEDS = ("sequential", "chained", "plateau", "lambda")
HF_SCHEDS = ("linear", "cosine")
KW = dict(lr=1e-2, weight_decay=0.1)


# ---------------------------------------------------------------------------------------------
# Hugging Face


def _hf_configs():
    return models.tiny_hf_configs(VOCAB, 32)


def _hf_build(config):
    import transformers

    torch.manual_seed(1234)
    return transformers.AutoModelForCausalLM.from_config(config).train()


def _hf_batches(rank):
    gen = torch.Generator().manual_seed(100 + rank)
    return [torch.randint(0, VOCAB, (2, 12), generator=gen) for _ in range(HF_STEPS)]


def _hf_train(model, opt, batches, sched=None):
    lrs = []
    for idx in batches:
        model(input_ids=idx, labels=idx).loss.backward()
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad()
        lrs.append([g["lr"] for g in opt.param_groups])
    return lrs


def _rel_sd(sd, ref_sd) -> float:
    return max(models.max_rel_diff(sd[k], v) for k, v in ref_sd.items())


def _abs_sd(sd, ref_sd) -> float:
    return max((sd[k] - v).abs().max().item() for k, v in ref_sd.items())


def _hf_save_pretrained(rank, tmp):
    """Stages 1-2: `if rank == 0: model.save_pretrained(dir)`; the directory reloads (here and
    in the test's process) with DDP's trained weights."""
    import transformers

    out = {}
    for name, config in _hf_configs().items():
        batches = _hf_batches(rank)
        ref = _hf_build(config)
        _hf_train(DDP(ref), torch.optim.AdamW(ref.parameters(), lr=1e-3), batches)
        ref_sd = {k: v.clone() for k, v in ref.state_dict().items()}
        for stage in (1, 2):
            zm, zo = zero_py.initialize(_hf_build(config), torch.optim.AdamW, stage=stage,
                                        lr=1e-3)
            _hf_train(zm, zo, batches)
            path = os.path.join(tmp, f"{name}-stage{stage}")
            if rank == 0:
                zm.save_pretrained(path)
            dist.barrier()
            back = transformers.AutoModelForCausalLM.from_pretrained(path).state_dict()
            trained = zm.state_dict()
            out[name, stage] = {"vs_ddp": _abs_sd(trained, ref_sd),
                                "reloaded": _rel_sd(back, trained),
                                "keys": sorted(back) == sorted(ref_sd),
                                "path": path,
                                "trained": {k: v.clone() for k, v in trained.items()}
                                if rank == 0 else None}
    return out


def _hf_groups(model, wd=0.1):
    """Trainer's grouping: weight decay for everything but biases and LayerNorm weights."""
    norms = {id(p) for m in model.modules() if isinstance(m, torch.nn.LayerNorm)
             for p in m.parameters()}
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if n.endswith("bias") or id(p) in norms else decay).append(p)
    assert decay and no_decay
    return [{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}]


def _hf_sched(kind, opt):
    import transformers

    make = {"linear": transformers.get_linear_schedule_with_warmup,
            "cosine": transformers.get_cosine_schedule_with_warmup}[kind]
    return make(opt, num_warmup_steps=2, num_training_steps=HF_STEPS + 1)


def _hf_zero(config, kind, stage):
    model = _hf_build(config)
    kw = {"wrap_policy": {type(model.transformer.h[0])}} if stage == 3 else {}
    zm, zo = zero_py.initialize(model, torch.optim.AdamW, stage=stage,
                                params=_hf_groups(model), lr=2e-3, **kw)
    return zm, zo, _hf_sched(kind, zo)


def _hf_schedulers(rank, tmp):
    """The cosine schedule also goes through save_checkpoint / load_checkpoint after 2 steps
    (its LambdaLR's state_dict holds a functools.partial's attributes)."""
    config = _hf_configs()["gpt2"]
    batches = _hf_batches(rank)
    out = {}
    for kind in HF_SCHEDS:
        ref = _hf_build(config)
        opt = torch.optim.AdamW(_hf_groups(ref), lr=2e-3)
        ref_lrs = _hf_train(DDP(ref), opt, batches, _hf_sched(kind, opt))
        ref_sd = ref.state_dict()
        for stage in (1, 2, 3):
            zm, zo, sched = _hf_zero(config, kind, stage)
            lrs = _hf_train(zm, zo, batches, sched)
            r = {"lrs": lrs, "ref_lrs": ref_lrs, "diff": _abs_sd(zm.state_dict(), ref_sd)}
            if kind == "cosine":
                zm, zo, sched = _hf_zero(config, kind, stage)
                lrs = _hf_train(zm, zo, batches[:2], sched)
                path = os.path.join(tmp, f"hf-{kind}-stage{stage}")
                zero_py.save_checkpoint(path, zm, zo, extra={"sched": sched.state_dict()})
                zm, zo, sched = _hf_zero(config, kind, stage)
                sched.load_state_dict(zero_py.load_checkpoint(path, zm, zo)["sched"])
                r["resumed_lrs"] = lrs + _hf_train(zm, zo, batches[2:], sched)
                r["resumed_diff"] = _abs_sd(zm.state_dict(), ref_sd)
            out[kind, stage] = r
    return out


# ---------------------------------------------------------------------------------------------
# torch.optim.lr_scheduler


def _groups(model):
    return [{"params": model.fc1.parameters(), "lr": 2e-2},
            {"params": [*model.fc2.parameters(), *model.head.parameters()],
             "weight_decay": 0.0}]


def _sched(kind, opt):
    S = torch.optim.lr_scheduler
    if kind == "sequential":
        return S.SequentialLR(opt, [S.LinearLR(opt, start_factor=0.1, total_iters=2),
                                    S.CosineAnnealingLR(opt, T_max=4, eta_min=1e-4)],
                              milestones=[2])
    if kind == "chained":
        return S.ChainedScheduler([S.ExponentialLR(opt, gamma=0.8),
                                   S.StepLR(opt, step_size=2, gamma=0.5)])
    if kind == "plateau":  # mode="max" on a falling loss: it reduces every other step
        return S.ReduceLROnPlateau(opt, mode="max", factor=0.5, patience=1)
    if kind == "lambda":
        return S.LambdaLR(opt, [lambda s: 1.0 / (1 + s), lambda s: 0.9 ** s])
    raise AssertionError(kind)


def _steps(model, opt, sched, batches, kind):
    lrs = []
    for b in batches:
        loss = models.mlp_loss(model, b)
        loss.backward()
        opt.step()
        opt.zero_grad()
        if kind == "plateau":
            metric = loss.detach().clone()
            dist.all_reduce(metric)  # the same metric on every rank, as a DDP script gives it
            sched.step(metric.item())
        else:
            sched.step()
        lrs.append([g["lr"] for g in opt.param_groups])
    return lrs


def _torch_scheduler(rank, tmp, kind):
    gen = torch.Generator().manual_seed(10 + rank)
    batches = [models.mlp_batch(gen) for _ in range(STEPS)]
    # DDP + torch.optim, uninterrupted
    torch.manual_seed(0)
    ref = models.MLP()
    ddp = DDP(ref)
    ref_opt = torch.optim.AdamW(_groups(ref), **KW)
    sched = _sched(kind, ref_opt)
    ref_lrs = _steps(ddp, ref_opt, sched, batches[:SPLIT], kind)
    ref_split = {k: v.clone() for k, v in ref.state_dict().items()}
    ref_lrs += _steps(ddp, ref_opt, sched, batches[SPLIT:], kind)
    ref_sd = ref.state_dict()
    return {stage: _zero_scheduler(tmp, kind, stage, batches, ref_lrs, ref_split, ref_sd)
            for stage in (1, 2, 3)}


def _zero_scheduler(tmp, kind, stage, batches, ref_lrs, ref_split, ref_sd):
    """zero_py checkpointed after SPLIT steps and resumed into a fresh model, optimizer and
    scheduler: its weights before the checkpoint and at the end against DDP's, and every
    step's lrs."""
    def make(seed):
        torch.manual_seed(seed)
        m = models.MLP()
        extra = {} if stage == 3 else {"bucket_bytes": 1024}
        zm, zo = zero_py.initialize(m, torch.optim.AdamW, stage=stage, params=_groups(m),
                                    **extra, **KW)
        return zm, zo, _sched(kind, zo)

    zm, zo, sched = make(0)
    first = _steps(zm, zo, sched, batches[:SPLIT], kind)
    before = _rel_sd(zm.state_dict(), ref_split)
    path = os.path.join(tmp, f"{kind}-stage{stage}")
    zero_py.save_checkpoint(path, zm, zo, extra={"sched": sched.state_dict()})
    del zm, zo, sched
    zm, zo, sched = make(7)
    extra = zero_py.load_checkpoint(path, zm, zo)
    sched.load_state_dict(extra["sched"])
    resumed = first + _steps(zm, zo, sched, batches[SPLIT:], kind)
    return {"ref_lrs": ref_lrs, "lrs": resumed, "before": before,
            "resumed": _rel_sd(zm.state_dict(), ref_sd)}


def _per_rank_metric(rank, stage):
    """ReduceLROnPlateau stepped on each rank's own metric (a DDP script's classic slip): it
    lowers the lr on rank 0 only, and the next step() is refused on every rank before anything
    changes; with the lrs set alike again, step() goes on as DDP's does."""
    gen = torch.Generator().manual_seed(20 + rank)
    batches = [models.mlp_batch(gen) for _ in range(2)]
    torch.manual_seed(0)
    ref = models.MLP()
    ddp = DDP(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), **KW)
    torch.manual_seed(0)
    zm, zo = zero_py.initialize(models.MLP(), torch.optim.AdamW, stage=stage, **KW)
    sched = torch.optim.lr_scheduler.ReduceLROnPlateau(zo, factor=0.5, patience=0)
    for m, o in ((ddp, ref_opt), (zm, zo)):
        models.mlp_loss(m, batches[0]).backward()
        o.step()
        o.zero_grad()
    sched.step(1.0)
    sched.step(2.0 if rank == 0 else 0.5)  # worse on rank 0 only: its lr is halved
    for m in (ddp, zm):
        models.mlp_loss(m, batches[1]).backward()
    try:
        zo.step()
        error = None
    except RuntimeError as exc:
        error = str(exc)
    for o in (ref_opt, zo):
        o.param_groups[0]["lr"] = KW["lr"] / 4
    ref_opt.step()
    zo.step()
    return {"error": error, "rel": _rel_sd(zm.state_dict(), ref.state_dict())}


def _all(rank, world_size, tmp):
    out = {"per_rank_metric": {stage: _per_rank_metric(rank, stage) for stage in (1, 2, 3)}}
    for kind in TORCH_SCHEDS:
        for stage, r in _torch_scheduler(rank, tmp, kind).items():
            out["torch", kind, stage] = r
    if HAVE_HF:
        import transformers

        transformers.logging.set_verbosity_error()
        out["save_pretrained"] = _hf_save_pretrained(rank, tmp)
        out["hf_sched"] = _hf_schedulers(rank, tmp)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return distributed.run(_all, 2, str(tmp_path_factory.mktemp("hf_sched")), timeout=240)


def _close(a, b):
    return all(math.isclose(x, y, rel_tol=RTOL) for x, y in zip(sum(a, []), sum(b, []))) \
        and [len(x) for x in a] == [len(x) for x in b]


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("kind", TORCH_SCHEDS)
def test_torch_scheduler_and_its_checkpoint_match_ddp(results, kind, stage):
    for rank, res in enumerate(results):
        r = res["torch", kind, stage]
        assert _close(r["lrs"], r["ref_lrs"]), (rank, r["lrs"], r["ref_lrs"])
        assert r["before"] <= RTOL, f"rank {rank}: before the checkpoint {r['before']:.2e}"
        assert r["resumed"] <= RTOL, f"rank {rank}: after resuming {r['resumed']:.2e}"


@pytest.mark.skipif(not HAVE_HF, reason=str(HF_MISSING))
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_save_pretrained_by_rank_0_reloads_what_ddp_trained(results, name, stage):
    import transformers

    for rank, res in enumerate(results):
        r = res["save_pretrained"][name, stage]
        assert r["vs_ddp"] <= WEIGHT_ATOL, (rank, r["vs_ddp"])
        assert r["keys"], rank
        assert r["reloaded"] == 0.0, (rank, r["reloaded"])  # exactly what rank 0 trained
    r = results[0]["save_pretrained"][name, stage]
    back = transformers.AutoModelForCausalLM.from_pretrained(r["path"])
    if name == "gpt2":
        assert back.lm_head.weight is back.transformer.wte.weight
    assert _rel_sd(back.state_dict(), r["trained"]) == 0.0


@pytest.mark.skipif(not HAVE_HF, reason=str(HF_MISSING))
@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("kind", HF_SCHEDS)
def test_hf_scheduler_with_trainer_groups_matches_ddp(results, kind, stage):
    for rank, res in enumerate(results):
        r = res["hf_sched"][kind, stage]
        assert _close(r["lrs"], r["ref_lrs"]), (rank, r["lrs"], r["ref_lrs"])
        assert r["diff"] <= WEIGHT_ATOL, (rank, r["diff"])
        if kind == "cosine":
            assert _close(r["resumed_lrs"], r["ref_lrs"]), (rank, r["resumed_lrs"])
            assert r["resumed_diff"] <= WEIGHT_ATOL, (rank, r["resumed_diff"])


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_hyperparameters_that_differ_between_ranks_are_refused(results, stage):
    """Each step compares the ranks' param groups' settings in a small all-reduce before
    anything is reduced (stages 2-3: the step's count; stage 1: one of its own)."""
    for rank, res in enumerate(results):
        r = res["per_rank_metric"][stage]
        assert r["error"] is not None, f"rank {rank}: a step with another lr on rank 0 ran"
        for words in ("hyperparameters differ between ranks", f"this is rank {rank}",
                      f"lr={KW['lr'] / 2 if rank == 0 else KW['lr']}", "ReduceLROnPlateau"):
            assert words in r["error"], (words, r["error"])
        assert r["rel"] <= RTOL, f"rank {rank}: after the refused step {r['rel']:.2e}"
