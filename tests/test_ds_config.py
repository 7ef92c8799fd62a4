"""DeepSpeed configs: zero_py.initialize(model, config=...).

The configs below are written for these tests in the shapes DeepSpeed's documentation and
examples use (the getting-started ZeRO-2 config, a ZeRO-3 bf16 config, an fp16 config with
dynamic loss scaling and a warm-up schedule, Hugging Face's "auto" template, an offload
config). Checked: what each key becomes, that a config trains exactly like the equivalent
explicit call (2 gloo ranks, parameters compared bitwise), that every key zero_py does not
honour is refused with its path (or, with strict=False, listed in one warning), that explicit
keywords conflicting with the config are errors, and that the schedules and the loss-scaling
policy follow DeepSpeed's definitions (re-derived here from its documentation).
"""

import copy
import json
import math
import warnings

import pytest
import torch
import torch.nn as nn

import distributed
import models
import zero_py
from zero_py.config import deepspeed, schedules
from zero_py.config.loss_scaling import HysteresisLossScaler

# -- configs in the shapes of DeepSpeed's docs and examples -----------------------------------

ZERO2_GETTING_STARTED = {
    "train_batch_size": 16,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "Adam", "params": {"lr": 0.00015, "betas": [0.9, 0.999],
                                             "eps": 1e-8, "weight_decay": 0.01}},
    "zero_optimization": {"stage": 2, "allgather_partitions": True,
                          "allgather_bucket_size": 5e8, "overlap_comm": True,
                          "reduce_scatter": True, "reduce_bucket_size": 5e8,
                          "contiguous_gradients": True},
}

ZERO3_BF16 = {
    "bf16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.95],
                                              "eps": 1e-8, "weight_decay": 0.1}},
    "zero_optimization": {"stage": 3, "overlap_comm": True, "contiguous_gradients": True,
                          "sub_group_size": 1e9, "stage3_prefetch_bucket_size": 5e8,
                          "stage3_param_persistence_threshold": 1e5,
                          "stage3_max_live_parameters": 1e9,
                          "stage3_gather_16bit_weights_on_model_save": True},
    "gradient_clipping": 1.0,
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 2,
    "wall_clock_breakdown": False,
}

FP16_WARMUP = {
    "train_micro_batch_size_per_gpu": 8,
    "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000,
             "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3,
                                                 "warmup_num_steps": 100}},
    "zero_optimization": {"stage": 1},
}

HF_AUTO_TEMPLATE = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "initial_scale_power": 16},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                              "weight_decay": "auto"}},
    "zero_optimization": {"stage": 2, "overlap_comm": True, "reduce_bucket_size": "auto"},
    "gradient_accumulation_steps": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "steps_per_print": 2000,
}

OFFLOAD = {
    "zero_optimization": {"stage": 3,
                          "offload_optimizer": {"device": "nvme"},  # no nvme_path
                          "offload_param": {"device": "nvme"}},  # nor here
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
}


def _paths(plan):
    return [path for path, _ in plan.refusals]


# -- what each key becomes --------------------------------------------------------------------

def test_zero2_getting_started_config():
    plan = deepspeed.translate(ZERO2_GETTING_STARTED, world_size=2)
    assert plan.refusals == []
    assert plan.stage == 2
    # DeepSpeed's "Adam" decouples weight decay unless adam_w_mode is false
    assert plan.optimizer_class is torch.optim.AdamW
    assert plan.optimizer_kwargs == {"lr": 0.00015, "betas": (0.9, 0.999), "eps": 1e-8,
                                     "weight_decay": 0.01}
    assert plan.reduce_bucket_numel == 500_000_000
    assert plan.train_micro_batch_size_per_gpu == 8  # 16 / (1 x 2 ranks)
    # left out, gradient_clipping is DeepSpeed's default (1.0 since 0.19.3); 0 turns it off
    assert plan.gradient_clipping == 1.0
    assert deepspeed.translate({"gradient_clipping": 0}).gradient_clipping is None
    adam = deepspeed.translate({"optimizer": {"type": "Adam", "params": {
        "lr": 1e-3, "adam_w_mode": False}}})
    assert adam.optimizer_class is torch.optim.Adam


def test_optimizer_params_left_out_take_deepspeeds_defaults(single_rank_group):
    # DeepSpeed's FusedAdam / CPU Adam default to weight_decay=0 (torch's AdamW: 0.01), its
    # Lion to lr=1e-3 and betas=(0.9, 0.999) (zero_py.Lion: 1e-4, (0.9, 0.99))
    def defaults(optimizer):
        plan = deepspeed.translate({"optimizer": optimizer})
        assert plan.refusals == []
        built = plan.optimizer_class([torch.randn(3, requires_grad=True)],
                                     **plan.optimizer_defaults, **plan.optimizer_kwargs)
        return plan.optimizer_class, {k: built.defaults[k] for k in
                                      ("lr", "betas", "weight_decay")}
    for kind in ("Adam", "AdamW", "adamw"):
        assert defaults({"type": kind, "params": {"lr": 2e-4}}) == (
            torch.optim.AdamW, {"lr": 2e-4, "betas": (0.9, 0.999), "weight_decay": 0.0})
    assert defaults({"type": "Adam"}) == (
        torch.optim.AdamW, {"lr": 1e-3, "betas": (0.9, 0.999), "weight_decay": 0.0})
    # torch_adam: DeepSpeed builds torch's AdamW itself, with torch's defaults
    assert defaults({"type": "AdamW", "params": {"torch_adam": True}})[1]["weight_decay"] == 0.01
    assert defaults({"type": "Lion", "params": {"weight_decay": 0.1}}) == (
        zero_py.Lion, {"lr": 1e-3, "betas": (0.9, 0.999), "weight_decay": 0.1})

    # initialize's own keyword for a key the config leaves out is no conflict: it is used
    _, opt = zero_py.initialize(models.MLP(), config={"optimizer": {"type": "AdamW"},
                                                      "zero_optimization": {"stage": 1}},
                                weight_decay=0.1)
    assert opt.param_groups[0]["weight_decay"] == 0.1
    _, opt = zero_py.initialize(models.MLP(), config={"optimizer": {"type": "AdamW"},
                                                      "zero_optimization": {"stage": 1}})
    assert opt.param_groups[0]["weight_decay"] == 0.0


