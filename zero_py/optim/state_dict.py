"""Optimizer state dicts: per-rank shard dicts, and the full torch-format dict stitched from them.

A shard dict is torch's format (state keyed by parameter index, param_groups with index lists)
whose per-element state tensors hold only the rank's slice of each parameter, flattened, plus a
"zero_py" entry that says which slice: meta["slices"][index] = (lo, hi) over the flattened
parameter. Scalar state (a 0-dim tensor, a number) is the same on every rank.
"""

from __future__ import annotations

from typing import Dict, List, Sequence

import torch

FORMAT_VERSION = 1


def is_shard_dict(state_dict: dict) -> bool:
    return isinstance(state_dict, dict) and "zero_py" in state_dict


def is_sliced(value, lo: int, hi: int) -> bool:
    """Whether a state value is per-element (sliced) rather than scalar."""
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == hi - lo


def merge_shards(shards: Sequence[dict], shapes: Dict[int, torch.Size]) -> dict:
    """One full torch-format state dict from every rank's shard dict."""
    full: Dict[int, dict] = {}
    covered: Dict[int, int] = {}
    for shard in shards:
        slices = shard["zero_py"]["slices"]
        for index, state in shard["state"].items():
            lo, hi = slices[index]
            numel = shapes[index].numel()
            dst = full.setdefault(index, {})
            covered[index] = covered.get(index, 0) + (hi - lo)
            for key, value in state.items():
                if is_sliced(value, lo, hi):
                    buf = dst.get(key)
                    if buf is None:
                        buf = dst[key] = torch.zeros(numel, dtype=value.dtype)
                    buf[lo:hi] = value
                elif key not in dst:
                    dst[key] = value.clone() if isinstance(value, torch.Tensor) else value
    for index, n in covered.items():
        if n != shapes[index].numel():
            raise RuntimeError(f"zero_py: shards cover {n} of parameter {index}'s "
                               f"{shapes[index].numel()} elements; a rank's state is missing")
        for key, value in full[index].items():
            if isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == n:
                full[index][key] = value.view(shapes[index])
    return {"state": full, "param_groups": [dict(g) for g in shards[0]["param_groups"]]}


def slice_full_state(state: dict, lo: int, hi: int, numel: int) -> dict:
    """This rank's slice of one parameter's torch-format state."""
    out = {}
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == numel:
            out[key] = value.reshape(-1)[lo:hi]
        else:
            out[key] = value
    return out


def check_groups(saved: List[dict], current: List[dict]) -> None:
    if len(saved) != len(current):
        raise ValueError(f"zero_py: the state dict has {len(saved)} param groups, this optimizer "
                         f"has {len(current)}; load a state dict of the same model and groups")
    for k, (s, c) in enumerate(zip(saved, current)):
        if len(s["params"]) != len(c["params"]):
            raise ValueError(f"zero_py: param group {k} has {len(s['params'])} parameters in the "
                             f"state dict and {len(c['params'])} here; the model differs")
