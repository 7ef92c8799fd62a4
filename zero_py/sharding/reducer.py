"""Gradient reduction for stages 1 and 2: gradients into bucket buffers, reduce-scatter, shard.

The C schedule (zero_py._C.Schedule) decides when each bucket may be reduced; this module
feeds it events and carries out its answers through the executor.

Stage 2 registers a post-accumulate-grad hook on every managed parameter: the gradient is
divided by the world size into its slot of a bucket buffer (as DDP averages), param.grad is
dropped, and every bucket the schedule releases is reduce-scattered at once, asynchronously,
while backward goes on. A pass is opened by begin_pass() (the first hook of a backward, or
stage 3's engine when a unit's backward starts), which queues the one end-of-backward callback
on the autograd engine; that callback ends the pass (gradients that arrived outside hooks,
accumulated under no_sync(), are copied in, and the rest of the buckets are flushed in order)
and then runs the listeners given to on_backward_end(). Stage 1 runs the same pass from step(),
over param.grad, which it leaves in place. Under no_sync() no pass is opened: gradients stay in
param.grad until the first backward after the block.

Gradients are reduced in the parameters' dtype, or in `reduce_dtype` when given (fp32 for
bf16/fp16 models that want an exact sum); with `accum_dtype` (fp32) they travel in the reduce
dtype and are summed into an fp32 shard. The gradient shard (the rank's piece of every
bucket, one compact tensor per reduction dtype) accumulates over passes until zero_grad().
Which parameters got a gradient is tracked per rank and combined (an OR) in the step's Count,
where it rides (sharding/riders.py), so a parameter that no rank used is skipped by the
optimizer exactly as torch.optim skips a None gradient under DDP.

Ranks must run the same number of reduced backward passes per step (stages 2 and 3: each pass
is a sequence of collectives, and an extra one on one rank would pair with other collectives on
the others). Every pass and every step therefore begins with a small all-reduce of each rank's
(what, step, pass) (Count, sharding/counts.py): the first collective of a pass or step, so it
always meets its peers' own, and a mismatch raises on every rank naming each rank's count,
before any collective of the pass is launched: a reduction launched on one rank alone would
pair with a later collective of the group (gloo aborts the process on the size mismatch).
Stage 3 waits for it at once (its backward gathers are collective); stage 2 before its first
reduction (the count's round trip overlaps the filling of the first bucket), or at once where
the pass takes gradients accumulated under no_sync(), so that a refused pass leaves them in
param.grad. Backwards under no_sync() differ in collectives from reduced ones, so the ranks
must agree on them too: stage 3 announces each of them (it announces each training forward
too, announce_forward, whose gathers are collective); stage 2's add no collective, and the
next reduced pass says that it reduces gradients accumulated under no_sync().

Stage 3 tells the reducer, as a backward starts, which parameters get no gradient on this rank
(mark_unused: the units its forward did not run); their buckets are reduced from zeros at once
instead of at the end of backward, which a peer that ran those units would wait for.

A backward that raises never runs its end-of-backward callback: the next backward, forward
(stage 3), zero_grad() or step() finds it (settle_failed_backward), waits for the reductions it
started and ends its pass; where it had reduced some buckets, the next backward or step()
refuses until zero_grad() drops those partial gradients.

This file holds GradReducer's construction and its passes (the gradient hooks, begin_pass, the
end of backward, a backward that raised); its mixins hold the rest: the buckets (buckets.py:
copy in, launch, retire), a quantized wire's residuals and noise (residuals.py), the Counts it
announces (announcements.py) and what the optimizer asks of it after backward (finish.py).
"""

from __future__ import annotations

import weakref
from typing import Callable, Dict, List, Optional, Tuple

import torch

from zero_py._native import _C
from zero_py.collectives.pool import BufferPool
from zero_py.collectives.work import Work
from zero_py.sharding import grad_checks
from zero_py.sharding.announcements import Announcements
from zero_py.sharding.buckets import Buckets
from zero_py.sharding.counts import (PASS, PASS_AFTER_NO_SYNC, PASS_NO_SYNC,
                                     PASS_WITHOUT_BACKWARD, Count)