def test_batch_sizes_derive_the_missing_one_as_deepspeed_does():
    # (config, world size) -> (train, micro, accumulation), as DeepSpeed's
    # _set_batch_related_parameters derives them
    cases = [({"train_batch_size": 48, "train_micro_batch_size_per_gpu": 4}, 3, (48, 4, 4)),
             ({"train_batch_size": 48}, 3, (48, 16, 1)),
             ({"train_batch_size": 48, "gradient_accumulation_steps": 2}, 3, (48, 8, 2)),
             ({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, 3,
              (24, 4, 2)),
             ({"train_micro_batch_size_per_gpu": 4}, 2, (8, 4, 1))]
    for cfg, world, want in cases:
        plan = deepspeed.translate(cfg, world_size=world)
        assert (plan.train_batch_size, plan.train_micro_batch_size_per_gpu,
                plan.gradient_accumulation_steps) == want, cfg
    for train in (44, 8):  # not a multiple of 4 x 3; below it (no accumulation step left)
        with pytest.raises(ValueError, match=r"must be a multiple of "
                                             r"train_micro_batch_size_per_gpu \(4\) x world"):
            deepspeed.translate({"train_batch_size": train,
                                 "train_micro_batch_size_per_gpu": 4}, world_size=3)


def test_zero3_bf16_config():
    plan = deepspeed.translate(ZERO3_BF16, world_size=4)
    assert plan.refusals == []
    assert plan.stage == 3 and plan.dtype == torch.bfloat16
    # DeepSpeed keeps numel <= its threshold replicated, zero_py numel < persistence_threshold
    assert plan.zero_kwargs["persistence_threshold"] == 100_001
    assert plan.live_numel == 500_000_000  # the smaller of the two stage-3 budgets
    assert plan.gradient_clipping == 1.0
    assert plan.train_batch_size == 4 * 2 * 4


def test_bf16_skips_steps_with_non_finite_gradients_under_stages_1_2(single_rank_group):
    # DeepSpeed's stages 1-2 skip a bf16 step whose gradient norm is not finite
    # (bf16.check_grad_overflow, default true since 0.19.3); its stage 3 checks fp16 only
    def step(stage, **bf16):
        torch.manual_seed(0)
        cfg = {"bf16": {"enabled": True, **bf16}, "zero_optimization": {"stage": stage},
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
        model, opt = zero_py.initialize(models.MLP(), config=cfg)
        x, y = models.mlp_batch(torch.Generator().manual_seed(0))
        x[0, 0] = float("inf")
        before = [p.detach().clone() for p in model.parameters()]
        loss = nn.functional.mse_loss(model(x.bfloat16()).float(), y)
        opt.scale_loss(loss).backward()
        opt.step()
        return opt.last_step_skipped, all(torch.equal(a, p) for a, p in
                                          zip(before, model.parameters()))
    for stage in (1, 2):
        assert step(stage) == (True, True)
    # check_grad_overflow false: the step is taken, as torch.optim takes it
    assert step(2, check_grad_overflow=False) == (False, False)
    assert deepspeed.translate({"bf16": {"enabled": True},
                                "zero_optimization": {"stage": 3}}).loss_scaler is None


def test_persistence_threshold_keeps_what_deepspeed_keeps(single_rank_group):
    # DeepSpeed keeps a parameter of exactly stage3_param_persistence_threshold elements
    # replicated (numel <= threshold): it keeps its full shape, where a larger one is sharded
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32))
    cfg = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 512}}
    model, _ = zero_py.initialize(model, torch.optim.AdamW, config=cfg)
    assert model[0].weight.shape == (32, 16)  # 512 elements
    assert model[2].weight.dim() == 1  # 1024 elements: a shard


def test_fp16_config_builds_deepspeeds_loss_scaler():
    plan = deepspeed.translate(FP16_WARMUP)
    assert plan.refusals == [] and plan.dtype == torch.float16
    scaler = plan.loss_scaler()
    assert isinstance(scaler, HysteresisLossScaler)
    assert (scaler.scale, scaler.growth_interval, scaler.hysteresis, scaler.min_scale) == \
        (2.0**16, 1000, 2, 1.0)
    assert plan.scheduler[0] is schedules.WarmupLR
    # min_loss_scale 0 (seen in real configs): DeepSpeed halves the scale with no floor
    floorless = deepspeed.translate({"fp16": {"enabled": True, "initial_scale_power": 2,
                                              "hysteresis": 1, "min_loss_scale": 0.0}})
    scaler = floorless.loss_scaler()
    for _ in range(4):
        scaler.update(True)
    assert scaler.scale == 2.0**-2
    static = deepspeed.translate({"fp16": {"enabled": True, "loss_scale": 128}})
    fixed = static.loss_scaler()
    assert not fixed.dynamic and fixed.scale == 128.0


