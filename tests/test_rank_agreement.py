"""Ranks that disagree are told so on every rank, before any collective that could abort or hang.

Without the check, each of these scenarios aborted the process inside gloo (buffers of
different sizes) or hung: an extra layer on one rank, a parameter in another dtype, another
bucket_bytes, another stage-3 wrap policy, another stage, another buffer, an argument refused
on one rank only, a state dict refused on one rank or saved at another step. Now every rank
raises a ValueError naming the first parameter or setting that differs and its value on each
rank. All scenarios run in one set of 2 processes on a process group with a 10 s timeout, so a
missed mismatch fails fast instead of hanging; a final scenario trains on the same group to
show the group is still usable after the refusals.
"""

import contextlib
import datetime
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import distributed
import models
import zero_py
from zero_py.examples.demo import Block


class Extra(nn.Module):
    """models.MLP with one more layer between fc2 and head."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 32)
        self.extra = nn.Linear(32, 32)
        self.head = nn.Linear(32, 8)


def _attempt(build, group):
    """The ValueError's message, or None. Any other exception (a missed mismatch surfaces as
    the group's 10 s timeout, a RuntimeError, or worse) fails the rank, hence the test."""
    dist.barrier(group)
    try:
        build()
    except ValueError as exc:
        return {"error": str(exc)}
    return {"error": None}


