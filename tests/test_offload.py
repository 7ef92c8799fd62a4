"""Optimizer offload (offload_optimizer="cpu"): every mode against the same run without offload.

The offloaded step runs the same fused kernel over the same values, only on host copies, bucket
by bucket: parameters must match the run without offload to the last bit (stages 1-3, fp32 and
bf16 with fp32 masters, clipping, gradient accumulation with no_sync, fp16 with a loss scaler
whose first steps overflow and are skipped, a torch.optim class on the generic path). State
dicts and checkpoints taken under offload resume, with or without offload, as the run that
never stopped. On the CPU the "device" is host memory too: the copies run on the copy thread,
through the same pipeline a GPU uses (tests/gpu runs it on a GPU).
"""

from __future__ import annotations

import contextlib
import copy
import errno
import os

import pytest
import torch

import distributed
import models
import zero_py
from safetensors.torch import load_file

from zero_py.io.engine import DirectFile

STEPS = 4


def build(stage, dtype, offload, opt_cls=torch.optim.AdamW, scaler=None, seed=0,
          offload_params=None, **kw):
    torch.manual_seed(seed)
    m = models.TiedGPT(n_layer=2)
    m.blocks[1].requires_grad_(False)  # a frozen layer
    m.to(dtype)
    kw = {"lr": 3e-3, "weight_decay": 0.05, **kw}
    if dtype != torch.float32:
        kw["grad_reduce_dtype"] = torch.float32
    if scaler is not None:
        kw["loss_scaler"] = zero_py.LossScaler(init_scale=scaler)
    extra = ({"wrap_policy": 1000, "persistence_threshold": 64,
              "offload_params": offload_params} if stage == 3 else {"bucket_bytes": 4096})
    return zero_py.initialize(m, opt_cls, stage=stage, offload_optimizer=offload, **extra, **kw)


def train(model, opt, rank, first, last, clip=True):
    """Steps first..last-1: two micro-batches per step (the first under no_sync), clipping."""
    for t in range(first, last):
        gen = torch.Generator().manual_seed(100 + 7 * t + rank)
        for k in range(2):
            batch = models.gpt_batch(gen, batch=3)
            with opt.no_sync() if k == 0 else contextlib.nullcontext():
                loss = model(*batch).float() / 2
                opt.scale_loss(loss).backward()
        if clip:
            opt.clip_grad_norm_(0.5)
        opt.step()
        opt.zero_grad()


def full(model):
    """The full weights on rank 0 (None elsewhere: the comparisons run there)."""
    sd = zero_py.full_state_dict(model)
    return None if sd is None else {k: v.float() for k, v in sd.items()}


def worst(a, b) -> float:
    if a is None:
        assert b is None
        return 0.0
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


CASES = [(stage, dtype) for stage in (1, 2, 3) for dtype in (torch.float32, torch.bfloat16)]


def run_parity(rank, world, tmp):
    out = {}
    for stage, dtype in CASES:
        runs = {}
        for offload in (None, "cpu"):
            model, opt = build(stage, dtype, offload)
            train(model, opt, rank, 0, STEPS)
            runs[offload] = full(model)
            if offload:
                rep = opt.memory_report()
                out[("report", stage, dtype)] = (rep["optimizer_states"],
                                                 rep["host_optimizer_states"], rep["host_grads"],
                                                 opt.optimizer_state_bytes())
        out[(stage, dtype)] = worst(runs["cpu"], runs[None])
        if stage == 3:  # the parameter shards in host memory, alone and with the optimizer
            for offload in (None, "cpu"):
                model, opt = build(3, dtype, offload, offload_params="cpu")
                train(model, opt, rank, 0, STEPS)
                out[("params", dtype, offload)] = worst(full(model), runs[None])
                out[("params report", dtype, offload)] = opt.memory_report()["host_params"]
    # fp16 whose first steps overflow (a scale of 2**60 cannot be held in fp16): skipped on
    # every rank, with and without offload
    runs = {}
    for offload in (None, "cpu"):
        model, opt = build(2, torch.float16, offload, scaler=2.0 ** 60)
        train(model, opt, rank, 0, STEPS + 2, clip=False)
        runs[offload] = (full(model), opt.skipped_steps, opt.loss_scale)
    out["fp16"] = (worst(runs["cpu"][0], runs[None][0]), runs["cpu"][1:], runs[None][1:])
    # a torch.optim class on the generic path
    runs = {}
    for offload in (None, "cpu"):
        model, opt = build(2, torch.bfloat16, offload, opt_cls=torch.optim.NAdam)
        train(model, opt, rank, 0, STEPS)
        runs[offload] = full(model)
    out["nadam"] = worst(runs["cpu"], runs[None])
    # state_dict under offload, loaded with and without offload; a checkpoint likewise
    model, opt = build(2, torch.bfloat16, None)
    train(model, opt, rank, 0, STEPS)
    reference = full(model)
    model, opt = build(2, torch.bfloat16, "cpu")
    train(model, opt, rank, 0, 2)
    shard = opt.state_dict()
    zero_py.save_checkpoint(f"{tmp}/ck", model, opt)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    for offload in (None, "cpu"):
        m2, o2 = build(2, torch.bfloat16, offload, seed=1)
        m2.load_state_dict(weights)
        o2.load_state_dict(shard)
        train(m2, o2, rank, 2, STEPS)
        out[("state_dict", offload)] = worst(full(m2), reference)
        for stage in (1, 3):
            m3, o3 = build(stage, torch.bfloat16, offload, seed=2)
            zero_py.load_checkpoint(f"{tmp}/ck", m3, o3)
            train(m3, o3, rank, 2, STEPS)
            out[("checkpoint", stage, offload)] = worst(full(m3), reference)
    return out


