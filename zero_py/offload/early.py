"""EarlyStep: an offloaded optimizer's step started during backward (offload_optimizer="cpu",
overlap_step=share), so that the CPU update of the first buckets to be reduced runs while the
device is still in backward instead of after it.

The step's inputs are all known when a bucket's gradient reaches the host except two that
depend on every bucket: the clipping coefficient (the total norm) and whether the step is
skipped (an overflow under a loss scaler). EarlyStep guesses them (no clipping, not skipped) and
checks the guess when step() comes:

    reduced(b)   the reducer finished bucket b (it is the reducer's mirror, ahead of HostShard):
                 the copy to the host is queued as without overlap, then, if bucket b fits in
                 the backup and the optimizer has states to update, a worker thread waits for
                 the copy, saves b's master and states into the backup and runs the fused
                 kernel on b with the guessed inputs (the step counts, seed, loss scale and
                 hyperparameters of the coming step, clipping coefficient 1)
    settle(args) step(): every early bucket whose guess equals the real inputs (same gradient
                 scale, so neither clipped nor rescaled; every parameter of the bucket updated,
                 with the same step counts, seed and hyperparameters) is kept, and the step does
                 not update it again; any other is put back from the backup and updated by the
                 step as usual
    discard()    anything not settled is put back: at the end of step() (end_step(); all
                 of it when the step is skipped), at zero_grad() without a step, before a state
                 dict or checkpoint taken between backward and step, and for a bucket reduced
                 again by an accumulating backward (writing(b)); and a bucket whose state
                 optimizer.state[p] reads between backward and step()

A kept bucket ran the same kernel on the same bytes as the step would have, so the result is
the same to the bit as without overlap; the tests compare whole runs. The cost is host memory:
the backup holds (1 + n_states) fp32 values per element of the buckets that may go early, at
most `share` of the shard (a bucket gets a slot of its own the first time it goes early, and
keeps it: the same buckets are reduced first every step).
"""

from __future__ import annotations

import concurrent.futures
import math
from typing import Callable, Dict, Optional, Sequence, Set, Tuple

import torch

from zero_py import kernels
from zero_py.offload.host import HostShard


def check_overlap_step(overlap_step, offload_optimizer: Optional[str], stage: int) -> float:
    """overlap_step as a share in [0, 1] (True is 1, False 0), or a clear error."""
    if isinstance(overlap_step, bool):
        overlap_step = 1.0 if overlap_step else 0.0
    if not isinstance(overlap_step, (int, float)) or not math.isfinite(overlap_step) \
            or not 0.0 <= overlap_step <= 1.0:
        raise ValueError(f"overlap_step must be a share of the shard in [0, 1] (or True/False), "
                         f"got {overlap_step!r}")
    if overlap_step and offload_optimizer != "cpu":
        raise ValueError("overlap_step updates buckets on the host during backward: it needs "
                         "offload_optimizer='cpu'")
    if overlap_step and stage == 1:
        raise ValueError("overlap_step needs stage 2 or 3: stage 1 reduces the gradients in "
                         "step(), so no bucket is ready during backward")
    return float(overlap_step)


