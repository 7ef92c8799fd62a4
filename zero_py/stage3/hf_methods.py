"""The methods of a Hugging Face model that stage 3 replaces on the model (zero_py.initialize):
generate() with synced_gpus=True where the ranks' no_grad forwards gather collectively, and
num_parameters() counting the full parameters rather than this rank's shard slices."""

from __future__ import annotations

import inspect

import torch.nn as nn

from zero_py.sharding.between_uses import full_numel


def takes_synced_gpus(model: nn.Module) -> bool:
    """Whether the model's class has a generate() with transformers' synced_gpus keyword."""
    generate = getattr(type(model), "generate", None)
    if not callable(generate):
        return False
    try:
        return "synced_gpus" in inspect.signature(generate).parameters
    except (TypeError, ValueError):
        return False


class _SyncedGenerate:
    """model.generate under stage 3 with several ranks whose no_grad forwards gather
    collectively (across hosts, CUDA, ZP_SHM=0): synced_gpus=True unless the caller passes it.
    Every forward gathers parameters collectively, so a rank that has finished generating must
    keep running forwards until all have: transformers turns this on by itself only for
    DeepSpeed and FSDP. A class, not a closure, so that torch.save(model) pickles."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, *args, **kwargs):
        kwargs.setdefault("synced_gpus", True)
        return type(self.model).generate(self.model, *args, **kwargs)


class _FullNumParameters:
    """model.num_parameters under stage 3 (a Hugging Face model): the class's own method, run
    where numel() of a parameter between uses is its full count (between_uses.full_numel),
    so it counts the model, not this rank's shard slices. A class, so that torch.save(model)
    pickles."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, *args, **kwargs):
        with full_numel():
            return type(self.model).num_parameters(self.model, *args, **kwargs)