def test_hf_auto_values_are_refused_with_the_reason():
    plan = deepspeed.translate(HF_AUTO_TEMPLATE)
    paths = _paths(plan)
    for path in ("fp16.enabled", "bf16.enabled", "optimizer.params.lr", "optimizer.params.betas",
                 "zero_optimization.reduce_bucket_size", "gradient_accumulation_steps",
                 "train_micro_batch_size_per_gpu", "steps_per_print"):
        assert path in paths, path
    reasons = dict(plan.refusals)
    assert "Trainer" in reasons["optimizer.params.lr"]


def test_nvme_offload_needs_nvme_path():
    plan = deepspeed.translate(OFFLOAD)
    reasons = dict(plan.refusals)
    assert set(reasons) == {"zero_optimization.offload_optimizer.device",
                            "zero_optimization.offload_param.device"}
    assert "needs nvme_path" in reasons["zero_optimization.offload_optimizer.device"]
    assert "needs nvme_path" in reasons["zero_optimization.offload_param.device"]
    both = deepspeed.translate({"zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme"},
        "offload_param": {"device": "nvme", "nvme_path": "/local_nvme"}}})
    assert both.refusals == []
    assert both.zero_kwargs["offload_params"] == "nvme"
    assert both.zero_kwargs["offload_optimizer"] == "nvme"
    assert both.zero_kwargs["offload_dir"] == "/local_nvme"
    apart = deepspeed.translate({"zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/a"},
        "offload_param": {"device": "nvme", "nvme_path": "/b"}}})
    assert "give both the same nvme_path" in dict(apart.refusals)[
        "zero_optimization.offload_param.nvme_path"]
    # a ZeRO-Infinity config as DeepSpeed's docs write it: the aio section tunes DeepSpeed's
    # own swapper and must not refuse the offload it comes with (it used to, telling the user
    # to pick 'cpu' or 'nvme')
    nvme = deepspeed.translate({"zero_optimization": {"stage": 2, "offload_optimizer": {
        "device": "nvme", "nvme_path": "/local_nvme"}},
        "aio": {"block_size": 1048576, "queue_depth": 8, "thread_count": 1,
                "single_submit": False, "overlap_events": True}})
    assert nvme.refusals == []
    with pytest.raises(ValueError, match="aio must be a JSON object"):
        deepspeed.translate({"aio": True})
    # its reason used to be the offload devices' ("use 'cpu' or 'nvme' or 'none'"), for a flag
    force = dict(deepspeed.translate({"zero_force_ds_cpu_optimizer": True}).refusals)
    assert "DeepSpeed's CPU Adam" in force["zero_force_ds_cpu_optimizer"]
    assert nvme.zero_kwargs["offload_optimizer"] == "nvme"
    assert nvme.zero_kwargs["offload_dir"] == "/local_nvme"
    off = deepspeed.translate({"zero_optimization": {"stage": 2, "offload_optimizer": {
        "device": "none", "pin_memory": True}}})
    assert off.refusals == []


def test_cpu_offload_becomes_offload_optimizer_and_offload_params():
    plan = deepspeed.translate({"zero_optimization": {
        "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
        "offload_param": {"device": "cpu"}}})
    assert plan.refusals == []
    assert plan.zero_kwargs["offload_optimizer"] == "cpu"
    assert plan.zero_kwargs["offload_params"] == "cpu"
    legacy = deepspeed.translate({"zero_optimization": {"stage": 2, "cpu_offload": True}})
    assert legacy.refusals == [] and legacy.zero_kwargs["offload_optimizer"] == "cpu"
    bad = deepspeed.translate({"zero_optimization": {"stage": 2, "offload_optimizer": {
        "device": "cpu", "pin_memory": False, "ratio": 0.3}}})
    assert set(_paths(bad)) == {"zero_optimization.offload_optimizer.pin_memory",
                                "zero_optimization.offload_optimizer.ratio"}
    # a misspelt or unsupported key of an offload section is refused, as DeepSpeed refuses it
    # (extra="forbid"), not passed over (the misspelt device trained without offload)
    typos = deepspeed.translate({"zero_optimization": {
        "stage": 3, "offload_optimizer": {"devcie": "cpu", "super_offload": True,
                                          "fast_init": True, "pipeline_read": False},
        "offload_param": {"device": "cpu", "max_in_cpu": 1e9, "pin_memroy": False}}})
    assert _paths(typos) == ["zero_optimization.offload_optimizer.devcie",
                             "zero_optimization.offload_optimizer.super_offload",
                             "zero_optimization.offload_param.pin_memroy"]
    # parameters on NVMe need the optimizer there too: refused by the config's key
    nvme = deepspeed.translate({"zero_optimization": {
        "stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/nvme"},
        "offload_optimizer": {"device": "cpu"}}})
    assert _paths(nvme) == ["zero_optimization.offload_param.device"]
    assert "offload_params" not in nvme.zero_kwargs
    # offloading the parameters is stage 3's: refused by the config's key, not initialize's
    for zero in ({"stage": 2, "offload_param": {"device": "cpu"}},
                 {"stage": 1, "cpu_offload_params": True}):
        plan = deepspeed.translate({"zero_optimization": zero})
        assert _paths(plan) == ["zero_optimization.offload_param"]
        assert "offload_params" not in plan.zero_kwargs