class EarlyStep:
    """The early updates of an offloaded fused optimizer (see the module docstring).

    `guess(b)` (the optimizer's) gives the inputs of the coming step for bucket b as
    (used, step_count, grad_scale, seed, stochastic_rounding) plus the hyperparameters of b's
    group, or None when b must not go early (no states yet: the first step makes them)."""

    def __init__(self, host: HostShard, update, share: float,
                 guess: Callable[[int], Optional[Tuple[tuple, object]]]):
        self.host = host
        self.update = update
        self.guess = guess
        flat = host.flat
        self.width = 1 + len(update.keys)
        self.budget_numel = int(share * flat.shard_numel)
        self.backup = torch.empty(self.budget_numel * self.width, dtype=torch.float32)
        self._slot: Dict[int, int] = {}  # bucket -> its element offset in the backup, for good
        self._next = 0
        self._jobs: Dict[int, Tuple[concurrent.futures.Future, tuple, object]] = {}
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self.kept_last_step = 0  # buckets the last step took from the early updates
        self.early_last_step = 0  # buckets that went early before it
        self._settled = False  # settle() ran in this step

    # -- the reducer's mirror ------------------------------------------------------------------

    def reduced(self, b: int, piece: torch.Tensor) -> None:
        self.host.reduced(b, piece)
        self._cancel(b)  # not expected (writing(b) comes first), but never run b twice
        guess = self.guess(b)
        if guess is None or not self._has_slot(b):
            return
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="zero_py-early-step")
        args, hyper = guess
        self._jobs[b] = (self._pool.submit(self._run, b, args, hyper), args, hyper)

    def writing(self, b: int) -> None:
        self._cancel(b)
        self.host.writing(b)

    def zeroed(self) -> None:
        self.discard()
        self.host.zeroed()

    # -- the step ------------------------------------------------------------------------------

    def settle(self, args: tuple, hyper_of: Callable[[int], object]) -> Set[int]:
        """The buckets whose early update stands for the step with inputs `args` (used,
        step_count, grad_scale, seed, stochastic_rounding); the others are put back."""
        kept: Set[int] = set()
        self.early_last_step = len(self._jobs)
        self._settled = True
        for b in list(self._jobs):
            fut, guessed, hyper = self._jobs.pop(b)
            if not self._finish(fut):
                continue  # it failed and put itself back: the step updates it
            if self._same(b, guessed, args) and hyper == hyper_of(b):
                kept.add(b)
            else:
                self._restore(b)
        self.kept_last_step = len(kept)
        return kept

    def discard(self, buckets: Optional[Sequence[int]] = None) -> None:
        """Puts back every early update not settled (of `buckets` only, if given)."""
        for b in list(self._jobs) if buckets is None else buckets:
            self._cancel(b)

    def end_step(self) -> None:
        """The end of step(): what it did not settle (all, when it was skipped) goes back."""
        if not self._settled:
            self.early_last_step, self.kept_last_step = len(self._jobs), 0
        self._settled = False
        self.discard()

    def nbytes(self) -> int:
        return self.backup.numel() * 4

    def close(self) -> None:
        self.discard()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    # -- internals ---------------------------------------------------------------------------

    def _has_slot(self, b: int) -> bool:
        if b in self._slot:
            return True
        n = self.host.flat.bucket_shard_numel[b]
        if n == 0 or self._next + n > self.budget_numel:
            return False
        self._slot[b] = self._next
        self._next += n
        return True

    def _views(self, b: int):
        """(backup rows, live tensors) of bucket b: its master piece and each state's range."""
        flat = self.host.flat
        n = flat.bucket_shard_numel[b]
        at = self._slot[b] * self.width
        rows = self.backup[at:at + n * self.width].view(self.width, n)
        r = flat.shard_range(b)
        live = [self.host.piece(b)] + [t[r.start:r.stop] for t in self.update.states]
        return rows, live

    def _run(self, b: int, args: tuple, hyper: tuple) -> None:
        self.host.grads_ready(b)
        rows, live = self._views(b)
        # one call on the kernels' threads (torch's copy from this worker thread ran at a
        # quarter of the memory's bandwidth on a 16-core host, slower than the update itself)
        kernels.copy_tensors(list(zip(rows, live)), n_threads=self.host.threads)
        try:
            # the hyperparameters of the guess, not the live groups: the main thread may
            # change them meanwhile (the step then sees the difference and redoes b)
            self.update.step(*args, buckets=[b],
                             param_groups={self.host.flat.bucket_group[b]: dict(hyper)})
        except BaseException:
            self._restore(b)
            raise

    @staticmethod
    def _finish(fut: concurrent.futures.Future) -> bool:
        """Waits for a job; False when it failed (nothing to put back: _run restores the
        bucket itself when the kernel fails, and a failed wait for the copy saved nothing)."""
        try:
            fut.result()
        except BaseException:
            return False
        return True

    def _cancel(self, b: int) -> None:
        if b not in self._jobs:
            return
        fut, _, _ = self._jobs.pop(b)
        if self._finish(fut):
            self._restore(b)

    def _restore(self, b: int) -> None:
        rows, live = self._views(b)
        kernels.copy_tensors(list(zip(live, rows)), n_threads=self.host.threads)

    def _same(self, b: int, guessed: tuple, args: tuple) -> bool:
        used, counts, grad_scale, seed, sr = args
        g_used, g_counts, g_scale, g_seed, g_sr = guessed
        if (grad_scale, seed, sr) != (g_scale, g_seed, g_sr):
            return False
        params: Sequence[int] = self.host.flat.bucket_params[b]
        return all(used[i] == g_used[i] and counts[i] == g_counts[i] for i in params)
