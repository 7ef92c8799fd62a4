"""Checkpoints: save_checkpoint / load_checkpoint (any world size, any stage), and the
readers behind `python -m zero_py consolidate` and `inspect`. Format: docs/checkpoint.md.

Under offload_optimizer="nvme" and offload_params="nvme" both copy the rank's masters, states
and stage-3 parameter pieces between the offload files and the checkpoint's files a few records
at a time (offloaded.py), never holding the shard in memory. overlap_step's early updates not
taken by a step are put back first (discard_early_updates())."""

import functools

from zero_py.checkpoint import load as _load
from zero_py.checkpoint import save as _save
from zero_py.checkpoint.reader import CheckpointError, optimizer_of
from zero_py.checkpoint.save import AsyncSave


def _settled(fn):
    @functools.wraps(fn)
    def call(path, model, optimizer, *args, **kwargs):
        optimizer_of(model, optimizer).discard_early_updates()
        return fn(path, model, optimizer, *args, **kwargs)
    return call


save_checkpoint = _settled(_save.save_checkpoint)
load_checkpoint = _settled(_load.load_checkpoint)

__all__ = ["save_checkpoint", "load_checkpoint", "CheckpointError", "AsyncSave"]