def test_cpu_offload_config_trains_offloaded(single_rank_group):
    cfg = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    model, opt = zero_py.initialize(models.MLP(), config=cfg)
    assert opt.offload_optimizer == "cpu"
    before = [p.detach().clone() for p in model.parameters()]
    models.mlp_loss(model, models.mlp_batch(torch.Generator().manual_seed(0))).backward()
    opt.step()
    assert all(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert opt.memory_report()["host_optimizer_states"] > 0


def test_keys_zero_py_does_not_honour_are_refused_by_path():
    cfg = {"zero_optimization": {"stage": 2, "contiguous_gradients": False, "overlap_comm": False,
                                 "reduce_bucket_size": 1e6, "allgather_bucket_size": 2e6,
                                 "stage3_param_persistence_threshold": 10,
                                 "zero_hpz_partition_size": 8, "stage_typo": 1},
           "optimizer": {"type": "OneBitAdam", "params": {}},
           "scheduler": {"type": "LRRangeTest", "params": {}},
           "activation_checkpointing": {"partition_activations": True},
           "flops_profiler": {"enabled": False},  # switched off: nothing to honour
           "tensorboard": {"enabled": True, "output_path": "runs"}}
    paths = _paths(deepspeed.translate(cfg))
    assert sorted(paths) == sorted([
        "zero_optimization.contiguous_gradients", "zero_optimization.overlap_comm",
        "zero_optimization.allgather_bucket_size",
        "zero_optimization.stage3_param_persistence_threshold",
        "zero_optimization.zero_hpz_partition_size", "zero_optimization.stage_typo",
        "optimizer.type", "scheduler.type", "activation_checkpointing", "tensorboard"])
    # stage 3 reduces and gathers by units, not by bucket sizes
    stage3 = _paths(deepspeed.translate({"zero_optimization": {
        "stage": 3, "reduce_bucket_size": 5e8, "stage3_max_reuse_distance": 1e9}}))
    assert stage3 == ["zero_optimization.stage3_max_reuse_distance",
                      "zero_optimization.reduce_bucket_size"]
    # stage 1 reduces in step(): it cannot overlap
    assert _paths(deepspeed.translate({"zero_optimization": {"stage": 1,
                                                             "overlap_comm": True}})) == \
        ["zero_optimization.overlap_comm"]


def test_values_no_setting_could_honour_always_raise():
    with pytest.raises(ValueError, match="both true"):
        deepspeed.translate({"fp16": {"enabled": True}, "bf16": {"enabled": True}})
    with pytest.raises(ValueError, match=r"train_batch_size \(10\) must equal"):
        deepspeed.translate({"train_batch_size": 10, "train_micro_batch_size_per_gpu": 4,
                             "gradient_accumulation_steps": 2}, world_size=1)
    with pytest.raises(ValueError, match="not divisible"):
        deepspeed.translate({"train_batch_size": 10, "gradient_accumulation_steps": 3},
                            world_size=1)
    with pytest.raises(ValueError, match="zero_optimization.stage must be"):
        deepspeed.translate({"zero_optimization": {"stage": 7}})
    with pytest.raises(ValueError, match="gradient_clipping must be a number"):
        deepspeed.translate({"gradient_clipping": "1.0"})
    with pytest.raises(ValueError, match="AdamW rejects them"):
        deepspeed.translate({"optimizer": {"type": "AdamW", "params": {"lr": -1}}})
    with pytest.raises(ValueError, match="WarmupLR rejects them.*warmup_type"):
        deepspeed.translate({"scheduler": {"type": "WarmupLR",
                                           "params": {"warmup_type": "cubic"}}})
    with pytest.raises(FileNotFoundError, match="not found"):
        deepspeed.translate("/nonexistent/ds_config.json")
    with pytest.raises(TypeError, match="path to a DeepSpeed JSON file or a dict"):
        deepspeed.translate(42)


def test_config_file_path(tmp_path, single_rank_group):
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(ZERO2_GETTING_STARTED))
    model, opt = zero_py.initialize(models.MLP(), config=str(path))
    assert opt.stage == 2 and opt.optimizer_class is torch.optim.AdamW
    assert opt.param_groups[0]["weight_decay"] == 0.01
    assert opt.ds_config.train_micro_batch_size_per_gpu == 16  # one rank
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        zero_py.initialize(models.MLP(), config=str(bad))


# -- strict and conflicts ---------------------------------------------------------------------

def test_strict_refusal_lists_every_key(single_rank_group):
    with pytest.raises(ValueError) as info:
        zero_py.initialize(models.MLP(), config=OFFLOAD)
    text = str(info.value)
    assert "zero_optimization.offload_optimizer.device" in text
    assert "zero_optimization.offload_param.device" in text
    assert "strict=False" in text


def test_resume_goes_on_with_the_configs_schedule(tmp_path, single_rank_group):
    # DeepSpeed's engine checkpoints its scheduler: a run resumed from save_checkpoint or
    # state_dict() goes on with the rates of the run that was not interrupted, not from the
    # warm-up's start
    def config(kind):
        params = {"warmup_min_lr": 1e-4, "warmup_max_lr": 1e-2, "warmup_num_steps": 3,
                  "total_num_steps": 8, "warmup_type": "linear"}
        if kind == "WarmupLR":
            del params["total_num_steps"]
        return {"optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
                "zero_optimization": {"stage": 2}, "scheduler": {"type": kind,
                                                                 "params": params}}

    def build(kind="WarmupDecayLR"):
        torch.manual_seed(0)
        return zero_py.initialize(models.MLP(), config=config(kind))
    gen = torch.Generator().manual_seed(0)
    batches = [models.mlp_batch(gen) for _ in range(6)]

    def train(model, opt, bs):
        for batch in bs:
            models.mlp_loss(model, batch).backward()
            opt.step()
            opt.zero_grad()
            rates.append(opt.param_groups[0]["lr"])
    rates = []
    train(*build(), batches)
    want = rates
    rates = []
    model, opt = build()
    train(model, opt, batches[:4])
    zero_py.save_checkpoint(tmp_path / "ckpt", model, opt)
    saved = opt.state_dict()
    head = rates
    other_model, other = build("WarmupLR")  # another schedule: refused, nothing changed
    with pytest.raises(zero_py.CheckpointError, match="lr_scheduler.*'WarmupDecayLR'"):
        zero_py.load_checkpoint(tmp_path / "ckpt", other_model, other)
    assert other.lr_scheduler.last_epoch == 0
    for load in ("checkpoint", "state_dict"):
        rates = list(head)
        model, opt = build()
        if load == "checkpoint":
            zero_py.load_checkpoint(tmp_path / "ckpt", model, opt)
        else:  # the rates only: the parameters start afresh here
            opt.load_state_dict(copy.deepcopy(saved))
        train(model, opt, batches[4:])
        assert rates == pytest.approx(want, rel=1e-12), load
    # a scheduler state the manifest cannot hold is refused before anything is written, on
    # every rank (the manifest is rank 0's: refused there alone, the other ranks would hang)
    opt.lr_scheduler.extra_state = torch.ones(2)
    with pytest.raises(zero_py.CheckpointError, match=r"lr scheduler state.*extra_state"):
        zero_py.save_checkpoint(tmp_path / "again", model, opt)
    assert not (tmp_path / "again").exists()


