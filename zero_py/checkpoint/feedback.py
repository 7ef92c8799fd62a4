"""The error-feedback residuals of grad_error_feedback in a checkpoint (collectives/quantized.py:
what rounding a rank's gradient contributions lost, owed to the next reduction of each bucket).

A residual is this rank's, per bucket, in the layout of the run that made it: one fp32 slot per
peer of the bucket's piece. A save puts each bucket's residual in the rank file as
`feedback/<bucket>` and records the buckets and a digest of what gives them their meaning
(world size, stage, each bucket's parameters and piece size) under the
file's "feedback" entry of the manifest. A load into a run with the same digest (the same
world size, stage and layout) gives every rank its residuals back, so training continues as
the uninterrupted run; any other load starts them at zero, as a run that never had any. A load
always drops the residuals the optimizer had before: they belong to another trajectory.
"""

from __future__ import annotations

import hashlib
import json
from typing import Dict, List, Optional, Tuple

import torch

_PREFIX = "feedback/"


def digest(opt) -> str:
    """What a residual's meaning depends on, hashed."""
    flat = opt._flat
    layout = [opt.executor.world_size, opt.stage,
              [[list(flat.bucket_params[b]), int(flat.bucket_shard_numel[b])]
               for b in range(flat.n_buckets)]]
    return hashlib.sha256(json.dumps(layout).encode()).hexdigest()[:32]


def payload(opt) -> Tuple[List[Tuple[str, torch.Tensor]], Optional[dict]]:
    """This rank's residuals as rank-file tensors, and the manifest's record of them (None
    without error feedback)."""
    reducer = opt._reducer
    if not reducer.error_feedback:
        return [], None
    residuals = reducer.residuals()
    buckets = sorted(residuals)
    return ([(f"{_PREFIX}{b}", residuals[b].detach()) for b in buckets],
            {"buckets": buckets, "digest": digest(opt)})


def stage(ck, opt, rank: int) -> Dict[int, torch.Tensor]:
    """The residuals this rank gets back from checkpoint `ck` (read now, installed by
    install()): its own, when the checkpoint was saved with error feedback by a run of the
    same world size, stage and layout; else none."""
    from zero_py.checkpoint.reader import rank_file

    if not opt._reducer.error_feedback or ck.manifest["world_size"] != opt.executor.world_size:
        return {}
    record = ck.manifest["files"][rank_file(rank)].get("feedback")
    if not record or record.get("digest") != digest(opt):
        return {}
    return {int(b): ck.tensor(rank, f"{_PREFIX}{b}").to(opt._flat.device)
            for b in record["buckets"]}


def install(opt, residuals: Dict[int, torch.Tensor]) -> None:
    opt._reducer.set_residuals(residuals)
