"""The models zero_py.initialize refuses before it touches them, for what the model would do
behind zero_py's back: a data-parallel wrapper (DDP, DataParallel, FSDP) reducing the gradients
a second time, sparse gradients (nn.Embedding(sparse=True)), which zero_py does not reduce, and,
under stage 3, a forward that writes its weight in place (nn.Embedding(max_norm=...))."""

from __future__ import annotations

import importlib

import torch.nn as nn


def refuse_data_parallel_wrappers(model: nn.Module) -> None:
    """A model (or a submodule) wrapped in DDP, DataParallel or FSDP: its wrapper reduces or
    shards the gradients too (under stages 2-3 DDP writes its averaged gradient back after
    zero_py took it; under stage 1 every gradient crosses the wire twice)."""
    kinds = [nn.DataParallel, nn.parallel.DistributedDataParallel]
    for path, name in (("torch.distributed.fsdp", "FullyShardedDataParallel"),
                       ("torch.distributed.fsdp", "FSDPModule")):
        try:
            kinds.append(getattr(importlib.import_module(path), name))
        except (ImportError, AttributeError):
            pass  # an older torch without it
    for name, m in model.named_modules():
        if isinstance(m, tuple(kinds)):
            raise ValueError(
                f"{'the model' if not name else f'submodule {name!r}'} is wrapped in "
                f"{type(m).__name__}: zero_py reduces (and shards) the gradients itself, so "
                "the wrapper would reduce them a second time. Give zero_py.initialize the "
                "bare model (drop the DDP(...) / FSDP wrapper; `model.module` is the one "
                "inside)")


def refuse_sparse_gradients(model: nn.Module) -> None:
    """An nn.Embedding / nn.EmbeddingBag with sparse=True and a trainable weight gives sparse
    gradients, which zero_py does not reduce: refused here rather than in the first backward
    (after a forward, on every rank)."""
    for name, m in model.named_modules():
        if (isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse
                and m.weight.requires_grad):
            raise ValueError(
                f"{type(m).__name__} {name or '(root)'!r} has sparse=True: its weight gets "
                "sparse gradients, which zero_py does not reduce or shard. Construct it with "
                "sparse=False (the default; dense gradients train to the same values), or "
                "freeze its weight")


def refuse_in_place_forward_writes(model: nn.Module) -> None:
    """Stage 3: an nn.Embedding / nn.EmbeddingBag with max_norm renormalizes the rows it looks
    up in place during its forward. Under stage 3 its weight there is the gathered full view,
    freed after the forward, so the renormalization would be lost (the model then drifts from
    DDP's, where it persists)."""
    for name, m in model.named_modules():
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.max_norm is not None:
            raise ValueError(
                f"{type(m).__name__} {name or '(root)'!r} has max_norm={m.max_norm}: its "
                "forward renormalizes the weight's rows in place, which under stage 3 writes "
                "into the gathered copy freed after the forward (the renormalization would be "
                "lost); use stage 1 or 2 for it, or max_norm=None")