from zero_py.sharding.finish import Finish
from zero_py.sharding.layout import FlatLayout
from zero_py.sharding.residuals import Residuals
from zero_py.sharding.riders import Riders, pack_bytes, words_for
from zero_py.sharding.storage import PieceStore


# Reductions in flight before the backward thread waits for the oldest: bounds the memory held
# by bucket buffers to this many, plus the buckets being filled.
MAX_BUCKETS_IN_FLIGHT = 2


class _EndOfBackward:
    """The end-of-backward callback queued on a backward's graph task. Only the autograd
    engine holds it: a backward that raises drops it uncalled, so a dead weak reference to it
    (with no end seen) says that the backward ended by an exception (settle_failed_backward)."""

    def __init__(self, fn: Callable[[], None]):
        self.fn = fn

    def __call__(self) -> None:
        self.fn()


_INCOMPLETE = (
    "zero_py: a backward raised after it had reduce-scattered part of its gradients (stages "
    "2-3 reduce them bucket by bucket during backward), so the gradients held since the last "
    "zero_grad() are incomplete: call optimizer.zero_grad() before the next backward or "
    "step(), as a loop that skips a failed batch does (`except RuntimeError: "
    "optimizer.zero_grad(); continue`)")


class _NoBuckets:
    """The bucket schedule of a layout without parameters: nothing is ever released."""

    def grad_ready(self, i: int) -> list:
        raise IndexError(f"parameter {i}: this layout has no parameter")

    def flush(self) -> list:
        return []

    def reset(self) -> None:
        pass


