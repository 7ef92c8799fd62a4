"""Checkpoints: save_checkpoint / load_checkpoint (any world size, any stage), and the
readers behind `python -m zero_py consolidate` and `inspect`. Format: docs/checkpoint.md.

Under offload_optimizer="nvme" both copy the rank's masters and states between the offload file
and the checkpoint's files a few records at a time (offloaded.py), never holding the shard in
memory. Under offload_params="nvme" the stage-3 parameter shards are resident for the call, and
overlap_step's early updates not taken by a step are put back first (params_resident())."""

import functools

from zero_py.checkpoint import load as _load
from zero_py.checkpoint import save as _save
from zero_py.checkpoint.reader import CheckpointError, optimizer_of
from zero_py.checkpoint.save import AsyncSave


def _params_resident(fn):
    @functools.wraps(fn)
    def call(path, model, optimizer, *args, **kwargs):
        with optimizer_of(model, optimizer).params_resident():
            return fn(path, model, optimizer, *args, **kwargs)
    return call


save_checkpoint = _params_resident(_save.save_checkpoint)
load_checkpoint = _params_resident(_load.load_checkpoint)

__all__ = ["save_checkpoint", "load_checkpoint", "CheckpointError", "AsyncSave"]
