"""Module buffers (BatchNorm running statistics, ...) across ranks: broadcast from rank 0 at
zero_py.initialize for every stage, and with broadcast_buffers=True before forwards as DDP's
broadcast_buffers=True does (_BufferSync); buffer_entries are what the ranks' agreement compares
of them."""

from __future__ import annotations

import weakref
from typing import Any, Dict, List, Tuple

import torch
import torch.nn as nn

from zero_py.optim import compat
from zero_py.optim.optimizer import ZeroOptimizer


def buffer_entries(model: nn.Module) -> List[Tuple[str, Any]]:
    return [(f"buffer {name}", {"shape": list(b.shape), "dtype": str(b.dtype)})
            for name, b in model.named_buffers()]



def _broadcast_buffers(model: nn.Module, executor) -> None:
    """Every rank's buffers become rank 0's: one broadcast per dtype (buffers flattened)."""
    by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
    for b in model.buffers():
        if b.numel() > 0 and not b.is_meta:
            by_dtype.setdefault(b.dtype, []).append(b)
    with torch.no_grad():
        for bufs in by_dtype.values():
            flat = torch.cat([b.detach().reshape(-1).to(executor.device) for b in bufs])
            # as bytes: the backends do not all take every dtype (gloo: bool, float8)
            executor.broadcast(flat.view(torch.uint8), 0).wait()
            at = 0
            for b in bufs:
                b.copy_(flat[at:at + b.numel()].view(b.shape).to(b.device, b.dtype))
                at += b.numel()


class _BufferSync:
    """broadcast_buffers=True: rank 0's buffers before each forward, as DDP decides it (before
    a forward that follows one run with gradients enabled and outside no_sync, and before the
    first)."""

    def __init__(self, model: nn.Module, opt: ZeroOptimizer):
        # the optimizer weakly, and its hooks go with it: the model holds them, and must not
        # keep a dropped stages 1-2 optimizer alive (compat.ModelManager)
        self.model, self.opt = model, weakref.ref(opt)
        self.pending = True
        opt._buffer_hooks = compat.release_on_collect(opt, [
            model.register_forward_pre_hook(self._pre_forward, prepend=True),
            model.register_forward_hook(self._post_forward)])

    def __deepcopy__(self, memo):
        # a copy of the model keeps these hooks, bound to this object: they skip the copy
        return self

    def _pre_forward(self, module, args) -> None:
        if self.pending and module is self.model:
            _broadcast_buffers(self.model, self.opt().executor)

    def _post_forward(self, module, args, output) -> None:
        if module is self.model:
            self.pending = torch.is_grad_enabled() and self.opt().reducer.sync_enabled


def start_buffers(model: nn.Module, opt: ZeroOptimizer, every_forward: bool) -> None:
    ranks = getattr(opt.executor, "data_parallel_size", opt.executor.world_size)
    if ranks == 1 or not any(True for _ in model.buffers()):
        return
    _broadcast_buffers(model, opt.executor)
    if every_forward:
        opt._buffer_sync = _BufferSync(model, opt)

