"""Checkpoints: save at one world size and stage, resume at another, and train on exactly as a
run that never stopped (the reference: the same training without a checkpoint).

The model is a GPT with tied input/output embeddings, a frozen block and a buffer, trained
with an LR scheduler whose state travels in `extra`. Scenarios (K steps, save, M more):

    A  bf16 + fp32 masters, AdamW     2 ranks stage 1  ->  2 ranks stage 3
    B  fp32, AdamW                    2 ranks stage 3  ->  2 ranks stage 1
    C  fp32, AdamW                    2 ranks stage 2  ->  3 ranks stage 2
    D  fp32, NAdam (generic path)     2 ranks stage 2  ->  3 ranks stage 3  ->  1 rank stage 1
    E  fp32, AdamW, optimizer on NVMe 2 ranks stage 2  ->  3 ranks stage 3 (both offloaded)

At one world size the resumed run must match the reference to the last bit (the same sums in
the same order); across world sizes the gradient sums are added in another order: 1e-5.
The damaged-checkpoint cases run at 2 ranks: every rank must raise, nothing may change.
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import distributed
import models
import zero_py
from zero_py.checkpoint.consolidate import torch_optimizer_state
from zero_py.checkpoint.reader import Checkpoint

K, M = 3, 3
SCENARIOS = {  # key: (dtype, optimizer class, [(world size, stage), ...])
    "A": (torch.bfloat16, torch.optim.AdamW, [(2, 1), (2, 3)]),
    "B": (torch.float32, torch.optim.AdamW, [(2, 3), (2, 1)]),
    "C": (torch.float32, torch.optim.AdamW, [(2, 2), (3, 2)]),
    "D": (torch.float32, torch.optim.NAdam, [(2, 2), (3, 3), (1, 1)]),
    # offload_optimizer="nvme" in both runs: the save and the load stream the optimizer state
    # between the offload files and the checkpoint (checkpoint/offloaded.py)
    "E": (torch.float32, torch.optim.AdamW, [(2, 2), (3, 3)]),
}
NVME = {"E"}


def build(stage, dtype, opt_cls, seed, nvme_dir=None):
    torch.manual_seed(seed)
    m = models.TiedGPT(n_layer=3)
    m.blocks[1].requires_grad_(False)  # a frozen layer
    m.register_buffer("marker", torch.randn(5))
    m.to(dtype)
    kw = {"lr": 3e-3, "weight_decay": 0.05}
    if dtype != torch.float32:
        kw["grad_reduce_dtype"] = torch.float32
    # stage 3: units of >= 1000 parameters; parameters under 64 elements are kept whole
    # (the persistent unit, which a load must refresh)
    extra = {"wrap_policy": 1000, "persistence_threshold": 64} if stage == 3 else {}
    if nvme_dir is not None:
        os.makedirs(nvme_dir, exist_ok=True)
        extra.update(offload_optimizer="nvme", offload_dir=nvme_dir)
    model, opt = zero_py.initialize(m, opt_cls, stage=stage, **extra, **kw)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7)
    return model, opt, sched


def train(model, opt, sched, first, last, rank, world):
    for t in range(first, last):
        gen = torch.Generator().manual_seed(1000 + t)
        idx, tgt = models.gpt_batch(gen, batch=12)
        n = 12 // world
        loss = model(idx[rank * n:(rank + 1) * n], tgt[rank * n:(rank + 1) * n])
        loss.float().backward()
        opt.step()
        opt.zero_grad()
        sched.step()


def full_params(model):
    sd = zero_py.full_state_dict(model)
    return None if sd is None else {k: v.float() for k, v in sd.items()}


def resume(path, stage, dtype, opt_cls, rank, world, nvme_dir=None):
    """A model built from another seed, loaded from `path`; its extra is checked."""
    model, opt, sched = build(stage, dtype, opt_cls, seed=1, nvme_dir=nvme_dir)
    extra = zero_py.load_checkpoint(path, model, opt)
    sched.load_state_dict(extra["sched"])
    saved_rank = rank if rank < extra["world"] else 0
    assert extra["rank"] == saved_rank, (extra["rank"], rank)
    assert torch.equal(extra["rng"], torch.full((7,), float(saved_rank)))
    assert extra["note"] == ("tuple", 1.5, float("inf"), None, {3: "int key"})
    return model, opt, sched


def save(path, model, opt, sched, rank, world, **kw):
    extra = {"sched": sched.state_dict(), "rank": rank, "world": world,
             "rng": torch.full((7,), float(rank)),
             "note": ("tuple", 1.5, float("inf"), None, {3: "int key"})}
    return zero_py.save_checkpoint(path, model, opt, extra, **kw)


# -- the runs (each a set of processes) ----------------------------------------------------------


def run_first(rank, world, tmp):
    """Phase 1 of every scenario at 2 ranks, and the references of A, B and C."""
    out = {}
    for key, (dtype, cls, phases) in SCENARIOS.items():
        stage = phases[0][1]
        model, opt, sched = build(stage, dtype, cls, seed=0,
                                  nvme_dir=os.path.join(tmp, "nvme") if key in NVME else None)
        train(model, opt, sched, 0, K, rank, world)
        with torch.no_grad():
            model.marker.copy_(torch.arange(5.0))
        save(os.path.join(tmp, key), model, opt, sched, rank, world)
        if key in "ABCE":
            train(model, opt, sched, K, K + M, rank, world)
            out[key] = full_params(model)
        if key == "C":  # the damaged-checkpoint cases start from these
            save(os.path.join(tmp, "C_more"), model, opt, sched, rank, world)
            out["C_optim"] = opt.consolidate_state_dict()
            # an asynchronous save of the same state, whose write waits until training has
            # changed every parameter and state
            import zero_py.checkpoint.save as save_mod

            gate, real = threading.Event(), save_mod.write_tensor_file
            save_mod.write_tensor_file = lambda *a, g=gate, w=real: g.wait(60) and w(*a)
            handle = save(os.path.join(tmp, "C_async"), model, opt, sched, rank, world,
                          async_save=True)
            train(model, opt, sched, K + M, K + M + 2, rank, world)
            gate.set()
            out["async_path"] = handle.wait()
            save_mod.write_tensor_file = real
    # rotation: keep the two newest of step_1 .. step_4 (numbered by step)
    model, opt, sched = build(2, torch.float32, torch.optim.AdamW, seed=0)
    for t in range(4):
        train(model, opt, sched, t, t + 1, rank, world)
        save(os.path.join(tmp, "rot", f"step_{t + 1}"), model, opt, sched, rank, world,
             keep_last=2)
    out["rot"] = sorted(os.listdir(os.path.join(tmp, "rot")))
    out.update(_rotation_failures(rank, os.path.join(tmp, "rot_fail")))
    return out


def _rotation_failures(rank, root):
    """keep_last when an older checkpoint cannot be removed (rank 0, which rotates, is refused
    one of its files, as a file held open on NFS or a directory of another user's would be),
    after a run restarted from scratch, and beside a directory whose manifest is damaged."""
    def fresh(seed):
        torch.manual_seed(seed)
        model = models.MLP()
        return model, zero_py.ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)

    model, opt = fresh(0)
    gen = torch.Generator().manual_seed(rank)

    def step(model, opt):
        models.mlp_loss(model, models.mlp_batch(gen)).backward()
        opt.step()
        opt.zero_grad()

    def save(name, model, opt, **kw):
        return zero_py.save_checkpoint(os.path.join(root, name), model, opt, **kw)

    for t in (1, 2):
        step(model, opt)
        save(f"step_{t}", model, opt)
    stuck, real = os.path.join(root, "step_1", "rank00001.safetensors"), os.unlink

    def refusing(path, *args, **kwargs):
        if os.fspath(path) == stuck:
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return real(path, *args, **kwargs)
    out = {}
    step(model, opt)
    if rank == 0:
        os.unlink = refusing
    try:
        error = _refusal(lambda: save("step_3", model, opt, keep_last=1))
    finally:
        os.unlink = real
    out["rot_errors"] = [None, None]
    dist.all_gather_object(out["rot_errors"], error)
    out["rot_left"] = {n: sorted(os.listdir(os.path.join(root, n)))
                       for n in sorted(os.listdir(root))}
    saved = [p.detach().clone() for p in model.parameters()]
    other, oopt = fresh(1)  # the checkpoint just written is whole
    zero_py.load_checkpoint(os.path.join(root, "step_3"), other, oopt)
    out["rot_loaded"] = all(torch.equal(a, b) for a, b in zip(saved, other.parameters()))
    step(model, opt)  # the next save with keep_last removes what the failed one left
    save("step_4", model, opt, keep_last=1)
    out["rot_after"] = sorted(os.listdir(root))
    if rank == 0:  # a checkpoint's directory whose manifest has a damaged step: never ours
        shutil.copytree(os.path.join(root, "step_4"), os.path.join(root, "step_9"))
        with open(os.path.join(root, "step_9", "manifest.json")) as f:
            man = json.load(f)
        man["step"] = "nine"
        with open(os.path.join(root, "step_9", "manifest.json"), "w") as f:
            json.dump(man, f)
    dist.barrier()
    model, opt = fresh(2)  # restarted from scratch: step 1 under a new name
    step(model, opt)
    save("step_1", model, opt, keep_last=1)
    out["restart"] = sorted(os.listdir(root))
    return out


DAMAGED = {  # case: (what the test does to a copy of C, what the error must say)
    "flipped_byte": ("flip a byte in rank00001's data", "CRC-32C"),
    "truncated": ("cut rank00000 short", "truncated"),
    "mixed": ("rank00001 from another save", "another save"),
    "manifest": ("garbage in manifest.json", "not valid JSON"),
    "missing": ("delete rank00001", "missing"),
    "version": ("format version 99", "format version 99"),
    "edited": ("manifest.json without 'files'", "lacks 'files'"),
    # the manifest's layout against its files (validate.py), each problem by file and field
    "layout_shape": ("a shape whose product the pieces do not cover",
                     "manifest.json: params['blocks.0.attn.qkv.weight'].pieces cover elements "
                     "[0, 3072) of the 3104"),
    "layout_empty_piece": ("a piece of zero length where the file holds elements",
                           "manifest.json: params['pos_emb.weight'].pieces[0] is [0, 0, 0]: it "
                           "holds no element"),
    "layout_rank": ("a piece on a rank without a file",
                    "manifest.json: params['tok_emb.weight'].pieces[0] is [7, 0, "),
    "layout_dtype": ("a dtype other than the file's",
                     "safetensors: tensor param/blocks.0.ln1.weight is F32, where "),
    # hostile directories (HOSTILE below): each used to crash a reader, hang it or the other
    # ranks, exhaust memory, or load what every step then refused
    "hostile_world": ("a world size of 10**9 (a list of 10**9 file names: MemoryError)",
                      "'world_size' is 1000000000"),
    "hostile_fifo": ("manifest.json a FIFO (its open waited forever)",
                     "manifest.json is not a regular file"),
    "hostile_link": ("rank00001 a symbolic link to a file outside the directory",
                     "rank00001.safetensors is a symbolic link"),
    "hostile_nested": ("manifest.json nested 10**5 deep (RecursionError)",
                       "nests deeper than this reader follows"),
    "hostile_metadata": ("a header whose __metadata__ is a list (AttributeError)",
                         "rank00000.safetensors: the header's __metadata__ is [1]"),
    "hostile_crc_type": ("a file entry whose crc32c is a list (inspect: TypeError)",
                         "files['rank00000.safetensors'].crc32c is [1], not 8 hex digits"),
    "hostile_step": ("a step count of 2**63 (loaded; the owner's step failed, the other rank "
                     "hung)", "params['pos_emb.weight'].step is 9223372036854775808"),
    "hostile_overlap": ("a tensor's byte range over another's (read another tensor's bytes)",
                        "overlapping or with bytes between them"),
    "hostile_alias": ("a tied alias named as a parameter (consolidate wrote an unreadable file)",
                      "aliases['pos_emb.weight'] is also the name of a parameter"),
    "hostile_extra": ("rank 1's extra not decodable (an unnamed TypeError)",
                      "rank00001.safetensors: the header's __metadata__['extra']"),
    "hostile_duplicate": ("a manifest with a key twice (JSON readers disagree on which wins)",
                          "has the key 'world_size' twice in one object"),
    "hostile_void": ("rank 1's extra a numpy void scalar of 10**9 bytes (allocated)",
                     "numpy dtype 'V8' is not one zero_py checkpoints store"),
    "hostile_lr": ("an lr of 'abc' (loaded; every step then failed)",
                   "optimizer.param_groups: param group 0: a hyperparameter the fused kernel "
                   "cannot read (ValueError: could not convert string to float: 'abc')"),
}
LAYOUT_EDITS = {  # case: what it does to the manifest of a copy of C
    "layout_shape": lambda m: m["params"]["blocks.0.attn.qkv.weight"].update(shape=[97, 32]),
    "layout_empty_piece": lambda m: m["params"]["pos_emb.weight"]["pieces"][0].__setitem__(
        2, m["params"]["pos_emb.weight"]["pieces"][0][1]),
    "layout_rank": lambda m: m["params"]["tok_emb.weight"]["pieces"][0].__setitem__(0, 7),
    "layout_dtype": lambda m: m["params"]["blocks.0.ln1.weight"].update(dtype="bfloat16"),
}


def _rewrite_header(d, rank, edit):
    """Edits rank `rank`'s safetensors header in checkpoint `d` (edit(header) -> None) and
    gives the manifest the file's new size and CRC-32C, as a hand-crafted file would have."""
    from zero_py._native import _C

    path = os.path.join(d, f"rank{rank:05d}.safetensors")
    with open(path, "rb") as f:
        raw = f.read()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    edit(header)
    text = json.dumps(header).encode()
    text += b" " * (-(8 + len(text)) % 8)
    raw = len(text).to_bytes(8, "little") + text + raw[8 + n:]
    with open(path, "wb") as f:
        f.write(raw)
    _edit_manifest(d, lambda m: m["files"][f"rank{rank:05d}.safetensors"].update(
        bytes=len(raw), crc32c=f"{_C.crc32c(memoryview(raw), 0):08x}"))


def _edit_manifest(d, edit):
    with open(os.path.join(d, "manifest.json")) as f:
        data = json.load(f)
    edit(data)
    with open(os.path.join(d, "manifest.json"), "w") as f:
        json.dump(data, f)


def _overlap(header):  # the first param/ tensor's range, moved 4 bytes into the one before it
    key = min((k for k in header if k.startswith("param/") and header[k]["data_offsets"][0]),
              key=lambda k: header[k]["data_offsets"][0])
    header[key]["data_offsets"] = [o - 4 for o in header[key]["data_offsets"]]


HOSTILE = {  # case: what it does to a copy of C
    "hostile_world": lambda d: _edit_manifest(d, lambda m: m.update(world_size=10**9)),
    "hostile_fifo": lambda d: (os.remove(os.path.join(d, "manifest.json")),
                               os.mkfifo(os.path.join(d, "manifest.json"))),
    "hostile_link": lambda d: (
        os.replace(os.path.join(d, "rank00001.safetensors"), d + ".outside"),
        os.symlink(d + ".outside", os.path.join(d, "rank00001.safetensors"))),
    "hostile_nested": lambda d: open(os.path.join(d, "manifest.json"), "w").write(
        "[" * 10**5 + "]" * 10**5),
    "hostile_metadata": lambda d: _rewrite_header(
        d, 0, lambda h: h.__setitem__("__metadata__", [1])),
    "hostile_crc_type": lambda d: _edit_manifest(
        d, lambda m: m["files"]["rank00000.safetensors"].update(crc32c=[1])),
    "hostile_step": lambda d: _edit_manifest(
        d, lambda m: m["params"]["pos_emb.weight"].update(step=2**63)),
    "hostile_overlap": lambda d: _rewrite_header(d, 1, _overlap),
    "hostile_alias": lambda d: _edit_manifest(
        d, lambda m: m["aliases"].update({"pos_emb.weight": "tok_emb.weight"})),
    "hostile_extra": lambda d: _rewrite_header(
        d, 1, lambda h: h["__metadata__"].update(extra='{"x": {"__items__": 5}}')),
    "hostile_duplicate": lambda d: open(os.path.join(d, "manifest.json"), "r+").write(
        open(os.path.join(d, "manifest.json")).read()[:-1] + ', "world_size": 2}'),
    "hostile_void": lambda d: _rewrite_header(
        d, 1, lambda h: h["__metadata__"].update(extra='{"x": {"__numpy__": 1000000000, '
                                                 '"dtype": "V8"}}')),
    "hostile_lr": lambda d: _edit_manifest(
        d, lambda m: m["optimizer"]["param_groups"][0].update(lr="abc")),
}
# what inspect and consolidate do not read
LOAD_ONLY = {"hostile_extra", "hostile_void", "hostile_lr"}


def make_damaged(tmp):
    src = os.path.join(tmp, "C")
    for case in DAMAGED:
        dst = os.path.join(tmp, "bad_" + case)
        shutil.copytree(src, dst)
        if case in HOSTILE:
            HOSTILE[case](dst)
            continue
        r0, r1 = (os.path.join(dst, f"rank0000{r}.safetensors") for r in (0, 1))
        if case == "flipped_byte":
            with open(r1, "r+b") as f:
                f.seek(os.path.getsize(r1) - 100)
                b = f.read(1)
                f.seek(-1, 1)
                f.write(bytes([b[0] ^ 0x40]))
        elif case == "truncated":
            os.truncate(r0, os.path.getsize(r0) - 8)
        elif case == "mixed":
            shutil.copy(os.path.join(tmp, "C_more", "rank00001.safetensors"), r1)
        elif case == "manifest":
            with open(os.path.join(dst, "manifest.json"), "a") as f:
                f.write("}{")
        elif case == "missing":
            os.remove(r1)
        elif case == "version":
            man = os.path.join(dst, "manifest.json")
            with open(man) as f:
                data = json.load(f)
            data["version"] = 99
            with open(man, "w") as f:
                json.dump(data, f)
        elif case in ("edited", *LAYOUT_EDITS):
            man = os.path.join(dst, "manifest.json")
            with open(man) as f:
                data = json.load(f)
            if case == "edited":
                del data["files"]
            else:
                LAYOUT_EDITS[case](data)
            with open(man, "w") as f:
                json.dump(data, f)


def _refusal(fn):
    try:
        fn()
    except zero_py.CheckpointError as exc:
        return str(exc)
    return None


def run_second_2(rank, world, tmp):
    """At 2 ranks: phase 2 of A and B; the damaged and mismatched checkpoints."""
    out = {}
    for key in "AB":
        dtype, cls, phases = SCENARIOS[key]
        model, opt, sched = resume(os.path.join(tmp, key), phases[1][1], dtype, cls, rank, world)
        out[key + "_marker"] = model.marker.tolist()
        train(model, opt, sched, K, K + M, rank, world)
        out[key] = full_params(model)
    model, opt, sched = build(2, torch.float32, torch.optim.AdamW, seed=1)
    before = [p.detach().clone() for p in model.parameters()]
    lr = opt.param_groups[0]["lr"]
    for case in DAMAGED:
        out["bad_" + case] = _refusal(
            lambda c=case: zero_py.load_checkpoint(os.path.join(tmp, "bad_" + c), model, opt))
    other, oopt, _ = build(2, torch.float32, torch.optim.SGD, seed=1)
    out["wrong_class"] = _refusal(lambda: zero_py.load_checkpoint(os.path.join(tmp, "C"),
                                                                  other, oopt))
    torch.manual_seed(0)
    wide = models.TiedGPT(n_layer=3, d_model=48)
    wide.blocks[1].requires_grad_(False)
    wide.register_buffer("marker", torch.randn(5))
    wmodel, wopt = zero_py.initialize(wide, torch.optim.AdamW, stage=2, lr=1e-3)
    out["wrong_shape"] = _refusal(lambda: zero_py.load_checkpoint(os.path.join(tmp, "C"),
                                                                  wmodel, wopt))
    out["unchanged"] = (all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
                        and opt.param_groups[0]["lr"] == lr and opt.optimizer_state_bytes()
                        == opt._masters.nbytes())
    # stages 1-2 read the other ranks' parameter values after the commit: a read failing there
    # on one rank raises on every rank too
    from zero_py.checkpoint import reader

    real = reader.Checkpoint.read_into
    if rank == 1:
        def failing(self, *args, **kwargs):
            raise OSError(5, "injected read error")
        reader.Checkpoint.read_into = failing
    try:
        out["replicas_failed"] = _refusal(
            lambda: zero_py.load_checkpoint(os.path.join(tmp, "C"), model, opt))
    finally:
        reader.Checkpoint.read_into = real
    # a failure the checks do not foresee, on one rank, raises on every rank (it used to leave
    # the others waiting in the agreement)
    from zero_py.checkpoint import load as load_mod
    from zero_py.checkpoint import save as save_mod

    def on_rank_1_failing(module, call):
        real = module.holdings
        if rank == 1:
            def broken(*args, **kwargs):
                raise RuntimeError("injected failure")
            module.holdings = broken
        try:
            return _refusal(call)
        finally:
            module.holdings = real
    out["unforeseen"] = on_rank_1_failing(
        load_mod, lambda: zero_py.load_checkpoint(os.path.join(tmp, "C"), model, opt))
    # and in a save, before anything is written: every rank raises, the path stays absent
    out["unforeseen_save"] = on_rank_1_failing(
        save_mod, lambda: zero_py.save_checkpoint(os.path.join(tmp, "C_unforeseen"), model, opt))
    out["unforeseen_save_absent"] = not os.path.exists(os.path.join(tmp, "C_unforeseen"))
    # the shard dict loaded back (opt.load_state_dict(opt.state_dict()), as a run resumed from
    # torch.save'd shard dicts does), then checkpointed: rank 0 used to count 0 steps for the
    # parameters rank 1 holds whole, so the manifest said they had no state beside the file
    # holding it, and load_checkpoint refused the checkpoint as damaged
    model, opt, sched = build(2, torch.float32, torch.optim.AdamW, seed=2)
    train(model, opt, sched, 0, 1, rank, world)
    opt.load_state_dict(opt.state_dict())
    save(os.path.join(tmp, "reloaded"), model, opt, sched, rank, world)
    model, opt, sched = build(2, torch.float32, torch.optim.AdamW, seed=2)
    train(model, opt, sched, 0, 1, rank, world)
    ref, resumed = opt.state_dict()["state"], []
    out["reloaded"] = _refusal(lambda: resumed.append(resume(
        os.path.join(tmp, "reloaded"), 2, torch.float32, torch.optim.AdamW, rank, world)[1]))
    got = resumed[0].state_dict()["state"] if resumed else {}
    out["reloaded_equal"] = sorted(got) == sorted(ref) and all(
        torch.equal(got[i][k], ref[i][k]) for i in ref for k in ref[i])
    # a rank that cannot write its file (here: the same relative path from another working
    # directory per rank, so rank 0's directory is not where rank 1 looks; a file system it
    # does not share with rank 0 alike) raised alone and left the others waiting: every rank
    # raises, nothing is published, the next save works. (Paths given differently are
    # refused before anything is written: tests/test_rank_agreement.py)
    here = os.getcwd()
    os.makedirs(os.path.join(tmp, f"cwd{rank}"), exist_ok=True)
    os.chdir(os.path.join(tmp, f"cwd{rank}"))
    try:
        out["other_paths"] = _refusal(lambda: zero_py.save_checkpoint("C", model, opt))
    finally:
        os.chdir(here)
    out["other_paths_absent"] = not any(os.path.exists(os.path.join(tmp, f"cwd{r}", "C"))
                                        for r in range(world))
    zero_py.save_checkpoint(os.path.join(tmp, "C_after_refusal"), model, opt)
    return out


def run_second_3(rank, world, tmp):
    """At 3 ranks: phase 2 of C; phase 2 of D, which saves again."""
    out = {}
    dtype, cls, phases = SCENARIOS["C"]
    model, opt, sched = resume(os.path.join(tmp, "C"), phases[1][1], dtype, cls, rank, world)
    train(model, opt, sched, K, K + M, rank, world)
    out["C"] = full_params(model)
    dtype, cls, phases = SCENARIOS["D"]
    model, opt, sched = resume(os.path.join(tmp, "D"), phases[1][1], dtype, cls, rank, world)
    train(model, opt, sched, K, K + M, rank, world)
    save(os.path.join(tmp, "D2"), model, opt, sched, rank, world)
    dtype, cls, phases = SCENARIOS["E"]
    model, opt, sched = resume(os.path.join(tmp, "E"), phases[1][1], dtype, cls, rank, world,
                               nvme_dir=os.path.join(tmp, "nvme"))
    train(model, opt, sched, K, K + M, rank, world)
    out["E"] = full_params(model)
    return out


def run_third_1(rank, world, tmp):
    """At 1 rank: phase 3 of D, and D's reference (2 K + M... steps without a stop)."""
    dtype, cls, phases = SCENARIOS["D"]
    model, opt, sched = build(phases[2][1], dtype, cls, seed=1)
    extra = zero_py.load_checkpoint(os.path.join(tmp, "D2"), model, opt)
    sched.load_state_dict(extra["sched"])
    assert extra["rank"] == 0 and extra["world"] == 3
    train(model, opt, sched, K + M, K + 2 * M, rank, world)
    ref, ropt, rsched = build(phases[2][1], dtype, cls, seed=0)
    train(ref, ropt, rsched, 0, K + 2 * M, rank, world)
    with torch.no_grad():
        ref.marker.copy_(torch.arange(5.0))  # as the first run set it before saving
    out = {"D": full_params(model), "D_ref": full_params(ref)}
    # Adagrad (whose state starts at initial_accumulator_value) with a branch unused before
    # the save: that parameter has no state in the checkpoint and must start fresh after it
    # (and the same with the optimizer on NVMe: the load writes that initial value into the
    # offload records)
    finals = []
    os.makedirs(os.path.join(tmp, "nvme1"), exist_ok=True)
    for resume_at, offload in ((None, {}), (K, {}),
                               (K, {"offload_optimizer": "nvme",
                                    "offload_dir": os.path.join(tmp, "nvme1")})):
        torch.manual_seed(0)
        net = models.Branchy()
        net, nopt = zero_py.initialize(net, torch.optim.Adagrad, stage=2, lr=0.05,
                                       initial_accumulator_value=0.3, **offload)
        for t in range(2 * K):
            if t == resume_at:
                zero_py.save_checkpoint(os.path.join(tmp, "ada"), net, nopt)
                torch.manual_seed(1)
                net, nopt = zero_py.initialize(models.Branchy(), torch.optim.Adagrad, stage=2,
                                               lr=0.05, initial_accumulator_value=0.3,
                                               **offload)
                zero_py.load_checkpoint(os.path.join(tmp, "ada"), net, nopt)
            x, y = models.mlp_batch(torch.Generator().manual_seed(t), d_out=8)
            loss = torch.nn.functional.mse_loss(net(x, use_branch=t >= K), y)
            loss.backward()
            nopt.step()
            nopt.zero_grad()
        finals.append(full_params(net))
    out["ada"], out["ada_ref"], out["ada_nvme"] = finals[1], finals[0], finals[2]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("ckpt"))
    first = distributed.run(run_first, 2, tmp)[0]
    make_damaged(tmp)
    second = distributed.run(run_second_2, 2, tmp)
    third = distributed.run(run_second_3, 3, tmp)[0]
    fourth = distributed.run(run_third_1, 1, tmp)[0]
    return {"tmp": tmp, "first": first, "second": second, "third": third, "fourth": fourth}


