"""HostShard: the host side of an optimizer offloaded to the CPU (ZeRO-Offload).

Parameters and gradients stay on the device. This rank's fp32 masters, its optimizer states
(the updater keeps them; see optim/update.py) and a host copy of its gradient shard live in host
memory, pinned when the device is a GPU. Per bucket b of the flat layout:

    masters.piece(b)   fp32 master of a bf16/fp16 bucket piece (None for fp32 buckets)
    mirrors.piece(b)   fp32 copy of an fp32 bucket piece: its master here (None otherwise)
    grads.piece(b)     the reduced gradient shard, copied from the device as its reduction
                       completes (during backward: reduced(b), from the reducer)
    staging.piece(b)   the updated bf16/fp16 values on their way back (None for fp32 buckets,
                       whose mirror is copied back itself)

Invariant: between steps the device piece of a bucket equals its master (mirror) rounded to
the parameter dtype, as without offload. The step runs bucket by bucket (step()): wait for the
bucket's gradient copy, update it with the fused CPU kernel, and queue its copy back, which
overlaps the next bucket's update.
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional, Sequence

import torch

from zero_py import kernels
from zero_py.offload.copies import DONE, Copy, CopyQueue
from zero_py.sharding.layout import FlatLayout
from zero_py.sharding.storage import PieceStore

CPU = torch.device("cpu")


def host_threads() -> int:
    """Kernel threads of an offloaded step: the CPUs this process may run on (ZP_NUM_THREADS
    overrides), shared by the ranks of this host (torchrun's LOCAL_WORLD_SIZE)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    if os.environ.get("ZP_NUM_THREADS"):
        return kernels.default_threads()
    return max(1, kernels.default_threads() // max(1, local))


def _pinned(device: torch.device):
    """PieceStore's allocator for host tensors: pinned where the device is a GPU (asynchronous
    copies need page-locked memory), ordinary host memory otherwise."""
    if device.type != "cuda":
        return None
    return lambda sizes: {dtype: torch.zeros(n, dtype=dtype, pin_memory=True)
                          for dtype, n in sizes.items()}


class HostShard:
    """The host buffers and copy pipeline of an offloaded optimizer over layout `flat`
    (FlatParams or ShardedParams); `grad_dtype_of`: the dtypes of the reducer's gradient
    shard."""

    def __init__(self, flat: FlatLayout, grad_dtype_of: Sequence[Optional[torch.dtype]]):
        self.flat = flat
        self.device = flat.device
        alloc = _pinned(self.device)
        fp32 = [flat.bucket_dtype(b) == torch.float32 for b in range(flat.n_buckets)]
        self.masters = PieceStore(flat, lambda b: None if fp32[b] else torch.float32, CPU, alloc)
        self.mirrors = PieceStore(flat, lambda b: torch.float32 if fp32[b] else None, CPU, alloc)
        self.grads = PieceStore(flat, lambda b: grad_dtype_of[b], CPU, alloc)
        self.staging = PieceStore(flat, lambda b: None if fp32[b] else flat.bucket_dtype(b),
                                  CPU, alloc)
        self.copies = CopyQueue(self.device)
        self.threads = host_threads()
        self._grad_copy: List[Copy] = [DONE] * flat.n_buckets  # the last D2H copy of each

    # -- the updater's view (optim/update.py) ------------------------------------------------

    def piece(self, b: int) -> torch.Tensor:
        """Bucket b's fp32 master on the host: the updater's masters."""
        m = self.masters.piece(b)
        return m if m is not None else self.mirrors.piece(b)

    def param_out(self, b: int) -> Optional[torch.Tensor]:
        """Where the kernel writes bucket b's updated values in the parameter dtype (None: the
        master is the value)."""
        return self.staging.piece(b)

    # -- gradients: device -> host, during backward ------------------------------------------

    def reduced(self, b: int, piece: torch.Tensor) -> None:
        """The reducer finished a reduction into bucket b's gradient piece (on the device):
        copy it out. After several passes (accumulation) the last copy holds the sum."""
        self._grad_copy[b] = self.copies.submit(self.grads.piece(b), piece)

    def writing(self, b: int) -> None:
        """The reducer is about to write bucket b's device gradient piece: the copy still
        reading it must be done first."""
        self._grad_copy[b].order_device()

    def zeroed(self) -> None:
        """The reducer zeroed its gradient shard (zero_grad(set_to_none=False)): the host copy,
        which the next step reads unless a backward reduces again, is zeroed too, once the
        copies into it have landed (a late one would bring the old gradient back)."""
        for b in range(self.flat.n_buckets):
            self.grads_ready(b)
        self.grads.zero_()

    def grads_ready(self, b: int) -> None:
        """Waits until bucket b's host gradient holds the device's."""
        self._grad_copy[b].wait()

    # -- the step ---------------------------------------------------------------------------

    def step(self, update, buckets: Sequence[int], *args, done=()) -> None:
        """Updates `buckets` one at a time on the host (update.step(*args, buckets=[b])) and
        copies each back to its device piece while the next is updated; returns when every
        device piece holds its new values (the caller then publishes them). Buckets in `done`
        were updated during backward (overlap_step, offload/early.py): only copied back."""
        back: List[Copy] = []
        for b in buckets:
            if b not in done:
                self.grads_ready(b)
                update.step(*args, buckets=[b])
            back.append(self.copies.submit(self.flat.bucket_piece(b), self._new_values(b)))
        for c in back:
            c.order_device()

    def push_all(self) -> None:
        """Copies every bucket's masters back to the device, cast to the parameter dtype (the
        torch.optim path: it updates every master in one call and writes no staging)."""
        back = [self.copies.submit(self.flat.bucket_piece(b), self.piece(b))
                for b in range(self.flat.n_buckets)]
        for c in back:
            c.order_device()

    def _new_values(self, b: int) -> torch.Tensor:
        out = self.staging.piece(b)
        return out if out is not None else self.mirrors.piece(b)

    def pull_params(self, buckets: Optional[Sequence[int]] = None) -> None:
        """fp32 buckets' mirrors from their device pieces (construction, a load of weights;
        `buckets`: those only, e.g. the ones holding a parameter written in place)."""
        with torch.no_grad():
            for b in range(self.flat.n_buckets) if buckets is None else buckets:
                mirror = self.mirrors.piece(b)
                if mirror is not None:
                    mirror.copy_(self.flat.bucket_piece(b))

    def nbytes(self) -> Dict[str, int]:
        """Host bytes held: fp32 masters and mirrors, the gradient copy and the staging."""
        return {"host_masters": self.masters.nbytes() + self.mirrors.nbytes(),
                "host_grads": self.grads.nbytes() + self.staging.nbytes()}

    def close(self) -> None:
        self.copies.close()