def test_torch_optimizer_and_scheduler_by_name_as_deepspeed_looks_them_up(single_rank_group):
    # DeepSpeed builds getattr(torch.optim, type) / getattr(torch.optim.lr_scheduler, type) for
    # a type it does not have itself; checked against torch's own classes
    cfg = {"optimizer": {"type": "RMSprop", "params": {"lr": 1e-2, "alpha": 0.9,
                                                       "momentum": 0.5}},
           "scheduler": {"type": "StepLR", "params": {"step_size": 2, "gamma": 0.5}},
           "gradient_clipping": 0, "zero_optimization": {"stage": 2}}
    torch.manual_seed(0)
    model, opt = zero_py.initialize(models.MLP(), config=cfg)
    torch.manual_seed(0)
    ref = models.MLP()
    ref_opt = torch.optim.RMSprop(ref.parameters(), lr=1e-2, alpha=0.9, momentum=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=2, gamma=0.5)
    gen = torch.Generator().manual_seed(0)
    for step in range(5):
        batch = models.mlp_batch(gen)
        for m, o in ((model, opt), (ref, ref_opt)):
            models.mlp_loss(m, batch).backward()
            o.step()
            o.zero_grad()
        ref_sched.step()
        assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"]
        if step == 2:
            saved = copy.deepcopy(opt.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    opt.load_state_dict(saved)  # the StepLR state comes back with it
    assert opt.lr_scheduler.last_epoch == 3
    refused = {"ReduceLROnPlateau": "scheduler.type", "LRRangeTest": "scheduler.type",
               "rmsprop": "optimizer.type", "Lamb": "optimizer.type"}
    for kind, path in refused.items():
        section = "scheduler" if path.startswith("scheduler") else "optimizer"
        plan = deepspeed.translate({section: {"type": kind, "params": {}}})
        assert _paths(plan) == [path], kind


def test_strict_false_warns_once_and_trains(single_rank_group):
    model = models.MLP()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, opt = zero_py.initialize(model, config=OFFLOAD, strict=False, wrap_policy=None)
    ours = [w for w in caught if "DeepSpeed config key" in str(w.message)]
    assert len(ours) == 1
    assert "offload_optimizer.device" in str(ours[0].message)
    assert "offload_param.device" in str(ours[0].message)
    before = [p.detach().clone() for p in model.parameters()]
    models.mlp_loss(model, models.mlp_batch(torch.Generator().manual_seed(0))).backward()
    opt.step()
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_explicit_keywords_that_conflict_are_errors(single_rank_group):
    with pytest.raises(ValueError, match="stage=3 was given.*zero_optimization.stage"):
        zero_py.initialize(models.MLP(), config=ZERO2_GETTING_STARTED, stage=3)
    with pytest.raises(ValueError, match="lr=0.1 was given.*optimizer.params.lr"):
        zero_py.initialize(models.MLP(), config=ZERO2_GETTING_STARTED, lr=0.1)
    with pytest.raises(ValueError, match="optimizer_class=.*optimizer.type"):
        zero_py.initialize(models.MLP(), torch.optim.SGD, config=ZERO2_GETTING_STARTED)
    with pytest.raises(ValueError, match="bucket_bytes=.*reduce_bucket_size"):
        zero_py.initialize(models.MLP(), config=ZERO2_GETTING_STARTED, bucket_bytes=2**20)
    # a failed call leaves the model as it was: not cast to fp16, not sharded by stage 3
    model = models.MLP()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(ValueError, match=r"loss_scaler= was given.*makes one \(its fp16 section"):
        zero_py.initialize(model, config=FP16_WARMUP, loss_scaler=zero_py.LossScaler())
    per_group = {"zero_optimization": {"stage": 3}, "scheduler": {
        "type": "WarmupLR", "params": {"warmup_max_lr": [1e-3, 2e-3]}}}
    with pytest.raises(ValueError, match="scheduler.params: WarmupLR rejects.*1 param group"):
        zero_py.initialize(model, torch.optim.AdamW, config=per_group)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    with pytest.raises(ValueError, match="strict applies to a DeepSpeed config only"):
        zero_py.initialize(models.MLP(), stage=2, strict=False)
    # the same value twice is no conflict, and what the config leaves out may be given
    _, opt = zero_py.initialize(models.MLP(), config=ZERO2_GETTING_STARTED, stage=2,
                                lr=0.00015, grad_reduce_dtype=torch.float32)
    assert opt.stage == 2 and opt.param_groups[0]["lr"] == 0.00015
    # without an optimizer section, the explicit optimizer is used
    _, opt = zero_py.initialize(models.MLP(), torch.optim.SGD,
                                config={"zero_optimization": {"stage": 1}}, lr=0.5)
    assert opt.optimizer_class is torch.optim.SGD and opt.stage == 1


# -- schedules and loss scaling against DeepSpeed's definitions -------------------------------

def _lrs(scheduler, opt, steps):
    out = [opt.param_groups[0]["lr"]]
    for _ in range(steps):
        opt.step()
        scheduler.step()
        out.append(opt.param_groups[0]["lr"])
    return out


def _opt(lr=0.1):
    return torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)


