"""Optimizers built and dropped many times in one process (a notebook, a hyperparameter search,
a test suite) at 2 ranks: each dropped one (`del`, `gc.collect()`) is collected, and gives back
what it took: file descriptors (its sockets, its NVMe offload file), threads (the shared-memory
all-gather's, gloo's), /dev/shm mappings. Counted from /proc, a few cycles after a first one
(which makes what a process makes once: the I/O engine's threads, the stage-3 gather group).

Also: a stage-2 and a stage-3 model alive at once, trained in one loop, and a stage-3 model
after destroy_process_group() and a new init_process_group, and a stage-3 model after a group
that rank 0 alone made, against DDP + torch.optim; a
stage-3 initialize refused by the optimizer leaves the model as it was; a stages 1-2 model
whose optimizer was dropped trains with torch.optim as a plain model; a construction that
fails on one rank (the NVMe file refused) takes its gradient hooks back (stages 1-2), or
makes the next initialize refuse the sharded model by name (stage 3).

All scenarios run in one set of 2 processes.
"""

import copy
import datetime
import gc
import os
import tempfile
import time
import weakref

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import distributed
import models
import zero_py
from zero_py.offload import nvme

_TORCH = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
CYCLES = 1  # after the first: each must give back everything it took



def _train_both(model, opt, ref, ref_opt, rank, steps=2):
    """`steps` steps of the MLP on this rank's batches, zero_py's side and the reference's."""
    gen = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        batch = models.mlp_batch(gen)
        for m, o in ((model, opt), (ref, ref_opt)):
            models.mlp_loss(m, batch).backward()
            o.step()
            o.zero_grad()

def _resources() -> dict:
    with open("/proc/self/maps") as f:
        shm = sum(1 for line in f if "/dev/shm/" in line)
    return {"fds": len(os.listdir("/proc/self/fd")), "threads": len(os.listdir("/proc/self/task")),
            "shm_maps": shm}


def _cycle(rank, kw) -> bool:
    """Builds, trains 2 steps, drops; True when the optimizer and the model were collected."""
    torch.manual_seed(0)
    model = models.MLP(16, 64, 8)
    model, opt = zero_py.initialize(model, torch.optim.AdamW, lr=1e-2, **kw)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(2):
        models.mlp_loss(model, models.mlp_batch(gen)).backward()
        opt.step()
        opt.zero_grad()
    gone = weakref.ref(opt), weakref.ref(model)
    del model, opt
    # twice: the optimizer's finalizer removes the gradient hooks that hold its reducer (from
    # C++), which the next collection then frees
    gc.collect()
    gc.collect()
    return all(r() is None for r in gone)


def _settled(bound=None) -> dict:
    """The counts once the threads of dropped objects have ended (they end on their own, a
    moment after the collection): within 2 s, down to `bound`, or no longer falling."""
    now = _resources()
    for _ in range(40):
        time.sleep(0.05)
        before, now = now, _resources()
        if (bound is not None and all(now[k] <= bound[k] for k in now)) or \
                (bound is None and now == before):
            break
    return now


def dropped(rank, kw) -> dict:
    collected = [_cycle(rank, kw)]
    first = _settled()
    for _ in range(CYCLES):
        collected.append(_cycle(rank, kw))
    return {"collected": collected, "first": first, "last": _settled(first)}


CASES = {
    # the engine, held by the parameters' gradient hooks (from C++, unseen by the collector),
    # kept the model and optimizer; each model made a gather group, and a thread of its own
    "stage3": dict(stage=3, wrap_policy={nn.Linear}),
    # the early updates' guess held the optimizer
    "overlap_step": dict(stage=2, offload_optimizer="cpu", overlap_step=1.0),
    # the offload file's descriptor (and its reserved space) outlived the optimizer
    "nvme": dict(stage=2, offload_optimizer="nvme"),
    # each optimizer made hybrid="node"'s groups and its replicate group anew (2 nodes of 1)
    "hybrid": dict(stage=2, hybrid="node"),
}


