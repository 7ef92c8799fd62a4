"""ZeroOptimizer's training step (a mixin of zero_py/optim/optimizer.py): the calls a training
loop makes between backwards (no_sync, zero_grad, step), the update applied to this rank's
shard, overlap_step's guess of the coming step's inputs (offload/early.py), and what the last
step moved (comm_stats)."""

from __future__ import annotations

import contextlib
import math
from typing import Dict, List, Sequence

import torch

from zero_py.collectives import HybridExecutor
from zero_py.optim import compat, dcp
from zero_py.optim.streamed import StreamedUpdate
from zero_py.optim.update import added_state


class TrainingStep:
    """Needs the optimizer's stage, executor, param_groups, loss_scaler, loss_scale,
    stochastic_rounding, uses_fused_kernel, _flat, _reducer, _update, _host, _early, _kind,
    _step_count, _had_grad, _sr_seed, _clip_coef, _nonfinite, _comm and _all_params, and the
    methods of the other mixins (_grad_stats, _poison_gradients, _follow_written_params)."""

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (in param.grad) without reducing them, like DDP's
        no_sync(); the first backward after the block reduces everything accumulated."""
        previous = self._reducer.sync_enabled
        self._reducer.sync_enabled = False
        try:
            yield
        finally:
            self._reducer.sync_enabled = previous

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As torch.optim's, at any point between steps: reductions still in flight are
        finished first. With set_to_none=False the parameters that had a gradient keep a zero
        one, which the next step() applies, as torch.optim does with a zeroed param.grad.
        After a backward that raised it ends what that backward left open, and drops the
        gradients it had reduced (GradReducer.settle_failed_backward)."""
        self._reducer.settle_failed_backward()
        if self.stage >= 2:
            if set_to_none:
                self._had_grad = [0] * len(self._had_grad)
            elif self._reducer.passes_since_step and not self._reducer.pass_open:
                mask = self._reducer.finish(check_stray=False)  # zeroed below
                if mask is not None:
                    self._had_grad = [a | b for a, b in zip(self._had_grad, mask.tolist())]
        if self.stage == 3:  # a parameter between uses is a BetweenUses: no torch function
            with torch._C.DisableTorchFunctionSubclass():
                super().zero_grad(set_to_none=set_to_none)
        else:
            super().zero_grad(set_to_none=set_to_none)
        if self._early is not None:
            self._early.discard()  # the gradients they used are gone: no step will use them
        self._clip_coef, self._nonfinite = None, None
        self._reducer.zero_grad(set_to_none)

    def _holds_gradients(self) -> bool:
        """Whether a gradient is held since the last zero_grad(): reduced into the shard (or
        being reduced), or remembered as a zeroed one (zero_grad(set_to_none=False))."""
        return (self._reducer.grad_shard_valid or self._reducer.pass_open
                or any(self._had_grad))

    # -- the step -----------------------------------------------------------------------------

    def step(self, closure=None):
        """Updates this rank's shard and all-gathers the parameters. With a loss scaler, a step
        whose gradients overflow on any rank is skipped on every rank (last_step_skipped).
        As torch.optim does, a parameter without a gradient (none since zero_grad(), or step()
        before any backward) is left alone, and step() twice applies the gradients twice.

        Called by torch.distributed.checkpoint to "initialize" a stateless optimizer (zero
        gradients assigned to every parameter, lr 0), it drops those gradients and does
        nothing (zero_py/optim/dcp.py)."""
        if dcp.caller(("_init_optim_state",)) is not None:
            for p in self._all_params:
                p.grad = None
            return None
        if "grad_scale" in self.__dict__ or "found_inf" in self.__dict__:
            self.__dict__.pop("grad_scale", None)
            self.__dict__.pop("found_inf", None)
            raise RuntimeError(compat.GRAD_SCALER_MESSAGE)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        compat.refuse_detached_params(self)
        with torch.no_grad():
            mask = self._finish_reduction()  # None: zero_grad() came after the last backward
            used = [0] * len(self._step_count) if mask is None else mask.tolist()
            if self.stage >= 2:
                used = [a | b for a, b in zip(used, self._had_grad)]
                self._had_grad = list(used)
            if self.loss_scaler is not None and self._nonfinite is None:
                self._nonfinite = self._grad_stats(2.0)[1]
            skip = bool(self._nonfinite) and self.loss_scaler is not None
            self._follow_written_params()
            try:
                if not skip:
                    self._apply_update(used)
            finally:
                if self._early is not None:
                    self._early.end_step()  # what the step did not take (all when skipped)
            self.last_step_skipped = skip
            self.skipped_steps += int(skip)
            if self.loss_scaler is not None:
                self.loss_scaler.update(skip)
            self._clip_coef, self._nonfinite = None, None
            self._reducer.after_step()
        self._comm.close()
        return loss

    def comm_stats(self) -> Dict[str, Dict[str, Dict[str, int]]]:
        """What the last step moved, by executor label and collective kind: {"shard":
        {"reduce_scatter": {"calls", "bytes_sent", "bytes_received"}, "all_gather": ...,
        "control": ...}, "shard.gather": ...} (stage 3's gathers), this rank's bytes under the
        ring model of zero_py/collectives/stats.py. The last step runs from the end of the
        step() before it (or of construction) to the end of the last step(): its backwards'
        reductions, stage 3's gathers, the step's all-gather; "control" holds the small
        bookkeeping all-reduces. {} before the first step. docs/scale-out.md."""
        return {label: {kind: dict(c) for kind, c in kinds.items()}
                for label, kinds in self._comm.last.items()}

    def _comm_executors(self) -> list:
        """The executors comm_stats() counts: the optimizer's, and its storage's (stage 3's
        gather channel); a hybrid executor's shard, replicate and world groups each."""
        out = []
        for ex in (self.executor, getattr(self._flat, "executor", None)):
            out += [ex.shard, ex.replicate, ex.world] if isinstance(ex, HybridExecutor) else [ex]
        return out

    def _apply_update(self, used: List[int]) -> None:
        if self.uses_fused_kernel:
            extra = self._state_to_add(self.param_groups)
            self._update.check_groups(used)  # before anything moves (counts, buckets)
            if extra:
                self._update.add_keys(extra)
        counts, seed = list(self._step_count), self._sr_seed
        for i, u in enumerate(used):
            if u:
                self._step_count[i] += 1
        if not any(used):
            return
        coef = self._clip_coef  # 0.0 is a coefficient (an inf total norm), not "none"
        if coef is not None and math.isnan(coef):
            self._poison_gradients()
            coef = None
        grad_scale = (1.0 if coef is None else coef) / self.loss_scale
        self._sr_seed += 1
        touched = [b for b in range(self._flat.n_buckets)
                   if any(used[i] for i in self._flat.bucket_params[b])]
        try:
            if getattr(self._flat, "nvme", None) is not None:
                # offload_params="nvme": bucket by bucket, each bucket's parameter record open
                # while its optimizer chunks stream; both files flip only when every write of
                # the step has landed (a failed write leaves both at the last good step)
                with self._update.store.transaction():
                    self._flat.update_pieces(touched, lambda b: self._update.step(
                        used, self._step_count, grad_scale, self._sr_seed,
                        self.stochastic_rounding, buckets=[b]))
            elif self._host is not None and self.uses_fused_kernel:
                args = (used, self._step_count, grad_scale, self._sr_seed,
                        self.stochastic_rounding)
                done = (self._early.settle(args, self._early_hyper)
                        if self._early is not None else ())
                self._host.step(self._update, touched, *args, done=done)
            else:
                self._update.step(used, self._step_count, grad_scale, self._sr_seed,
                                  self.stochastic_rounding)
        except OSError:
            # an NVMe write failed: the state on disk and the parameters are the last good
            # step's (StreamedUpdate put them back, or their file did not flip); so are the
            # counts
            self._step_count, self._sr_seed = counts, seed
            raise
        if self.uses_fused_kernel:
            self._update.note_step(used, self._step_count)
        self._flat.publish(self._wire, touched)

    def _state_to_add(self, groups: List[dict], fresh: Sequence[dict] = ()) -> List[str]:
        """The state keys of the fused update that `groups` need and it does not keep yet
        (update.added_state: SGD's momentum buffer, once a momentum is switched on after
        construction; Adam's max where a group `fresh` from add_param_group has amsgrad),
        checked to be addable; changes nothing."""
        extra = added_state(self._kind, self._update.keys, groups, fresh)
        if extra is None:
            raise ValueError("the param groups need optimizer state this optimizer does not "
                             f"keep (it keeps {self._update.keys}): amsgrad was switched on "
                             "after construction, which torch.optim.Adam cannot take after its "
                             "first step either; construct the optimizer with amsgrad=True")
        if extra and (isinstance(self._update, StreamedUpdate) or self._early is not None):
            raise ValueError(
                "a momentum was switched on after construction (e.g. by OneCycleLR's "
                "cycle_momentum), but with offload_optimizer='nvme' or overlap_step the "
                "optimizer state is laid out at construction: construct it with momentum != 0 "
                "(a scheduler sets the value from then on)")
        return extra

    def _early_guess(self, b: int):
        """overlap_step: the inputs of the coming step for bucket b as they stand while its
        gradient reaches the host (offload/early.py), guessing no clipping and no overflow;
        None before the first step (the step makes the states)."""
        if self._update.states is None:
            return None
        self._follow_written_params([b])  # a write since the last step: the master follows
        params = self._flat.bucket_params[b]
        used = {i: 1 for i in params}
        counts = {i: self._step_count[i] + 1 for i in params}
        args = (used, counts, 1.0 / self.loss_scale, self._sr_seed + 1,
                self.stochastic_rounding)
        return args, self._early_hyper(b)

    def _early_hyper(self, b: int) -> tuple:
        """Bucket b's group's hyperparameters, comparable with == (tensors as numbers)."""
        g = self.param_groups[self._flat.bucket_group[b]]
        return tuple(sorted((k, v.tolist() if isinstance(v, torch.Tensor) else v)
                            for k, v in g.items() if k != "params"))
