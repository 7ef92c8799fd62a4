"""WrittenParams: which parameters of a stages 1-2 optimizer were written in place since their
fp32 masters last followed them.

A bf16/fp16 parameter keeps a separate fp32 master, and so does an fp32 one when the optimizer
is offloaded (the host mirror, or the record on NVMe; without offload an fp32 parameter is its
own master). A write into the parameter (model.load_state_dict, torch.distributed.checkpoint's
set_state_dict, `p.copy_(t)` under no_grad, an init function) must reach the master before the
master is updated, or the step would overwrite the written values with an update of the old
ones. A write through the parameter bumps its version counter; the optimizer's own writes (the
copy back, the all-gather) go through views of the flat buffer, which keep a counter of their
own, so they are not counted. Stage 3 follows a model load in its load hook
(stage3/state_dict.py).
"""

from __future__ import annotations

from typing import Iterable, List, Optional

import torch

from zero_py.sharding.layout import FlatLayout


class WrittenParams:
    """The version counters of `flat`'s parameters with a separate master, as their masters
    last saw them."""

    def __init__(self, flat: FlatLayout, fp32_too: bool):
        """fp32_too: the fp32 parameters' masters are copies too (an offloaded optimizer)."""
        self.flat = flat
        self._watched = [[i for i in flat.bucket_params[b]
                          if fp32_too or flat.params[i].dtype != torch.float32]
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
