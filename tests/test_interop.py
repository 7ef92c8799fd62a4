"""What a team migrating from DDP (or FSDP2) already has, against DDP + torch.optim at 2 ranks,
stages 1-3: a DDP run's torch.save'd model and torch.optim state dicts resumed under zero_py,
and torch.distributed.checkpoint.state_dict's get_/set_ functions (as FSDP2 and torchtitan-style
code call them) on a zero_py model and optimizer, in each of its modes: full_state_dict on every
rank, sharded (full_state_dict=False), and full on rank 0 with broadcast_from_rank0; and, both
ways between DDP and zero_py, the dicts of a model with parameters without elements.

Every scenario runs in one set of 2 processes. Tolerance 1e-5 relative (fp32).
"""

import copy
import inspect
import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
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


def _zero(model, stage, cls, kw, groups=None):
    extra = {} if stage == 3 else {"bucket_bytes": 1024}
    params = None if groups is None else groups(model)
    return zero_py.initialize(model, cls, stage=stage, params=params, **extra, **kw)


def _amsgrad_on_weights(model):
    """Adam with amsgrad for the weights only: torch.optim keeps max_exp_avg_sq for those."""
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if n.endswith("weight")], "amsgrad": True},
            {"params": [p for n, p in named if not n.endswith("weight")]}]


def _biases_without_momentum(model):
    """SGD's biases at momentum 0: torch.optim keeps no state for them."""
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if n.endswith("weight")]},
            {"params": [p for n, p in named if not n.endswith("weight")], "momentum": 0.0}]


def _state_mismatches(full: dict, ref: dict) -> list:
    """Where a consolidated dict is not torch.optim's: state keys per parameter, values."""
    out = []
    if set(full["state"]) != set(ref["state"]):
        out.append(("parameters", sorted(full["state"]), sorted(ref["state"])))
    for k, st in ref["state"].items():
        got = full["state"].get(k, {})
        if set(got) != set(st):
            out.append((k, sorted(got), sorted(st)))
            continue
        out += [(k, key) for key, v in st.items()
                if isinstance(v, torch.Tensor) and models.max_rel_diff(got[key], v) > RTOL]
    return out


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


def ddp_resume(rank, tmp, cls, kw, frozen, groups=None, zero_kw=None):
    """A DDP run saved model.state_dict() and its torch.optim state_dict() at step 3; zero_py
    (each stage) loads both on every rank and goes on, as DDP does from the same files; its
    consolidated dict is then DDP's torch.optim one (the same state keys, the same values).
    zero_kw: zero_py's options where they differ from the saved run's (the dict's param groups
    bring the saved values, as torch.optim's load_state_dict does)."""
    select = groups or (lambda m: m.parameters())
    first, later = _data(rank)
    torch.manual_seed(0)
    m = _make(frozen)
    opt = cls(select(m), **kw)
    _train(DDP(m), opt, first)
    paths = os.path.join(tmp, "ddp_model.pt"), os.path.join(tmp, "ddp_optim.pt")
    if rank == 0:
        torch.save(m.state_dict(), paths[0])
        torch.save(opt.state_dict(), paths[1])
    dist.barrier()
    torch.manual_seed(1)
    ref = _make(frozen)
    ref.load_state_dict(torch.load(paths[0]))
    ref_opt = cls(select(ref), **kw)
    ref_opt.load_state_dict(torch.load(paths[1]))
    _train(DDP(ref), ref_opt, later)
    out = {}
    for stage in (1, 2, 3):
        torch.manual_seed(2)
        zm, zo = _zero(_make(frozen), stage, cls, kw if zero_kw is None else zero_kw, groups)
        zm.load_state_dict(torch.load(paths[0]))
        zo.load_state_dict(torch.load(paths[1]))
        _train(zm, zo, later)
        out[stage] = _rel(zm, ref)
        full = zo.consolidate_state_dict(to=0)
        if rank == 0:
            out["dict", stage] = _state_mismatches(full, ref_opt.state_dict())
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


