"""Python objects between ranks, over any executor's collectives: gather_object (tensors and
containers, for optimizer state dicts) and the JSON forms gather_json / broadcast_json (plain
data, for checkpoints, whose loading must never unpickle).

gather_object's objects travel as torch.save bytes in uint8 tensors on the executor's device
and are read back with weights_only=True (tensors, numbers, strings, containers: nothing that
runs code). Each rank's payload is broadcast in turn, so no rank but `dst` holds more than one.
torch.distributed.gather_object is not used: it needs NumPy, pickles, and the native NCCL
executor has its own communicator.
"""

from __future__ import annotations

import ctypes
import io
import json
from typing import Any, List, Optional

import torch


def _gather_bytes(executor, payload: bytes, dst: Optional[int]) -> Optional[List[bytes]]:
    """Every rank's `payload` on group rank `dst` (on every rank when dst is None), None
    elsewhere. Collective."""
    # hybrid sharding: within the shard group (the ranks' payloads may differ per replica)
    executor = getattr(executor, "shard", executor)
    if executor.world_size == 1:
        return [payload]
    device = executor.device
    data_here = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload \
        else torch.empty(0, dtype=torch.uint8)
    sizes = torch.zeros(executor.world_size, dtype=torch.int64, device=device)
    mine = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    executor.all_gather(sizes, mine).wait()
    out: List[bytes] = []
    # one broadcast per rank rather than an all-gather: no rank but dst ever holds more than
    # one payload (a consolidated optimizer state is the model's size)
    for r, n in enumerate(sizes.tolist()):
        if r == executor.rank:
            data = data_here.to(device)
        else:
            data = torch.empty(int(n), dtype=torch.uint8, device=device)
        if n:
            executor.broadcast(data, r).wait()
        if dst is None or executor.rank == dst:
            host = data.cpu()
            out.append(ctypes.string_at(host.data_ptr(), int(n)) if n else b"")
        del data
    return out if dst is None or executor.rank == dst else None


def gather_object(executor, obj: Any, dst: Optional[int] = 0) -> Optional[List[Any]]:
    """The list of every rank's `obj` on group rank `dst` (every rank when dst is None), None
    elsewhere. Collective."""
    if executor.world_size == 1:
        return [obj]
    buf = io.BytesIO()
    torch.save(obj, buf)
    got = _gather_bytes(executor, buf.getvalue(), dst)
    if got is None:
        return None
    return [torch.load(io.BytesIO(b), weights_only=True) for b in got]


def gather_json(executor, obj: Any, dst: Optional[int] = 0) -> Optional[List[Any]]:
    """Every rank's JSON-serializable `obj` on group rank `dst` (every rank when dst is None),
    None elsewhere. Collective."""
    got = _gather_bytes(executor, json.dumps(obj).encode(), dst)
    return None if got is None else [json.loads(b) for b in got]


def broadcast_json(executor, obj: Any, src: int = 0) -> Any:
    """Rank `src`'s JSON-serializable `obj` on every rank (other ranks pass anything, e.g.
    None). Collective."""
    executor = getattr(executor, "shard", executor)  # hybrid sharding: the shard group
    if executor.world_size == 1:
        return obj
    device = executor.device
    payload = json.dumps(obj).encode() if executor.rank == src else b""
    n = torch.tensor([len(payload)], dtype=torch.int64, device=device)
    executor.broadcast(n, src).wait()
    data = (torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
            if executor.rank == src else torch.empty(int(n), dtype=torch.uint8, device=device))
    executor.broadcast(data, src).wait()
    host = data.cpu()
    return json.loads(ctypes.string_at(host.data_ptr(), host.numel()))
