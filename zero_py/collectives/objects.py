"""gather_object: Python objects from every rank to one, over any executor's all-gathers.

Objects travel as torch.save bytes in uint8 tensors on the executor's device and are read back
with weights_only=True (tensors, numbers, strings, containers: nothing that runs code).
Each rank's payload is broadcast in turn, so no rank but `dst` holds more than one.
torch.distributed.gather_object is not used: it needs NumPy, and the native NCCL executor has
its own communicator.
"""

from __future__ import annotations

import ctypes
import io
from typing import Any, List, Optional

import torch


def gather_object(executor, obj: Any, dst: int = 0) -> Optional[List[Any]]:
    """The list of every rank's `obj` on group rank `dst`, None elsewhere. Collective."""
    if executor.world_size == 1:
        return [obj]
    device = executor.device
    buf = io.BytesIO()
    torch.save(obj, buf)
    payload = torch.frombuffer(bytearray(buf.getbuffer()), dtype=torch.uint8)
    sizes = torch.zeros(executor.world_size, dtype=torch.int64, device=device)
    mine = torch.tensor([payload.numel()], dtype=torch.int64, device=device)
    executor.all_gather(sizes, mine).synchronize()
    out: List[Any] = []
    # one broadcast per rank rather than an all-gather: no rank but dst ever holds more than
    # one payload (a consolidated optimizer state is the model's size)
    for r, n in enumerate(sizes.tolist()):
        if r == executor.rank:
            data = payload.to(device)
        else:
            data = torch.empty(int(n), dtype=torch.uint8, device=device)
        executor.broadcast(data, r).synchronize()
        if executor.rank == dst:
            host = data.cpu()
            out.append(torch.load(io.BytesIO(ctypes.string_at(host.data_ptr(), int(n))),
                                  weights_only=True))
        del data
    return out if executor.rank == dst else None