def refused_stage3(rank) -> dict:
    """A stage-3 initialize that the optimizer refuses (stochastic_rounding on fp32
    parameters) leaves the model as it was: plain full parameters, no hooks. It then trains
    under a new initialize as DDP + torch.optim does. (The refusal came after the sharding:
    the parameters were left as this rank's 1-D slices, of another size on each rank, and the
    next initialize aborted the process inside gloo.)"""
    torch.manual_seed(0)
    model = models.MLP(16, 64, 8)
    ref = DDP(copy.deepcopy(model))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        zero_py.initialize(model, torch.optim.AdamW, stage=3, wrap_policy={nn.Linear},
                           stochastic_rounding=True)
        refused = None
    except ValueError as exc:
        refused = str(exc)
    untouched = all(p.shape == before[n].shape and torch.equal(p.detach(), before[n])
                    for n, p in model.named_parameters())
    hooks = sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules())
    model, opt = zero_py.initialize(model, torch.optim.AdamW, stage=3, wrap_policy={nn.Linear},
                                    lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    _train_both(model, opt, ref, ref_opt, rank)
    with zero_py.gathered(model):
        rel = max(models.max_rel_diff(a, b) for a, b in zip(model.parameters(),
                                                             ref.module.parameters()))
    return {"refused": refused, "untouched": untouched, "hooks": hooks, "rel": rel}


def side_by_side(rank, stages) -> list:
    """Models under the given stages, alive at once, trained in one loop (forwards, one
    backward, steps) against DDP + torch.optim: each one's relative difference."""
    torch.manual_seed(0)
    plain = [models.MLP(16, 64, 8) for _ in stages]
    refs = [DDP(copy.deepcopy(m)) for m in plain]
    ref_opts = [torch.optim.AdamW(r.parameters(), lr=1e-2) for r in refs]
    zs = [zero_py.initialize(m, torch.optim.AdamW, stage=s, lr=1e-2,
                             **({"wrap_policy": {nn.Linear}} if s == 3 else {}))
          for m, s in zip(plain, stages)]
    gen = torch.Generator().manual_seed(rank)
    for _ in range(3):
        batch = models.mlp_batch(gen)
        for pairs in (zs, list(zip(refs, ref_opts))):
            sum(models.mlp_loss(m, batch) for m, _ in pairs).backward()
            for _, o in pairs:
                o.step()
                o.zero_grad()
    rel = []
    for (m, _), r in zip(zs, refs):
        with zero_py.gathered(m):
            rel.append(max(models.max_rel_diff(a, b)
                           for a, b in zip(m.parameters(), r.module.parameters())))
    return rel


def new_world(rank, world_size) -> dict:
    """destroy_process_group(), a new init_process_group, and a new stage-3 model: its gather
    group is made anew (the one shared before belonged to the destroyed world). A model kept
    from the old world is refused by name at its next forward (it was torch's "Group ... is
    not registered", or nothing for the shared-memory all-gather)."""
    where = [tempfile.mkdtemp(prefix="zp_world_") if rank == 0 else None]
    dist.broadcast_object_list(where, src=0)
    old, old_opt = zero_py.initialize(models.MLP(16, 64, 8), torch.optim.AdamW, lr=1e-2,
                                      stage=3, wrap_policy={nn.Linear})
    dist.barrier()
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(where[0], "store"),
                                                         world_size),
                            rank=rank, world_size=world_size)
    try:
        models.mlp_loss(old, models.mlp_batch(torch.Generator().manual_seed(rank))).backward()
        old_opt.step()
        stale = None
    except ValueError as exc:
        stale = str(exc)
    del old, old_opt
    return {"rel": side_by_side(rank, (3,)), "stale": stale}