def _scenarios(rank, world_size, root):
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=10))
    torch.manual_seed(0)
    out = {}
    out["extra_layer"] = _attempt(lambda: zero_py.initialize(
        Extra() if rank == 1 else models.MLP(), stage=2, process_group=group, lr=1e-2), group)

    def other_dtype():
        m = models.MLP()
        if rank == 1:
            m.fc2.to(torch.bfloat16)
        zero_py.ZeroOptimizer(m.parameters(), stage=1, process_group=group, lr=1e-2)
    out["dtype"] = _attempt(other_dtype, group)
    out["bucket_bytes"] = _attempt(lambda: zero_py.ZeroOptimizer(
        models.MLP().parameters(), stage=2, process_group=group,
        bucket_bytes=1024 * (rank + 1)), group)
    out["wrap_policy"] = _attempt(lambda: zero_py.initialize(
        models.TiedGPT(), stage=3, process_group=group,
        wrap_policy={Block} if rank == 0 else None), group)
    out["stage"] = _attempt(lambda: zero_py.initialize(
        models.MLP(), stage=2 + rank, process_group=group), group)

    def buffers():
        m = models.MLP()
        if rank == 1:
            m.register_buffer("stat", torch.zeros(3))
        zero_py.initialize(m, stage=2, process_group=group)
    out["buffer"] = _attempt(buffers, group)
    out["lr"] = _attempt(lambda: zero_py.ZeroOptimizer(
        models.MLP().parameters(), stage=2, process_group=group, lr=1e-2 * (rank + 1)), group)

    # an argument refused on one rank only: every rank raises, none waits for the others
    out["refused_on_one_rank"] = _attempt(lambda: zero_py.ZeroOptimizer(
        models.MLP().parameters(), stage=2, process_group=group, lr=-1.0 if rank else 1e-2),
        group)

    def float64_stage3():
        m = models.MLP()
        if rank == 1:
            m.fc2.double()
        zero_py.initialize(m, stage=3, process_group=group)
    out["refused_on_one_rank_stage3"] = _attempt(float64_stage3, group)

    # a ZP_* knob set to a value it does not take: refused at construction, naming it, on
    # every rank (it used to be a bare int()/float() error, or a failed all-gather, in the
    # middle of the first forward, or ignored), here on rank 1 alone and at stage 3 on both
    def with_env(value, build):
        os.environ["ZP_SHM_TIMEOUT_S"] = value
        try:
            build()
        finally:
            del os.environ["ZP_SHM_TIMEOUT_S"]
    out["env_refused_on_one_rank"] = _attempt(lambda: with_env("abc" if rank else "30", (
        lambda: zero_py.ZeroOptimizer(models.MLP().parameters(), stage=2,
                                      process_group=group))), group)
    out["env_refused_stage3"] = _attempt(lambda: with_env("-1", (
        lambda: zero_py.initialize(models.MLP(), stage=3, process_group=group))), group)

    # loads: every rank loads or none (a dict refused on one rank, shard dicts of other steps)
    m = models.MLP()
    opt = zero_py.ZeroOptimizer(m.parameters(), stage=2, process_group=group, lr=1e-2)
    saved = []
    for _ in range(2):
        models.mlp_loss(m, models.mlp_batch(torch.Generator().manual_seed(rank))).backward()
        opt.step()
        opt.zero_grad()
        saved.append(opt.state_dict())
    first = next(iter(saved[1]["state"]))  # a parameter this rank holds a slice of
    broken = {**saved[1], "state": {**saved[1]["state"], first: {**saved[1]["state"][first],
                                                                 "exp_avg": torch.ones(1)}}}
    out["load_refused_on_one_rank"] = _attempt(
        lambda: opt.load_state_dict(broken if rank == 1 else saved[1]), group)
    out["load_other_steps"] = _attempt(lambda: opt.load_state_dict(saved[rank]), group)
    out["load_agreeing"] = _attempt(lambda: opt.load_state_dict(saved[0]), group)

    # clip_grad_norm_ refused on one rank only (it raised there alone, and the other rank
    # waited in the norm's all-reduce), or with another max_norm per rank (each rank clipped
    # its shard by its own coefficient): every rank raises; the run then goes on as one that
    # never made the call
    def clipped(calls):
        torch.manual_seed(0)
        m = models.MLP()
        opt = zero_py.ZeroOptimizer(m.parameters(), stage=2, process_group=group, lr=1e-2)
        models.mlp_loss(m, models.mlp_batch(torch.Generator().manual_seed(rank))).backward()
        errors = [_attempt(call(opt), group) for call in calls]
        opt.clip_grad_norm_(0.1)
        opt.step()
        return errors, [p.detach().clone() for p in m.parameters()]
    (out["clip_refused_on_one_rank"], out["clip_max_norm"]), out["clip_then"] = clipped([
        lambda opt: lambda: opt.clip_grad_norm_(1.0, -1.0 if rank else 2.0),
        lambda opt: lambda: opt.clip_grad_norm_(0.1 * (rank + 1))])
    out["clip_never"] = clipped([])[1]

    # consolidate_state_dict to a rank the group lacks returned None on every rank, silently
    opt = zero_py.ZeroOptimizer(models.MLP().parameters(), stage=2, process_group=group)
    out["consolidate_to_5"] = _attempt(lambda: opt.consolidate_state_dict(to=5), group)
    out["consolidate_to_differs"] = _attempt(lambda: opt.consolidate_state_dict(to=rank),
                                             group)

    # stage 3's gathered() with another modifier_rank per rank: each rank broadcast its own
    # edits on exit (a hang); one not in the group was found by that broadcast only, after
    # the block ran, as "broadcast: src 5 ...". Both raise on every rank, before the block
    def stage3_mlp():
        torch.manual_seed(0)
        return zero_py.initialize(models.MLP(), stage=3, process_group=group,
                                  wrap_policy={nn.Linear}, lr=1e-2)

    def gathered_then_trained(calls):
        m, opt = stage3_mlp()
        errors = []
        for modifier_rank in calls:
            dist.barrier(group)
            try:
                with zero_py.gathered(m, modifier_rank=modifier_rank), torch.no_grad():
                    m.fc1.weight.add_(1.0)
                errors.append(None)
            except (ValueError, RuntimeError) as exc:
                errors.append(str(exc))
        models.mlp_loss(m, models.mlp_batch(torch.Generator().manual_seed(rank))).backward()
        opt.step()
        with zero_py.gathered(m):
            return errors, [p.detach().clone() for p in m.parameters()]
    out["gathered_errors"], out["gathered_then"] = gathered_then_trained([rank, 5])
    out["gathered_never"] = gathered_then_trained([])[1]

    # a loss scale loaded on one rank only: the gradients were reduced scaled by each rank's
    # own scale and each shard unscaled by its own (silently 0.04 off at lr 1e-2 in 2 steps);
    # the step refuses on every rank, and once the scale agrees again training goes on as a
    # run that never had it
    def scaled(diverge):
        torch.manual_seed(0)
        m = models.MLP()
        opt = zero_py.ZeroOptimizer(m.parameters(), stage=2, process_group=group, lr=1e-2,
                                    loss_scaler=zero_py.LossScaler(init_scale=2.0**8))
        good = opt.loss_scaler.state_dict()
        error = None
        for k in range(2):
            if diverge and k == 0 and rank == 1:
                opt.loss_scaler.load_state_dict({**good, "scale": 2.0**12})
            loss = models.mlp_loss(m, models.mlp_batch(torch.Generator().manual_seed(rank)))
            opt.scale_loss(loss).backward()
            try:
                opt.step()
            except RuntimeError as exc:
                error = str(exc)
                opt.loss_scaler.load_state_dict(good)  # the run goes on: skip this batch
                opt.zero_grad()
                loss = models.mlp_loss(m, models.mlp_batch(torch.Generator().manual_seed(rank)))
                opt.scale_loss(loss).backward()
                opt.step()
            opt.zero_grad()
        return error, [p.detach().clone() for p in m.parameters()]
    (out["scale_error"], out["scale_then"]), out["scale_never"] = scaled(True), scaled(False)[1]

    def accumulate_two_and_step(m, opt):
        """Two micro-batches agreeing on every rank (the first under no_sync()), one step."""
        for k in range(2):
            with opt.no_sync() if k == 0 else contextlib.nullcontext():
                models.mlp_loss(m, models.mlp_batch(
                    torch.Generator().manual_seed(2 * rank + k))).backward()
        opt.step()

    # stage 3's no_sync() entered on rank 0 only, around the forward and backward (a rank's
    # own accumulation counter) or around the backward alone, after a forward outside it or
    # inside it on both ranks: rank 1's backward reduced and rank 0's did not, so each waited
    # in a collective the other never made until the group's timeout, then raised a bare
    # timeout. Both ranks raise at once, naming no_sync(), and the run then goes on
    # (zero_grad, the same two micro-batches agreeing: the first under no_sync() on both) as
    # one that never made the calls
    def no_sync_then_trained(calls):
        m, opt = stage3_mlp()
        errors = []
        for around in calls:
            dist.barrier(group)
            batch = models.mlp_batch(torch.Generator().manual_seed(10 + rank))
            alone = opt.no_sync() if rank == 0 else contextlib.nullcontext()
            start = time.monotonic()
            try:
                if around == "forward and backward":
                    with alone:
                        models.mlp_loss(m, batch).backward()
                else:
                    with opt.no_sync() if around == "backward of a forward inside" else (
                            contextlib.nullcontext()):
                        loss = models.mlp_loss(m, batch)
                    with alone:
                        loss.backward()
                errors.append(None)
            except RuntimeError as exc:
                errors.append(str(exc))
            errors.append(time.monotonic() - start)
            opt.zero_grad()
        accumulate_two_and_step(m, opt)
        with zero_py.gathered(m):
            return errors, [p.detach().clone() for p in m.parameters()]
    out["no_sync_errors"], out["no_sync_then"] = no_sync_then_trained(
        ["forward and backward", "backward", "backward of a forward inside"])
    out["no_sync_never"] = no_sync_then_trained([])[1]

    # stage 2 with several buckets, no_sync() around rank 0's first backward only, then a
    # backward (an accumulation counter off by one) or step(): rank 1 reduce-scattered its
    # first buckets during backward before any check, rank 0 raised at its next count and
    # never matched them, so the next collective of the group (gloo) aborted the process on a
    # size mismatch; step() alone went through. Both ranks raise at once, naming no_sync(),
    # before any reduction of the pass is launched: the parameters are untouched, and after
    # zero_grad() the run goes on as one that never made the calls. Stage 1 reduces only in
    # step(), where rank 0's accumulated gradient is reduced as any other: it trains as a run
    # with no no_sync()
    def stage2_no_sync(stage, calls):
        torch.manual_seed(0)
        m = models.MLP()
        opt = zero_py.ZeroOptimizer(m.parameters(), stage=stage, process_group=group, lr=1e-2,
                                    bucket_bytes=1024)
        assert opt.reducer.flat.n_buckets >= 3, opt.reducer.flat.n_buckets
        errors = []
        for then in calls:
            dist.barrier(group)
            before = [p.detach().clone() for p in m.parameters()]
            alone = opt.no_sync() if rank == 0 and then else contextlib.nullcontext()
            start = time.monotonic()
            try:
                with alone:
                    models.mlp_loss(m, models.mlp_batch(
                        torch.Generator().manual_seed(20 + rank))).backward()
                if then == "backward":
                    models.mlp_loss(m, models.mlp_batch(
                        torch.Generator().manual_seed(30 + rank))).backward()
                opt.step()
                errors.append(None)
            except RuntimeError as exc:
                errors.append(str(exc))
            errors.append(time.monotonic() - start)
            errors.append(all(torch.equal(a, p) for a, p in zip(before, m.parameters())))
            opt.zero_grad()
        accumulate_two_and_step(m, opt)
        return errors, [p.detach().clone() for p in m.parameters()]
    out["stage2_no_sync_errors"], out["stage2_no_sync_then"] = stage2_no_sync(
        2, ["backward", "step()"])
    out["stage2_no_sync_never"] = stage2_no_sync(2, [])[1]
    # stage 1: the attempt trains (it is the run's first step), so its reference makes it
    # with no_sync() on neither rank
    out["stage1_no_sync"] = stage2_no_sync(1, ["step()"])
    out["stage1_no_sync_never"] = stage2_no_sync(1, [None])

    # zero_grad(set_to_none=False) on rank 1 only, then a step without backward: rank 1 kept
    # zeroed gradients that torch.optim applies (momentum, weight decay) and rank 0 none, so
    # rank 1 updated its shard and all-gathered it while rank 0 skipped the update and its
    # all-gather (rank 1 waited until the group's timeout; the ranks' models 7% apart). Every
    # rank refuses the step; after a zero_grad() alike training goes on as a run without it
    def zeroed(diverge):
        torch.manual_seed(0)
        m = models.MLP()
        opt = zero_py.ZeroOptimizer(m.parameters(), torch.optim.SGD, stage=2,
                                    process_group=group, lr=0.1, momentum=0.9,
                                    weight_decay=0.1)
        models.mlp_loss(m, models.mlp_batch(torch.Generator().manual_seed(rank))).backward()
        opt.step()
        error = None
        if diverge:
            opt.zero_grad(set_to_none=rank == 0)
            try:
                opt.step()
            except RuntimeError as exc:
                error = str(exc)
        opt.zero_grad()
        models.mlp_loss(m, models.mlp_batch(torch.Generator().manual_seed(5 + rank))).backward()
        opt.step()
        return error, [p.detach().clone() for p in m.parameters()]
    (out["zeroed_error"], out["zeroed_then"]), out["zeroed_never"] = zeroed(True), zeroed(False)[1]

    # save_checkpoint with async_save on rank 1 only: rank 1 went on to make the save
    # thread's groups while rank 0 waited in the write's collectives (a hang until the
    # group's timeout; under hybrid sharding past it); another path per rank, or keep_last,
    # failed on a missing temporary directory or went unseen. Refused on every rank, nothing
    # written; the same call then saves
    m, opt = zero_py.initialize(models.MLP(), torch.optim.SGD, stage=2, process_group=group,
                                lr=1e-2)
    saves = {}
    for name, kwargs in (("async_save", {"async_save": rank == 1}),
                         ("path", {"path": os.path.join(root, f"ck{rank}")}),
                         ("agreeing", {})):
        dist.barrier(group)
        path = kwargs.pop("path", os.path.join(root, "ck"))
        try:
            zero_py.save_checkpoint(path, m, opt, **kwargs)
            saves[name] = None
        except zero_py.CheckpointError as exc:
            saves[name] = str(exc)
        dist.barrier(group)
        saves[name + " files"] = sorted(os.listdir(root))
    out["saves"] = saves

    # the group still works: agreeing ranks train
    m = models.MLP()
    opt = zero_py.ZeroOptimizer(m.parameters(), stage=2, process_group=group, lr=1e-2)
    models.mlp_loss(m, models.mlp_batch(torch.Generator().manual_seed(rank))).backward()
    opt.step()
    out["trained"] = [p.detach().clone() for p in m.parameters()]
    return out


