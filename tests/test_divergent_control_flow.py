"""Stage 3 under control flow that differs between ranks, against DDP(find_unused_parameters=True).

- Units skipped by some ranks on some steps, up to every unit but the root on a step (an
  unused expert, a rank whose micro-batch routes nowhere), and a unit run twice by one rank
  only, at 2 and 3 ranks: the parameters after every step equal DDP's.
- A rank-local no_grad forward (evaluation on rank 0 only), between training steps: its output
  equals the DDP module's, and training goes on to DDP's result.
- A different number of backward passes per step on one rank, and a no_grad forward on one rank
  alone where the ranks do not share memory (ZP_SHM=0): every rank raises a RuntimeError that
  says so, at once (the process group's timeout is 20 s; they take about a second).

Every scenario of one world size runs in one set of processes.
"""

from __future__ import annotations

import copy
import datetime
import time

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import distributed
import models
import zero_py

STEPS = 8
LR = dict(lr=3e-3, weight_decay=0.1)
RTOL = 1e-5


class Expert(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = nn.Linear(d, d)

    def forward(self, h):
        return torch.tanh(self.fc(h))


class Experts(nn.Module):
    """An embedding, experts a step may skip (each a unit), a head in the root unit."""

    def __init__(self, vocab=16, d=16, n_experts=4):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.experts = nn.ModuleList(Expert(d) for _ in range(n_experts))
        self.head = nn.Linear(d, vocab)

    def forward(self, idx, targets, active=None, twice=()):
        h = self.emb(idx)
        for k, expert in enumerate(self.experts):
            if active is None or k in active:
                h = h + expert(h)
                if k in twice:  # an expert this rank runs again
                    h = h + expert(h)
        logits = self.head(h)
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                           targets.reshape(-1))


def _active(rank, step, n=4):
    """Which experts rank `rank` runs at `step`: all, some, or none (every unit but the root
    skipped), differing between ranks."""
    plans = [None, {0, 2}, set(), {1}, {3}, set(), {0, 1, 2, 3}, {2}]
    return plans[(step + 3 * rank) % len(plans)]


def _pair(rank):
    # a failure here must not wait for torch's default 30 minutes
    torch.distributed.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=20))
    torch.manual_seed(0)
    ref = Experts()
    zm = copy.deepcopy(ref)
    ddp = DDP(ref, find_unused_parameters=True)
    ref_opt = torch.optim.AdamW(ddp.parameters(), **LR)
    zm, zopt = zero_py.initialize(zm, torch.optim.AdamW, stage=3, wrap_policy={Expert}, **LR)
    return ddp, ref_opt, zm, zopt


def _params_rel(zmodel, ref):
    with zero_py.gathered(zmodel):
        return max(models.max_rel_diff(a, b) for a, b in zip(zmodel.parameters(),
                                                             ref.parameters()))


def _batch(gen):
    idx = torch.randint(0, 16, (4, 9), generator=gen)
    return idx[:, :-1], idx[:, 1:]


def _skipped_units(rank, world):
    ddp, ref_opt, zm, zopt = _pair(rank)
    gen = torch.Generator().manual_seed(10 + rank)
    rel = []
    for step in range(STEPS):
        x, y = _batch(gen)
        active = _active(rank, step)
        twice = set()
        if rank == 0 and step % 3 == 1:  # its first expert twice, the other ranks' once
            twice = {0} if active is None else set(sorted(active)[:1])
        for model, opt in ((ddp, ref_opt), (zm, zopt)):
            model(x, y, active, twice).backward()
            opt.step()
            opt.zero_grad()
        rel.append(_params_rel(zm, ddp.module))
    return rel


def _local_eval(rank, world):
    ddp, ref_opt, zm, zopt = _pair(rank)
    gen = torch.Generator().manual_seed(10 + rank)
    evals = []
    for _ in range(4):
        x, y = _batch(gen)
        for model, opt in ((ddp, ref_opt), (zm, zopt)):
            model(x, y).backward()
            opt.step()
            opt.zero_grad()
        if rank == 0:  # evaluation on rank 0 only, the peers go on training
            ex, ey = _batch(torch.Generator().manual_seed(99))
            with torch.no_grad():
                got = zm(ex, ey, {0, 1}).item()
                want = ddp.module(ex, ey, {0, 1}).item()
            evals.append((got, want))
    return {"evals": evals, "rel": _params_rel(zm, ddp.module)}


