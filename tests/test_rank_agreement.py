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

import datetime
import os

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


def _scenarios(rank, world_size):
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

    # the group still works: agreeing ranks train
    m = models.MLP()
    opt = zero_py.ZeroOptimizer(m.parameters(), stage=2, process_group=group, lr=1e-2)
    models.mlp_loss(m, models.mlp_batch(torch.Generator().manual_seed(rank))).backward()
    opt.step()
    out["trained"] = [p.detach().clone() for p in m.parameters()]
    return out


def test_disagreeing_ranks_raise_on_every_rank():
    results = distributed.run(_scenarios, 2, timeout=120)
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
    for a, b in zip(*(r["trained"] for r in results)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
