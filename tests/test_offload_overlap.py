"""overlap_step: the offloaded step started during backward, against the same offloaded run
without it, to the bit.

Each bucket reduced during backward is updated at once on the host with the step's inputs
guessed (no clipping, no overflow); step() keeps the guesses that hold and puts the others back
(offload/early.py). The runs below make every way a guess can fail happen: clipping that
scales the gradients, fp16 steps skipped for overflow, the learning rate changed between
backward and step, zero_grad() between them, a second backward that reduces the same buckets
again (accumulation without no_sync), a state dict taken or optimizer.state[p] read between
them, the masters synced from loaded weights between them; and the way it holds:
no clipping. Each is compared with the run without overlap, and the counts of early and kept
buckets show which path ran.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

import distributed
import models
import zero_py
from test_offload import build as offload_build, full, worst  # the offload tests'

STEPS = 4


def build(stage, dtype, overlap, scaler=None):
    """The offload tests' model and optimizer (offload_optimizer="cpu"), with overlap_step."""
    extra = {} if scaler is None else {"loss_scaler": scaler}
    return offload_build(stage, dtype, "cpu", overlap_step=overlap, **extra)


def train(model, opt, rank, clip=None, no_sync=True, lr_change=False, zero_between=False,
          state_dict_between=False, state_read_between=False, load_between=False):
    """STEPS steps of two micro-batches each; returns per step (early buckets, kept buckets)
    and the state dicts taken (or optimizer.state[p] read) between backward and step."""
    counts, shards = [], []
    for t in range(STEPS):
        gen = torch.Generator().manual_seed(100 + 7 * t + rank)
        if zero_between and t == 2:  # a backward whose gradients are thrown away
            loss = model(*models.gpt_batch(gen, batch=3)).float()
            opt.scale_loss(loss).backward()
            opt.zero_grad()
        for k in range(2):
            batch = models.gpt_batch(gen, batch=3)
            sync = opt.no_sync() if (k == 0 and no_sync) else contextlib.nullcontext()
            with sync:
                loss = model(*batch).float() / 2
                opt.scale_loss(loss).backward()
        if clip is not None:
            opt.clip_grad_norm_(clip)
        if lr_change and t == 2:
            for g in opt.param_groups:
                g["lr"] *= 0.5
        if state_dict_between and t == 2:
            shards.append(opt.state_dict())
        if load_between and t == 2:  # weights loaded into the bf16 model, as README says
            model.load_state_dict({k: 0.9 * v for k, v in model.state_dict().items()})
            opt.sync_master_from_params()
        if state_read_between and t == 2:  # as a script logging exp_avg's norm would
            shards.append({"state": {i: {k: v.clone() for k, v in opt.state[p].items()}
                                     for i, p in enumerate(model.parameters())
                                     if p in opt.state}})
        opt.step()
        early = opt._early
        counts.append((early.early_last_step, early.kept_last_step) if early else (0, 0))
        opt.zero_grad()
    return counts, shards


def shard_worst(a, b) -> float:
    """The largest difference between two state dicts' tensors (states and fp32 masters)."""
    assert a["state"].keys() == b["state"].keys() and a["state"]
    worst_diff = 0.0
    for key, sa in a["state"].items():
        for name, value in sa.items():
            if isinstance(value, torch.Tensor) and value.dim():
                worst_diff = max(worst_diff, float((value - b["state"][key][name]).abs().max()))
    return worst_diff


SCENARIOS = {
    "no clipping": dict(clip=None),
    "clipped": dict(clip=0.05),
    "clip not reached": dict(clip=1e6),
    "accumulating backward": dict(no_sync=False),
    "lr changed": dict(lr_change=True),
    "zero_grad between": dict(zero_between=True),
    "state_dict between": dict(state_dict_between=True),
    "state read between": dict(state_read_between=True),
    "weights loaded between": dict(load_between=True),
}
CASES = [(stage, dtype) for stage in (2, 3) for dtype in (torch.float32, torch.bfloat16)]