def _local_eval_across_hosts(rank, world):
    import os

    os.environ["ZP_SHM"] = "0"  # as if the ranks were on several hosts: no shared memory
    ddp, ref_opt, zm, zopt = _pair(rank)
    gen = torch.Generator().manual_seed(10 + rank)
    x, y = _batch(gen)
    start = time.monotonic()
    try:
        if rank == 0:
            with torch.no_grad():
                zm(x, y)
        zm(x, y).backward()
        zopt.step()
        return {"error": None}
    except RuntimeError as exc:
        return {"error": str(exc), "seconds": time.monotonic() - start}


def _local_eval_between_clip_and_step(rank, world):
    """One host: a no_grad forward on rank 0 alone between clip_grad_norm_ and step(), where a
    peer may be writing its shards (in its step) as rank 0 reads them."""
    ddp, ref_opt, zm, zopt = _pair(rank)
    gen = torch.Generator().manual_seed(10 + rank)
    x, y = _batch(gen)
    try:
        zm(x, y).backward()
        zopt.clip_grad_norm_(1.0)
        if rank == 0:
            with torch.no_grad():
                zm(x, y)
        zopt.step()
        zm(x, y).backward()  # the peers' next forward meets rank 0's lone one
        return {"error": None}
    except RuntimeError as exc:
        return {"error": str(exc)}


def _extra_backward(rank, world):
    ddp, ref_opt, zm, zopt = _pair(rank)
    gen = torch.Generator().manual_seed(10 + rank)
    x, y = _batch(gen)
    zm(x, y).backward()  # a whole step first
    zopt.step()
    zopt.zero_grad()
    start = time.monotonic()
    try:
        zm(x, y).backward()
        if rank == 0:  # a second backward on rank 0 only
            zm(x, y).backward()
        zopt.step()
        return {"error": None}
    except RuntimeError as exc:
        return {"error": str(exc), "seconds": time.monotonic() - start}


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_units_skipped_by_some_ranks_up_to_all_match_ddp(world):
    for rank, rel in enumerate(distributed.run(_skipped_units, world)):
        assert max(rel) < RTOL, (rank, rel)


def test_rank_local_no_grad_forward_works():
    res = distributed.run(_local_eval, 2)
    for got, want in res[0]["evals"]:
        assert abs(got - want) <= 1e-5 * abs(want), (got, want)
    assert len(res[0]["evals"]) == 4
    for r in res:
        assert r["rel"] < RTOL, r


def test_a_rank_local_no_grad_forward_without_shared_memory_is_refused_on_every_rank():
    """Across hosts a no_grad forward's gathers are collective: one rank's alone is refused on
    every rank before any gather starts, not left to time out."""
    for rank, r in enumerate(distributed.run(_local_eval_across_hosts, 2)):
        assert r["error"] is not None, (rank, "the lone forward went unnoticed")
        assert "no_grad forward" in r["error"] and "one host" in r["error"], r["error"]
        assert r["seconds"] < 10, r


def test_a_rank_local_no_grad_forward_between_clip_and_step_is_refused_on_every_rank():
    """Between clip_grad_norm_ and step() a peer may be writing its shards with no version to
    wait for, so a no_grad forward there is collective, even on one host: one rank's alone is
    refused on every rank (it used to read the peers' shards, possibly half updated)."""
    for rank, r in enumerate(distributed.run(_local_eval_between_clip_and_step, 2)):
        assert r["error"] is not None, (rank, "the lone forward went unnoticed")
        assert "clip_grad_norm_() and step()" in r["error"], r["error"]


def test_a_different_number_of_backward_passes_is_refused_on_every_rank():
    res = distributed.run(_extra_backward, 2)
    for rank, r in enumerate(res):
        assert r["error"] is not None, (rank, "the extra backward went unnoticed")
        assert "different numbers of forward or backward passes" in r["error"], r["error"]
        assert "rank 0" in r["error"] and "rank 1" in r["error"], r["error"]
        assert r["seconds"] < 10, r


def test_merged_order_follows_every_rank():
    from zero_py.stage3.engine import merge_orders

    def rows(*seqs):
        return [[len(s), *s] + [0] * (6 - len(s)) for s in seqs]
    # rank 0 ran units 0, 3; rank 1 ran 0, 1, 2, 3: one order consistent with both, and the
    # unit no rank ran (4) in its module place
    assert merge_orders(rows([0, 3], [0, 1, 2, 3]), 5) == [0, 1, 2, 3, 4]
    # a unit run late by every rank stays late, whatever its id
    assert merge_orders(rows([0, 2, 1], [0, 1]), 3) == [0, 2, 1]
    # ranks that disagree (a cycle): every unit once, lowest id first where stuck
    order = merge_orders(rows([0, 1, 2], [0, 2, 1]), 3)
    assert sorted(order) == [0, 1, 2] and order[0] == 0
