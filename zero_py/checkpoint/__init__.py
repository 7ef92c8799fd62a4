"""Checkpoints: save_checkpoint / load_checkpoint (any world size, any stage), and the
readers behind `python -m zero_py consolidate` and `inspect`. Format: docs/checkpoint.md.

Both run with the optimizer resident (ZeroOptimizer.resident(): a no-op, except that under
offload_optimizer="nvme" the shard's masters and states are read from the offload file for the
call and written back after it)."""

import functools

from zero_py.checkpoint import load as _load
from zero_py.checkpoint import save as _save
from zero_py.checkpoint.reader import CheckpointError, optimizer_of
from zero_py.checkpoint.save import AsyncSave

__all__ = ["save_checkpoint", "load_checkpoint", "CheckpointError", "AsyncSave"]


def _resident(fn):
    @functools.wraps(fn)
    def call(path, model, optimizer, *args, **kwargs):
        with optimizer_of(model, optimizer).resident():
            return fn(path, model, optimizer, *args, **kwargs)
    return call


save_checkpoint = _resident(_save.save_checkpoint)
load_checkpoint = _resident(_load.load_checkpoint)
