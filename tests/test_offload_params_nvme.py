"""Stage-3 parameter shards on NVMe (offload_params="nvme"): against the same stage-3 run in memory.

The parameters go through the same kernels and collectives, only read from and written to a file
bucket by bucket: the result must match the run in memory to the last bit (fp32 and bf16 with fp32
masters, clipping, accumulation under no_sync, a frozen layer, fp16 with a loss scaler whose first
steps overflow and are skipped). Optimizer and model state dicts and checkpoints taken under NVMe
resume in memory, and the other way round, as the run that never stopped; checkpoints copy the
parameter pieces record by record, never the whole shard, and a failed load changes nothing. A
step whose parameter writes fail keeps the last good step (parameters and optimizer states) and
can be retried. The host memory the library holds for the parameters is its ring, whatever the
model's size. Every scenario runs in one set of processes (start-up dominates).
"""

from __future__ import annotations

import contextlib
import errno
import os

import pytest
import torch

import distributed
import models
import zero_py
from test_offload import build, full, load_failing_on_rank_1, train, worst
from zero_py.io.engine import DirectFile

STEPS = 4


def nvme_build(dtype, tmp, **kw):
    return build(3, dtype, "nvme", offload_params="nvme", offload_dir=tmp, **kw)


def memory_build(dtype, **kw):
    return build(3, dtype, None, **kw)


def run_parity(rank, world, tmp):
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        model, opt = memory_build(dtype)
        train(model, opt, rank, 0, STEPS)
        reference = full(model)
        model, opt = nvme_build(dtype, tmp)
        train(model, opt, rank, 0, STEPS)
        out[dtype] = worst(full(model), reference)
        out[("shards in memory", dtype)] = sum(s.shards.nbytes() for s in (
            opt._flat, opt._flat.frozen_storage))
    runs = {}
    for nvme in (False, True):
        kw = {"scaler": 2.0 ** 60}
        model, opt = (nvme_build(torch.float16, tmp, **kw) if nvme
                      else memory_build(torch.float16, **kw))
        train(model, opt, rank, 0, STEPS + 2, clip=False)
        runs[nvme] = (full(model), opt.skipped_steps)
    out["fp16"] = (worst(runs[True][0], runs[False][0]), runs[True][1], runs[False][1])
    return out


def run_resume(rank, world, tmp):
    """State dicts and checkpoints: saved under NVMe, resumed in memory and on NVMe; saved in
    memory, resumed on NVMe; each against the run that never stopped."""
    out = {}
    dtype = torch.bfloat16
    model, opt = memory_build(dtype)
    train(model, opt, rank, 0, STEPS)
    reference = full(model)
    for saved_on_nvme in (True, False):
        model, opt = nvme_build(dtype, tmp) if saved_on_nvme else memory_build(dtype)
        train(model, opt, rank, 0, 2)
        shard = opt.state_dict()
        weights = {k: v.clone() for k, v in model.state_dict().items()}
        ck = f"{tmp}/ck-{saved_on_nvme}"
        zero_py.save_checkpoint(ck, model, opt)
        for load_on_nvme in (True, False):
            if not saved_on_nvme and not load_on_nvme:
                continue
            make = (lambda seed: nvme_build(dtype, tmp, seed=seed)) if load_on_nvme \
                else (lambda seed: memory_build(dtype, seed=seed))
            m2, o2 = make(1)
            m2.load_state_dict(weights)
            o2.load_state_dict(shard)
            train(m2, o2, rank, 2, STEPS)
            out[("state_dict", saved_on_nvme, load_on_nvme)] = worst(full(m2), reference)
            m3, o3 = make(2)
            zero_py.load_checkpoint(ck, m3, o3)
            train(m3, o3, rank, 2, STEPS)
            out[("checkpoint", saved_on_nvme, load_on_nvme)] = worst(full(m3), reference)
    # gathered(modifier_rank): rank 0's edit reaches every rank's file
    model, opt = nvme_build(torch.float32, tmp)
    with zero_py.gathered(model, modifier_rank=0):
        with torch.no_grad():
            if rank == 0:
                model.blocks[0].mlp[0].weight.fill_(0.25)
    with zero_py.gathered(model):
        out["modified"] = bool((model.blocks[0].mlp[0].weight == 0.25).all())
    return out