def test_warmup_schedules_follow_deepspeed():
    # DeepSpeed: lr(i) = min + (max - min) * gamma(i) for batch iteration i (-1 at the start:
    # min), gamma = log(i + 1) / log(W) or i / W during warm-up, 1 after (WarmupLR) or
    # (T - i) / (T - W) clamped at 0 (WarmupDecayLR)
    lo, hi, w, t = 1e-5, 1e-3, 10, 30
    opt = _opt()
    got = _lrs(schedules.WarmupLR(opt, lo, hi, w, "log"), opt, 15)
    want = [lo] + [lo + (hi - lo) * (math.log(i + 1) / math.log(w) if i < w else 1.0)
                   for i in range(15)]
    assert got == pytest.approx(want, rel=1e-12)
    opt = _opt()
    got = _lrs(schedules.WarmupDecayLR(opt, t, lo, hi, w, "linear"), opt, 35)
    want = [lo] + [lo + (hi - lo) * (i / w if i < w else max(0.0, (t - i) / (t - w)))
                   for i in range(35)]
    assert got == pytest.approx(want, rel=1e-12)
    # WarmupCosineLR scales the optimizer's own lr: 0 at the start, warm-up from
    # warmup_min_ratio to 1, then a half cosine to cos_min_ratio
    opt = _opt(lr=0.5)
    got = _lrs(schedules.WarmupCosineLR(opt, t, 0.1, w, 0.01, "linear"), opt, 35)
    want = [0.0]
    for i in range(35):
        if i < w:
            r = 0.1 + (i / w) * 0.9
        else:
            progress = min(1.0, (i - w + 1) / (t - w))
            r = 0.01 + 0.99 * (1 + math.cos(math.pi * progress)) / 2
        want.append(0.5 * r)
    assert got == pytest.approx(want, rel=1e-12)
    # warmup_max_lr left out: the optimizer's lr
    opt = _opt(lr=0.2)
    sched = schedules.WarmupLR(opt, warmup_num_steps=4, warmup_type="linear")
    assert _lrs(sched, opt, 6)[-1] == pytest.approx(0.2)


def test_one_cycle_follows_deepspeed():
    # DeepSpeed's OneCycle: at batch iteration i (b = i + 1, cycle length F + S), the rate
    # climbs lo -> hi over F iterations and back over S, then lo / (1 + rate * (i - F - S + 1)
    # / decay_step_size); with betas, beta1 moves hi_mom -> lo_mom and back (decaying by
    # growing), beta2 is 0.99; at the start (-1) lr = lo and beta1 = lo_mom
    lo, hi, first, second, rate, size = 1e-3, 1e-2, 4, 2, 0.5, 3
    mom_lo, mom_hi, mom_rate = 0.8, 0.95, 0.01
    opt = torch.optim.AdamW([torch.zeros(1, requires_grad=True)], lr=0.1, betas=(0.9, 0.999))
    sched = schedules.OneCycle(opt, lo, hi, rate, first, second, decay_step_size=size,
                               cycle_min_mom=mom_lo, cycle_max_mom=mom_hi,
                               decay_mom_rate=mom_rate)
    got, want = [(opt.param_groups[0]["lr"], opt.param_groups[0]["betas"])], [(lo, (mom_lo, 0.99))]
    for i in range(12):
        opt.step()
        sched.step()
        got.append((opt.param_groups[0]["lr"], opt.param_groups[0]["betas"]))
        b = i + 1
        if i < first + second:
            scale = b / first if b <= first else (first + second - b) / second
            want.append((lo + (hi - lo) * scale, (mom_hi - (mom_hi - mom_lo) * scale, 0.99)))
        else:
            k = (i - first - second + 1) / size
            want.append((lo / (1 + rate * k), (mom_hi * (1 + mom_rate * k), 0.99)))
    assert [g[0] for g in got] == pytest.approx([w[0] for w in want], rel=1e-12)
    assert [g[1][0] for g in got] == pytest.approx([w[1][0] for w in want], rel=1e-12)
    assert all(g[1][1] == 0.99 for g in got)
    # from a config; SGD has no betas: its momentum is left alone, as in DeepSpeed
    plan = deepspeed.translate({"scheduler": {"type": "OneCycle", "params": {
        "cycle_min_lr": lo, "cycle_max_lr": hi, "cycle_first_step_size": first}}})
    assert plan.refusals == [] and plan.scheduler[0] is schedules.OneCycle
    sgd = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1, momentum=0.9)
    assert _lrs(schedules.OneCycle(sgd, lo, hi, cycle_first_step_size=first), sgd, 2)[-1] == \
        pytest.approx(lo + (hi - lo) * 2 / first)
    assert sgd.param_groups[0]["momentum"] == 0.9 and "betas" not in sgd.param_groups[0]