def test_disagreeing_ranks_raise_on_every_rank(tmp_path):
    results = distributed.run(_scenarios, 2, str(tmp_path), timeout=120)
    expected = {
        "extra_layer": ["parameter 4", "head.weight (8, 32)", "extra.weight (32, 32)",
                        "parameters per rank: rank 0: 6, rank 1: 8"],
        "dtype": ["parameter 2", "torch.float32", "torch.bfloat16"],
        "bucket_bytes": ["option bucket_bytes", "rank 0: 1024", "rank 1: 2048"],
        "wrap_policy": ["unit=", "blocks.0", "(root)"],
        "stage": ["stage", "rank 0: 2", "rank 1: 3"],
        "buffer": ["buffer stat", "rank 0: absent"],
        "lr": ["option lr", "rank 0: 0.01", "rank 1: 0.02"],
        "load_refused_on_one_rank": ["the loaded state dict", "rank 0: \"accepted\"",
                                     "rank 1: \"refused: zero_py: parameter",
                                     "'exp_avg' has shape (1,)"],
        "load_other_steps": ["updates applied before the save", "rank 0: 1", "rank 1: 2"],
        "refused_on_one_rank": ["the ranks disagree on arguments", "rank 0: \"accepted\"",
                                "rank 1: \"refused: Invalid learning rate: -1.0"],
        "refused_on_one_rank_stage3": ["zero_py.initialize: the ranks disagree on arguments",
                                       "rank 0: \"accepted\"", "dtype torch.float64"],
        "env_refused_on_one_rank": ["rank 0: \"accepted\"",
                                    "ZP_SHM_TIMEOUT_S='abc' is not a number of seconds > 0"],
        "env_refused_stage3": ["ZP_SHM_TIMEOUT_S='-1' is not a number of seconds > 0"],
    }
    for name, words in expected.items():
        per_rank = [r[name] for r in results]
        for rank, got in enumerate(per_rank):
            assert got["error"] is not None, f"{name}: rank {rank} raised nothing"
            for word in words:
                assert word in got["error"], f"{name}: {word!r} not in:\n{got['error']}"
        # the same message on both ranks (but for the call's name: stage 2 and stage 3 differ)
        texts = [got["error"][max(0, got["error"].find("the ranks disagree")):]
                 for got in per_rank]
        assert texts[0] == texts[1], name
    assert all(r["load_agreeing"]["error"] is None for r in results)
    clip_words = {
        "clip_refused_on_one_rank": ["rank 1 refused its arguments: norm_type must be > 0",
                                     "rank 0: clip_grad_norm_(max_norm=1.0, norm_type=2.0",
                                     "rank 1: clip_grad_norm_(max_norm=1.0, norm_type=-1.0"],
        "clip_max_norm": ["different arguments", "rank 0: clip_grad_norm_(max_norm=0.1,",
                          "rank 1: clip_grad_norm_(max_norm=0.2,", "nothing was changed"],
        "consolidate_to_5": ["consolidate_state_dict(to=5)", "an int from 0 to 1"],
        "consolidate_to_differs": ["the ranks disagree on consolidate_state_dict's to",
                                   "rank 0: 0", "rank 1: 1"]}
    for name, words in clip_words.items():
        texts = [r[name]["error"] for r in results]
        assert texts[0] is not None and texts[0] == texts[1], (name, texts)
        for word in words:
            assert word in texts[0], f"{name}: {word!r} not in:\n{texts[0]}"
    for rank, r in enumerate(results):
        assert r["scale_error"] is not None, f"rank {rank} stepped with another loss scale"
        assert "hyperparameters differ between ranks" in r["scale_error"], r["scale_error"]
        assert f"loss scaler scale={2.0**12 if rank else 2.0**8}" in r["scale_error"]
        for a, b in zip(r["scale_then"], r["scale_never"]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    for r in results:
        other_modifier, out_of_group = r["gathered_errors"]
        assert "did not all start the same gathered access" in other_modifier, other_modifier
        assert "zero_py.gathered() with modifier_rank=" in other_modifier, other_modifier
        assert "the same modifier_rank, on every rank" in other_modifier, other_modifier
        assert out_of_group.startswith("zero_py.gathered(): modifier_rank=5 is not a rank of "
                                       "the model's process group: pass an int from 0 to 1")
        for a, b in zip(r["gathered_then"], r["gathered_never"]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        for a, b in zip(r["clip_then"], r["clip_never"]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    for r in results:
        errors = r["no_sync_errors"]
        for error, seconds, where in zip(errors[::2], errors[1::2],
                                         ("forward", "backward", "backward")):
            assert error is not None and "no_sync() was entered on some ranks only" in error, (
                error)
            assert f"rank 0: {where} inside no_sync() number 1" in error, error
            assert "inside no_sync(): rank 0; outside: rank 1" in error, error
            assert "every rank must enter no_sync() together" in error, error
            assert seconds < 5, f"refused after {seconds:.1f} s: the group's timeout?"
        for a, b in zip(r["no_sync_then"], r["no_sync_never"]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        errors = r["stage2_no_sync_errors"]
        for error, seconds, unchanged in zip(errors[::3], errors[1::3], errors[2::3]):
            assert error is not None and "no_sync() was entered on some ranks only" in error, (
                error)
            assert ("rank 0: backward pass reducing gradients accumulated inside no_sync() "
                    "number 1 in step 0; rank 1: backward pass number 1 in step 0") in error, error
            assert "inside no_sync(): rank 0; outside: rank 1" in error, error
            assert "every rank must enter no_sync() together" in error, error
            assert seconds < 5, f"refused after {seconds:.1f} s: the group's timeout?"
            assert unchanged, "a refused call changed the parameters"
        for a, b in zip(r["stage2_no_sync_then"], r["stage2_no_sync_never"]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        assert r["stage1_no_sync"][0][0] is None, r["stage1_no_sync"][0]
        for a, b in zip(r["stage1_no_sync"][1], r["stage1_no_sync_never"][1]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    for rank, r in enumerate(results):
        assert r["zeroed_error"] is not None, f"rank {rank} stepped with other kept gradients"
        assert "hyperparameters differ between ranks" in r["zeroed_error"], r["zeroed_error"]
        assert ("zero_grad(set_to_none=False) kept the zeroed gradients of 6 parameters"
                if rank else "no zeroed gradient kept") in r["zeroed_error"], r["zeroed_error"]
        for a, b in zip(r["zeroed_then"], r["zeroed_never"]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    for r in results:
        saves = r["saves"]
        for name, words in (("async_save", ["rank 0: save_checkpoint(", "async_save=False); "
                                            "rank 1: save_checkpoint(", "async_save=True)"]),
                            ("path", ["/ck0'", "/ck1'"])):
            assert saves[name] is not None and all(w in saves[name] for w in words), saves
            assert "the ranks passed different arguments" in saves[name], saves[name]
            assert "nothing was written" in saves[name], saves[name]
            assert saves[name + " files"] == [], saves
        assert saves["agreeing"] is None and saves["agreeing files"] == ["ck"], saves
    for a, b in zip(*(r["trained"] for r in results)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