def run_checkpoints(rank, world, tmp):
    """Checkpoints copy the parameter pieces between the parameter files and the checkpoint's
    files record by record: the whole shard is never read in (resident() fails the test), the
    rank files hold the same tensors as a save of the resident shards, and a synchronous or an
    asynchronous save resumes exactly, in memory and on NVMe (fp32: the optimizer's masters
    come from the parameters; bf16: from the saved masters). A stage-2 checkpoint (another
    layout) loads on NVMe as in memory. A load whose parameter writes fail on one rank raises on
    every rank and leaves the model and optimizer as they were."""
    from safetensors.torch import load_file

    from zero_py.checkpoint.reader import rank_file
    from zero_py.offload.param_store import ParamStore
    from zero_py.sharding.storage import ShardedParams

    out = {}
    real = ShardedParams.resident

    def whole_shard(self):
        raise AssertionError("a checkpoint read the parameter shards into memory")

    @contextlib.contextmanager
    def streamed_only():
        ShardedParams.resident = whole_shard
        try:
            yield
        finally:
            ShardedParams.resident = real

    for dtype in (torch.float32, torch.bfloat16):
        model, opt = memory_build(dtype)
        train(model, opt, rank, 0, STEPS)
        reference = full(model)
        model, opt = nvme_build(dtype, tmp)
        train(model, opt, rank, 0, 2)
        held = []  # the records the save reads: each once
        hold = ParamStore.hold
        ParamStore.hold = lambda self, b, held=held, hold=hold: (
            held.append((id(self), b)) or hold(self, b))
        try:
            with streamed_only():
                zero_py.save_checkpoint(f"{tmp}/ck", model, opt)
        finally:
            ParamStore.hold = hold
        stores = (opt._flat.nvme, opt._flat.frozen_storage.nvme)
        out[("records read", dtype)] = (sorted(held), sorted(
            (id(st), b) for st in stores for b in range(st.n_buckets) if st.piece_bytes[b]))
        with opt.resident():
            zero_py.save_checkpoint(f"{tmp}/ck-resident", model, opt)
        a, b = (load_file(f"{tmp}/{ck}/{rank_file(rank)}") for ck in ("ck", "ck-resident"))
        out[("same tensors", dtype)] = (a.keys() == b.keys() and any(k.startswith("param/")
                                                                     for k in a)
                                        and all(torch.equal(a[k], b[k]) for k in a))
        with streamed_only():
            handle = zero_py.save_checkpoint(f"{tmp}/ck-async", model, opt, async_save=True)
        train(model, opt, rank, 2, 3)  # training goes on while the file is written
        handle.wait()
        for src in ("ck", "ck-async"):
            for on_nvme in (True, False):
                m2, o2 = nvme_build(dtype, tmp, seed=2) if on_nvme else memory_build(dtype, seed=2)
                with streamed_only():
                    zero_py.load_checkpoint(f"{tmp}/{src}", m2, o2)
                train(m2, o2, rank, 2, STEPS)
                out[("resume", src, on_nvme, dtype)] = worst(full(m2), reference)
    # another stage's layout: the same checkpoint into stage 3 in memory and on NVMe
    dtype = torch.bfloat16
    model, opt = build(2, dtype, None)
    train(model, opt, rank, 0, 2)
    zero_py.save_checkpoint(f"{tmp}/ck-stage2", model, opt)
    resumed = {}
    for on_nvme in (False, True):
        m2, o2 = nvme_build(dtype, tmp, seed=2) if on_nvme else memory_build(dtype, seed=2)
        with streamed_only():
            zero_py.load_checkpoint(f"{tmp}/ck-stage2", m2, o2)
        train(m2, o2, rank, 2, STEPS)
        resumed[on_nvme] = full(m2)
    out["stage 2 into nvme"] = worst(resumed[True], resumed[False])
    # a load that fails on rank 1 (its parameter file refuses the writes)
    model, opt = memory_build(dtype)
    train(model, opt, rank, 0, STEPS)
    reference = full(model)
    model, opt = nvme_build(dtype, tmp)
    train(model, opt, rank, 0, 2)
    out.update(load_failing_on_rank_1(f"{tmp}/ck-stage2", model, opt, opt._flat.nvme, rank))
    train(model, opt, rank, 2, STEPS)
    out["after failed load"] = worst(full(model), reference)
    return out


