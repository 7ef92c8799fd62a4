"""What a team migrating from DDP (or FSDP2) already has, against DDP + torch.optim at 2 ranks,
stages 1-3: a DDP run's torch.save'd model and torch.optim state dicts resumed under zero_py,
and torch.distributed.checkpoint.state_dict's get_/set_ functions (as FSDP2 and torchtitan-style
code call them) on a zero_py model and optimizer, in each of its modes: full_state_dict on every
rank, sharded (full_state_dict=False), and full on rank 0 with broadcast_from_rank0.

Every scenario runs in one set of 2 processes. Tolerance 1e-5 relative (fp32).
"""

import os

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import distributed
import models
import zero_py

RTOL = 1e-5
DCP_MODES = ("full", "sharded", "rank0")


def _make(frozen=False):
    m = models.MLP()
    if frozen:
        m.fc1.requires_grad_(False)
    return m


def _zero(model, stage, cls, kw):
    extra = {} if stage == 3 else {"bucket_bytes": 1024}
    return zero_py.initialize(model, cls, stage=stage, **extra, **kw)


def _train(model, opt, batches):
    for b in batches:
        models.mlp_loss(model, b).backward()
        opt.step()
        opt.zero_grad()


def _rel(zmodel, ref) -> float:
    sd = zmodel.state_dict()  # full values at every stage (collective under stage 3)
    return max(models.max_rel_diff(sd[n], p) for n, p in ref.named_parameters())


def _data(rank):
    gen = torch.Generator().manual_seed(rank)
    return [models.mlp_batch(gen) for _ in range(3)], [models.mlp_batch(gen) for _ in range(4)]


def ddp_resume(rank, tmp, cls, kw, frozen):
    """A DDP run saved model.state_dict() and its torch.optim state_dict() at step 3; zero_py
    (each stage) loads both on every rank and goes on, as DDP does from the same files."""
    first, later = _data(rank)
    torch.manual_seed(0)
    m = _make(frozen)
    opt = cls(m.parameters(), **kw)
    _train(DDP(m), opt, first)
    paths = os.path.join(tmp, "ddp_model.pt"), os.path.join(tmp, "ddp_optim.pt")
    if rank == 0:
        torch.save(m.state_dict(), paths[0])
        torch.save(opt.state_dict(), paths[1])
    dist.barrier()
    torch.manual_seed(1)
    ref = _make(frozen)
    ref.load_state_dict(torch.load(paths[0]))
    ref_opt = cls(ref.parameters(), **kw)
    ref_opt.load_state_dict(torch.load(paths[1]))
    _train(DDP(ref), ref_opt, later)
    out = {}
    for stage in (1, 2, 3):
        torch.manual_seed(2)
        zm, zo = _zero(_make(frozen), stage, cls, kw)
        zm.load_state_dict(torch.load(paths[0]))
        zo.load_state_dict(torch.load(paths[1]))
        _train(zm, zo, later)
        out[stage] = _rel(zm, ref)
    dist.barrier()
    return out