def after_a_members_only_group(rank) -> float:
    """Rank 0 alone makes a group (new_group([0], use_local_synchronization=True)), as a
    stage-3 model over a subgroup makes its gather channel on the subgroup's members only;
    then a stage-3 model over a new group of every rank trains against DDP. Its gather channel
    was named from each rank's count of groups, which differed: the ranks waited for each
    other in its new_group until the store's timeout (torch 2.13 and 2.14; 4 ranks: a stage-3
    model over ranks {2, 3} only, then one over the world). From torch 2.14 torch names its
    own groups from that count too: its new_group of every rank then times out without zero_py,
    so there the model goes over the world group (whose channel's new_group hung the same way).
    """
    if rank == 0:
        dist.new_group([0], use_local_synchronization=True)
    group = (None if _TORCH >= (2, 14)  # every rank: same name
             else dist.new_group(timeout=datetime.timedelta(seconds=10)))
    torch.manual_seed(0)
    ref = models.MLP(16, 64, 8)
    ddp = DDP(copy.deepcopy(ref), process_group=group)
    ref_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    model, opt = zero_py.initialize(ref, torch.optim.AdamW, stage=3, lr=1e-2,
                                    wrap_policy={nn.Linear}, process_group=group)
    _train_both(model, opt, ddp, ref_opt, rank)
    with zero_py.gathered(model):
        return max(models.max_rel_diff(a, b)
                   for a, b in zip(model.parameters(), ddp.module.parameters()))