def run_other_paths(rank, world, tmp):
    """A model built on the meta device (each bucket's piece written to its record once filled,
    the whole shard never in memory), trained; and a no_grad forward in eval mode: both as in
    memory."""
    from zero_py.sharding.storage import ShardedParams

    real = ShardedParams.resident

    def whole_shard(self):
        raise AssertionError("a partitioned construction read the parameter shards into memory")
    out = {}
    runs = {}
    for nvme, partly in ((False, False), (True, False), (False, True), (True, True)):
        torch.manual_seed(0)
        with torch.device("meta"):
            model = models.TiedGPT(n_layer=2)
        if partly:  # one block built on the CPU: its values stay (buckets filled in part)
            torch.manual_seed(9)
            model.blocks[1] = models.TiedGPT(n_layer=2).blocks[1]
        kw = ({"offload_params": "nvme", "offload_optimizer": "nvme", "offload_dir": tmp}
              if nvme else {})
        ShardedParams.resident = whole_shard  # filled bucket by bucket, never whole
        try:
            model, opt = zero_py.initialize(model, torch.optim.AdamW, stage=3, lr=3e-3,
                                            wrap_policy=1000, persistence_threshold=64, **kw)
        finally:
            ShardedParams.resident = real
        train(model, opt, rank, 0, 2)
        model.eval()
        with torch.no_grad():
            logits = model(models.gpt_batch(torch.Generator().manual_seed(5), batch=2)[0])
        runs[nvme, partly] = (full(model), logits)
    for partly in (False, True):
        key = "partly meta" if partly else "meta"
        out[key] = worst(runs[True, partly][0], runs[False, partly][0])
        out[("eval", partly)] = float((runs[True, partly][1] - runs[False, partly][1]).abs().max())
    return out


def run_failed_write(rank, world, tmp):
    """A step whose writes fail (the parameter file, or the optimizer's, turned read-only under
    it): an error on every rank, the last good step kept (parameters and optimizer states);
    the same step retried once the disk is back gives what the run that never failed gives."""
    out = {}
    model, opt = memory_build(torch.bfloat16)
    train(model, opt, rank, 0, STEPS)
    reference = full(model)
    for which in ("params", "optimizer"):
        model, opt = nvme_build(torch.bfloat16, tmp)
        train(model, opt, rank, 0, 2)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        state_before = opt.state_dict()["state"]
        gen = torch.Generator().manual_seed(100 + 7 * 2 + rank)
        for k in range(2):
            batch = models.gpt_batch(gen, batch=3)
            with opt.no_sync() if k == 0 else contextlib.nullcontext():
                (model(*batch).float() / 2).backward()
        opt.clip_grad_norm_(0.5)
        store = opt._flat.nvme if which == "params" else opt._update.store
        good = store.file
        store.file = DirectFile(f"/proc/self/fd/{good.fd}", writable=False)
        try:
            opt.step()
            out[(which, "failed step")] = "no error"
        except OSError as exc:
            out[(which, "failed step")] = str(exc)
        finally:
            store.file.close()
            store.file = good
        out[(which, "kept params")] = all(torch.equal(before[k], v)
                                          for k, v in model.state_dict().items())
        after = opt.state_dict()["state"]
        out[(which, "kept state")] = all(
            torch.equal(state_before[i][key], after[i][key])
            for i in state_before for key in ("exp_avg", "exp_avg_sq", "master_param"))
        opt.step()  # the disk is back: the same gradients, the same step
        opt.zero_grad()
        train(model, opt, rank, 3, STEPS)
        out[(which, "retried")] = worst(full(model), reference)
    return out