def run_all(rank, world, tmp):
    """Every scenario of this file in one set of processes (process start-up dominates)."""
    out = {"parity": run_parity(rank, world, os.path.join(tmp, "parity")),
           "nvme": run_nvme(rank, world, os.path.join(tmp, "nvme")),
           "nvme checkpoints": run_nvme_checkpoints(rank, world, os.path.join(tmp, "nvme")),
           "written weights": written_weights(rank, world, os.path.join(tmp, "nvme")),
           "refusals": refusals(rank, world),
           "nvme refusals": nvme_refusals(rank, world, os.path.join(tmp, "refusals")),
           "full disk": full_disk(rank, world, os.path.join(tmp, "full"))}
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("offload")
    for sub in ("parity", "nvme", "refusals", "full"):
        os.makedirs(tmp / sub)
    return distributed.run(run_all, 2, str(tmp))


@pytest.fixture(scope="module")
def parity(runs):
    return [r["parity"] for r in runs]


@pytest.mark.parametrize("stage,dtype", CASES, ids=[f"stage{s}-{str(d)[6:]}" for s, d in CASES])
def test_offloaded_step_matches_the_step_on_the_device_to_the_bit(parity, stage, dtype):
    for r in parity:
        assert r[(stage, dtype)] == 0.0, r[(stage, dtype)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("offload", [None, "cpu"], ids=["params", "params+optimizer"])
def test_stage3_parameter_offload_matches_to_the_bit(parity, dtype, offload):
    for r in parity:
        assert r[("params", dtype, offload)] == 0.0, r[("params", dtype, offload)]
        assert r[("params report", dtype, offload)] > 0


def test_fp16_overflowing_steps_are_skipped_alike(parity):
    for r in parity:
        diff, with_offload, without = r["fp16"]
        assert diff == 0.0
        assert with_offload == without
        assert with_offload[0] > 0, "the test meant to overflow the first steps"


def test_generic_torch_optim_class_offloaded(parity):
    for r in parity:
        assert r["nadam"] == 0.0, r["nadam"]


def test_state_dict_and_checkpoint_taken_under_offload_resume_exactly(parity):
    for r in parity:
        for key in (("state_dict", None), ("state_dict", "cpu"), ("checkpoint", 1, None),
                    ("checkpoint", 1, "cpu"), ("checkpoint", 3, None), ("checkpoint", 3, "cpu")):
            assert r[key] == 0.0, (key, r[key])


def test_memory_report_puts_the_optimizer_on_the_host(parity):
    for r in parity:
        for stage, dtype in CASES:
            device, host, grads, total = r[("report", stage, dtype)]
            assert device == 0
            assert host == total > 0
            assert grads > 0


def written_weights(rank, world, tmp):
    """Weights written into fp32 parameters reach the next step under offload at stages 1-2, as
    without offload, where an fp32 parameter is its own master (offload/written.py):
    model.load_state_dict between steps and between backward and step(), and DCP's
    set_state_dict restoring an earlier step (it loads the optimizer first, then the model)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    out = {}
    for stage, offload, overlap in ((1, "nvme", 0.0), (2, "cpu", 1.0)):
        runs = {}
        for off in (None, offload):
            kw = {"offload_dir": tmp} if off == "nvme" else {}
            if off is not None and overlap:
                kw["overlap_step"] = overlap
            model, opt = build(stage, torch.float32, off, **kw)
            train(model, opt, rank, 0, 2, clip=False)
            saved_model, saved_opt = get_state_dict(model, opt)
            saved = ({k: v.clone() for k, v in saved_model.items()}, copy.deepcopy(saved_opt))
            model.load_state_dict({k: 0.9 * v for k, v in model.state_dict().items()})
            train(model, opt, rank, 2, 3, clip=False)
            (model(*models.gpt_batch(torch.Generator().manual_seed(rank), batch=3))
             .float().backward())
            model.load_state_dict({k: 1.1 * v for k, v in model.state_dict().items()})
            opt.step()  # overlap_step: its early updates ran from the weights before the load
            opt.zero_grad()
            set_state_dict(model, opt, model_state_dict=saved[0], optim_state_dict=saved[1])
            train(model, opt, rank, 2, STEPS, clip=False)
            runs[off] = full(model)
        out[(stage, offload, overlap)] = worst(runs[offload], runs[None])
    return out


def test_weights_written_into_fp32_parameters_reach_the_offloaded_step(runs):
    for r in (x["written weights"] for x in runs):
        for key, diff in r.items():
            assert diff == 0.0, (key, diff)


def test_bad_offload_value_is_refused():
    with pytest.raises(ValueError, match="offload_optimizer must be"):
        zero_py.ZeroOptimizer.check_arguments(torch.optim.AdamW, offload_optimizer="gpu")


def refusals(rank, world):
    said = []
    for kw in ({"stage": 3, "offload_params": "nvme0"}, {"stage": 2, "offload_params": "cpu"},
               {"stage": 2, "offload_optimizer": True}):
        try:
            zero_py.initialize(models.MLP(), torch.optim.AdamW, lr=1e-3, **kw)
        except ValueError as exc:
            said.append(str(exc))
    return said


def test_bad_offload_arguments_are_refused_on_every_rank(runs):
    for said in (r["refusals"] for r in runs):
        assert len(said) == 3, said
        assert "offload_params must be" in said[0]
        assert "only apply to stage=3" in said[1]
        assert "offload_optimizer must be" in said[2]


# -- NVMe (offload_optimizer="nvme") ------------------------------------------------------------
# Small records (ZP_OFFLOAD_CHUNK_BYTES) and a ring of 3 make every step stream many chunks,
# with reads ahead and writes behind, as a large model does.

NVME_CASES = [(stage, dtype) for stage in (1, 2, 3) for dtype in (torch.float32, torch.bfloat16)]


def run_nvme(rank, world, tmp):
    os.environ["ZP_OFFLOAD_CHUNK_BYTES"] = "12288"
    os.environ["ZP_OFFLOAD_RING"] = "3"
    nvme = {"offload_dir": tmp}
    out = {}
    for stage, dtype in NVME_CASES:
        model, opt = build(stage, dtype, None)
        train(model, opt, rank, 0, STEPS)
        reference = full(model)
        model, opt = build(stage, dtype, "nvme", **nvme)
        assert opt._update.store.n_chunks > 3
        train(model, opt, rank, 0, STEPS)
        out[(stage, dtype)] = worst(full(model), reference)
        rep = opt.memory_report()
        out[("report", stage, dtype)] = (rep["optimizer_states"], rep["host_optimizer_states"],
                                         rep["nvme_optimizer_states"])
    # fp16 with overflowing first steps
    runs = {}
    for offload in (None, "nvme"):
        model, opt = build(2, torch.float16, offload, scaler=2.0 ** 60,
                           **(nvme if offload else {}))
        train(model, opt, rank, 0, STEPS + 2, clip=False)
        runs[offload] = (full(model), opt.skipped_steps)
    out["fp16"] = (worst(runs["nvme"][0], runs[None][0]), runs["nvme"][1], runs[None][1])
    # state dicts and checkpoints between NVMe and memory, both ways
    model, opt = build(2, torch.bfloat16, None)
    train(model, opt, rank, 0, STEPS)
    reference = full(model)
    model, opt = build(2, torch.bfloat16, "nvme", **nvme)
    train(model, opt, rank, 0, 2)
    shard = opt.state_dict()
    out["state view"] = all(torch.equal(opt.state[p]["exp_avg"], shard["state"][i]["exp_avg"])
                            for i, p in enumerate(model.parameters()) if i in shard["state"])
    zero_py.save_checkpoint(f"{tmp}/ck", model, opt)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    for offload in (None, "nvme"):
        extra = nvme if offload else {}
        m2, o2 = build(2, torch.bfloat16, offload, seed=1, **extra)
        m2.load_state_dict(weights)
        o2.load_state_dict(shard)
        train(m2, o2, rank, 2, STEPS)
        out[("state_dict", offload)] = worst(full(m2), reference)
        m3, o3 = build(3, torch.bfloat16, offload, seed=2, **extra)
        zero_py.load_checkpoint(f"{tmp}/ck", m3, o3)
        train(m3, o3, rank, 2, STEPS)
        out[("checkpoint", offload)] = worst(full(m3), reference)
    # a step whose writes fail (the file turned read-only under it): an error on every rank,
    # the last good step kept on disk and in the parameters; the same step retried once the
    # disk is back gives what the run that never failed gives
    model, opt = build(2, torch.bfloat16, "nvme", **nvme)
    train(model, opt, rank, 0, 2)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    state_before = opt.state_dict()["state"]
    gen = torch.Generator().manual_seed(100 + 7 * 2 + rank)
    for k in range(2):
        batch = models.gpt_batch(gen, batch=3)
        with opt.no_sync() if k == 0 else contextlib.nullcontext():
            (model(*batch).float() / 2).backward()
    opt.clip_grad_norm_(0.5)
    store = opt._update.store
    good = store.file
    store.file = DirectFile(f"/proc/self/fd/{good.fd}", writable=False)
    try:
        opt.step()
        out["failed step"] = "no error"
    except OSError as exc:
        out["failed step"] = str(exc)
    finally:
        store.file.close()
        store.file = good
    out["kept params"] = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    after = opt.state_dict()["state"]
    out["kept state"] = all(torch.equal(state_before[i][key], after[i][key])
                            for i in state_before for key in ("exp_avg", "exp_avg_sq",
                                                              "master_param"))
    opt.step()  # the disk is back: the same gradients, the same step
    opt.zero_grad()
    train(model, opt, rank, 3, STEPS)
    out["retried"] = worst(full(model), reference)
    return out


@pytest.fixture(scope="module")
def nvme(runs):
    return [r["nvme"] for r in runs]


@pytest.mark.parametrize("stage,dtype", NVME_CASES,
                         ids=[f"stage{s}-{str(d)[6:]}" for s, d in NVME_CASES])
def test_nvme_step_matches_the_step_in_memory_to_the_bit(nvme, stage, dtype):
    for r in nvme:
        assert r[(stage, dtype)] == 0.0, r[(stage, dtype)]
        device, host, disk = r[("report", stage, dtype)]
        assert device == 0 and disk > 0
        assert host == 3 * disk // 2 // nvme_chunks(r, stage, dtype), (host, disk)


def nvme_chunks(r, stage, dtype):
    """Records in the file: the ring holds 3 of them, the file 2 slots of each."""
    return r[("report", stage, dtype)][2] // 2 // (r[("report", stage, dtype)][1] // 3)


def test_nvme_fp16_overflowing_steps_are_skipped_alike(nvme):
    for r in nvme:
        diff, with_nvme, without = r["fp16"]
        assert diff == 0.0 and with_nvme == without and with_nvme > 0


def test_nvme_state_dicts_and_checkpoints_resume_exactly(nvme):
    for r in nvme:
        assert r["state view"]
        for key in (("state_dict", None), ("state_dict", "nvme"), ("checkpoint", None),
                    ("checkpoint", "nvme")):
            assert r[key] == 0.0, (key, r[key])


def test_nvme_failed_write_keeps_the_last_good_step(nvme):
    for r in nvme:
        assert "NVMe offload file" in r["failed step"] and "last good step" in r["failed step"]
        assert r["kept params"] and r["kept state"]
        assert r["retried"] == 0.0, r["retried"]


def run_nvme_checkpoints(rank, world, tmp):
    """Checkpoints of an optimizer on NVMe copy its masters and states between the offload file
    and the checkpoint a few records at a time (zero_py/checkpoint/offloaded.py). An fp32 run
    (the masters are the parameters) saved at step 2, with and without offload; loaded into
    NVMe and memory at stages 1-3; a load whose offload writes fail on one rank; and the host
    memory the copy holds at two model sizes."""
    nvme = {"offload_dir": tmp}
    out = {}
    model, opt = build(2, torch.float32, None)
    train(model, opt, rank, 0, 2)
    zero_py.save_checkpoint(f"{tmp}/ck_memory", model, opt)
    train(model, opt, rank, 2, STEPS)
    reference = full(model)  # a save changes nothing: this is the uninterrupted run
    model, opt = build(2, torch.float32, "nvme", **nvme)
    train(model, opt, rank, 0, 2)
    zero_py.save_checkpoint(f"{tmp}/ck_nvme", model, opt)
    # the same state saved from NVMe and from memory: the same tensors (the format is one)
    mine = f"rank{rank:05d}.safetensors"
    a, b = (load_file(os.path.join(tmp, ck, mine)) for ck in ("ck_nvme", "ck_memory"))
    out["same files"] = (list(a) == list(b) and any(k.startswith("state/") for k in a)
                         and all(torch.equal(a[k], b[k]) for k in a))
    for src, offload, stage in (("nvme", "nvme", 1), ("nvme", "nvme", 3), ("nvme", None, 1),
                                ("memory", "nvme", 2)):
        m2, o2 = build(stage, torch.float32, offload, seed=2, **(nvme if offload else {}))
        zero_py.load_checkpoint(f"{tmp}/ck_{src}", m2, o2)
        train(m2, o2, rank, 2, STEPS)
        out[("resume", src, offload, stage)] = worst(full(m2), reference)
    # a load that fails halfway: rank 1's offload file refuses the records' writes. Every rank
    # raises, and the optimizer (its current slots) and the parameters are as they were: the
    # run goes on as if the load had never been tried
    train(model, opt, rank, 2, 3)
    out.update(load_failing_on_rank_1(f"{tmp}/ck_nvme", model, opt, opt._update.store, rank))
    train(model, opt, rank, 3, STEPS)
    out["after failed load"] = worst(full(model), reference)
    # host memory: the copy goes through the store's ring whatever the model's size, and never
    # through resident() (which reads the whole shard in)
    from zero_py.checkpoint import offloaded
    from zero_py.optim.streamed import StreamedUpdate

    def whole_shard(self):
        raise AssertionError("a checkpoint read the offloaded optimizer into memory")
    real, StreamedUpdate.resident = StreamedUpdate.resident, whole_shard
    try:
        for d_model in (32, 128):
            torch.manual_seed(0)
            m = models.TiedGPT(n_layer=2, d_model=d_model).to(torch.bfloat16)
            m, o = zero_py.initialize(m, torch.optim.AdamW, stage=2, lr=1e-3, bucket_bytes=4096,
                                      offload_optimizer="nvme", **nvme)
            train(m, o, rank, 0, 1, clip=False)
            zero_py.save_checkpoint(f"{tmp}/ck_size{d_model}", m, o)
            saved = dict(offloaded.stats)
            zero_py.load_checkpoint(f"{tmp}/ck_size{d_model}", m, o)
            out[("memory", d_model)] = (saved, dict(offloaded.stats),
                                        o.memory_report()["host_optimizer_states"],
                                        o.memory_report()["nvme_optimizer_states"])
    finally:
        StreamedUpdate.resident = real
    return out


def test_nvme_checkpoints_stream_and_resume_exactly(runs):
    for r in (x["nvme checkpoints"] for x in runs):
        assert r["same files"]
        for key in (("resume", "nvme", "nvme", 1), ("resume", "nvme", "nvme", 3),
                    ("resume", "nvme", None, 1), ("resume", "memory", "nvme", 2)):
            assert r[key] == 0.0, (key, r[key])


def test_nvme_failed_load_leaves_the_optimizer_as_it_was(runs):
    for r in (x["nvme checkpoints"] for x in runs):
        assert "rank 1" in r["failed load"] and "NVMe offload file" in r["failed load"], \
            r["failed load"]
        assert r["failed load kept params"]
        assert r["after failed load"] == 0.0, r["after failed load"]


def test_nvme_checkpoint_host_memory_does_not_grow_with_the_model(runs):
    for r in (x["nvme checkpoints"] for x in runs):
        (save_s, load_s, ring_s, disk_s) = r[("memory", 32)]
        (save_l, load_l, ring_l, disk_l) = r[("memory", 128)]
        assert disk_l > 10 * disk_s and disk_s > 4 * ring_s  # the shard outgrows the ring
        assert ring_s == ring_l
        for stats in (save_s, load_s, save_l, load_l):
            assert 0 < stats["ring_bytes"] <= ring_s and stats["scratch_bytes"] == 0, stats
        # every byte went through the ring: many more requests for the larger shard
        assert save_l["requests"] > 4 * save_s["requests"] > 0
        assert load_l["requests"] > 10 * load_s["requests"] > 0


def load_failing_on_rank_1(path, model, opt, store, rank) -> dict:
    """load_checkpoint(path) while rank 1's offload file `store.file` (the optimizer's or the
    parameters') refuses writes: {"failed load": what it raised, "failed load kept params":
    whether the model's values are as before}."""
    out = {}
    params = {k: v.clone() for k, v in model.state_dict().items()}
    good = store.file
    if rank == 1:
        store.file = DirectFile(f"/proc/self/fd/{good.fd}", writable=False)
    try:
        zero_py.load_checkpoint(path, model, opt)
        out["failed load"] = "no error"
    except zero_py.CheckpointError as exc:
        out["failed load"] = str(exc)
    finally:
        if store.file is not good:
            store.file.close()
            store.file = good
    out["failed load kept params"] = all(torch.equal(params[k], v)
                                         for k, v in model.state_dict().items())
    return out


def nvme_refusals(rank, world, tmp):
    said = []
    ro = os.path.join(tmp, "read-only")
    os.makedirs(ro, exist_ok=True)
    os.chmod(ro, 0o500)
    for kw in ({"offload_optimizer": "nvme"},
               {"offload_optimizer": "nvme", "offload_dir": os.path.join(tmp, "missing")},
               {"offload_optimizer": "nvme", "offload_dir": ro},
               {"offload_optimizer": "cpu", "offload_dir": tmp},
               {"offload_optimizer": "nvme", "offload_dir": tmp, "opt_cls": torch.optim.NAdam}):
        opt_cls = kw.pop("opt_cls", torch.optim.AdamW)
        try:
            zero_py.initialize(models.MLP(), opt_cls, stage=2, lr=1e-3, **kw)
            said.append("accepted")
        except ValueError as exc:
            said.append(str(exc))
    return said


def test_nvme_bad_arguments_are_refused_on_every_rank(runs):
    for said in (r["nvme refusals"] for r in runs):
        assert "needs offload_dir" in said[0]
        assert "is not a directory" in said[1]
        if os.geteuid() != 0:  # root may write in a directory of mode 0o500
            assert "not writable" in said[2]
        assert "applies to offload_optimizer='nvme' only" in said[3]
        assert "streams the fused optimizers" in said[4]


def full_disk(rank, world, tmp):
    fallocate = os.posix_fallocate
    if rank == 1:  # this rank's drive is full
        def no_space(fd, offset, length):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        os.posix_fallocate = no_space
    try:
        zero_py.initialize(models.MLP(), torch.optim.AdamW, stage=2, lr=1e-3,
                           offload_optimizer="nvme", offload_dir=tmp)
    except (OSError, ValueError) as exc:
        return type(exc).__name__, str(exc), os.listdir(tmp)
    finally:
        os.posix_fallocate = fallocate
    return "accepted", "", os.listdir(tmp)


def test_nvme_full_disk_is_an_error_on_every_rank(runs):
    said = [r["full disk"] for r in runs]
    assert said[1][0] == "OSError" and "cannot reserve" in said[1][1], said[1]
    assert "free space there or choose another offload_dir" in said[1][1]
    assert said[0][0] == "ValueError" and "No space left" in said[0][1], said[0]
    assert said[0][2] == [] and said[1][2] == [], "the offload files are unlinked at once"