def _deepspeed_scale_sequence(overflows, init, window, min_scale, delayed_shift, consecutive):
    """DeepSpeed's DynamicLossScaler.update_scale, as its documentation and source define it:
    iteration counters, not a clean-step counter."""
    scale, hyst, it, last_overflow = init, delayed_shift, 0, -1
    out = []
    for overflow in overflows:
        if overflow:
            if delayed_shift == 1 or hyst == 1:
                scale = max(scale / 2, min_scale)
            else:
                hyst -= 1
            last_overflow = it
        else:
            if consecutive:
                hyst = delayed_shift
            stable = it - last_overflow - 1
            if stable > 0 and stable % window == 0:
                if not consecutive:
                    hyst = delayed_shift
                scale *= 2
        it += 1
        out.append(scale)
    return out


@pytest.mark.parametrize("hysteresis,consecutive", [(1, False), (2, False), (3, False),
                                                    (2, True)])
def test_loss_scaler_follows_deepspeeds_policy(hysteresis, consecutive):
    gen = torch.Generator().manual_seed(hysteresis + 10 * consecutive)
    overflows = (torch.rand(400, generator=gen) < 0.15).tolist() + [False] * 30 + [True] * 12
    scaler = HysteresisLossScaler(2.0**10, scale_window=5, min_scale=1.0,
                                  hysteresis=hysteresis, consecutive_hysteresis=consecutive)
    got = []
    for o in overflows:
        scaler.update(o)
        got.append(scaler.scale)
    assert got == _deepspeed_scale_sequence(overflows, 2.0**10, 5, 1.0, hysteresis,
                                            consecutive)
    again = HysteresisLossScaler()
    again.load_state_dict(scaler.state_dict())
    assert again.state_dict() == scaler.state_dict()


def test_hysteresis_survives_the_optimizers_state_dict(single_rank_group):
    """An fp16 run under DeepSpeed's policy, resumed through optimizer.state_dict() and
    through consolidate_state_dict(): an overflow before the save spends one unit of
    hysteresis, so the overflow right after the load backs the scale off, as in the run that
    never stopped. load_state_dict used to keep only the base LossScaler's keys: the hysteresis
    came back full, that overflow left the scale at 1024 where the run halved it to 512, and
    every later step differed. A bad hysteresis entry is refused and changes nothing."""
    def build():
        torch.manual_seed(0)
        model = models.MLP().half()
        return model, zero_py.ZeroOptimizer(
            model.parameters(), torch.optim.AdamW, lr=1e-2,
            loss_scaler=HysteresisLossScaler(2.0**10, scale_window=3, hysteresis=2))
    gen = torch.Generator().manual_seed(0)
    batches = [models.mlp_batch(gen) for _ in range(6)]
    for k in (1, 3):  # overflows before the save (1) and at the first step after it (3)
        batches[k][0][0, 0] = float("inf")

    def train(model, opt, bs):
        for x, y in bs:
            opt.scale_loss(torch.nn.functional.mse_loss(model(x.half()).float(), y)).backward()
            opt.step()
            opt.zero_grad()
            scales.append((opt.loss_scale, opt.last_step_skipped))
    scales = []
    ref, ref_opt = build()
    train(ref, ref_opt, batches)
    want = scales
    assert want[3] == (512.0, True)
    for full in (False, True):
        scales = []
        model, opt = build()
        train(model, opt, batches[:3])
        saved = copy.deepcopy((model.state_dict(), opt.consolidate_state_dict() if full
                               else opt.state_dict()))
        model, opt = build()
        model.load_state_dict(saved[0])
        bad = copy.deepcopy(saved[1])
        bad["loss_scaler"]["hysteresis_left"] = -1
        with pytest.raises(ValueError, match="'hysteresis_left' must be an int >= 1"):
            opt.load_state_dict(bad)
        assert opt.loss_scaler.state_dict() == HysteresisLossScaler(
            2.0**10, scale_window=3, hysteresis=2).state_dict()
        opt.load_state_dict(saved[1])
        train(model, opt, batches[3:])
        assert scales == want, full
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))


# -- training parity: initialize(config=...) against the explicit call ----------------------

PARITY_STEPS = 6


def _parity_body(rank, world_size, name):
    """Trains twice from the same weights: once from the config, once with the explicit
    equivalent (clipping and the schedule done by hand, the schedule's rates computed from
    DeepSpeed's formula); returns both parameter lists."""
    cfg, explicit, stage3 = PARITY[name]
    def build():
        torch.manual_seed(0)
        return models.tiny_gpt() if stage3 else models.MLP()

    def batches(step):
        gen = torch.Generator().manual_seed(100 * step + rank)
        if stage3:
            x = torch.randint(0, 32, (4, 16), generator=gen)
            return x, x
        return models.mlp_batch(gen)

    def loss_of(model, batch):
        if stage3:
            x, y = batch
            logits, _ = model(x)
            return nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                               y.reshape(-1))
        x, y = batch  # fp16/bf16 models take inputs in their dtype; the loss is fp32
        out = model(x.to(next(model.parameters()).dtype))
        return nn.functional.mse_loss(out.float(), y)

    from zero_py.examples.demo import Block
    wrap = {"wrap_policy": {Block}} if stage3 else {}
    model, opt = zero_py.initialize(build(), config=cfg, **wrap)
    with zero_py.gathered(model):
        start = [p.detach().float().clone() for p in model.parameters()]
    for step in range(PARITY_STEPS):
        opt.scale_loss(loss_of(model, batches(step))).backward()
        opt.step()
        opt.zero_grad()
    lrs = opt.param_groups[0]["lr"]
    with zero_py.gathered(model):
        got = [p.detach().float().clone() for p in model.parameters()]

    ref_model = build()
    if explicit.get("dtype") is not None:
        ref_model = ref_model.to(explicit["dtype"])
    kwargs = dict(explicit["kwargs"])
    if "loss_scaler" in kwargs:
        kwargs["loss_scaler"] = kwargs["loss_scaler"]()
    ref_model, ref = zero_py.initialize(ref_model, explicit["optimizer"], **wrap, **kwargs)
    rate = explicit.get("rate")
    for step in range(PARITY_STEPS):
        if rate is not None:
            for g in ref.param_groups:
                g["lr"] = rate(step)
        ref.scale_loss(loss_of(ref_model, batches(step))).backward()
        if explicit.get("clip"):
            ref.clip_grad_norm_(explicit["clip"])
        ref.step()
        ref.zero_grad()
    with zero_py.gathered(ref_model):
        want = [p.detach().float().clone() for p in ref_model.parameters()]
    return {"got": got, "want": want, "lr": lrs, "skipped": opt.skipped_steps,
            "moved": sum(not torch.equal(a, b) for a, b in zip(start, got))}