def plain_after_drop(rank, stage) -> dict:
    """A stages 1-2 model given to initialize (broadcast_buffers=True, a BatchNorm), trained,
    its optimizer dropped: the optimizer is collected, the model trains with torch.optim as a
    plain copy of it does, and a new initialize takes it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Tanh(), nn.Linear(32, 8))
    model, opt = zero_py.initialize(model, torch.optim.AdamW, stage=stage, lr=1e-2,
                                    broadcast_buffers=True)
    gen = torch.Generator().manual_seed(rank)
    models.mlp_loss(model, models.mlp_batch(gen)).backward()
    opt.step()
    opt.zero_grad()
    gone = weakref.ref(opt)
    del opt
    gc.collect()
    twin = copy.deepcopy(model)  # a plain model (no optimizer follows a copy)
    batch = models.mlp_batch(gen)
    for m in (model, twin):
        sgd = torch.optim.SGD(m.parameters(), lr=0.1)
        models.mlp_loss(m, batch).backward()
        sgd.step()
    same = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                  twin.state_dict().values()))
    try:
        zero_py.initialize(model, torch.optim.AdamW, stage=stage, lr=1e-2)
        again = None
    except ValueError as exc:  # "already managed": the model still held the dropped one
        again = str(exc)
    return {"collected": gone() is None, "same": same, "again": again}


def failed_offload_file(rank, stage, tmp) -> dict:
    """The NVMe offload file refused on rank 1 only (injected), inside the optimizer's
    construction: every rank raises. Stages 1-2: the gradient hooks the construction had
    registered are taken back, and a new initialize trains as DDP + torch.optim does.
    Stage 3 (already sharded): a new initialize is refused by name on every rank."""
    real = nvme.DirectFile

    def refused(path, *args, **kw):
        if rank == 1:
            raise OSError(28, "injected: no space left")
        return real(path, *args, **kw)
    torch.manual_seed(0)
    model = models.MLP(16, 64, 8)
    ref = DDP(copy.deepcopy(model))
    nvme.DirectFile = refused
    try:
        zero_py.initialize(model, torch.optim.AdamW, lr=1e-2, stage=stage, offload_dir=tmp,
                           offload_optimizer="nvme",
                           **({"wrap_policy": {nn.Linear}} if stage == 3 else {}))
        raised = None
    except (OSError, ValueError) as exc:
        raised = str(exc)
    finally:
        nvme.DirectFile = real
    hooks = sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())
    try:
        model, opt = zero_py.initialize(model, torch.optim.AdamW, stage=2, lr=1e-2)
    except ValueError as exc:
        return {"raised": raised, "hooks": hooks, "again": str(exc)}
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    _train_both(model, opt, ref, ref_opt, rank)
    rel = max(models.max_rel_diff(a, b) for a, b in zip(model.parameters(),
                                                         ref.module.parameters()))
    return {"raised": raised, "hooks": hooks, "again": None, "rel": rel}


def _all(rank, world_size):
    out = {"refused_stage3": refused_stage3(rank), "side_by_side": side_by_side(rank, (2, 3))}
    for stage in (1, 2):
        out["plain_after_drop", stage] = plain_after_drop(rank, stage)
    with tempfile.TemporaryDirectory(prefix=f"zp_life{rank}_") as tmp:
        for name, kw in CASES.items():
            kw = dict(kw, offload_dir=tmp) if "nvme" in name else kw
            if name == "hybrid":  # torchrun's, for one rank per node
                os.environ.update(LOCAL_WORLD_SIZE="1", LOCAL_RANK="0")
            try:
                start = time.perf_counter()
                out[name] = dropped(rank, kw)
                out[name]["seconds"] = time.perf_counter() - start
            finally:
                for var in ("LOCAL_WORLD_SIZE", "LOCAL_RANK"):
                    os.environ.pop(var, None)
        for stage in (2, 3):
            out["failed_offload_file", stage] = failed_offload_file(rank, stage, tmp)
        out["files_left"] = os.listdir(tmp)
    out["members_only_group"] = after_a_members_only_group(rank)
    out["new_world"] = new_world(rank, world_size)
    return out


@pytest.fixture(scope="module")
def results():
    return distributed.run(_all, 2, timeout=240)


@pytest.mark.parametrize("case", list(CASES))
def test_a_dropped_optimizer_gives_back_what_it_took(results, case):
    for rank, res in enumerate(results):
        r = res[case]
        assert all(r["collected"]), (case, rank, "a dropped optimizer was not collected",
                                     r["collected"])
        assert all(r["last"][k] <= r["first"][k] for k in r["first"]), (
            case, rank, f"grew over {CYCLES} cycles", r)
    print(case, [round(res[case]["seconds"], 2) for res in results])


def test_no_offload_file_is_left(results):
    for res in results:
        assert res["files_left"] == []


def test_a_refused_stage3_initialize_leaves_the_model_untouched(results):
    for rank, res in enumerate(results):
        r = res["refused_stage3"]
        assert r["refused"] and "stochastic_rounding" in r["refused"], (rank, r)
        assert r["untouched"] and r["hooks"] == 0, (rank, r)
        assert r["rel"] <= 1e-5, (rank, r)


def test_models_alive_at_once_match_ddp(results):
    for rank, res in enumerate(results):
        assert max(res["side_by_side"]) <= 1e-5, (rank, res["side_by_side"])


def test_a_stage3_model_after_a_group_made_by_some_ranks_only(results):
    for rank, res in enumerate(results):
        assert res["members_only_group"] <= 1e-5, (rank, res["members_only_group"])


def test_a_new_world_trains_and_refuses_the_old_worlds_model(results):
    for rank, res in enumerate(results):
        r = res["new_world"]
        assert max(r["rel"]) <= 1e-5, (rank, r)
        assert r["stale"] and "process group was destroyed" in r["stale"], (rank, r)


@pytest.mark.parametrize("stage", [1, 2])
def test_a_stage12_model_is_plain_once_its_optimizer_is_dropped(results, stage):
    for rank, res in enumerate(results):
        r = res["plain_after_drop", stage]
        assert r["collected"], (stage, rank, "the model kept its dropped optimizer")
        assert r["same"], (stage, rank, "the model did not train as a plain copy of it")
        assert r["again"] is None, (stage, rank, r["again"])


@pytest.mark.parametrize("stage", [2, 3])
def test_a_failed_construction_leaves_no_hooks_or_is_refused_by_name(results, stage):
    for rank, res in enumerate(results):
        r = res["failed_offload_file", stage]
        assert r["raised"] and ("injected" in r["raised"] or "disagree" in r["raised"]), (rank, r)
        if stage == 2:
            assert r["hooks"] == 0 and r["again"] is None and r["rel"] <= 1e-5, (rank, r)
        else:  # the parameters were sharded already: refused by name, never a gloo abort
            assert r["again"] and "stage-3 shard slice" in r["again"], (rank, r)
