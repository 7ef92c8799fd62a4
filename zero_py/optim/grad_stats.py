"""ZeroOptimizer's global gradient statistics (a mixin of zero_py/optim/optimizer.py): the loss
scale, and the norm and overflow check over every rank's gradient shard that clipping and loss
scaling need, in one read pass and one small all-reduce. Clipping is applied inside the next
step()'s update (its coefficient is kept here), not as a pass of its own."""

from __future__ import annotations

import math
from array import array
from typing import Dict, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from zero_py import kernels
from zero_py.collectives import stats as comm_stats
from zero_py.collectives.objects import gather_json
from zero_py.optim import agreement


class GradStatistics:
    """Needs the optimizer's loss_scaler, executor, _flat, _reducer; sets _nonfinite and
    _clip_coef for the next step()."""

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 without a loss scaler)."""
        return self.loss_scaler.scale if self.loss_scaler is not None else 1.0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """loss * loss_scale: call backward on this when a loss scaler is set."""
        return loss * self.loss_scale if self.loss_scaler is not None else loss

    def _grad_stats(self, norm_type: float, call: str = "step()",
                    refused: Optional[str] = None) -> Tuple[float, bool]:
        """Global sum of |g|^p (or max |g| for p = inf) over every rank's gradient shard, and
        whether any rank holds an inf or nan; one read pass and one small all-reduce.

        The all-reduce also carries what each rank was asked (`call`: the arguments in words)
        and whether it refused them (`refused`: why): a rank that raised alone before it, or
        clipped with its own max_norm, left the others waiting in a collective it never made,
        or clipped each rank's shard of the gradients by another coefficient. Such a call
        raises ValueError on every rank, before anything changes. For p = inf each rank's max
        goes in a slot of its own of the same all-reduce (the others' slots zero, so the SUM
        gives every rank every max): a second all-reduce (MAX) was one more round trip. The
        slots are there for every p, so the tensor has the same size on ranks that disagree
        on p; the max is read only once they are known to agree."""
        flat, grads = self._flat, self._reducer.grads
        if refused is None:
            tables: Dict[torch.dtype, array] = {}  # the pieces are ours: no checks needed
            for b in range(flat.n_buckets):
                piece = grads.piece(b)
                tables.setdefault(piece.dtype, array("q")).extend(
                    kernels.segment_row(piece.numel(), grad=piece.data_ptr()))
            both = kernels.grad_stats(tables, norm_type, flat.device,
                                      n_threads=torch.get_num_threads())
        else:
            both = torch.zeros(2, dtype=torch.float64)
        # a third element says whether this rank's sum is NaN: a MAX all-reduce (norm_type
        # inf) compares, and may keep a peer's finite value over a NaN, where torch's norm of
        # DDP's averaged gradients is NaN
        both = both.to(torch.float64)
        # built on the host and sent without blocking (a blocking copy to a device waits for
        # everything queued on the stream: the statistics' kernel, the backward before it)
        check = torch.tensor([float(refused is not None)] + agreement.call_terms(call),
                             dtype=torch.float64).to(both.device, non_blocking=True)
        nan = both[:1].isnan().to(both.dtype)
        by_max = math.isinf(norm_type) and refused is None
        # hybrid sharding: the call is compared over every rank (a replica clipping with its
        # own max_norm drifted from the others, 8% in one SGD step, unseen by its shard
        # group's comparison), so the all-reduce spans the world; the norm counts each
        # element once, from the first replica's ranks (the replicas hold the same bits;
        # adding the others' zeros is exact, so the sum is the shard group's to the bit)
        world = getattr(self.executor, "world", self.executor)
        slots = torch.zeros(world.world_size, dtype=both.dtype, device=both.device)
        if by_max:  # summed with the rest (0 here), the max taken from the slots
            slots[world.rank] = both[0]
        if by_max or (world is not self.executor and self.executor.replica_rank != 0):
            both[0] = 0.0
        both = torch.cat([both, nan, slots, check])
        if world.device != both.device:
            both = both.to(world.device)
        with comm_stats.control():
            work = world.all_reduce(both, dist.ReduceOp.SUM)
        work.wait()
        sums = both.cpu().tolist()
        ws = world.world_size
        maxima, terms = sums[3:3 + ws], sums[3 + ws:]
        if terms[0] > 0 or not agreement.calls_agree(terms[1:], ws):
            raise ValueError(self._call_refusal(world, call, refused))
        if by_max:  # a NaN max is the NaN flag's (sums[2]), whatever max() makes of it
            sums[0] = max(maxima)
        # sums[0], not both[0]: reading the device tensor again waited for the device a second
        # time each step
        return (float("nan") if sums[2] > 0 else sums[0]), sums[1] > 0

    def _call_refusal(self, world, call: str, refused: Optional[str]) -> str:
        """The error of a _grad_stats call refused on some rank or asked with other arguments
        on another: each rank's call and refusal (one exchange), the same text on every rank."""
        per_rank = gather_json(world, [call, refused], None)
        said = [e for _, e in per_rank if e]
        if said and len(said) == len(per_rank) and len(set(said)) == 1:
            head = said[0]  # every rank refused the same
        elif said:
            first = next(r for r, (_, e) in enumerate(per_rank) if e)
            head = f"rank {first} refused its arguments: {per_rank[first][1]}"
        else:
            head = ("the ranks passed different arguments, so each rank would clip its own "
                    "shard of the gradients by its own coefficient")
        lines = [f"zero_py: {head}"]
        lines += [f"  rank {r}: {c}" + (f" refused: {e}" if e else "")
                  for r, (c, e) in enumerate(per_rank)]
        lines.append("every rank must make the same call with the same arguments (e.g. "
                     "clip_grad_norm_(max_norm, norm_type) with the same values); nothing "
                     "was changed")
        return "\n".join(lines)

    def _settle_clip(self) -> None:
        """Stages 2-3, as a backward's pass opens with gradients in the shard: a
        clip_grad_norm_ since the last step has torch's effect on them now (torch's clip scales
        the gradients in place, so a backward after it adds to clipped ones). Its coefficient,
        and the non-finite flag, are of the gradients before this backward: both are dropped."""
        coef, self._clip_coef, self._nonfinite = self._clip_coef, None, None
        if coef is None or coef == 1.0:
            return
        reducer = self._reducer
        for b in range(self._flat.n_buckets):
            if reducer.mirror is not None:
                reducer.mirror.writing(b)  # a copy of the piece to the host finishes first
            reducer.grads.piece(b).mul_(coef)

    def _finish_reduction(self, clip: bool = False) -> Optional[torch.Tensor]:
        """The reducer's finish(). Stage 1 reduces param.grad when asked (it has no hooks in
        backward): where a backward ran between a clip_grad_norm_ and now, param.grad is
        reduced again, and the shard made what torch's would hold, the clipped gradients of
        before plus the new ones: S_new - (1 - coef) S_clipped."""
        reducer = self._reducer
        reducer.check_complete()
        if not reducer.grads_changed():
            return reducer.finish(clip=clip)
        coef, self._clip_coef, self._nonfinite = self._clip_coef, None, None
        n = self._flat.n_buckets
        held = ([reducer.grads.piece(b).clone() for b in range(n)]
                if coef is not None and coef != 1.0 else None)
        reducer.reduce_again()
        mask = reducer.finish(clip=clip)
        if held is not None:
            for b in range(n):
                piece = reducer.grads.piece(b)
                if reducer.mirror is not None:
                    reducer.mirror.writing(b)
                piece.add_(held[b], alpha=coef - 1.0)
                if reducer.mirror is not None:
                    reducer.mirror.reduced(b, piece)
        return mask

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0,
                        error_if_nonfinite: bool = False, *,
                        _left_out: Sequence[int] = ()) -> torch.Tensor:
        """Clips the gradients of all ranks together, as torch.nn.utils.clip_grad_norm_ does on
        DDP's full gradients, and returns the same total norm (of the unscaled gradients). The
        clip coefficient is applied inside the next step()'s update, not as a pass of its own.
        Call it after backward and before step().

        _left_out: the frozen parameters (indices into the storage's) that a call of torch's
        function over the trainable ones left out (compat.py): the norm and the coefficient
        cover every gradient, so one of them holding a gradient is refused."""
        # arguments this rank refuses are refused on every rank, in the statistics'
        # all-reduce (_grad_stats): raised here alone, they left the other ranks waiting
        refused = None
        try:
            max_norm, norm_type = float(max_norm), float(norm_type)
        except (TypeError, ValueError) as exc:
            refused = f"clip_grad_norm_ takes numbers for max_norm and norm_type: {exc}"
        else:
            if not (norm_type > 0 or math.isinf(norm_type)) or math.isnan(norm_type):
                refused = f"norm_type must be > 0 or inf, got {norm_type}"
        call = (f"clip_grad_norm_(max_norm={max_norm!r}, norm_type={norm_type!r}, "
                f"error_if_nonfinite={bool(error_if_nonfinite)})")
        if refused is not None:
            norm_type = 2.0
        with torch.no_grad():
            used = self._finish_reduction(clip=True)  # the same on every rank: so is a refusal
            held = [i for i in _left_out if used is not None and used[i]]
            if held:
                raise RuntimeError(
                    f"zero_py: torch.nn.utils.clip_grad_norm_ left out parameter "
                    f"{self._name(self._flat.params[held[0]])}, which has requires_grad=False "
                    "but holds a gradient of this step (it was frozen after its backward): "
                    "torch's function would leave it out of the norm and unclipped, which "
                    "zero_py's clipping of the whole gradient shard cannot; clip before "
                    "freezing it, or pass every parameter (model.parameters())")
            sum_pow, nonfinite = self._grad_stats(norm_type, call, refused)
        self._nonfinite = nonfinite
        if nonfinite and error_if_nonfinite:
            raise RuntimeError(f"the total norm of order {norm_type} of the gradients is "
                               "non-finite, so it cannot be clipped; set "
                               "error_if_nonfinite=False to go on")
        # inf and NaN go through as in torch's: an inf gradient makes the total inf
        total = (sum_pow if math.isinf(norm_type) else sum_pow ** (1.0 / norm_type))
        # a clip since the last step has not touched the gradients here (its coefficient
        # waits for the update): torch's would have scaled them, so this norm is of the
        # clipped gradients (the norm a loop logs after clipping) and the coefficients
        # compound, as torch's in-place clips do
        total /= self.loss_scale
        if self._clip_coef is not None:
            total *= self._clip_coef
        if nonfinite and self.loss_scaler is not None:
            self._clip_coef = None  # the step is skipped
            return torch.tensor(total, dtype=torch.float32)
        # torch multiplies the gradients by clamp(max_norm / (total + 1e-6), max=1) whatever
        # the total: 0 for an inf total (the finite gradients vanish, an inf one becomes NaN),
        # NaN for a NaN total (every gradient becomes NaN: _poison_gradients). DDP runs do so
        # on every rank alike, and so does this: the total is the same on every rank.
        coef = max_norm / (total + 1e-6)
        coef = coef if math.isnan(coef) or coef < 1.0 else 1.0
        self._clip_coef = (1.0 if self._clip_coef is None else self._clip_coef) * coef
        return torch.tensor(total, dtype=torch.float32)

    def _poison_gradients(self) -> None:
        """A NaN clip coefficient, applied as torch's clip_grad_norm_ applies it: every
        gradient becomes NaN, so every parameter the step updates does, as under DDP. The
        kernels take a finite grad_scale only, so the gradient shard itself is filled (and its
        host copy, when offloaded); overlap_step's early updates, made from the gradients
        before, are put back first."""
        self.discard_early_updates()
        reducer, host = self._reducer, self._host
        for b in range(self._flat.n_buckets):
            if reducer.mirror is not None:
                reducer.mirror.writing(b)
            reducer.grads.piece(b).fill_(float("nan"))
            if host is not None:
                host.grads_ready(b)
                host.grads.piece(b).fill_(float("nan"))