def _warmup_decay_rate(lo, hi, w, t):
    def rate(step):  # the rate of step `step` (0-based) is that of batch iteration step - 1
        i = step - 1
        if i < 0:
            return lo
        gamma = math.log(i + 1) / math.log(w) if i < w else max(0.0, (t - i) / (t - w))
        return lo + (hi - lo) * gamma
    return rate


PARITY = {
    "stage2-adam-warmupdecay-clip": (
        {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 8,
         "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "weight_decay": 0.1}},
         "scheduler": {"type": "WarmupDecayLR",
                       "params": {"warmup_min_lr": 1e-4, "warmup_max_lr": 1e-2,
                                  "warmup_num_steps": 3, "total_num_steps": 8}},
         "gradient_clipping": 0.05,
         "zero_optimization": {"stage": 2, "reduce_bucket_size": 200,
                               "allgather_bucket_size": 200, "overlap_comm": True}},
        {"optimizer": torch.optim.AdamW,
         "kwargs": {"stage": 2, "lr": 1e-2, "weight_decay": 0.1, "bucket_bytes": 800},
         "clip": 0.05, "rate": _warmup_decay_rate(1e-4, 1e-2, 3, 8)},
        False),
    "stage1-fp16-hysteresis": (
        {"fp16": {"enabled": True, "initial_scale_power": 18, "loss_scale_window": 2,
                  "hysteresis": 2, "min_loss_scale": 1},
         "optimizer": {"type": "SGD", "params": {"lr": 0.05, "momentum": 0.9}},
         "zero_optimization": {"stage": 1}},
        {"optimizer": torch.optim.SGD, "dtype": torch.float16,
         "kwargs": {"stage": 1, "lr": 0.05, "momentum": 0.9,
                    "loss_scaler": lambda: HysteresisLossScaler(2.0**18, 2, 1.0, 2)}},
        False),
    "stage3-bf16-lion-persistence": (
        {"bf16": {"enabled": True},
         "optimizer": {"type": "Lion", "params": {"lr": 1e-3, "betas": [0.9, 0.99],
                                                  "weight_decay": 0.01}},
         "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 100,
                               "stage3_max_live_parameters": 1e5},
         "communication_data_type": "fp32"},
        {"optimizer": zero_py.Lion, "dtype": torch.bfloat16, "clip": 1.0,  # the default
         "kwargs": {"stage": 3, "lr": 1e-3, "betas": (0.9, 0.99), "weight_decay": 0.01,
                    "persistence_threshold": 101, "prefetch_bytes": 2 * 10**5,
                    "grad_reduce_dtype": torch.float32}},
        True),
}


@pytest.mark.parametrize("name", list(PARITY))
def test_config_trains_like_the_explicit_call(name):
    explicit = PARITY[name][1]
    for rank, res in enumerate(distributed.run(_parity_body, 2, name)):
        got, want = res["got"], res["want"]
        assert len(got) == len(want)
        assert res["moved"] >= len(got) // 2, f"{name}: training did not move the parameters"
        for i, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a, b), f"{name}: rank {rank} parameter {i} differs"
        if name.startswith("stage2"):
            # the schedule advanced once per step: iteration PARITY_STEPS - 1
            assert res["lr"] == pytest.approx(explicit["rate"](PARITY_STEPS))
        if "fp16" in name:  # the loss scale starts too high: the first steps are skipped
            assert 0 < res["skipped"] < PARITY_STEPS


def test_zero_plus_plus_quantization_keys_become_options():
    plan = deepspeed.translate({"zero_optimization": {
        "stage": 3, "zero_quantized_weights": True, "zero_quantized_gradients": True}})
    assert plan.refusals == []
    assert plan.zero_kwargs["quantized_weights"] == "int8"
    assert plan.zero_kwargs["quantized_grads"] == "int4"
    off = deepspeed.translate({"zero_optimization": {
        "stage": 2, "zero_quantized_weights": False, "zero_quantized_nontrainable_weights": True}})
    assert "quantized_weights" not in off.zero_kwargs
    assert _paths(off) == ["zero_optimization.zero_quantized_nontrainable_weights"]
    # DeepSpeed's stages 1-2 ignore them (full-precision collectives): refused, not quantized
    for stage in (1, 2):
        low = deepspeed.translate({"zero_optimization": {
            "stage": stage, "zero_quantized_weights": True, "zero_quantized_gradients": True}})
        assert _paths(low) == ["zero_optimization.zero_quantized_weights",
                               "zero_optimization.zero_quantized_gradients"]
        assert not {"quantized_weights", "quantized_grads"} & set(low.zero_kwargs)