class GradReducer(Buckets, Residuals, Announcements, Finish):
    def __init__(self, flat: FlatLayout, executor, stage: int,
                 reduce_dtype: Optional[torch.dtype] = None,
                 max_in_flight: int = MAX_BUCKETS_IN_FLIGHT,
                 accum_dtype: Optional[torch.dtype] = None):
        self.flat = flat
        self.max_in_flight = max_in_flight  # reductions in flight before backward waits
        self.executor = executor
        # DDP averages over every rank: under hybrid sharding, every replica's too
        self._averaged_over = getattr(executor, "data_parallel_size", executor.world_size)
        self.stage = stage
        # a stage-3 model with no trainable parameter reduces nothing (the C schedule needs a
        # bucket): its passes still open and end, driving the engine's end of backward
        self.schedule = (_C.Schedule(flat.param_bucket, flat.n_buckets) if flat.n_buckets
                         else _NoBuckets())
        device = flat.device
        # buckets travel in wire_dtype; the shard holds the sum, in accum_dtype when given (a
        # bf16 wire summed in fp32: the executor's reduce-scatter widens, collectives/quantized.py)
        self.wire_dtype = [reduce_dtype or flat.bucket_dtype(b) for b in range(flat.n_buckets)]
        self.grads = PieceStore(flat, lambda b: accum_dtype or self.wire_dtype[b], device)
        self.grad_shard_valid = False  # False: the next reduction overwrites instead of adding
        self.sync_enabled = True       # False inside no_sync()
        # which parameters got a gradient since zero_grad(): a bytearray, made a tensor as a
        # pass ends (setting an element of a tensor cost 5 us, a gradient)
        self._local_used = bytearray(len(flat.params))
        self._global_used: Optional[torch.Tensor] = None
        # what rides on the Counts (riders.py): the used mask rides on the step's count, read
        # there by finish() (its own all-reduce at each backward's end was one more round
        # trip a step); the stage-3 engine adds its order of first uses
        self.riders = Riders()
        self._carry_used = False  # the Count being built carries _local_used
        n_words = words_for(len(flat.params))
        self.riders.add(n_words, lambda: (pack_bytes(self._local_used, n_words)
                                          if self._carry_used else None), self._take_used)
        self._open: Dict[int, torch.Tensor] = {}  # bucket -> its buffer (from the pool)
        self._in_flight: List[Tuple[Work, Optional[torch.Tensor], int]] = []  # (reduction,
        # its buffer, its bucket)
        # an offloaded optimizer's host side (offload.HostShard): told when a reduction into a
        # bucket's piece completes (it copies the piece out), before the piece is written and
        # when the shard is zeroed (zeroed())
        self.mirror = None
        self._listeners: List[Callable[[], None]] = []  # run after each backward's pass
        self._before_end: List[Callable[[], None]] = []  # run before it ends
        # Bucket buffers are recycled: a new pass costs no allocation and no full memset, only
        # zeroing the slots that receive no gradient. A bucket takes the smallest idle buffer
        # that fits it (BufferPool), so a small bucket held open through backward (e.g. tied
        # embeddings, whose gradient arrives first and last) does not pin one the size of the
        # largest.
        self._pool = BufferPool(device)
        self._copied = bytearray(len(flat.params))  # gradient copied in during this pass
        self._pass_open = False
        self._callback_queued = False  # the end-of-backward callback is queued
        self._end_callback: Callable[[], Optional[_EndOfBackward]] = lambda: None  # weak
        self._launched = False  # a reduction was started in the open pass
        self.incomplete = False  # a backward raised after reducing some buckets (_INCOMPLETE)
        self._on_failed: List[Callable[[], None]] = []  # run by settle_failed_backward
        self._finished = False  # finish() ran since the last pass: its result stands
        # stage 1: the param.grad tensors (and their versions) its last reduction read; a
        # backward since (after a clip_grad_norm_, before step) changed one of them
        self._reduced_from: List[Tuple[Optional[torch.Tensor], int]] = []
        # run as a backward's pass opens with gradients already in the shard (stages 2-3)
        self._on_accumulate: List[Callable[[], None]] = []
        self.passes_since_step = 0
        self.steps = 0  # after_step() calls: the step the passes belong to
        self.forwards_since_step = 0  # stage 3's training forwards (announce_forward)
        # stage 2: a backward inside no_sync() left gradients in param.grad since the last
        # reduced pass, step or zero_grad(): the next pass reduces them and says so in its
        # count (_begin_pass); stage 3 announces each backward inside no_sync() instead
        self._unsynced = False
        # the pass and step counts are compared across ranks (Count); stage 3 waits for the
        # comparison as a pass starts, since its backward gathers are collective
        self.check_counts = stage >= 2
        # the optimizer's param_groups as (fingerprint, words), compared in the step's count
        self.hyperparameters: Callable[[], Optional[Tuple[int, Callable[[], str]]]] = (
            lambda: None)
        self.check_at_once = False
        self._count: Optional[Count] = None
        self._updating = False  # finish() ran: the optimizer may be writing the shards
        self._unused = bytearray(len(flat.params))  # marked unused in this pass
        # why no gradient may come now, if none should (the stage-3 engine sets it while a
        # forward run inside zero_py.gathered() may be backpropagated): the hooks raise it
        self.grads_refused: Optional[str] = None
        self._zero_input: Dict[torch.dtype, torch.Tensor] = {}
        # error feedback of a quantized wire (collectives/quantized.py): bucket -> fp32
        # residual of the peers' chunks, made at its first reduction and kept across steps
        self.error_feedback = getattr(executor, "error_feedback", False)
        self._residual: Dict[int, torch.Tensor] = {}
        # stochastic rounding of a quantized wire: each reduction's noise is (the seed
        # noise_seed() gives: the optimizer's rounding seed, per rank and step; a stream of the
        # bucket and the pass), so a run and its resumption repeat to the bit
        self.stochastic = getattr(executor, "stochastic_grads", False)
        self.noise_seed: Callable[[], int] = lambda: 0
        # how messages name parameter i (its storage index): the optimizer sets its names
        self.name_of: Callable[[int], str] = str
        self._hooks: List[Callable] = []  # the gradient hook of each parameter (stages 2-3)
        if stage == 2:
            for i, p in enumerate(flat.params):
                self._hooks.append(self._make_hook(i))
                p.register_post_accumulate_grad_hook(self._hooks[-1])

    # -- events ---------------------------------------------------------------------------------

    def late_hook(self) -> Optional[str]:
        """None, or why a hook registered after the reducer's is refused (grad_checks.py)."""
        return grad_checks.late_hook(self.flat.params, self._hooks, self.name_of)

    def _make_hook(self, i: int):
        def hook(param: torch.Tensor) -> None:
            # checked before any state changes, and on every rank alike: nothing to undo
            if self.grads_refused is not None:
                raise RuntimeError(self.grads_refused)
            grad_checks.check_grad(self.flat, i, param.grad, self.name_of)
            # this backward's first gradient (none queued its end, or that of a backward that
            # raised, which the engine dropped): before anything is copied
            if not self._callback_queued or self._end_callback() is None:
                late = self.late_hook()
                if late is not None:
                    raise RuntimeError(late)
            if not self.flat.is_gathered(self.flat.param_bucket[i]):
                raise RuntimeError(
                    f"zero_py: parameter {self.name_of(i)} got a gradient while its unit is not "
                    "gathered: under stage 3 a parameter outside the model's forward is its "
                    "shard slice; compute with it inside the forward (or `with "
                    "zero_py.gathered(model):`)")
            if not self.begin_pass():
                return
            if self._unused[i]:
                raise RuntimeError(
                    f"zero_py stage 3: parameter {self.name_of(i)} got a gradient, but its unit "
                    "did not run in this rank's forward, so it was reduced as unused already; "
                    "a unit's parameters must be used by its own module's forward (tie or "
                    "register them where they are used)")
            if torch.is_grad_enabled():  # create_graph=True: the copy records no history
                with torch.no_grad():
                    self._take(i)
            else:  # as backward runs its hooks otherwise: no_grad() would cost 5 us a gradient
                self._take(i)
        return hook

    def _take(self, i: int) -> None:
        """Parameter i's gradient (checked) into its bucket; the buckets it completes go."""
        self._copy_in(i, checked=True)
        for b in self.schedule.grad_ready(i):
            self._launch(b)

    @property
    def finished(self) -> bool:
        """finish() ran since the last pass, step or zero_grad(): the next step() takes its
        result (the gradients reduced then) as it stands."""
        return self._finished

    @property
    def pass_open(self) -> bool:
        """A backward pass is being reduced (begin_pass() ran, its end has not)."""
        return self._pass_open

    def on_backward_end(self, fn: Callable[[], None]) -> None:
        """Runs fn after every backward, once its pass has been ended (stage 3 frees its units
        there). fn also runs after backwards under no_sync(), where no pass is opened."""
        self._listeners.append(fn)

    def before_backward_end(self, fn: Callable[[], None]) -> None:
        """Runs fn at the end of every backward, before its pass ends (stage 3 issues the rest
        of its gathers there: every collective of the phase is then issued before this rank
        waits for any reduction, so no peer waits on a gather this rank has yet to issue)."""
        self._before_end.append(fn)

    def begin_pass(self) -> bool:
        """Called from inside backward: opens this backward's pass (once) and queues its end on
        the autograd engine. Returns whether gradients are reduced in this backward (False
        under no_sync())."""
        if self._callback_queued and self._end_callback() is not None:
            return self._pass_open  # this backward's (or an enclosing one's: reentrant)
        self.settle_failed_backward()
        if self.sync_enabled:
            self.check_complete()
        self._callback_queued = True
        self._queue_end()
        if self.sync_enabled:
            self._begin_pass()
            return self._pass_open
        if self.check_at_once:
            # stage 3: a backward inside no_sync() announces itself (its forward's count does
            # not tell: a forward inside no_sync() on every rank may be backpropagated outside
            # it on some), so that a peer starting a reduced pass here (its PASS count) meets
            # this and both raise, rather than wait in gathers and reductions that do not pair
            self._count = Count(self.executor, PASS_NO_SYNC, self.steps,
                                self.passes_since_step + 1, riders=self.riders)
            self._check_count()
        else:  # stage 2 adds no collective here: the next reduced pass announces what it left
            self._unsynced = True
        return False

    def _queue_end(self) -> None:
        # no frame that may end in an exception (whose traceback keeps its locals) holds it
        end = _EndOfBackward(self._backward_done)
        self._end_callback = weakref.ref(end)
        torch.autograd.Variable._execution_engine.queue_callback(end)

    def check_complete(self) -> None:
        """Raises where a backward that raised left part of its gradients in the shard (see
        settle_failed_backward): before a backward or a step uses them."""
        self.settle_failed_backward()
        if self.incomplete:
            raise RuntimeError(_INCOMPLETE)

    def on_failed_backward(self, fn: Callable[[], None]) -> None:
        """Runs fn when settle_failed_backward() finds a backward that raised (stage 3 ends its
        backward phase there: the units it gathered are freed)."""
        self._on_failed.append(fn)

    def settle_failed_backward(self) -> bool:
        """Whether a backward raised since the last call: its end-of-backward callback never
        ran (the engine dropped it). Ends what it left open, as every rank that raised at the
        same point does alike: the reductions it started (collectives its peers started too)
        are waited for, its bucket buffers go back to the pool, and stage 3's listeners end
        the backward phase. Where it had started a reduction, the gradient shard holds part
        of its gradients: the next backward or step() refuses (incomplete) until zero_grad().
        Called as a backward, forward (stage 3), zero_grad() or step() starts."""
        if not self._callback_queued or self._end_callback() is not None:
            return False
        self._callback_queued = False
        if self._pass_open:
            self._pass_open = False
            self.incomplete = self.incomplete or self._launched
            for buf in self._open.values():
                self._pool.give(buf)
            self._open = {}
            self._check_count()
            self._retire(block_over=0)
        for fn in self._on_failed:
            fn()
        return True

    def _backward_done(self) -> None:
        self._callback_queued = False
        for fn in self._before_end:
            fn()
        if self._pass_open:
            self._end_pass()
        for fn in self._listeners:
            fn()

    def before_accumulate(self, fn: Callable[[], None]) -> None:
        """Runs fn as a pass opens (stages 2-3), before its gradients are added to the shard
        (a clip_grad_norm_ since the last step scales what the shard holds first)."""
        self._on_accumulate.append(fn)


    def _begin_pass(self, kind: int = PASS) -> None:
        if self.check_counts:
            self._check_count()  # the previous pass's, if not checked yet
            if kind == PASS and self._unsynced:
                kind = PASS_AFTER_NO_SYNC
            self._count = Count(self.executor, kind, self.steps, self.passes_since_step + 1,
                                riders=self.riders)
            # waited for before the pass takes or launches anything its peers may not match:
            # at once under stage 3 (its backward gathers are collective) and where the pass
            # takes gradients accumulated under no_sync() (a refused pass must leave them in
            # param.grad); else before its first reduction (_launch)
            if self.check_at_once or kind == PASS_AFTER_NO_SYNC:
                self._check_count()
        if self.stage >= 2:
            for fn in self._on_accumulate:
                fn()
        self._unused = bytearray(len(self.flat.params))
        self._pass_open = True
        self._launched = False
        self._finished = False
        self.schedule.reset()
        self._copied = bytearray(len(self.flat.params))

    def _end_pass(self) -> None:
        """Releases every remaining bucket in order, first copying in the gradients no hook
        reported (no_sync leftovers; all of them in stage 1). Copying bucket by bucket keeps at
        most a few bucket buffers alive, as during backward."""
        self._check_count()
        with torch.no_grad():
            for b in self.schedule.flush():
                for i in self.flat.bucket_params[b]:
                    if not self._copied[i] and self.flat.params[i].grad is not None:
                        self._copy_in(i)
                self._launch(b)
            self.grad_shard_valid = True
        self._pass_open = False
        self._unsynced = False
        self.passes_since_step += 1

    def reduce_now(self) -> None:
        """A whole pass outside backward: stage 1's reduction, or stage 2's when this rank ran
        no backward since the last step (its peers did, and wait for its collectives)."""
        if self.stage == 1:
            self.grad_shard_valid = False  # param.grad holds the full sum: overwrite
            self._local_used = bytearray(len(self.flat.params))
            self._reduced_from = [(p.grad, p.grad._version if p.grad is not None else 0)
                                  for p in self.flat.params]
        # stage 3: its peers' backward gathered units with it; no backward here cannot match
        self._begin_pass(PASS_WITHOUT_BACKWARD if self.check_at_once else PASS)
        self._end_pass()