class _WithEmpty(nn.Module):
    """An MLP beside parameters without elements (a placeholder, a Linear of width 0) that
    take part in the forward, so torch.optim keeps state for them (a step, empty moments)."""

    def __init__(self):
        super().__init__()
        self.mlp = models.MLP()
        self.empty = nn.Parameter(torch.empty(0))
        self.none_in = nn.Linear(0, 8)

    def forward(self, x):
        return self.mlp(x) + self.none_in(x[:, :0]) + self.empty.sum()


def dcp_zero_element_params(rank, stage, mode):
    """DCP's dicts of a model with parameters without elements, both ways: DDP's into a fresh
    zero_py optimizer (before the fix: KeyError 'state.empty.step' in DCP's loader, since
    zero_py keeps no state for them), and zero_py's into a DDP optimizer that has stepped
    (before: DCP's "Missing optimizer state for parameter 'empty'"); each run then trains on
    as DDP does."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                         set_state_dict)

    opts = StateDictOptions(full_state_dict=mode == "full")
    first, later = _data(rank)
    kw = dict(lr=1e-2, weight_decay=0.1)

    def pair(seed):
        torch.manual_seed(seed)
        ref = _WithEmpty()
        ddp = DDP(copy.deepcopy(ref))
        ref_opt = torch.optim.AdamW(ddp.parameters(), **kw)
        zm, zo = _zero(ref, stage, torch.optim.AdamW, kw)
        return ddp, ref_opt, zm, zo

    ddp, ref_opt, zm, zo = pair(0)
    _train(ddp, ref_opt, first)
    _train(zm, zo, first)
    ref_sd, zero_sd = get_state_dict(ddp, ref_opt, options=opts), get_state_dict(zm, zo,
                                                                                options=opts)
    ddp2, ref_opt2, zm2, zo2 = pair(5)
    _train(ddp2, ref_opt2, later[:1])  # a torch.optim with state of its own
    set_state_dict(zm2, zo2, model_state_dict=ref_sd[0], optim_state_dict=ref_sd[1],
                   options=opts)
    set_state_dict(ddp2, ref_opt2, model_state_dict=zero_sd[0], optim_state_dict=zero_sd[1],
                   options=opts)
    _train(ddp, ref_opt, later)
    _train(zm2, zo2, later)
    _train(ddp2, ref_opt2, later)
    sd = zm2.state_dict()  # full values at every stage
    return {"ddp_into_zero": max(models.max_rel_diff(sd[n], p)
                                 for n, p in ddp.module.named_parameters() if p.numel()),
            "zero_into_ddp": max(models.max_rel_diff(p, q) for p, q in
                                 zip(ddp2.parameters(), ddp.parameters()) if q.numel())}


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


class _RefusesZeroGradients(torch.optim.SGD):
    """An optimizer that takes an all-zero gradient for a broken graph: it cannot be stepped
    on DCP's or zero_py's zero-gradient stand-in, so the state it keeps is unknown until it
    steps."""

    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None and not p.grad.any():
                    raise RuntimeError("an all-zero gradient")
        return super().step(closure)


def _batches(gen, n, dtype):
    return [tuple(t.to(dtype) for t in models.mlp_batch(gen)) for _ in range(n)]


def dcp_torchtitan_resume(rank, tmp, stage):
    """The torchtitan resume: a fresh model and optimizer, get_state_dict as the template,
    dcp.load into it, set_state_dict, train on. torch.optim's template is filled by DCP's zero
    step, which zero_py skips; before, a ZeroOptimizer without state gave a template without
    optimizer state, so the load brought none: resumed with fresh moments, 83% off (of a
    tensor's largest value) the run that never stopped after two steps. Checked against the
    run that never stopped: from a zero_py checkpoint in fp32 (AdamW, SGD) and bf16 (its fp32
    masters come back, offloaded too), and a DDP bf16 checkpoint (no masters: loaded with
    allow_partial_load, the masters follow the parameters, as the same dict loaded by
    load_state_dict gives). An optimizer class that cannot be stepped on a stand-in warns."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    out = {}
    cases = (("adamw", torch.float32, torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1), None),
             ("sgd", torch.float32, torch.optim.SGD, dict(lr=5e-2, momentum=0.9), None),
             ("adamw_bf16", torch.bfloat16, torch.optim.AdamW, dict(lr=1e-2), None),
             ("adamw_bf16_offloaded", torch.bfloat16, torch.optim.AdamW,
              dict(lr=1e-2, offload_optimizer="cpu"), None))
    for name, dtype, cls, kw, groups in cases:
        gen = torch.Generator().manual_seed(rank)
        first, later = _batches(gen, 2, dtype), _batches(gen, 2, dtype)

        def build(seed, dtype=dtype, cls=cls, kw=kw, groups=groups):
            torch.manual_seed(seed)
            return _zero(_make().to(dtype), stage, cls, kw, groups)

        zm, zo = build(0)
        _train(zm, zo, first)
        path = os.path.join(tmp, f"titan-{stage}-{name}")
        model_sd, optim_sd = get_state_dict(zm, zo)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
        _train(zm, zo, later)  # the run that never stopped
        rm, ro = build(1)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            model_sd, optim_sd = get_state_dict(rm, ro)
        out[name, "warnings"] = [str(w.message) for w in seen]
        out[name, "template state"] = len(optim_sd["state"])
        sd = {"model": model_sd, "optim": optim_sd}
        dcp.load(sd, checkpoint_id=path)
        set_state_dict(rm, ro, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        _train(rm, ro, later)
        out[name] = _rel(rm, zm.module if hasattr(zm, "module") else zm) if stage < 3 else \
            max(models.max_rel_diff(v, zm.state_dict()[k]) for k, v in rm.state_dict().items())
    # a DDP bf16 dict (no fp32 masters) into the template with allow_partial_load
    gen = torch.Generator().manual_seed(rank)
    first, later = _batches(gen, 2, torch.bfloat16), _batches(gen, 2, torch.bfloat16)
    torch.manual_seed(0)
    ref = _make().to(torch.bfloat16)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    _train(DDP(ref), ref_opt, first)
    path = os.path.join(tmp, f"titan-{stage}-ddp")
    model_sd, optim_sd = get_state_dict(ref, ref_opt)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    plain = (ref.state_dict(), ref_opt.state_dict())
    torch.manual_seed(1)
    am, ao = _zero(_make().to(torch.bfloat16), stage, torch.optim.AdamW, dict(lr=1e-2))
    am.load_state_dict(plain[0])
    ao.load_state_dict(plain[1])
    _train(am, ao, later)
    torch.manual_seed(2)
    rm, ro = _zero(_make().to(torch.bfloat16), stage, torch.optim.AdamW, dict(lr=1e-2))
    model_sd, optim_sd = get_state_dict(rm, ro)
    sd = {"model": model_sd, "optim": optim_sd}
    dcp.load(sd, checkpoint_id=path, planner=DefaultLoadPlanner(allow_partial_load=True))
    set_state_dict(rm, ro, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    _train(rm, ro, later)
    a, r = am.state_dict(), rm.state_dict()
    out["ddp_bf16"] = max(models.max_rel_diff(r[k], a[k]) for k in a)
    if stage == 2:
        torch.manual_seed(0)
        m = _make()
        opt = zero_py.ZeroOptimizer(m.parameters(), _RefusesZeroGradients, stage=2, lr=1e-2,
                                    momentum=0.9)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            get_state_dict(m, opt)
        out["unknown state"] = [str(w.message) for w in seen]
    return out


def _all(rank, world_size, tmp):
    out = {}
    out["resume", "adamw"] = ddp_resume(rank, tmp, torch.optim.AdamW,
                                        dict(lr=1e-2, weight_decay=0.1), False)
    out["resume", "sgd_frozen"] = ddp_resume(rank, tmp, torch.optim.SGD,
                                             dict(lr=5e-2, momentum=0.9), True)
    out["resume", "sgd_group_without_momentum"] = ddp_resume(
        rank, tmp, torch.optim.SGD, dict(lr=5e-2, momentum=0.9), False, _biases_without_momentum)
    if "decoupled_weight_decay" in inspect.signature(torch.optim.Adam).parameters:
        # Adam(decoupled_weight_decay=True)'s dict into an Adam built without it: its groups
        # switch the decay, as torch.optim's do (refused before: 'another update path')
        out["resume", "adam_decoupled_dict"] = ddp_resume(
            rank, tmp, torch.optim.Adam, dict(lr=1e-2, weight_decay=0.1,
                                              decoupled_weight_decay=True), False,
            zero_kw=dict(lr=1e-2, weight_decay=0.1))
    out["resume", "adam_amsgrad_one_group"] = ddp_resume(rank, tmp, torch.optim.Adam,
                                                         dict(lr=1e-2), False, _amsgrad_on_weights)
    for stage in (1, 2, 3):
        for mode in DCP_MODES:
            out["dcp", stage, mode] = dcp_state_dicts(rank, stage, mode)
    for stage in (1, 2, 3):
        for mode in ("full", "sharded"):
            out["dcp_empty", stage, mode] = dcp_zero_element_params(rank, stage, mode)
    out["dcp_scaler"] = dcp_refuses_loss_scaler(rank)
    for stage in (1, 2, 3):
        out["dcp_titan", stage] = dcp_torchtitan_resume(rank, tmp, stage)
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return distributed.run(_all, 2, str(tmp_path_factory.mktemp("interop")), timeout=240)


# adam_amsgrad_one_group: torch.optim keeps max_exp_avg_sq only for the amsgrad group's
# parameters; its dict loads (the others start without a max, as torch's do) and the
# consolidated dict leaves it out for them too. sgd_group_without_momentum: no state at all
# for the biases (the consolidated dict held an empty one for each)
@pytest.mark.parametrize("case", ["adamw", "sgd_frozen", "sgd_group_without_momentum",
                                  "adam_amsgrad_one_group", "adam_decoupled_dict"])
def test_ddp_checkpoint_resumes_under_zero_py(results, case):
    if ("resume", case) not in results[0]:
        pytest.skip("torch.optim.Adam has no decoupled_weight_decay in this torch")
    for rank, res in enumerate(results):
        for stage, rel in res["resume", case].items():
            if isinstance(stage, tuple):
                assert rel == [], f"stage {stage[1]}: the consolidated dict is not DDP's: {rel}"
                continue
            assert rel <= RTOL, f"stage {stage} rank {rank}: differs from DDP by {rel:.2e}"


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("mode", DCP_MODES)
def test_dcp_state_dict_functions_match_ddp(results, stage, mode):
    for rank, res in enumerate(results):
        r = res["dcp", stage, mode]
        assert r["get"] <= RTOL, f"rank {rank}: get_*_state_dict differs by {r['get']:.2e}"
        assert r["set_then_train"] <= RTOL, \
            f"rank {rank}: set_*_state_dict then training differs by {r['set_then_train']:.2e}"


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("mode", ["full", "sharded"])
def test_dcp_state_dicts_with_zero_element_parameters(results, stage, mode):
    for rank, res in enumerate(results):
        for way, rel in res["dcp_empty", stage, mode].items():
            assert rel <= RTOL, f"rank {rank} {way}: differs from DDP by {rel:.2e}"


def test_dcp_get_refuses_to_drop_the_loss_scaler(results):
    for res in results:
        msg = res["dcp_scaler"]
        assert msg is not None and "loss scaler" in msg and "save_checkpoint" in msg, msg


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_dcp_torchtitan_resume_from_a_fresh_optimizer(results, stage):
    for rank, res in enumerate(results):
        r = res["dcp_titan", stage]
        for case in ("adamw", "sgd", "adamw_bf16", "adamw_bf16_offloaded"):
            assert r[case, "warnings"] == [] and r[case, "template state"] > 0, (case, r)
            assert r[case] <= RTOL, f"rank {rank} {case}: differs from the run that never " \
                f"stopped by {r[case]:.2e}"
        assert r["ddp_bf16"] == 0.0, f"rank {rank}: a DDP bf16 dict through the template " \
            f"differs from the same dict loaded by load_state_dict by {r['ddp_bf16']:.2e}"
        if stage == 2:
            msgs = r["unknown state"]
            assert len(msgs) == 1 and "_RefusesZeroGradients" in msgs[0] and \
                "loads no optimizer state" in msgs[0], msgs
