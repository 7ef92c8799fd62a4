"""GradReducer's finish (a mixin of zero_py/sharding/reducer.py): what the optimizer asks of it
between the last backward and the next pass. finish() waits for every reduction and gives the
mask of the parameters some rank had a gradient for (refusing a param.grad set after the last
reduced backward); the shards are then being updated (updating) until after_step() or
zero_grad(); stage 1 reduces param.grad again where a backward changed it since."""

from __future__ import annotations

import torch

from zero_py.sharding.counts import CLIP, STEP, STEP_STRAY


class Finish:
    """Needs the reducer's flat, stage, steps, mirror, grads, check_counts, name_of, the pass
    state (passes_since_step, forwards_since_step, _unsynced, _local_used, _global_used,
    _reduced_from, _finished, _updating, grad_shard_valid, incomplete), its passes (reduce_now,
    settle_failed_backward), buckets (_retire) and counts (_check_count, _counted)."""

    def grads_changed(self) -> bool:
        """Stage 1, after finish(): whether a param.grad changed since its reduction read it
        (a backward between clip_grad_norm_ and step)."""
        return self._finished and self.stage == 1 and any(
            (p.grad is not g) or (g is not None and g._version != v)
            for p, (g, v) in zip(self.flat.params, self._reduced_from))

    def reduce_again(self) -> None:
        """Stage 1: the next finish() reduces param.grad again (see grads_changed)."""
        self._end_update()
        self._finished = False

    def finish(self, check_stray: bool = True, clip: bool = False) -> torch.Tensor:
        """Waits for every reduction; returns the per-parameter 'some rank had a gradient'
        mask (uint8). Calling it again before the next pass or step returns the same.
        `clip`: for clip_grad_norm_, which its step's count names (counts.CLIP).

        Stages 2-3, with check_stray: a param.grad set after the last reduced backward (`p.grad
        = g` after backward, or a backward under no_sync() after the reduced one) would be
        left out of this step, so it is refused, on every rank (the step's count carries it),
        before anything is waited for; nothing changes. Without a backward since the last
        step such gradients are this step's (reduce_now)."""
        if self._finished:
            return self._global_used
        if self.stage == 1 or self.passes_since_step == 0:
            settings = None
            if self.stage == 1:
                # stage 1 counts no passes, but each rank updates its own shard: the ranks'
                # param groups' settings are compared in a small all-reduce issued before the
                # reduction and checked once that is under way (checked first, it would make
                # the ranks wait for each other before copying their gradients in: ~8 ms a
                # step here). A refused step changes nothing: its sums are dropped, and the
                # next step() reduces param.grad again
                # it carries the used mask: which param.grad the reduction reads (below)
                self._local_used = bytearray(p.grad is not None for p in self.flat.params)
                settings = self._counted(CLIP if clip else STEP, 0)
            self.reduce_now()
            if settings is not None:
                try:
                    settings.check()  # gives _global_used (_take_used)
                except RuntimeError:
                    self._retire(block_over=0)
                    raise
            stray = []
        else:
            stray = []
            if check_stray:  # read without __torch_function__ (see late_hook)
                with torch._C.DisableTorchFunctionSubclass():
                    stray = [i for i, p in enumerate(self.flat.params) if p.grad is not None]
        if self.check_counts:
            self._check_count()
            self._count = self._counted(STEP_STRAY if stray else CLIP if clip else STEP,
                                        self.passes_since_step)
            self._check_count()  # gives _global_used (_take_used)
        if stray:
            more = f" (and {len(stray) - 1} more)" if len(stray) > 1 else ""
            # every parameter at once: the usual cause is a DDP wrapper, whose reducer writes
            # its averaged gradient back into param.grad after zero_py's hook took it
            ddp = (" Every parameter has one: is the model wrapped in DistributedDataParallel? "
                   "zero_py reduces the gradients itself; give it the bare model (drop the "
                   "DDP(...) wrapper)." if len(stray) == len(self.flat.params) > 1 else "")
            raise RuntimeError(
                f"zero_py: parameter {self.name_of(stray[0])}{more} has a param.grad set "
                "after the last backward was reduced (e.g. `p.grad = g` after backward, or a "
                "backward under no_sync() after the reduced one). Stages 2-3 take each "
                "gradient from backward as it is reduced and leave param.grad None, so this "
                "step would ignore it. Put such terms into the loss before backward, assign "
                "gradients only in a step without backward (they are then reduced: the "
                "torch.autograd.grad idiom), or use stage 1; optimizer.zero_grad() drops them"
                + ddp)
        self._retire(block_over=0)
        # the update of the parameter shards follows: one-sided readers wait for its end (once:
        # a clip_grad_norm_ and a backward after it finish() twice before the step)
        if not self._updating:
            self._updating = True
            getattr(self.flat, "begin_update", lambda steps: None)(self.steps)
        self._finished = True
        return self._global_used

    @property
    def updating(self) -> bool:
        """finish() ran and the step has not ended: the optimizer may be writing the parameter
        shards (stage 3's one-sided readers cannot tell from the peers' versions)."""
        return self._updating

    def _end_update(self) -> None:
        if self._updating:
            self._updating = False
            getattr(self.flat, "end_update", lambda steps: None)(self.steps)

    def after_step(self) -> None:
        self.passes_since_step = 0
        self.forwards_since_step = 0
        self._unsynced = False
        self.steps += 1
        self._end_update()
        self._finished = False
        self._reduced_from = []

    def zero_grad(self, set_to_none: bool) -> None:
        self.settle_failed_backward()
        self.incomplete = False
        self._end_update()  # finish() without a step (clip_grad_norm_ alone): nothing changed
        self._finished = False
        self._reduced_from = []
        self._retire(block_over=0)
        self.grad_shard_valid = False
        self._unsynced = False
        self._local_used = bytearray(len(self.flat.params))
        self._global_used = None
        if not set_to_none:
            if self.mirror is not None:
                for b in range(self.flat.n_buckets):
                    self.mirror.writing(b)
            self.grads.zero_()
            if self.mirror is not None:  # its copy of the shard is what an offloaded step reads
                self.mirror.zeroed()
