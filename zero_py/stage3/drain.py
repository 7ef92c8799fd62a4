"""DrainGathers: the gathers a stage-3 backward issues at its end without using them.

At the end of backward every rank issues the gathers left in the phase's schedule
(Stage3Engine._drain_backward): a peer whose backward reached those units needs this rank's
pieces, and waits for them. This rank's backward is over, so it never reads what they bring.
Each used to get the unit's own gather buffer, and every one of them was issued before any was
freed (a free waits for its gather, and nothing may wait before the backward's last reductions
are issued): a model whose first units get no backward (frozen embeddings or lower layers, the
usual fine-tuning) held all of them gathered at once, 7 units against a budget of 2 with 6 of 8
layers frozen. Here they take part with this rank's piece as input and share one scratch
output per dtype, as large as the largest bucket among them: the peers get what they need, and
this rank holds one bucket's worth of garbage, freed once the gathers completed.

Where this rank's piece is not a tensor of its own (offload_params: it is read into the
gather buffer first) the unit is gathered as before.
"""

from __future__ import annotations

from typing import Dict, List

import torch

from zero_py.collectives.work import issue


class DrainGathers:
    def __init__(self, storages: list) -> None:
        self.storages = storages  # the engine's
        self._works: List = []
        self._scratch: Dict[torch.dtype, torch.Tensor] = {}

    def prepare(self, units: List[int]) -> bool:
        """The scratch for the gathers of `units` (the drain's); False where a storage cannot
        take part without its gather buffer (its pieces are offloaded): the caller gathers
        them as before."""
        if any(s.host_shards or s.nvme is not None for s in self.storages):
            return False
        sizes: Dict[torch.dtype, int] = {}
        for s in self.storages:
            for b in (b for u in units for b in s.unit_buckets[u]):
                dtype = s.bucket_dtype(b)
                sizes[dtype] = max(sizes.get(dtype, 0), s.bucket_numel[b])
        self.wait()
        device = self.storages[0].device
        self._scratch = {dtype: torch.empty(n, dtype=dtype, device=device)
                         for dtype, n in sizes.items()}
        self.storages[0].meter.add(self._bytes())
        return True

    def issue(self, u: int, phase: str) -> None:
        """Takes part in unit u's gathers (one of those prepare() was given) without keeping
        their values."""
        for s in self.storages:
            for b in s.unit_buckets[u]:
                out = self._scratch[s.bucket_dtype(b)][:s.bucket_numel[b]]
                work = issue(f"all-gather of {s.describe_bucket(b)}", s.executor.all_gather,
                             out, s.shards.piece(b))
                self._works.append(work.named(f"{work.what} for {phase} (its values are not "
                                              "used on this rank)"))

    def _bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._scratch.values())

    def wait(self) -> None:
        """Waits for every gather issued, then drops the scratch."""
        works, self._works = self._works, []
        for work in works:
            work.wait()
        self.storages[0].meter.add(-self._bytes())
        self._scratch = {}