def run_all(rank, world):
    out = {}
    for stage, dtype in CASES:
        for name, how in SCENARIOS.items():
            if (stage, dtype) != (2, torch.bfloat16) and name not in ("no clipping", "clipped"):
                continue  # the failure paths do not depend on the stage or dtype
            runs = {}
            for overlap in (0.0, 1.0):
                model, opt = build(stage, dtype, overlap)
                counts, shards = train(model, opt, rank, **how)
                runs[overlap] = (full(model), counts, shards + [opt.state_dict()])
            # the weights, and the optimizer states and fp32 masters (bf16 weights could hide
            # a difference in the states below their rounding)
            out[(stage, dtype, name)] = (worst(runs[1.0][0], runs[0.0][0]), runs[1.0][1],
                                         [shard_worst(a, b) for a, b in
                                          zip(runs[1.0][2], runs[0.0][2])])
    # fp16 whose scale grows at every step until the gradients overflow: steps taken and
    # skipped, alike with and without overlap
    runs = {}
    for overlap in (0.0, 1.0):
        scaler = zero_py.LossScaler(init_scale=2.0 ** 8, growth_factor=2.0 ** 8,
                                    growth_interval=1)
        model, opt = build(2, torch.float16, overlap, scaler=scaler)
        counts, _ = train(model, opt, rank)
        runs[overlap] = (full(model), opt.skipped_steps, counts)
    out["fp16"] = (worst(runs[1.0][0], runs[0.0][0]), runs[1.0][1], runs[0.0][1], runs[1.0][2])
    # half of the shard may go early: fewer buckets, the same result
    model, opt = build(2, torch.bfloat16, 0.5)
    counts, _ = train(model, opt, rank)
    half = (full(model), counts, opt.memory_report()["host_optimizer_states"],
            opt.state_dict())
    model, opt = build(2, torch.bfloat16, 1.0)
    counts_all, _ = train(model, opt, rank)
    out["half"] = (max(worst(half[0], full(model)), shard_worst(half[3], opt.state_dict())),
                   half[1], counts_all, half[2], opt.memory_report()["host_optimizer_states"],
                   opt._flat.shard_numel)
    out["refusals"] = refusals()
    return out


def refusals():
    msgs = {}
    cases = {"no offload": dict(offload_optimizer=None, overlap_step=1.0),
             "stage 1": dict(stage=1, offload_optimizer="cpu", overlap_step=1.0),
             "bad share": dict(offload_optimizer="cpu", overlap_step=1.5),
             "generic class": dict(offload_optimizer="cpu", overlap_step=0.5,
                                   opt=torch.optim.NAdam)}
    for name, kw in cases.items():
        torch.manual_seed(0)
        m = models.TiedGPT(n_layer=1)
        opt_cls = kw.pop("opt", torch.optim.AdamW)
        stage = kw.pop("stage", 2)
        try:
            zero_py.initialize(m, opt_cls, stage=stage, lr=1e-3, **kw)
            msgs[name] = None
        except ValueError as exc:
            msgs[name] = str(exc)
    return msgs


@pytest.fixture(scope="module")
def runs():
    return distributed.run(run_all, 2)


@pytest.mark.parametrize("stage,dtype", CASES, ids=[f"stage{s}-{str(d)[6:]}" for s, d in CASES])
def test_early_updates_kept_without_clipping_match_to_the_bit(runs, stage, dtype):
    for out in runs:
        diff, counts, shard_diffs = out[(stage, dtype, "no clipping")]
        assert diff == 0.0 and not any(shard_diffs)
        assert counts[0] == (0, 0)  # the first step makes the states: nothing goes early
        assert all(early > 0 and kept == early for early, kept in counts[1:]), counts


@pytest.mark.parametrize("stage,dtype", CASES, ids=[f"stage{s}-{str(d)[6:]}" for s, d in CASES])
def test_clipped_steps_put_the_early_updates_back(runs, stage, dtype):
    for out in runs:
        diff, counts, shard_diffs = out[(stage, dtype, "clipped")]
        assert diff == 0.0 and not any(shard_diffs)
        assert all(early > 0 and kept == 0 for early, kept in counts[1:]), counts


def test_a_clip_that_does_not_scale_keeps_them(runs):
    for out in runs:
        diff, counts, shard_diffs = out[(2, torch.bfloat16, "clip not reached")]
        assert diff == 0.0 and not any(shard_diffs)
        assert all(early > 0 and kept == early for early, kept in counts[1:]), counts


