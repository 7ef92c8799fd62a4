"""PieceStore: one piece per bucket packed into one tensor per dtype (gradient shards, fp32
masters, the stage-3 shards)."""

from __future__ import annotations

from typing import Callable, Dict, List, Optional

import torch

from zero_py.sharding.layout import FlatLayout


class PieceStore:
    """One tensor of a rank's piece per bucket, packed into one compact tensor per dtype.

    `dtype_of(b)` says the dtype of bucket b's piece, or None for no piece: gradients use it
    with the reduction dtype of each bucket, fp32 masters with the buckets whose parameters
    are not fp32 (an fp32 parameter piece is its own master)."""

    def __init__(self, flat: FlatLayout, dtype_of: Callable[[int], Optional[torch.dtype]],
                 device: torch.device, allocate: Optional[Callable[[Dict[torch.dtype, int]],
                                                                   Optional[dict]]] = None):
        self.dtype_of = [dtype_of(b) for b in range(flat.n_buckets)]
        sizes: Dict[torch.dtype, int] = {}
        self._offset: List[int] = []
        for b, dtype in enumerate(self.dtype_of):
            self._offset.append(sizes.get(dtype, 0))
            if dtype is not None:
                sizes[dtype] = sizes.get(dtype, 0) + flat.bucket_shard_numel[b]
        self.sizes = sizes
        # allocate(sizes) may place the tensors (zeros) elsewhere, e.g. in shared memory
        tensors = allocate(sizes) if allocate is not None else None
        self.tensors = tensors if tensors is not None else {
            dtype: torch.zeros(n, dtype=dtype, device=device) for dtype, n in sizes.items()}
        self._numel = flat.bucket_shard_numel

    def piece(self, b: int, tensors: Optional[dict] = None) -> Optional[torch.Tensor]:
        """Bucket b's piece in this store's tensors (or in `tensors`, laid out alike: a peer's
        copy of the store)."""
        dtype = self.dtype_of[b]
        if dtype is None:
            return None
        lo = self._offset[b]
        return (tensors or self.tensors)[dtype][lo:lo + self._numel[b]]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def zero_(self) -> None:
        for t in self.tensors.values():
            t.zero_()

