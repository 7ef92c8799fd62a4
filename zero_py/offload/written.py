"""WrittenParams: which fp32 parameters of an offloaded stages 1-2 optimizer were written in
place since their masters last followed them.

Without offload an fp32 parameter is its own master: a write into it (model.load_state_dict,
torch.distributed.checkpoint's set_state_dict, `p.copy_(t)` under no_grad) is what the next
step updates. Offloaded, its master is a copy (the host mirror, or the record on NVMe), so such
a write must reach the copy before the copy is updated, or the step would overwrite the written
values with an update of the old ones. A write through the parameter bumps its version counter;
the optimizer's own writes (the copy back, the all-gather) go through views of the flat buffer,
which keep a counter of their own, so they are not counted. (bf16/fp16 parameters keep a
separate fp32 master with or without offload: sync_master_from_params() follows a write there.)
"""

from __future__ import annotations

from typing import Iterable, List, Optional

import torch

from zero_py.sharding.layout import FlatLayout


class WrittenParams:
    """The version counters of `flat`'s fp32 parameters as their masters last saw them."""

    def __init__(self, flat: FlatLayout):
        self.flat = flat
        self._watched = [[i for i in flat.bucket_params[b]
                          if flat.params[i].dtype == torch.float32]
                         for b in range(flat.n_buckets)]
        self._seen: List[int] = [0] * len(flat.params)
        self.mark()

    def mark(self, buckets: Optional[Iterable[int]] = None) -> None:
        """The masters of `buckets` (or all) follow their parameters now (construction,
        sync_master_from_params, a pull)."""
        for b in range(self.flat.n_buckets) if buckets is None else buckets:
            for i in self._watched[b]:
                self._seen[i] = self.flat.params[i]._version

    def written(self, buckets: Optional[Iterable[int]] = None) -> List[int]:
        """The buckets (of `buckets`, or all) holding a parameter written since the last mark:
        the caller pulls their masters from the parameters, then marks them."""
        params = self.flat.params
        return [b for b in (range(self.flat.n_buckets) if buckets is None else buckets)
                if any(params[i]._version != self._seen[i] for i in self._watched[b])]
