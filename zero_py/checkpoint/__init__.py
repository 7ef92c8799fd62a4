"""Checkpoints: save_checkpoint / load_checkpoint (any world size, any stage), and the
readers behind `python -m zero_py consolidate` and `inspect`. Format: docs/checkpoint.md.

Under offload_optimizer="nvme" both copy the rank's masters and states between the offload file
and the checkpoint's files a few records at a time (offloaded.py), never holding the shard in
memory."""

from zero_py.checkpoint.load import load_checkpoint
from zero_py.checkpoint.reader import CheckpointError
from zero_py.checkpoint.save import AsyncSave, save_checkpoint

__all__ = ["save_checkpoint", "load_checkpoint", "CheckpointError", "AsyncSave"]