def _worst(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(models.max_rel_diff(a[k], b[k]) for k in a)


@pytest.mark.parametrize("key", ["A", "B"])
def test_resume_at_another_stage_matches_the_uninterrupted_run_exactly(runs, key):
    assert _worst(runs["second"][0][key], runs["first"][key]) == 0.0
    assert runs["second"][0][key + "_marker"] == [0.0, 1.0, 2.0, 3.0, 4.0]  # the buffer


def test_resume_at_another_world_size(runs):
    assert _worst(runs["third"]["C"], runs["first"]["C"]) < 1e-5


def test_resume_under_nvme_offload_at_another_world_size_and_stage(runs):
    assert _worst(runs["third"]["E"], runs["first"]["E"]) < 1e-5


def test_resume_two_ranks_to_three_to_one_on_the_generic_path(runs):
    assert _worst(runs["fourth"]["D"], runs["fourth"]["D_ref"]) < 1e-5


def test_state_of_a_parameter_unused_before_the_save_starts_fresh(runs):
    assert _worst(runs["fourth"]["ada"], runs["fourth"]["ada_ref"]) == 0.0
    assert _worst(runs["fourth"]["ada_nvme"], runs["fourth"]["ada_ref"]) == 0.0


def test_keep_last_rotation(runs):
    assert runs["first"]["rot"] == ["step_3", "step_4"]


def test_keep_last_that_cannot_remove_an_old_checkpoint_says_so_and_keeps_the_new_one(runs):
    """It used to raise "save_checkpoint failed, the previous checkpoint is kept" after the new
    one was published; and a run restarted from scratch (smaller steps) had the checkpoint it
    had just written deleted as the oldest, with save_checkpoint returning its path."""
    first = runs["first"]
    step_1 = os.path.join(runs["tmp"], "rot_fail", "step_1")
    msg = first["rot_errors"][0]
    assert first["rot_errors"][1] == msg  # every rank raises the same
    assert msg is not None and "the checkpoint is saved, whole" in msg, msg
    assert f"could not remove 1 older checkpoint(s): {step_1} (Permission denied" in msg, msg
    assert "previous checkpoint is kept" not in msg, msg
    # the manifest goes last: what is left is a checkpoint the next rotation takes
    assert first["rot_left"] == {
        "step_1": ["manifest.json", "rank00001.safetensors"],
        "step_3": ["manifest.json", "rank00000.safetensors", "rank00001.safetensors"]}
    assert first["rot_loaded"]
    assert first["rot_after"] == ["step_4"]
    assert first["restart"] == ["step_1", "step_9"]


@pytest.mark.parametrize("case", sorted(DAMAGED))
def test_damaged_checkpoint_is_refused_on_every_rank(runs, case):
    for rank_out in runs["second"]:
        msg = rank_out["bad_" + case]
        assert msg is not None, f"rank loaded a checkpoint with: {DAMAGED[case][0]}"
        assert DAMAGED[case][1] in msg, msg


def test_a_checkpoint_saved_after_loading_the_shard_dict_loads(runs):
    for rank_out in runs["second"]:
        assert rank_out["reloaded"] is None, rank_out["reloaded"]
        assert rank_out["reloaded_equal"]


def test_mismatched_model_or_optimizer_is_refused_and_nothing_changes(runs):
    for rank_out in runs["second"]:
        assert "SGD" in rank_out["wrong_class"] and "AdamW" in rank_out["wrong_class"]
        assert "shape" in rank_out["wrong_shape"], rank_out["wrong_shape"]
        assert rank_out["unchanged"]


def test_a_failed_read_of_the_other_ranks_parameters_raises_on_every_rank(runs):
    for rank_out in runs["second"]:
        msg = rank_out["replicas_failed"]
        assert msg is not None and "rank 1" in msg and "injected read error" in msg, msg
        assert "other ranks' parameter values" in msg and "load the checkpoint again" in msg


def test_an_unforeseen_failure_of_one_rank_in_a_load_raises_on_every_rank(runs):
    for rank_out in runs["second"]:
        msg = rank_out["unforeseen"]
        assert msg is not None and "rank 1: RuntimeError: injected failure" in msg, msg
        msg = rank_out["unforeseen_save"]
        assert msg is not None and "RuntimeError: injected failure" in msg, msg
        assert "rank 1" in msg and rank_out["unforeseen_save_absent"]


def test_a_rank_that_cannot_write_its_file_raises_on_every_rank(runs):
    for rank_out in runs["second"]:
        msg = rank_out["other_paths"]
        assert msg is not None and "rank 1 could not write rank00001.safetensors" in msg, msg
        assert "every rank must pass the same path" in msg, msg
        assert rank_out["other_paths_absent"]


def test_async_save_writes_the_state_of_its_call(runs):
    """The same bytes as the synchronous save of the same step, though training went on."""
    from safetensors.torch import load_file

    tmp = runs["tmp"]
    assert runs["first"]["async_path"] == os.path.join(tmp, "C_async")
    for r in range(2):
        name = f"rank0000{r}.safetensors"
        a = load_file(os.path.join(tmp, "C_async", name))
        b = load_file(os.path.join(tmp, "C_more", name))
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a)
    Checkpoint.open(os.path.join(tmp, "C_async")).verify()


