"""Fault injection: one rank dies (os._exit) or raises (and then stays alive without taking part)
at the forward, the backward, a reduce-scatter or the step, under stages 1, 2 and 3, at 2 and 3
ranks, with a process-group timeout of TIMEOUT_S. Every survivor must raise a RuntimeError that
names the operation it was waiting for, within TIMEOUT_S + SLACK_S of the fault (measured from
the faulty rank's clock reading just before the fault, on the same host), and then exit.

tests/distributed.py fails as soon as a rank dies, so the scenarios have their own launcher:
every scenario is a set of processes with its own store, all scenarios run at once (most of their
time is the timeout, not CPU), forked from a server that imported torch once. The default set
covers every stage, place, kind of fault and world size at least once; ZP_FAULT_FULL=1 runs the
whole matrix (48 scenarios).
"""

from __future__ import annotations

import datetime
import itertools
import json
import os
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT_S = 10.0
SLACK_S = 5.0  # scheduling on two shared cores, the peer checks' period, the exits
FAULT_STEP = 1  # the step before it is whole, so every collective is already warm
WHERES = ("forward", "backward", "reduce_scatter", "step")
BATCH = 12  # scenarios run at once (the full matrix's 48 in four rounds): more can take longer
# than TIMEOUT_S to connect on two cores


_injected = []  # the fault was raised on this rank (autograd may re-wrap the exception)


def _fault(how: str, out: str, rank: int) -> None:
    with open(os.path.join(out, "fault.json"), "w") as f:
        json.dump({"rank": rank, "at": time.time()}, f)
    if how == "kill":
        os._exit(17)
    _injected.append(rank)
    raise RuntimeError(f"injected on rank {rank}")


