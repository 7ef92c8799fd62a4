"""BufferPool: recycled flat buffers (the reducer's gradient buckets, the reduce-scatter's
receive buffers, stage 3's gather buffers), so a step costs no allocation once warm."""

from __future__ import annotations

from typing import List

import torch


class BufferPool:
    """take(numel, dtype) gives a view of the smallest idle buffer that fits; when none does,
    the idle buffers of that dtype (all too small) are dropped and one of exactly numel
    elements is made, so what the pool holds never exceeds, per dtype, the most buffers in use
    at once, each as large as the largest asked for. peak_bytes: the most bytes alive at once,
    idle or in use."""

    def __init__(self, device):
        self._device = device
        self._idle: List[torch.Tensor] = []
        self._bytes = 0
        self.peak_bytes = 0

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        fits = [k for k, t in enumerate(self._idle) if t.numel() >= numel and t.dtype == dtype]
        if fits:
            return self._idle.pop(min(fits, key=lambda k: self._idle[k].numel()))[:numel]
        self._bytes -= sum(t.numel() * t.element_size() for t in self._idle if t.dtype == dtype)
        self._idle = [t for t in self._idle if t.dtype != dtype]
        t = torch.empty(numel, dtype=dtype, device=self._device)
        self._bytes += t.numel() * t.element_size()
        self.peak_bytes = max(self.peak_bytes, self._bytes)
        return t

    def give(self, t: torch.Tensor) -> None:
        """Returns a buffer (or a view take() gave) for reuse."""
        self._idle.append(t if t._base is None else t._base)