def test_files_are_safetensors_and_loading_needs_no_pickle(runs):
    from safetensors.torch import load_file

    path = os.path.join(runs["tmp"], "C")
    tensors = load_file(os.path.join(path, "rank00001.safetensors"))
    assert any(k.startswith("state/exp_avg/") for k in tensors)
    with open(os.path.join(path, "manifest.json")) as f:
        man = json.load(f)
    assert man["world_size"] == 2 and man["stage"] == 2 and man["step"] == K
    ck = Checkpoint.open(path)
    ck.verify()


# -- a rank that dies in the middle of a save ------------------------------------------------------


def _killed_worker(rank, world, store, tmp):
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=10))
    torch.set_num_threads(1)
    model, opt, sched = build(2, torch.float32, torch.optim.AdamW, seed=0)
    train(model, opt, sched, 0, 1, rank, world)
    path = os.path.join(tmp, "ck")
    save(path, model, opt, sched, rank, world)
    train(model, opt, sched, 1, 2, rank, world)
    if rank == 1:
        import zero_py.checkpoint.save as save_mod

        def dies_half_way(fpath, tensors, meta):
            with open(fpath, "wb") as f:
                f.write(b"\0" * 1000)
            os._exit(9)

        save_mod.write_tensor_file = dies_half_way
    t0 = time.monotonic()
    try:
        save(path, model, opt, sched, rank, world)
        result = {"raised": None}
    except Exception as exc:  # noqa: BLE001 - what the survivor raises is the result
        result = {"raised": f"{type(exc).__name__}: {exc}"}
    result["seconds"] = time.monotonic() - t0
    with open(os.path.join(tmp, f"result{rank}.json"), "w") as f:
        json.dump(result, f)
    os._exit(0)