def test_a_bucket_reduced_again_is_put_back_first(runs):
    # without no_sync both micro-batches reduce every bucket: the first pass's early updates
    # are put back when the second writes the bucket, and the second's are kept
    for out in runs:
        diff, counts, shard_diffs = out[(2, torch.bfloat16, "accumulating backward")]
        assert diff == 0.0 and not any(shard_diffs)
        assert all(early > 0 and kept == early for early, kept in counts[1:]), counts


def test_hyperparameters_changed_after_backward_redo_the_update(runs):
    for out in runs:
        diff, counts, shard_diffs = out[(2, torch.bfloat16, "lr changed")]
        assert diff == 0.0 and not any(shard_diffs)
        # kept: only the buckets reduced inside step(), after the change (their guess has it)
        assert 0 < counts[2][1] < counts[2][0], counts
        assert counts[3][1] == counts[3][0] > 0, counts


def test_zero_grad_between_backward_and_step_discards_them(runs):
    for out in runs:
        diff, counts, shard_diffs = out[(2, torch.bfloat16, "zero_grad between")]
        assert diff == 0.0 and not any(shard_diffs)
        assert counts[2][1] == counts[2][0] > 0, counts


def test_state_dict_between_backward_and_step_sees_no_guess(runs):
    for out in runs:
        diff, counts, shard_diffs = out[(2, torch.bfloat16, "state_dict between")]
        assert diff == 0.0 and shard_diffs == [0.0, 0.0]
        # the state dict put back those before it; only the buckets reduced inside step() went
        # early after it
        assert 0 < counts[2][0] < counts[1][0], counts


def test_optimizer_state_read_between_backward_and_step_sees_no_guess(runs):
    for out in runs:
        diff, counts, shard_diffs = out[(2, torch.bfloat16, "state read between")]
        assert diff == 0.0 and shard_diffs == [0.0, 0.0]
        assert 0 < counts[2][0] < counts[1][0], counts  # as for a state dict


def test_masters_synced_between_backward_and_step_discard_them(runs):
    # sync_master_from_params() after a load of weights (also what gathered(modifier_rank=)
    # and a stage-3 model.load_state_dict call): the early updates ran from the old masters
    for out in runs:
        diff, counts, shard_diffs = out[(2, torch.bfloat16, "weights loaded between")]
        assert diff == 0.0 and not any(shard_diffs)
        assert 0 < counts[2][0] < counts[1][0], counts  # put back: only step()'s went early


def test_fp16_skipped_steps_discard_the_early_updates(runs):
    for out in runs:
        diff, skipped, skipped_ref, counts = out["fp16"]
        assert diff == 0.0 and skipped == skipped_ref and skipped >= 1
        assert any(early > 0 and kept == 0 for early, kept in counts), counts  # skipped


def test_a_share_bounds_the_buckets_and_the_backup(runs):
    for out in runs:
        diff, half, every, half_bytes, all_bytes, shard = out["half"]
        assert diff == 0.0
        assert 0 < half[-1][0] < every[-1][0], (half, every)
        # the backup: master + AdamW's two states, fp32, per element of the share
        assert all_bytes - half_bytes == (shard - int(0.5 * shard)) * 12


def test_the_estimate_counts_the_backup():
    base = zero_py.estimate_memory(7e6, world_size=4, stage=2, dtype="bf16", offload="cpu")
    est = zero_py.estimate_memory(7e6, world_size=4, stage=2, dtype="bf16", offload="cpu",
                                  overlap_step=1.0)
    assert est.host - base.host == base.shard_numel * 12
    with pytest.raises(ValueError, match="offload='cpu'"):
        zero_py.estimate_memory(7e6, world_size=4, stage=2, overlap_step=1.0)


def test_bad_overlap_arguments_are_refused_with_what_to_change(runs):
    for out in runs:
        msgs = out["refusals"]
        assert "offload_optimizer='cpu'" in msgs["no offload"]
        assert "stage 2 or 3" in msgs["stage 1"]
        assert "[0, 1]" in msgs["bad share"]
        assert "fused kernels" in msgs["generic class"]
