"""The manifest of a save (manifest.json): what rank 0 reads from the optimizer before the
files are written (manifest_base), completed with what every rank reported of its file
(complete_manifest). The format is described in docs/checkpoint.md."""

from __future__ import annotations

import datetime
from typing import Dict, List

import torch

from zero_py.checkpoint import plain
from zero_py.checkpoint.holdings import Held, persistent_buffers
from zero_py.checkpoint.reader import FORMAT, VERSION, CheckpointError, rank_file
from zero_py.config import attached_schedule


def manifest_base(model, opt, held: Dict[str, Held], save_id: str) -> dict:
    """Everything of the manifest but what the rank files report, read from the optimizer
    now (an asynchronous save finishes while training goes on)."""
    fp = opt._flat
    names = {id(p): n for n, p in model.named_parameters()}
    params: Dict[str, dict] = {}
    for name, h in held.items():
        entry = {"shape": list(h.shape), "dtype": plain.dtype_name(h.dtype),
                 "requires_grad": h.requires_grad, "trainable": h.index is not None,
                 "pieces": []}
        if h.order is not None and not h.order.row_major:
            entry["dim_order"] = list(h.order.dim_order)  # pieces count in this order
        if h.index is not None:
            entry["step"] = opt._step_count[h.index]
            entry["master"] = opt._masters.dtype_of[fp.param_bucket[h.index]] is not None
        params[name] = entry
    groups = []
    for g in opt.param_groups:
        hyper = {k: plain.encode(v, None, f"param group option {k!r}")
                 for k, v in g.items() if k != "params"}
        groups.append({"params": [names[id(p)] for p in g["params"] if id(p) in names], **hyper})
    buffers = {name: {"shape": list(b.shape), "dtype": plain.dtype_name(b.dtype)}
               for name, b in persistent_buffers(model).items()}
    aliases = {n: names[id(p)] for n, p in model.named_parameters(remove_duplicate=False)
               if n != names[id(p)]}  # tied parameters under their other names
    steps = [e["step"] for e in params.values() if "step" in e]
    cls = opt.optimizer_class
    return {
        "format": FORMAT, "version": VERSION, "save_id": save_id,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "step": max(steps, default=0), "world_size": opt.executor.world_size,
        "stage": opt.stage,
        "optimizer": {"class": f"{cls.__module__}.{cls.__qualname__}",
                      "fused": opt.uses_fused_kernel, "param_groups": groups,
                      "rounding_steps": opt._sr_seed - opt._rounding_seed_base(),
                      "skipped_steps": opt.skipped_steps},
        "loss_scaler": None if opt.loss_scaler is None else
        plain.encode(opt.loss_scaler.state_dict(), None, "loss scaler state"),
        # a DeepSpeed config's scheduler (optimizer.lr_scheduler), as DeepSpeed checkpoints it
        "lr_scheduler": plain.encode(attached_schedule.state_of(opt), None,
                                     "lr scheduler state"),
        "params": params, "aliases": aliases, "buffers": buffers,
        "versions": {"torch": torch.__version__},
    }


def complete_manifest(manifest: dict, records: List[dict]) -> dict:
    """The manifest with what every rank reported: its pieces, states, file size and CRC."""
    params = manifest["params"]
    for r, rec in enumerate(records):
        for name, (lo, hi) in rec["pieces"].items():
            params[name]["pieces"].append([r, lo, hi])
        for name, st in rec["states"].items():
            params[name].setdefault("state", st)
    for name, entry in params.items():
        entry["pieces"].sort(key=lambda x: x[1])
        if entry.get("step") and "state" not in entry:
            raise CheckpointError(f"no rank reported the optimizer state of {name}")
    manifest["files"] = {rank_file(r): {"rank": r, "bytes": rec["bytes"],
                                        "crc32c": rec["crc32c"],
                                        "extra": rec["extra"] is not None,
                                        **({"feedback": rec["feedback"]}
                                           if rec.get("feedback") else {})}
                         for r, rec in enumerate(records)}
    return manifest