def run_memory(rank, world, tmp):
    """The host bytes the library holds for the parameters (memory_report's host_params: the
    rings) do not grow with the number of layers; the files do. Training never holds the
    whole shard (resident() is not entered by a forward, backward or step)."""
    from zero_py.sharding.storage import ShardedParams

    out = {}
    entered = []
    resident = ShardedParams.resident

    def counting(self):
        entered.append(self)
        return resident(self)
    for n_layer in (2, 6):
        torch.manual_seed(0)
        model = models.TiedGPT(n_layer=n_layer)
        model, opt = zero_py.initialize(model, torch.optim.AdamW, stage=3, lr=1e-3,
                                        wrap_policy=1000, persistence_threshold=64,
                                        offload_params="nvme", offload_optimizer="nvme",
                                        offload_dir=tmp)
        ShardedParams.resident = counting
        try:
            train(model, opt, rank, 0, 2)
        finally:
            ShardedParams.resident = resident
        rep = opt.memory_report()
        rings = opt._flat.nvme.host_bytes()
        out[n_layer] = (rep["host_params"], rep["nvme_params"], rings,
                        opt._flat.shards.nbytes(), len(entered))
    return out


def run_refusals(rank, world, tmp):
    said = []
    ro = os.path.join(tmp, "read-only")
    os.makedirs(ro, exist_ok=True)
    os.chmod(ro, 0o500)
    cases = [{"offload_params": "nvme", "offload_dir": tmp},
             {"offload_params": "nvme", "offload_optimizer": "cpu"},
             {"offload_params": "nvme", "offload_optimizer": "nvme",
              "offload_dir": os.path.join(tmp, "missing")},
             {"offload_params": "nvme", "offload_optimizer": "nvme", "offload_dir": ro},
             {"offload_params": "nvme", "offload_optimizer": "nvme"}]
    for kw in cases:
        try:
            zero_py.initialize(models.MLP(), torch.optim.AdamW, stage=3, lr=1e-3, **kw)
            said.append("accepted")
        except ValueError as exc:
            said.append(str(exc))
    # a full drive on rank 1 only: the parameter file cannot be reserved there
    fallocate = os.posix_fallocate
    if rank == 1:
        def no_space(fd, offset, length):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        os.posix_fallocate = no_space
    full_dir = os.path.join(tmp, "full")
    os.makedirs(full_dir, exist_ok=True)
    try:
        zero_py.initialize(models.MLP(), torch.optim.AdamW, stage=3, lr=1e-3,
                           offload_params="nvme", offload_optimizer="nvme",
                           offload_dir=full_dir)
        said.append(("accepted", "", os.listdir(full_dir)))
    except (OSError, ValueError) as exc:
        said.append((type(exc).__name__, str(exc), os.listdir(full_dir)))
    finally:
        os.posix_fallocate = fallocate
    return said


def run_all(rank, world, tmp):
    os.environ["ZP_OFFLOAD_CHUNK_BYTES"] = "12288"  # many optimizer records per bucket
    os.environ["ZP_OFFLOAD_RING"] = "3"
    out = {}
    for name, fn in (("parity", run_parity), ("resume", run_resume),
                     ("checkpoints", run_checkpoints), ("other", run_other_paths),
                     ("failed write", run_failed_write), ("memory", run_memory),
                     ("refusals", run_refusals)):
        # the default ring (reads ahead in the step too) for parity, the tightest elsewhere
        os.environ["ZP_OFFLOAD_PARAM_RING"] = "3" if name == "parity" else "2"
        sub = os.path.join(tmp, name.replace(" ", "-"))
        os.makedirs(sub, exist_ok=True)
        out[name] = fn(rank, world, sub)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return distributed.run(run_all, 2, str(tmp_path_factory.mktemp("params-nvme")))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_params_on_nvme_match_the_run_in_memory_to_the_bit(runs, dtype):
    for r in runs:
        assert r["parity"][dtype] == 0.0, r["parity"][dtype]
        assert r["parity"][("shards in memory", dtype)] == 0


