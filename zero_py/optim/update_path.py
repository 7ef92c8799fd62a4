"""ZeroOptimizer's update path (a mixin of zero_py/optim/optimizer.py): what it builds over its
storage (the gradient reducer and its hooks, the fp32 masters, the update: fused, torch.optim,
NVMe-streamed, or with overlap_step's early updates), at construction and when add_param_group
lays the parameters out again; and the masters kept equal to the parameters written outside
step() (sync_master_from_params, the written parameters of offload/written.py)."""

from __future__ import annotations

import weakref
from typing import List, Optional, Sequence

import torch

from zero_py.offload import HostShard
from zero_py.offload.early import EarlyStep
from zero_py.offload.written import WrittenParams
from zero_py.optim import agreement, compat
from zero_py.optim.streamed import ResidentMasters, StreamedUpdate
from zero_py.optim.update import FusedUpdate, TorchUpdate
from zero_py.sharding.reducer import MAX_BUCKETS_IN_FLIGHT, GradReducer
from zero_py.sharding.storage import PieceStore, full_shape


class UpdatePath:
    """Needs the optimizer's stage, executor, param_groups, defaults, optimizer_class,
    offload_optimizer, _kind, _wire, _grad_reduce_dtype, _grad_accum_dtype, _offload_dir,
    _overlap_step, _class_kwargs, _all_params, _managed_index, _hook_handles, _host, _early
    and _names; sets _flat, _reducer, _masters, _update, _written, _step_count, _had_grad and
    the index maps."""

    def _build(self, storage, step_count: List[int]) -> None:
        """The gradient path, the fp32 masters and the update over `storage` (construction, and
        add_param_group's new layout). The reducer's gradient hooks are recorded so that a
        rebuild or the optimizer's collection removes them."""
        fp = self._flat = storage
        stage = self.stage
        # stage 3 reduces as stage 2 does: from hooks, during backward. A stage-3 bucket is a
        # whole unit: one reduction in flight (it overlaps the backward of the next unit) keeps
        # the gradient working set at two unit-sized buffers.
        self._reducer, handles = compat.capture_hooks(fp.params, lambda: GradReducer(
            fp, self._wire, min(stage, 2), self._grad_reduce_dtype,
            MAX_BUCKETS_IN_FLIGHT if stage < 3 else 1, accum_dtype=self._grad_accum_dtype))
        # a quantized wire's stochastic rounding; weakly, so that the parameters' hooks (they
        # hold the reducer) do not keep the optimizer alive
        me = weakref.ref(self)
        self._reducer.noise_seed = lambda: me()._sr_seed
        self._reducer.name_of = lambda i: me()._name(fp.params[i])
        self._reducer.before_accumulate(lambda: me()._settle_clip())
        self._reducer.hyperparameters = lambda: agreement.hyperparameters(
            me().param_groups, me()._scaler_state(),
            [i for i, kept in enumerate(me()._had_grad) if kept])
        self._hook_handles.extend(handles)
        self._step_count = step_count  # per managed parameter, as torch's state["step"]
        # stages 2-3 drop param.grad: which parameters DDP would still hold a gradient tensor
        # for (one since the last zero_grad(set_to_none=True)), so that they are updated as
        # torch.optim updates a zeroed gradient
        self._had_grad = [0] * len(fp.params)
        if self._early is not None:
            self._early.close()
            self._early = None
        if self._host is not None:
            self._host.close()
        if isinstance(getattr(self, "_update", None), StreamedUpdate):
            self._update.close()
        if self.offload_optimizer == "nvme":
            self._masters = ResidentMasters(fp)
        elif self.offload_optimizer == "cpu":
            # the masters (and states, kept by the updater) in host memory; the reducer tells
            # the host side when each gradient piece is reduced, so it is copied out at once
            self._host = self._reducer.mirror = HostShard(fp, self._reducer.grads.dtype_of)
            self._masters = self._host.masters
        else:
            self._masters = PieceStore(
                fp, lambda b: None if fp.bucket_dtype(b) == torch.float32 else torch.float32,
                fp.device)
        self._managed_of = {i: k for k, i in enumerate(self._managed_index)}
        # given frozen: outside the layout, never updated; step() refuses one since unfrozen
        # (on every rank: under stage 3 by its full size, as a rank's slice may be empty)
        self._left_out = [p for i, p in enumerate(self._all_params)
                          if i not in self._managed_of and full_shape(p).numel() > 0]
        self._param_index = {id(p): i for i, p in enumerate(self._all_params)}
        if self.offload_optimizer == "nvme":
            self._update = self._streamed_update(fp)
        elif self._kind is not None:
            self._update = FusedUpdate(self._kind, fp, self._reducer.grads, self._masters,
                                       self.param_groups, self._host, self.defaults)
            if self._host is not None and self._overlap_step:
                # ahead of the host side as the reducer's mirror: it starts the early updates.
                # Its guess holds the optimizer weakly, as the reducer's other callbacks do
                # (a bound method here kept every dropped overlap_step optimizer alive)
                me = weakref.ref(self)
                self._early = self._reducer.mirror = EarlyStep(
                    self._host, self._update, self._overlap_step,
                    lambda b: me()._early_guess(b))
        else:
            self._update = TorchUpdate(self.optimizer_class, fp, self._reducer.grads,
                                       self._masters, self.param_groups, self._host,
                                       self._class_kwargs)
        # stages 1-2: a master that is a copy (bf16/fp16 parameters; fp32 ones offloaded) must
        # follow writes into its parameter (offload/written.py)
        self._written = (WrittenParams(fp, bool(self.offload_optimizer))
                         if not fp.params_sharded else None)

    def _streamed_update(self, fp) -> StreamedUpdate:
        """The NVMe update, its offload file made on every rank or on none: a rank whose file
        cannot be made (a full disk, a refused directory) raises its error and the others an
        error naming it, instead of waiting for it in the first step."""
        update, problem = None, None
        try:
            update = StreamedUpdate(self._kind, fp, self._reducer.grads, self._masters,
                                    self.param_groups, self._offload_dir, self.defaults)
        except OSError as exc:
            problem = exc
        try:
            agreement.check(self.executor, [("the NVMe offload file", f"failed: {problem}"
                                             if problem else "made")],
                            "zero_py.ZeroOptimizer(offload_optimizer='nvme')")
        except ValueError:
            if update is not None:
                update.close()
            if problem is not None:
                raise problem from None
            raise
        if problem is not None:
            raise problem
        return update

    def sync_master_from_params(self) -> None:
        """Copies the parameters into their fp32 masters. Construction does it; call it again
        after loading weights into a bf16/fp16 model whose optimizer already exists (loading
        the optimizer's state dict does it too, unless that dict carries the masters). Early
        updates of overlap_step (made from the masters before) are put back first."""
        self.discard_early_updates()
        with torch.no_grad():
            if isinstance(self._update, StreamedUpdate) and not self._update.is_resident:
                self._update.pull_masters()
            else:
                for b in range(self._flat.n_buckets):
                    master = self._masters.piece(b)
                    if master is not None:
                        master.copy_(self._flat.bucket_piece(b))
                if self._host is not None:
                    self._host.pull_params()
        if self._written is not None:
            self._written.mark()

    def _follow_written_params(self, buckets: Optional[Sequence[int]] = None) -> None:
        """Stages 1-2: the masters of the parameters written in place since they last
        followed them (model.load_state_dict, DCP's set_state_dict, p.copy_(t)) follow the
        parameters, of `buckets` only if given (offload/written.py): elementwise, where the
        master's rounding is not the parameter's value (follow_masters). Early updates
        (overlap_step) made before such a write are put back first."""
        written = self._written.written(buckets) if self._written is not None else []
        if not written:
            return
        if self._early is not None and buckets is None:
            self._early.discard()
        if isinstance(self._update, StreamedUpdate) and not self._update.is_resident:
            self._update.pull_masters(written)  # a failed write marks nothing: pulled again
        else:
            if self._host is not None:
                self._host.pull_params(written)
            self.follow_masters(written)
        self._written.mark(written)