def _worker(rank, world, store, out, stage, where, how, faulty):
    torch.set_num_threads(1)
    os.environ["ZP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=TIMEOUT_S))
    import models
    import zero_py
    from zero_py.examples.demo import Block

    torch.manual_seed(0)
    model = models.TiedGPT(n_layer=3)
    kw = {"wrap_policy": {Block}} if stage == 3 else {"bucket_bytes": 4096}
    model, opt = zero_py.initialize(model, torch.optim.AdamW, stage=stage, lr=1e-3, **kw)
    now = {"step": 0}
    bad = rank == faulty

    def at(place):
        if bad and now["step"] == FAULT_STEP and place == where:
            _fault(how, out, rank)

    # the model's first hook, before zero_py's: under stage 3 the fault comes before the
    # step's first gather (the root's; blocks' gathers are prefetched with it)
    model.register_forward_pre_hook(lambda m, a: at("forward"), prepend=True)

    def mark_backward(m, a, output):
        if torch.is_grad_enabled():
            output.register_hook(lambda g: at("backward"))
    model.blocks[1].register_forward_hook(mark_backward)
    reduce_scatter = opt.executor.reduce_scatter
    calls = []

    def reduce_scatter_then_fault(output, input):
        work = reduce_scatter(output, input)
        calls.append(now["step"])
        if calls.count(now["step"]) == 2:  # one reduction of this step is in flight
            at("reduce_scatter")
        return work
    opt.executor.reduce_scatter = reduce_scatter_then_fault

    gen = torch.Generator().manual_seed(rank)
    with open(os.path.join(out, f"ready{rank}"), "w") as f:
        f.write(str(time.time()))
    result = {"rank": rank, "raised": None}
    try:
        for now["step"] in range(FAULT_STEP + 2):  # noqa: B007 - read by the hooks
            idx = torch.randint(0, 32, (4, 17), generator=gen)
            loss = model(idx[:, :-1], idx[:, 1:])
            loss.backward()
            at("step")
            opt.step()
            opt.zero_grad()
    except Exception as exc:  # noqa: BLE001 - what the survivor raised is the result
        if not _injected:
            result.update(raised=type(exc).__name__, message=str(exc), at=time.time(),
                          runtime_error=isinstance(exc, RuntimeError), step=now["step"])
    if _injected:
        # the faulty rank stays alive and takes no part, as a rank stuck elsewhere would:
        # the survivors' gloo connections to it stay open, so only the timeout frees them
        deadline = time.monotonic() + 4 * TIMEOUT_S
        while time.monotonic() < deadline and len([f for f in os.listdir(out) if f.startswith(
                "result") and f.endswith(".json")]) < world - 1:
            time.sleep(0.2)
        os._exit(0)
    with open(os.path.join(out, f"result{rank}.json.tmp"), "w") as f:
        json.dump(result, f)
    os.rename(os.path.join(out, f"result{rank}.json.tmp"), os.path.join(out, f"result{rank}.json"))
    # a survivor leaves as a training script does after an exception: the interpreter exits
    # with its process group still up (not destroyed: its peers are gone)


def _context():
    """Processes forked from a server that imported torch and zero_py once: a scenario's ranks
    start in milliseconds instead of seconds of imports each."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "zero_py", "models"])
    return ctx


def _launch(ctx, scenario, root):
    stage, where, how, world = scenario
    out = os.path.join(root, f"s{stage}-{where}-{how}-{world}")
    os.makedirs(out)
    faulty = world - 1 if how == "kill" else 1  # the last rank, or one in the middle
    procs = [ctx.Process(target=_worker, daemon=True,
                         args=(r, world, os.path.join(out, "store"), out, stage, where, how,
                               faulty)) for r in range(world)]
    for p in procs:
        p.start()
    return {"scenario": scenario, "out": out, "procs": procs, "faulty": faulty}


def _collect(run):
    stage, where, how, world = run["scenario"]
    out = run["out"]
    with open(os.path.join(out, "fault.json")) as f:
        fault = json.load(f)
    found = []
    for r in range(world):
        if r == run["faulty"]:
            continue
        path = os.path.join(out, f"result{r}.json")
        assert os.path.exists(path), (run["scenario"], f"rank {r} never raised: a hang")
        with open(path) as f:
            res = json.load(f)
        res["seconds"] = res["at"] - fault["at"] if res["raised"] else None
        found.append(res)
    return found


def _scenarios():
    full = [(stage, where, how, world) for stage, where, how, world in
            itertools.product((1, 2, 3), WHERES, ("kill", "raise"), (2, 3))]
    if os.environ.get("ZP_FAULT_FULL") == "1":
        return full
    # stages 2 and 3 at every place, both kinds and both world sizes at every stage (stage 1
    # communicates in step() only)
    return [(3, "forward", "raise", 2), (3, "backward", "kill", 3),
            (3, "reduce_scatter", "raise", 3), (3, "step", "kill", 2),
            (2, "forward", "kill", 2), (2, "backward", "raise", 3),
            (2, "reduce_scatter", "kill", 3), (2, "step", "raise", 2),
            (1, "forward", "raise", 2), (1, "reduce_scatter", "kill", 3)]


@pytest.fixture(scope="module")
def outcomes():
    ctx = _context()
    with tempfile.TemporaryDirectory(prefix="zp_fault_") as root:
        start = time.monotonic()
        scenarios = _scenarios()
        runs = []
        deadline = start + 240 * (1 + (len(scenarios) - 1) // BATCH)
        for first in range(0, len(scenarios), BATCH):  # at most BATCH scenarios at a time
            batch = [_launch(ctx, s, root) for s in scenarios[first:first + BATCH]]
            runs += batch
            while time.monotonic() < deadline and any(
                    p.is_alive() for run in batch for p in run["procs"]):
                time.sleep(0.2)
        print(f"all ranks exited {time.monotonic() - start:.1f} s after the launch")
        hung = []
        for run in runs:
            for r, p in enumerate(run["procs"]):
                if p.is_alive():
                    hung.append((run["scenario"], r))
                    p.kill()
        results = {}
        for run in runs:
            try:
                results[run["scenario"]] = _collect(run)
            except (AssertionError, OSError) as exc:
                results[run["scenario"]] = exc
        yield results, hung


def test_no_process_outlives_the_bound(outcomes):
    """Survivors raise and exit, the faulty rank exits: nothing is left running."""
    _, hung = outcomes
    assert not hung, f"ranks still running 240 s per round after the start: {hung}"


@pytest.mark.parametrize("scenario", _scenarios(), ids=lambda s: "stage{}-{}-{}-{}ranks".format(*s))
def test_every_survivor_raises_within_the_timeout(outcomes, scenario):
    results, _ = outcomes
    found = results[scenario]
    if isinstance(found, Exception):
        raise found
    stage, where, how, world = scenario
    assert len(found) == world - 1
    for res in found:
        assert res["raised"], (scenario, res, "a survivor finished as if nothing happened")
        assert res["runtime_error"], res
        msg = res["message"]
        assert msg.startswith("zero_py:"), (scenario, msg)
        # it says which operation it was waiting for
        assert "did not complete" in msg or "passes per step" in msg, (scenario, msg)
        if stage == 3 and "all-gather" in msg:
            assert "unit" in msg and "bucket" in msg, (scenario, msg)
        if "reduce-scatter" in msg:
            assert "bucket" in msg, (scenario, msg)
        assert res["seconds"] < TIMEOUT_S + SLACK_S, (scenario, res["seconds"], msg)
    print(scenario, [round(r["seconds"], 2) for r in found],
          [r["message"][:120] for r in found])
