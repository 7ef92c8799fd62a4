"""Stage 3's sharded storages, built from a model's values: zero_py.initialize hands
shard_parameters() the parameters with their units, and gets back the ShardedParams the engine
gathers from (sharding/storage.py), filled one bucket at a time so that the model is never
held twice."""

from __future__ import annotations

from typing import Dict, Sequence, Set

import torch
import torch.nn as nn

from zero_py.sharding.storage import GatherMeter, ShardedParams


def shard_parameters(params: Sequence[nn.Parameter], groups: Sequence[int],
                     unit_of: Dict[int, int], n_units: int, executor, align_bytes: int,
                     meter: GatherMeter, persistence_threshold: int,
                     uninitialized: Set[int], host_shards: bool = False,
                     param_file=None, on_made=None, device=None) -> ShardedParams:
    """The sharded storage of `params`, filled from their current values (rank 0's, broadcast),
    one bucket at a time: the caller's storage of a parameter is dropped as soon as its bucket
    is done, so no more than one unit is whole at a time beyond the model the caller built.
    Parameters with fewer than `persistence_threshold` elements go to the persistent unit
    (n_units: never freed). Buckets whose parameters are all in `uninitialized` (built on the
    meta device) are neither filled nor broadcast: replay_init fills their pieces later.
    host_shards: the shards live in host memory (offload_params="cpu"). param_file: makes the
    file the shards live in (offload_params="nvme"); on_made(flat) runs before the first
    collective (the ranks agree that every file was made)."""
    persistent = n_units
    units = [persistent if p.numel() < persistence_threshold else unit_of[id(p)] for p in params]
    failure = []

    def make_file(flat):
        try:
            return param_file(flat)
        except OSError as exc:  # raised after the agreement, on every rank
            failure.append(exc)
            return None
    flat = ShardedParams(params, groups, units, n_units + 1, executor, align_bytes, meter,
                         persistent_unit=persistent, host_shards=host_shards,
                         param_file=make_file if param_file is not None else None,
                         device=device)
    if on_made is not None:
        flat.param_file_error = failure[0] if failure else None
        on_made(flat)
    # a write of the shards (their first): a peer that reads them one-sided (a no_grad
    # forward, a state dict) once its own initialize returned waits until this rank's is done
    with torch.no_grad(), flat.writing():
        for b in range(flat.n_buckets):
            # the values to lay out, taken before materialize() points .data elsewhere
            values = {i: flat.params[i].detach() for i in flat.bucket_params[b]
                      if id(flat.params[i]) not in uninitialized}
            flat.materialize(b, values)
            del values
    return flat