def test_a_rank_killed_mid_save_leaves_the_previous_checkpoint(tmp_path):
    tmp = str(tmp_path)
    ctx = mp.start_processes(_killed_worker, args=(2, os.path.join(tmp, "store"), tmp),
                             nprocs=2, join=False, start_method="spawn")
    deadline = time.monotonic() + 120
    for p in ctx.processes:
        p.join(max(1.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            pytest.fail("a rank still runs 120 s after the other died: a hang")
    with open(os.path.join(tmp, "result0.json")) as f:
        result = json.load(f)
    assert result["raised"], "the survivor returned from save_checkpoint as if it had saved"
    assert result["seconds"] < 10 + 5, result
    ck = Checkpoint.open(os.path.join(tmp, "ck"))
    ck.verify()
    assert ck.manifest["step"] == 1  # the previous checkpoint, whole
    assert sorted(os.listdir(os.path.join(tmp, "ck"))) == [
        "manifest.json", "rank00000.safetensors", "rank00001.safetensors"]
    # the survivor (rank 0, which made the temporary directory) removed it as it raised: the
    # partial save used to stay beside the checkpoint, rank files and all, until a save of the
    # same name came again
    left = [n for n in os.listdir(tmp) if n.startswith(".ck.tmp-")]
    assert not left, f"the failed save left {left} behind"


# -- consolidation and inspection, in one process without torch.distributed --------------------


def test_consolidate_gives_the_full_model(runs, tmp_path):
    from safetensors.torch import load_file

    out = str(tmp_path / "model.safetensors")
    subprocess.run([sys.executable, "-m", "zero_py", "consolidate",
                    os.path.join(runs["tmp"], "C_more"), out], check=True)
    full = load_file(out)
    ref = runs["first"]["C"]  # C_more was saved right after the reference's last step
    model = models.TiedGPT(n_layer=3)
    model.register_buffer("marker", torch.randn(5))
    model.load_state_dict(full)  # what torch accepts: every key, tied ones included
    for k, v in ref.items():
        assert torch.equal(full[k].float(), v), k
    assert torch.equal(full["marker"], torch.arange(5.0))


def test_consolidate_bf16_and_optimizer_state(runs, tmp_path):
    from safetensors.torch import load_file

    out = str(tmp_path / "model.safetensors")
    optim_out = str(tmp_path / "optim.safetensors")
    from zero_py.__main__ import main  # in this process (the test above runs the module)

    assert main(["consolidate", "--dtype", "bfloat16", "--optimizer", optim_out,
                 os.path.join(runs["tmp"], "C_more"), out]) == 0
    full = load_file(out)
    assert all(v.dtype == torch.bfloat16 for k, v in full.items() if k != "marker")
    optim = torch_optimizer_state(optim_out)
    ref = runs["first"]["C_optim"]  # consolidate_state_dict() right after C_more was saved
    assert optim["state"].keys() == ref["state"].keys() and optim["state"]
    for i, st in ref["state"].items():
        for key, value in st.items():
            got = optim["state"][i][key]
            assert torch.equal(torch.as_tensor(got).float(), value.float()), (i, key)
    assert [g["params"] for g in optim["param_groups"]] == \
        [g["params"] for g in ref["param_groups"]]
    assert optim["param_groups"][0]["lr"] == ref["param_groups"][0]["lr"]
    # torch.optim takes it
    model = models.TiedGPT(n_layer=3)
    model.blocks[1].requires_grad_(False)
    torch.optim.AdamW(model.parameters(), lr=1.0).load_state_dict(optim)


def test_inspect_prints_the_manifest(runs, capsys):
    from zero_py.__main__ import main  # `python -m zero_py inspect`, in this process

    assert main(["inspect", os.path.join(runs["tmp"], "C")]) == 0
    out = capsys.readouterr().out
    assert "step" in out and "world size" in out and "OK" in out
    assert main(["inspect", os.path.join(runs["tmp"], "bad_flipped_byte")]) != 0
    bad = capsys.readouterr()
    assert "CRC-32C" in (bad.out + bad.err)
    # a clear error, not a traceback
    assert main(["inspect", os.path.join(runs["tmp"], "bad_edited")]) != 0
    edited = capsys.readouterr().err
    assert "lacks 'files'" in edited and "Traceback" not in edited, edited


def test_inspect_and_consolidate_refuse_a_manifest_that_does_not_describe_its_files(
        runs, tmp_path, capsys):
    """A manifest whose layout disagrees with its files (a shape the pieces do not cover, an
    empty piece, a piece on a rank without a file, another dtype) used to pass `inspect` as
    "OK" (and make consolidate fail with a KeyError traceback or write a wrong tensor):
    refused as load_checkpoint refuses it, each problem by file and field."""
    from zero_py.__main__ import main

    for case in [*LAYOUT_EDITS, *(c for c in HOSTILE if c not in LOAD_ONLY)]:
        path = os.path.join(runs["tmp"], "bad_" + case)
        assert main(["inspect", path]) == 1, case
        out, err = capsys.readouterr()
        assert " OK" not in out and DAMAGED[case][1] in err and path in err, (case, err)
        assert main(["consolidate", path, str(tmp_path / "out.safetensors")]) == 1, case
        out, err = capsys.readouterr()
        assert DAMAGED[case][1] in err, (case, err)
        assert not (tmp_path / "out.safetensors").exists()


def _crc32c_reference(data: bytes) -> int:
    """Bit by bit, from the definition (reflected polynomial 0x82F63B78)."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc ^= byte
        for _ in range(8):
            crc = (crc >> 1) ^ (0x82F63B78 if crc & 1 else 0)
    return crc ^ 0xFFFFFFFF


def test_crc32c_matches_its_definition():
    from zero_py._native import _C

    gen = torch.Generator().manual_seed(3)
    data = bytes(torch.randint(0, 256, (3000,), generator=gen, dtype=torch.uint8).tolist())
    assert _C.crc32c(b"123456789") == 0xE3069283
    for lo, hi in ((0, 3000), (1, 2999), (7, 100), (5, 5)):
        assert _C.crc32c(data[lo:hi]) == _crc32c_reference(data[lo:hi])
    assert _C.crc32c(data[1000:], _C.crc32c(data[:1000])) == _C.crc32c(data)
    with pytest.raises(ValueError, match="32-bit"):
        _C.crc32c(data, 2**32)


def test_a_momentum_switched_on_by_a_scheduler_resumes_exactly(single_rank_group, tmp_path):
    """SGD built with momentum=0 under OneCycleLR (cycle_momentum: the scheduler sets a
    momentum at once, and the first step makes the buffer, as torch.optim's does): a resumed
    run, built the same way, gets the buffer back and continues as the uninterrupted run."""
    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(),
                                    torch.nn.Linear(16, 4))
        opt = zero_py.ZeroOptimizer(model.parameters(), torch.optim.SGD, lr=0.05)
        return model, opt, torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=10)

    gen = torch.Generator().manual_seed(3)
    data = [(torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen))
            for _ in range(8)]

    def train_on(model, opt, sched, batches):
        for x, y in batches:
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            sched.step()

    whole = make()
    train_on(*whole, data)
    first = make()
    train_on(*first, data[:4])
    assert first[1].state[first[0][0].weight]["momentum_buffer"].abs().sum() > 0
    zero_py.save_checkpoint(tmp_path / "ck", first[0], first[1],
                            {"sched": first[2].state_dict()})
    second = make()
    extra = zero_py.load_checkpoint(tmp_path / "ck", second[0], second[1])
    second[2].load_state_dict(extra["sched"])
    train_on(*second, data[4:])
    for a, b in zip(whole[0].parameters(), second[0].parameters()):
        assert torch.equal(a, b)


def test_sgd_parameters_without_a_momentum_buffer_yet_resume_as_torch(single_rank_group,
                                                                        tmp_path):
    """SGD with momentum on the weights' group from the start and off on the biases' until
    after the save: the biases have no momentum buffer (torch.optim holds none), so their
    first step with momentum starts it from the gradient. Resumed through a checkpoint (the
    optimizer's state resident, on NVMe, in host memory) and through the consolidated state
    dict in torch.optim.SGD itself, every run goes on as torch.optim.SGD that never stopped
    (they used to load a zero buffer and dampen the gradient into it)."""
    def groups(model):
        return [{"params": [p for n, p in model.named_parameters() if n.endswith("weight")],
                 "momentum": 0.9},
                {"params": [p for n, p in model.named_parameters() if n.endswith("bias")]}]
    kw = dict(lr=5e-2, momentum=0.0, dampening=0.3)
    torch.manual_seed(0)
    ref = models.MLP()
    ref_opt = torch.optim.SGD(groups(ref), **kw)
    gen = torch.Generator().manual_seed(0)
    batches = [models.mlp_batch(gen) for _ in range(5)]
    runs = []
    (tmp_path / "nvme").mkdir()
    for off in ({}, {"offload_optimizer": "nvme", "offload_dir": str(tmp_path / "nvme")},
                {"offload_optimizer": "cpu"}):
        torch.manual_seed(0)
        model = models.MLP()
        opt = zero_py.ZeroOptimizer(groups(model), torch.optim.SGD, **off, **kw)
        for x, y in batches[:2]:
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        zero_py.save_checkpoint(tmp_path / "ck", model, opt)
        torch.manual_seed(1)
        model = models.MLP()
        opt = zero_py.ZeroOptimizer(groups(model), torch.optim.SGD, **off, **kw)
        zero_py.load_checkpoint(tmp_path / "ck", model, opt)
        runs.append((model, opt))
    torch_model = copy.deepcopy(runs[0][0])
    torch_opt = torch.optim.SGD(groups(torch_model), **kw)
    torch_opt.load_state_dict(runs[0][1].consolidate_state_dict())
    runs.append((torch_model, torch_opt))
    for k, (x, y) in enumerate(batches):
        if k == 2:
            for _, opt in [(ref, ref_opt)] + runs:
                opt.param_groups[1]["momentum"] = 0.9
        for model, opt in [(ref, ref_opt)] + runs if k >= 2 else [(ref, ref_opt)]:
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    for i, (model, _) in enumerate(runs):
        assert max(models.max_rel_diff(a, b) for a, b in zip(model.parameters(),
                                                             ref.parameters())) < 1e-6, i


def test_a_bf16_run_saved_before_its_first_step_resumes(single_rank_group, tmp_path):
    """A save before any step holds the fp32 masters the manifest says it has (it used to
    leave them out, and every load of it failed: "lacks tensor master/..."); resident and on
    NVMe, the resumed run goes on as the one that never stopped."""
    def run(resume, offload):
        torch.manual_seed(0)
        model = models.MLP().bfloat16()
        opt = zero_py.ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, **offload)
        if resume:
            zero_py.save_checkpoint(tmp_path / "ck0", model, opt)
            torch.manual_seed(1)
            model = models.MLP().bfloat16()
            opt = zero_py.ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2,
                                        **offload)
            zero_py.load_checkpoint(tmp_path / "ck0", model, opt)
        gen = torch.Generator().manual_seed(0)
        for _ in range(3):
            x, y = models.mlp_batch(gen)
            torch.nn.functional.mse_loss(model(x.bfloat16()).float(), y).backward()
            opt.step()
            opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()]
    (tmp_path / "nvme").mkdir()
    for offload in ({}, {"offload_optimizer": "nvme", "offload_dir": str(tmp_path / "nvme")}):
        for a, b in zip(run(False, offload), run(True, offload)):
            assert torch.equal(a, b), offload



class _BF16WithFP32Norms(torch.nn.Module):
    """A bf16 model whose BatchNorm (running stats, a 0-d num_batches_tracked) and LayerNorm
    stay fp32: parameters of two dtypes and buffers of two shapes' ranks in one checkpoint."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 32).bfloat16()
        self.bn = torch.nn.BatchNorm1d(32)
        self.ln = torch.nn.LayerNorm(32)
        self.head = torch.nn.Linear(32, 8).bfloat16()

    def forward(self, x):
        h = self.ln(self.bn(self.fc1(x.bfloat16()).float()))
        return self.head(h.bfloat16()).float()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_model_with_batchnorm_and_mixed_dtypes_resumes_exactly(single_rank_group, tmp_path,
                                                                 stage):
    """BatchNorm's num_batches_tracked is a 0-d buffer: every checkpoint of a model with a
    BatchNorm used to be refused at load as damaged ("tensor buffer/bn.num_batches_tracked has
    shape [], where ... places 1 elements"). A bf16 model with fp32 norms, saved mid-run and
    loaded into a fresh one, goes on bitwise as the run that never stopped (buffers included)."""
    def build(seed):
        torch.manual_seed(seed)
        model = _BF16WithFP32Norms()
        if stage == 3:
            return zero_py.initialize(model, torch.optim.AdamW, stage=3, lr=1e-2,
                                      weight_decay=0.1)
        return model, zero_py.ZeroOptimizer(model.parameters(), torch.optim.AdamW, stage=stage,
                                            lr=1e-2, weight_decay=0.1, bucket_bytes=1024)

    def run(resume):
        model, opt = build(0)
        gen = torch.Generator().manual_seed(0)
        for k in range(6):
            if k == 3 and resume:
                zero_py.save_checkpoint(tmp_path / "ck", model, opt)
                model, opt = build(1)
                zero_py.load_checkpoint(tmp_path / "ck", model, opt)
            x, y = models.mlp_batch(gen)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        return {k: v.detach().clone() for k, v in model.state_dict().items()}
    ref, got = run(False), run(True)
    assert got["bn.num_batches_tracked"] == 6 and ref.keys() == got.keys()
    for k in ref:
        assert got[k].dtype == ref[k].dtype and torch.equal(got[k], ref[k]), k



def test_a_checkpoint_loads_into_a_model_of_another_dtype(single_rank_group, tmp_path):
    """A bf16 run's checkpoint loaded into an fp32 model gives it the fp32 masters (not the
    bf16 values); an fp32 run's checkpoint loaded into a bf16 model rounds the parameters to
    nearest even and keeps their fp32 values as the masters. Either way the next step is the
    one the fp32 values give (README: Checkpoints)."""
    def trained(dtype):
        torch.manual_seed(0)
        model = models.MLP().to(dtype)
        opt = zero_py.ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
        x, y = models.mlp_batch(torch.Generator().manual_seed(0))
        torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y).backward()
        opt.step()
        opt.zero_grad()
        return model, opt
    for saved, loaded in ((torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16)):
        model, opt = trained(saved)
        zero_py.save_checkpoint(tmp_path / str(saved), model, opt)
        fp32 = ([opt.consolidate_state_dict()["state"][i]["master_param"]
                 for i in range(len(opt.param_groups[0]["params"]))]
                if saved == torch.bfloat16 else [p.detach().clone() for p in model.parameters()])
        torch.manual_seed(1)
        other = models.MLP().to(loaded)
        oopt = zero_py.ZeroOptimizer(other.parameters(), torch.optim.AdamW, lr=1e-2)
        zero_py.load_checkpoint(tmp_path / str(saved), other, oopt)
        for p, want in zip(other.parameters(), fp32):
            assert p.dtype == loaded and torch.equal(p.detach(), want.to(loaded)), saved
        if loaded == torch.bfloat16:
            masters = oopt.consolidate_state_dict()["state"]
            assert all(torch.equal(masters[i]["master_param"], w) for i, w in enumerate(fp32))


# -- what a save refuses before writing anything, in one process ------------------------------


def _small_run(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    opt = zero_py.ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=0.01)
    torch.nn.functional.mse_loss(model(torch.randn(4, 6)), torch.randn(4, 3)).backward()
    opt.step()
    opt.zero_grad()
    return model, opt


def test_keep_last_removes_what_a_save_whose_rank_0_died_left(single_rank_group, tmp_path):
    """A save whose rank 0 is killed (or SIGTERMed by torchrun) mid-write leaves its temporary
    directory; keep_last's rotation removes those of the checkpoints named like the new one
    (they used to stay until a save of that very name came again), never another family's,
    nor an '.old' one (publish_dir's fallback: it may be the only copy of a checkpoint)."""
    model, opt = _small_run()
    hexes = [uuid.uuid4().hex for _ in range(4)]
    for name in (f".step_00200.tmp-{hexes[0]}", f".step_00300.tmp-{hexes[1]}.old",
                 f".other_00200.tmp-{hexes[2]}", f".step_00400.tmp-{hexes[3]}"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "rank00000.safetensors").write_bytes(os.urandom(64))
    zero_py.save_checkpoint(tmp_path / "step_00100", model, opt, keep_last=2)
    assert sorted(os.listdir(tmp_path)) == [f".other_00200.tmp-{hexes[2]}",
                                            f".step_00300.tmp-{hexes[1]}.old", "step_00100"]


def test_extra_round_trips_plain_data_and_refuses_tensors_it_cannot_store(single_rank_group,
                                                                           tmp_path):
    """Tensors of every stored dtype and layout come back equal; a tensor of a dtype the files
    cannot hold (complex, uint16) or without values (meta) is refused by its path in `extra`
    before anything is written (it used to fail in the file writer, after the temporary
    directory was made: a ValueError left behind, and a hang of the other ranks)."""
    model, opt = _small_run()
    gen = torch.Generator().manual_seed(5)
    grid = torch.randn(3, 4, generator=gen)
    extra = {"t": grid.t(), "bf": torch.randn(5, generator=gen).bfloat16(),
             "zero_d": torch.tensor(1.5, dtype=torch.bfloat16), "empty": torch.empty(0, 3),
             "ints": {1: {2: b"\x00\xff"}, (1, 2): (3, [4.5, None])}, "big": 2 ** 62}
    zero_py.save_checkpoint(tmp_path / "ok", model, opt, extra)
    got = zero_py.load_checkpoint(tmp_path / "ok", model, opt)
    assert got.keys() == extra.keys() and got["ints"] == extra["ints"] and got["big"] == 2 ** 62
    for k in ("t", "bf", "zero_d", "empty"):
        assert got[k].dtype == extra[k].dtype and torch.equal(got[k], extra[k]), k
    # numpy scalars and arrays (np.random.get_state()), torch's RNG states: given back as
    # they were (numpy used to be refused, with a hint to call its state_dict())
    np.random.seed(4)
    rng = {"torch": torch.get_rng_state(), "random": torch.random.get_rng_state(),
           "numpy": np.random.get_state(), "gen": torch.Generator().manual_seed(3).get_state()}
    nums = {"i": np.int64(-3), "u": np.uint8(200), "f": np.float32(1.25), "d": np.float64(0.1),
            "b": np.bool_(True), "a": np.arange(12, dtype=np.float16).reshape(3, 4)[:, ::2],
            "s": np.array(["ab", "c"]), "e": np.zeros((0, 2), dtype=np.int32),
            "nested": [None, True, {"k": (np.int32(7), [])}]}
    zero_py.save_checkpoint(tmp_path / "numpy", model, opt, {"rng": rng, "nums": nums})
    got = zero_py.load_checkpoint(tmp_path / "numpy", model, opt)
    for k in ("torch", "random", "gen"):
        assert got["rng"][k].dtype == torch.uint8 and torch.equal(got["rng"][k], rng[k]), k
    assert got["rng"]["numpy"][0] == "MT19937" and got["rng"]["numpy"][2:] == rng["numpy"][2:]
    assert got["rng"]["numpy"][1].dtype == np.uint32
    assert np.array_equal(got["rng"]["numpy"][1], rng["numpy"][1])
    ahead = np.random.rand(3)
    np.random.set_state(got["rng"]["numpy"])
    assert np.array_equal(np.random.rand(3), ahead)
    for k, v in nums.items():
        if k == "nested":
            assert got["nums"][k] == v and type(got["nums"][k][2]["k"][0]) is np.int32
            continue
        assert type(got["nums"][k]) is type(v), k
        assert (np.array_equal(got["nums"][k], v) and got["nums"][k].dtype == v.dtype
                if isinstance(v, np.ndarray) else got["nums"][k] == v), k
    before = sorted(os.listdir(tmp_path))
    for bad, what in ((torch.zeros(2, dtype=torch.complex64), "complex64"),
                      (torch.zeros(2, dtype=torch.uint16), "uint16"),
                      (torch.empty(3, device="meta"), "meta device"),
                      (np.array([object()]), "dtype object"),
                      # the message lists what is stored, numpy included (it used to omit it)
                      (len, "not plain data.*tensors and numpy scalars and arrays")):
        with pytest.raises(zero_py.CheckpointError, match=rf"extra\['x'\]\[1\].*{what}"):
            zero_py.save_checkpoint(tmp_path / "bad", model, opt, {"x": [0, bad]})
        assert sorted(os.listdir(tmp_path)) == before  # no temporary directory left


def test_a_save_replaces_only_a_checkpoint_or_an_empty_directory(single_rank_group, tmp_path):
    """Publishing swaps out what is at the path and deletes it: a file, a link or a directory
    of the user's there is refused, untouched (it used to be deleted without a word)."""
    model, opt = _small_run()
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "outputs").mkdir()
    (tmp_path / "outputs" / "log.txt").write_text("mine too")
    (tmp_path / "target").mkdir()
    os.symlink(tmp_path / "target", tmp_path / "latest")
    for name in ("notes.txt", "outputs", "latest"):
        with pytest.raises(zero_py.CheckpointError, match="remove it or save elsewhere"):
            zero_py.save_checkpoint(tmp_path / name, model, opt)
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert (tmp_path / "outputs" / "log.txt").read_text() == "mine too"
    assert os.readlink(tmp_path / "latest") == str(tmp_path / "target")
    assert sorted(os.listdir(tmp_path)) == ["latest", "notes.txt", "outputs", "target"]
    # a directory whose manifest.json is a FIFO is not a checkpoint either (the save used to
    # wait forever opening it, here and in keep_last's scan of the other checkpoints)
    (tmp_path / "piped").mkdir()
    os.mkfifo(tmp_path / "piped" / "manifest.json")
    outcome = []

    def piped():
        try:
            zero_py.save_checkpoint(tmp_path / "piped", model, opt)
        except zero_py.CheckpointError as exc:
            outcome.append(str(exc))
    saving = threading.Thread(target=piped, daemon=True)
    saving.start()
    saving.join(20)
    waited = saving.is_alive()
    if waited:  # release the open that waits for a writer, then fail
        os.close(os.open(tmp_path / "piped" / "manifest.json", os.O_WRONLY | os.O_NONBLOCK))
        saving.join(20)
    assert not waited, "the save waited on the FIFO"
    assert outcome and "remove it or save elsewhere" in outcome[0], outcome
    os.remove(tmp_path / "piped" / "manifest.json")
    os.rmdir(tmp_path / "piped")
    # an empty directory, then the checkpoint now there, are replaced
    zero_py.save_checkpoint(tmp_path / "target", model, opt, {"n": 1})
    zero_py.save_checkpoint(tmp_path / "target", model, opt, {"n": 2})
    assert zero_py.load_checkpoint(tmp_path / "target", model, opt) == {"n": 2}
    # a directory of the user's whose manifest.json links to a checkpoint's is not one: it was
    # replaced, and its files deleted with it
    (tmp_path / "linked").mkdir()
    (tmp_path / "linked" / "notes.txt").write_text("mine")
    os.symlink(tmp_path / "target" / "manifest.json", tmp_path / "linked" / "manifest.json")
    with pytest.raises(zero_py.CheckpointError, match="remove it or save elsewhere"):
        zero_py.save_checkpoint(tmp_path / "linked", model, opt)
    assert (tmp_path / "linked" / "notes.txt").read_text() == "mine"


def _tiny_run(seed):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    opt = zero_py.ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2)
    return model, opt


def _small_step(model, opt, seed):
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(16, 8, generator=gen), torch.randn(16, 4, generator=gen)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()


def _different_saves(rank, world, tmp):
    model, opt = _tiny_run(0)
    for step, name in enumerate(("a", "b")):
        _small_step(model, opt, step)
        zero_py.save_checkpoint(os.path.join(tmp, name), model, opt)
    before = [p.detach().clone() for p in model.parameters()]
    try:  # rank 0 is given one save, rank 1 the other
        zero_py.load_checkpoint(os.path.join(tmp, "ab"[rank]), model, opt)
        error = None
    except zero_py.CheckpointError as exc:
        error = str(exc)
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    return error, unchanged


def test_ranks_that_read_different_saves_are_refused_on_every_rank(tmp_path):
    """A save published to the path while the ranks open it (or different paths) would load
    different states on different ranks: refused on every rank, nothing changed."""
    for error, unchanged in distributed.run(_different_saves, 2, str(tmp_path)):
        assert error is not None and "read different saves" in error, error
        assert unchanged


def test_an_open_checkpoint_reads_its_own_save_when_the_path_is_replaced(single_rank_group,
                                                                         tmp_path):
    """The files of an open checkpoint are read through the directory it opened: a save
    published to the same path meanwhile never mixes in (its bytes are those of the save
    opened, or the read fails once that save's files are deleted). Without the directory's
    descriptor the second read below would open the new save's file by name."""
    path = tmp_path / "ck"
    model, opt = _tiny_run(0)
    _small_step(model, opt, 0)
    zero_py.save_checkpoint(path, model, opt)
    old = {n: p.detach().clone() for n, p in model.named_parameters()}
    ck = Checkpoint.open(path)
    try:
        out = torch.empty(old["0.weight"].numel())
        ck.read_into("param", "0.weight", 0, out.numel(), out)  # opens the rank file
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)  # the next save holds other values
        zero_py.save_checkpoint(path, model, opt)
        out.zero_()
        ck.read_into("param", "0.weight", 0, out.numel(), out)  # the file opened: the old save
        assert torch.equal(out, old["0.weight"].flatten())
        from zero_py.checkpoint.files import wait_for_removals
        wait_for_removals()  # the old directory is deleted: its files are gone
        for f in ck._raws.values():  # opened before: read anew below
            f.close()
        ck._raws.clear()
        with pytest.raises((zero_py.CheckpointError, OSError)):
            ck.read_into("param", "0.weight", 0, out.numel(), out)
    finally:
        ck.close()
