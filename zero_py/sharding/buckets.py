"""GradReducer's buckets (a mixin of zero_py/sharding/reducer.py): each gradient averaged into
its slot of a bucket buffer (recycled through a BufferPool), a bucket the schedule releases
reduce-scattered into the gradient shard at once, asynchronously (or from zeros where this rank
used none of it: mark_unused), and the reductions in flight retired in order, at most
max_in_flight of them before backward waits."""

from __future__ import annotations

import torch

from zero_py.collectives.work import Work, issue
from zero_py.sharding import grad_checks


def _cuda_usable() -> bool:
    from zero_py.kernels import cuda  # CUDA runs only
    return cuda.is_available()


def _cuda_cast(src: torch.Tensor, dst: torch.Tensor, scale: float) -> None:
    from zero_py.kernels import cuda
    cuda.cast(src.reshape(-1), dst, scale)


class Buckets:
    """Needs the reducer's flat, executor, stage, schedule, wire_dtype, grads, mirror,
    max_in_flight, grad_shard_valid, name_of and the per-pass state it sets up (_open,
    _in_flight, _pool, _copied, _unused, _local_used, _launched, _pass_open, _zero_input), its
    counts (_check_count) and its quantized wire's extras (_residual_of, _noise)."""

    @property
    def peak_bucket_bytes(self) -> int:
        """The most bucket buffer bytes alive at once (idle, open or in flight)."""
        return self._pool.peak_bytes

    def _bucket_buffer(self, b: int) -> torch.Tensor:
        entry = self._open.get(b)
        if entry is None:
            view = self._pool.take(self.flat.bucket_numel[b], self.wire_dtype[b])
            for lo, hi in self.flat.bucket_gaps[b]:
                view[lo:hi].zero_()
            entry = self._open[b] = view
        return entry

    def _copy_in(self, i: int, checked: bool = False) -> None:
        p = self.flat.params[i]
        g = p.grad
        if not checked:
            grad_checks.check_grad(self.flat, i, g, self.name_of)
        b = self.flat.param_bucket[i]
        lo = self.flat.param_offset[i]
        n = self.flat.param_numel[i]
        # the planned size: a stage-3 parameter may already be its shard slice again here
        slot = self._bucket_buffer(b)[lo:lo + n]
        ws = self._averaged_over
        flat = self.flat.flat_of(i, g)  # 1-D in the parameter's memory order (a view if it can)
        if ws > 1 and g.dtype == slot.dtype:
            torch.div(flat, ws, out=slot)  # DDP's averaging, before the sum
        elif g.is_cuda and ws & (ws - 1) == 0 and flat.is_contiguous() and _cuda_usable():
            # widening and averaging in one pass (the CUDA cast kernel); * (1 / ws) equals
            # / ws exactly when ws is a power of two
            _cuda_cast(flat, slot, 1.0 / ws)
        else:
            slot.copy_(flat)  # widened first when reducing in a wider dtype
            if ws > 1:
                slot.div_(ws)
        self._local_used[i] = 1
        self._copied[i] = 1
        if self.stage == 2:
            p.grad = None

    def mark_unused(self, params) -> None:
        """Parameters (indices) that get no gradient in this pass on this rank, known when it
        starts (stage 3: those of units this rank did not run in its forward), made ready at
        once, as DDP's find_unused_parameters does: their buckets are released in order
        without waiting for the end of backward, which a peer that used them would wait for.
        A bucket they fill entirely is reduced from zeros without a buffer of its own and
        without waiting, so this never blocks."""
        if not self._pass_open:
            return
        with torch.no_grad():
            for i in params:
                if self._copied[i]:
                    continue
                if self.flat.params[i].grad is not None:
                    self._copy_in(i)  # accumulated under no_sync(): it goes with this pass
                else:
                    self._unused[i] = 1
                for b in self.schedule.grad_ready(i):
                    self._launch(b)

    def _zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """numel zeros of dtype, read-only, shared by every all-zero bucket."""
        z = self._zero_input.get(dtype)
        if z is None or z.numel() < numel:
            z = self._zero_input[dtype] = torch.zeros(numel, dtype=dtype, device=self.flat.device)
        return z[:numel]

    def _launch(self, b: int) -> None:
        # the pass's count, before its first reduction: a peer that is not starting the same
        # pass (a step, a pass reducing gradients accumulated under no_sync()) would leave the
        # reductions this rank launched unmatched, to pair with later collectives of the group
        self._check_count()
        ps = self.flat.bucket_params[b]
        if b not in self._open and all(self._unused[i] for i in ps):
            # nothing of this bucket on this rank (mark_unused): zeros in, and no wait; one
            # shared zero tensor where the executor's reduce-scatter leaves its input alone
            numel, dtype = self.flat.bucket_numel[b], self.wire_dtype[b]
            if getattr(self.executor, "reduce_scatter_keeps_input", False):
                self._launch_from(b, self._zeros(numel, dtype), pooled=False)
            else:
                self._launch_from(b, self._pool.take(numel, dtype).zero_(), pooled=True)
            return
        buf = self._bucket_buffer(b)
        self._open.pop(b)
        for i in self.flat.bucket_params[b]:
            if not self._copied[i]:  # no gradient on this rank: reduce zeros
                lo = self.flat.param_offset[i]
                buf[lo:lo + self.flat.param_numel[i]].zero_()
        self._launch_from(b, buf, pooled=True)
        self._retire(block_over=self.max_in_flight)

    def _launch_from(self, b: int, buf: torch.Tensor, pooled: bool) -> None:
        self._launched = True
        piece = self.grads.piece(b)
        describe = getattr(self.flat, "describe_bucket", None)
        what = (f"reduce-scatter of the gradients of "
                f"{describe(b) if describe is not None else f'bucket {b}'}")
        mirror = self.mirror
        extra = ((self._residual_of(b) if self.error_feedback else None,
                  self._noise(b)) if self.stochastic
                 else (self._residual_of(b),) if self.error_feedback else ())  # its extras
        if not self.grad_shard_valid:
            if mirror is not None:
                mirror.writing(b)
            work = issue(what, self.executor.reduce_scatter, piece, buf, *extra)
        else:
            tmp = torch.empty_like(piece)
            work = issue(what, self.executor.reduce_scatter, tmp, buf, *extra)

            def accumulate(piece=piece, tmp=tmp) -> None:
                if mirror is not None:
                    mirror.writing(b)
                piece.add_(tmp)
            work = Work(work, accumulate, what=what)
        self._in_flight.append((work, buf if pooled else None, b))

    def _retire(self, block_over: int) -> None:
        """Finishes completed reductions in order, and waits while more than `block_over` are
        in flight."""
        if len(self._in_flight) > block_over:
            self._check_count()  # a count mismatch is the clearer error than a lost reduction
        while self._in_flight and (len(self._in_flight) > block_over
                                   or self._in_flight[0][0].is_completed()):
            work, buf, b = self._in_flight.pop(0)
            work.wait()
            if buf is not None:
                self._pool.give(buf)
            if self.mirror is not None:
                self.mirror.reduced(b, self.grads.piece(b))