def test_params_on_nvme_fp16_overflowing_steps_are_skipped_alike(runs):
    for r in runs:
        diff, with_nvme, without = r["parity"]["fp16"]
        assert diff == 0.0 and with_nvme == without and with_nvme > 0


def test_state_dicts_and_checkpoints_move_between_nvme_and_memory(runs):
    for r in runs:
        res = r["resume"]
        keys = [k for k in res if isinstance(k, tuple)]
        assert len(keys) == 6, keys
        for key in keys:
            assert res[key] == 0.0, (key, res[key])
        assert res["modified"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_checkpoints_stream_the_parameter_file_and_resume_exactly(runs, dtype):
    for r in runs:
        res = r["checkpoints"]
        assert res[("same tensors", dtype)]
        read, records = res[("records read", dtype)]
        assert read == records and len(records) > 2, (len(read), len(records))
        for src in ("ck", "ck-async"):
            for on_nvme in (True, False):
                key = ("resume", src, on_nvme, dtype)
                assert res[key] == 0.0, (key, res[key])
        assert res["stage 2 into nvme"] == 0.0, res["stage 2 into nvme"]


def test_checkpoint_load_failing_on_one_rank_changes_nothing_on_nvme(runs):
    for r in runs:
        res = r["checkpoints"]
        said = res["failed load"]
        assert "rank 1" in said and "NVMe offload file of the parameters" in said, said
        assert res["failed load kept params"]
        assert res["after failed load"] == 0.0, res["after failed load"]


def test_meta_device_model_and_eval_forward_on_nvme(runs):
    for r in runs:
        for partly in (False, True):
            key = "partly meta" if partly else "meta"
            assert r["other"][key] == 0.0, (key, r["other"][key])
            assert r["other"][("eval", partly)] == 0.0, r["other"][("eval", partly)]


@pytest.mark.parametrize("which", ["params", "optimizer"])
def test_failed_write_keeps_the_last_good_step(runs, which):
    for r in runs:
        res = r["failed write"]
        said = res[(which, "failed step")]
        assert ("NVMe offload file of the parameters" if which == "params"
                else "NVMe offload file in") in said, said
        assert "last good step" in said
        assert res[(which, "kept params")] and res[(which, "kept state")]
        assert res[(which, "retried")] == 0.0, res[(which, "retried")]


def test_host_memory_for_params_is_the_ring_whatever_the_depth(runs):
    for r in runs:
        small, large = r["memory"][2], r["memory"][6]
        for host, _, rings, in_memory, resident_calls in (small, large):
            assert in_memory == 0  # no shard in memory between steps
            assert resident_calls == 0  # nor during them
            assert host == rings > 0
        assert small[0] == large[0], (small, large)  # same ring at 2 and 6 layers
        assert large[1] > 2 * small[1]  # the file grows with the model


def test_bad_arguments_and_full_drive_are_errors_on_every_rank(runs):
    for r in runs:
        said = r["refusals"]
        assert "needs offload_optimizer='nvme'" in said[0] and "got offload_optimizer=None" \
            in said[0], said[0]
        assert "needs offload_optimizer='nvme'" in said[1] and "'cpu'" in said[1], said[1]
        assert "is not a directory" in said[2], said[2]
        if os.geteuid() != 0:  # root may write in a directory of mode 0o500
            assert "not writable" in said[3], said[3]
        assert "offload_params='nvme' needs offload_dir" in said[4], said[4]
    full_drive = [r["refusals"][5] for r in runs]
    assert full_drive[1][0] == "OSError" and "cannot reserve" in full_drive[1][1], full_drive[1]
    assert "free space there or choose another offload_dir" in full_drive[1][1]
    assert full_drive[0][0] == "ValueError" and "No space left" in full_drive[0][1], full_drive[0]
    assert full_drive[0][2] == [] and full_drive[1][2] == [], "the files are unlinked at once"


def test_offload_params_nvme_is_refused_outside_stage_3():
    with pytest.raises(ValueError, match="only apply to stage=3"):
        zero_py.initialize(models.MLP(), torch.optim.AdamW, stage=2, lr=1e-3,
                           offload_params="nvme")
