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
"""

from __future__ import annotations

import weakref
from typing import Callable, Dict, List, Optional, Tuple

import torch

from zero_py._native import _C
from zero_py.collectives.pool import BufferPool
from zero_py.collectives.quantized import residual_numel
from zero_py.collectives.work import Work, issue
from zero_py.sharding import grad_checks
from zero_py.sharding.counts import (CLIP, EVAL_FORWARD, FORWARD, FORWARD_NO_SYNC, GATHERED,
                                     PASS, PASS_AFTER_NO_SYNC, PASS_NO_SYNC,
                                     PASS_WITHOUT_BACKWARD, STEP, STEP_STRAY,
                                     Count)
from zero_py.sharding.layout import FlatLayout
from zero_py.sharding.riders import Riders, pack_bytes, unpack_any, words_for
from zero_py.sharding.storage import PieceStore

def _cuda_usable() -> bool:
    from zero_py.kernels import cuda  # CUDA runs only
    return cuda.is_available()


def _cuda_cast(src: torch.Tensor, dst: torch.Tensor, scale: float) -> None:
    from zero_py.kernels import cuda
    cuda.cast(src.reshape(-1), dst, scale)


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


class GradReducer:
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

    @property
    def peak_bucket_bytes(self) -> int:
        """The most bucket buffer bytes alive at once (idle, open or in flight)."""
        return self._pool.peak_bytes

    # -- buckets --------------------------------------------------------------------------------

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
        if ws > 1 and g.dtype == slot.dtype:
            torch.div(self.flat.flat_of(i, g), ws, out=slot)  # DDP's averaging, before the sum
        elif g.is_cuda and ws & (ws - 1) == 0 and g.is_contiguous() and _cuda_usable():
            # widening and averaging in one pass (the CUDA cast kernel); * (1 / ws) equals
            # / ws exactly when ws is a power of two
            _cuda_cast(self.flat.flat_of(i, g), slot, 1.0 / ws)
        else:
            slot.copy_(self.flat.flat_of(i, g))  # widened first when reducing in a wider dtype
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

    def _noise(self, b: int) -> Tuple[int, int]:
        """The noise of bucket b's reduction in this pass: (seed, stream)."""
        seed = (self.noise_seed() * 0x9E3779B97F4A7C15 + 0x6A09E667) & 0xFFFFFFFFFFFFFFFF
        return seed, (b << 16) + min(self.passes_since_step, 0xFFFF)

    def _residual_of(self, b: int) -> torch.Tensor:
        r = self._residual.get(b)
        if r is None:
            n = residual_numel(self.executor.world_size, self.grads.piece(b).numel())
            r = self._residual[b] = torch.zeros(n, dtype=torch.float32, device=self.flat.device)
        return r

    def residuals(self) -> Dict[int, torch.Tensor]:
        """The error-feedback residuals made so far, by bucket (checkpoint/feedback.py)."""
        return dict(self._residual)

    def set_residuals(self, residuals: Dict[int, torch.Tensor]) -> None:
        """The residuals from now on (a load's; the buckets not given start at zero)."""
        for b, r in residuals.items():
            want = residual_numel(self.executor.world_size, self.grads.piece(b).numel())
            if r.dtype != torch.float32 or r.numel() != want:
                raise ValueError(f"the error-feedback residual of bucket {b} must be {want} "
                                 f"float32, got {r.dtype} x {r.numel()}")
        self._residual = dict(residuals)

    @property
    def residual_bytes(self) -> int:
        """Bytes of the error-feedback residuals once every bucket has been reduced."""
        if not self.error_feedback:
            return 0
        ws = self.executor.world_size
        return 4 * sum(residual_numel(ws, self.grads.piece(b).numel())
                       for b in range(self.flat.n_buckets))

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

    # -- what the optimizer asks -------------------------------------------------------------

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

    def _counted(self, kind: int, passes: int) -> Count:
        """The step's Count, with the param groups' settings and the used mask riding on it."""
        self._carry_used = True
        try:
            return Count(self.executor, kind, self.steps, passes, hyper=self.hyperparameters(),
                         riders=self.riders)
        finally:
            self._carry_used = False

    def _take_used(self, rows: torch.Tensor) -> None:
        """The step's count delivers every rank's used mask: 'some rank had a gradient', on
        the host (its readers index it per parameter)."""
        self._global_used = unpack_any(rows, len(self.flat.params))

    def announce_forward(self, eval_forward: bool, problem: Optional[str] = None) -> None:
        """Stage 3, at the start of a forward whose gathers are collective: every rank must be
        starting the same forward (compared now, before any gather). `problem`: why this
        rank refuses it, raised on every rank (the others say which rank refused)."""
        if not self.check_counts:
            if problem is not None:
                raise RuntimeError(problem)
            return
        self._check_count()
        n = self.forwards_since_step + (not eval_forward)
        # a training forward says whether it runs inside no_sync(): the ranks' backwards of it
        # differ in collectives otherwise (its own comparison, counts.py), and no collective is
        # added for it
        kind = (EVAL_FORWARD if eval_forward else FORWARD if self.sync_enabled else
                FORWARD_NO_SYNC)
        self._count = Count(self.executor, kind, self.steps, n, problem, riders=self.riders)
        self._check_count()  # a refused forward is not counted: every rank raised alike
        self.forwards_since_step = n

    def announce_gathered(self, what: str, key: int = 0) -> None:
        """Stage 3, before the collective gathers of a state dict or zero_py.gathered(): every
        rank must be starting one (compared now, before any gather), with the same `key` (what
        it gathers, e.g. a number for its units). A rank whose peers go on to a forward,
        backward or step, or start one with another key, raises with them, naming each rank's
        call; a rank whose peers run no collective of the group raises after its timeout."""
        self._check_count()
        self._count = Count(self.executor, GATHERED, self.steps, key, what=what,
                             riders=self.riders)
        self._check_count()

    @property
    def updating(self) -> bool:
        """finish() ran and the step has not ended: the optimizer may be writing the parameter
        shards (stage 3's one-sided readers cannot tell from the peers' versions)."""
        return self._updating

    def _check_count(self) -> None:
        """Raises on every rank if the ranks' last pass or step announcements differ."""
        count, self._count = self._count, None
        if count is not None:
            count.check()

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