def dcp_state_dicts(rank, stage, mode):
    """get_model_state_dict / get_optimizer_state_dict of a zero_py run hold DDP's values;
    set_ of DDP's dicts into a fresh zero_py model and optimizer goes on as DDP does."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions, get_model_state_dict, get_optimizer_state_dict, set_model_state_dict,
        set_optimizer_state_dict)

    get = StateDictOptions(full_state_dict=mode != "sharded", cpu_offload=mode == "rank0")
    put = StateDictOptions(full_state_dict=mode != "sharded", cpu_offload=mode == "rank0",
                           broadcast_from_rank0=mode == "rank0")
    first, later = _data(rank)
    kw = dict(lr=1e-2, weight_decay=0.1)
    torch.manual_seed(0)
    ref = _make()
    ddp = DDP(ref)
    ref_opt = torch.optim.AdamW(ref.parameters(), **kw)
    _train(ddp, ref_opt, first)
    ref_msd = get_model_state_dict(ddp, options=get)
    ref_osd = get_optimizer_state_dict(ddp, ref_opt, options=get)
    torch.manual_seed(0)
    zm, zo = _zero(_make(), stage, torch.optim.AdamW, kw)
    _train(zm, zo, first)
    msd = get_model_state_dict(zm, options=get)
    osd = get_optimizer_state_dict(zm, zo, options=get)
    got = 0.0
    if ref_msd:  # "rank0": the other ranks get empty dicts, from DDP as from zero_py
        got = max(models.max_rel_diff(msd[k], v) for k, v in ref_msd.items())
        for name, st in ref_osd["state"].items():
            assert set(osd["state"][name]) == set(st), (name, set(osd["state"][name]))
            for key, v in st.items():
                assert osd["state"][name][key].shape == v.shape, (name, key)
                got = max(got, models.max_rel_diff(osd["state"][name][key], v))
        assert [g["params"] for g in osd["param_groups"]] == \
            [g["params"] for g in ref_osd["param_groups"]]
    else:
        assert not msd and not osd
    torch.manual_seed(5)
    zm2, zo2 = _zero(_make(), stage, torch.optim.AdamW, kw)
    set_model_state_dict(zm2, ref_msd, options=put)
    set_optimizer_state_dict(zm2, zo2, ref_osd, options=put)
    _train(zm2, zo2, later)
    _train(ddp, ref_opt, later)
    return {"get": got, "set_then_train": _rel(zm2, ref)}


def dcp_refuses_loss_scaler(rank):
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    torch.manual_seed(0)
    m = _make()
    opt = zero_py.ZeroOptimizer(m.parameters(), torch.optim.AdamW, stage=2, lr=1e-2,
                                loss_scaler=zero_py.LossScaler())
    try:
        get_optimizer_state_dict(m, opt)
    except ValueError as exc:
        return str(exc)
    return None


def dcp_template_of_a_stateless_optimizer(rank):
    """The torchtitan resume: a fresh model and optimizer, get_state_dict as the template,
    dcp.load into it, set_state_dict. A ZeroOptimizer without state gives a template without
    optimizer state, so the load brings none (torch.optim's zero step fills its template);
    before, silently: resumed with fresh moments, 83% off (of a tensor's largest value) the
    run that never stopped after two steps. It warns now; after a step it does not."""
    import warnings

    from torch.distributed.checkpoint.state_dict import get_state_dict

    torch.manual_seed(0)
    m = _make()
    opt = zero_py.ZeroOptimizer(m.parameters(), torch.optim.AdamW, stage=2, lr=1e-2)
    out = {}
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _, optim_sd = get_state_dict(m, opt)
        out["fresh"] = [str(w.message) for w in seen if "holds no state yet" in str(w.message)]
        out["template state"] = len(optim_sd["state"])
        _train(m, opt, [models.mlp_batch(torch.Generator().manual_seed(rank))])
        del seen[:]
        get_state_dict(m, opt)
        out["after a step"] = [str(w.message) for w in seen
                               if "holds no state yet" in str(w.message)]
    return out


def _all(rank, world_size, tmp):
    out = {}
    out["resume", "adamw"] = ddp_resume(rank, tmp, torch.optim.AdamW,
                                        dict(lr=1e-2, weight_decay=0.1), False)
    out["resume", "sgd_frozen"] = ddp_resume(rank, tmp, torch.optim.SGD,
                                             dict(lr=5e-2, momentum=0.9), True)
    for stage in (1, 2, 3):
        for mode in DCP_MODES:
            out["dcp", stage, mode] = dcp_state_dicts(rank, stage, mode)
    out["dcp_scaler"] = dcp_refuses_loss_scaler(rank)
    out["dcp_stateless"] = dcp_template_of_a_stateless_optimizer(rank)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return distributed.run(_all, 2, str(tmp_path_factory.mktemp("interop")), timeout=240)


@pytest.mark.parametrize("case", ["adamw", "sgd_frozen"])
def test_ddp_checkpoint_resumes_under_zero_py(results, case):
    for rank, res in enumerate(results):
        for stage, rel in res["resume", case].items():
            assert rel <= RTOL, f"stage {stage} rank {rank}: differs from DDP by {rel:.2e}"


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("mode", DCP_MODES)
def test_dcp_state_dict_functions_match_ddp(results, stage, mode):
    for rank, res in enumerate(results):
        r = res["dcp", stage, mode]
        assert r["get"] <= RTOL, f"rank {rank}: get_*_state_dict differs by {r['get']:.2e}"
        assert r["set_then_train"] <= RTOL, \
            f"rank {rank}: set_*_state_dict then training differs by {r['set_then_train']:.2e}"


def test_dcp_get_refuses_to_drop_the_loss_scaler(results):
    for res in results:
        msg = res["dcp_scaler"]
        assert msg is not None and "loss scaler" in msg and "save_checkpoint" in msg, msg


def test_dcp_template_of_an_optimizer_without_state_warns(results):
    for res in results:
        r = res["dcp_stateless"]
        assert len(r["fresh"]) == 1 and "dcp.load into it loads no optimizer state" in \
            r["fresh"][0], r
        assert r["template state"] == 0 and r["after a step"] == [], r
