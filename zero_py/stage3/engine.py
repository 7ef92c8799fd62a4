"""The stage-3 engine: hooks that gather each unit before its forward and backward, free it
after, and the C prefetch schedule that decides what is gathered ahead.

Reading order. sharding/units.py cuts the model into units; sharding/storage.py's
ShardedParams keeps this rank's shards and gathers a unit's buckets on demand (between uses a
parameter is its own shard slice, never a tensor without storage). shard_parameters() below
builds the storages from the model's values. Stage3Engine installs the hooks and runs the C
prefetch schedule (zero_py._C.Prefetch):
  pre-forward of a unit   -> need(u): gather it (and, ahead, the next units of the recorded
                             order within a live-bytes budget); wait for it
  post-forward            -> done(u): free it (kept until backward with
                             reshard_after_forward=False, and always for the root and the
                             last unit of the recorded order, which backward needs first)
  grad of a unit's output -> need(u) in the backward phase (gathered again)
  grad of a unit's inputs -> done(u): its backward is over, free it
  end of backward         -> drain the schedule, free everything, agree on the next order
Gradients are reduce-scattered as in stage 2 (sharding/reducer.py: post-accumulate-grad hooks,
the C bucket schedule), so a unit's gradients leave as soon as its backward is done; the
reducer owns the end-of-backward callback and calls the engine after it.

Every rank must issue its all-gathers in the same sequence. The schedule guarantees it for the
gathers it schedules (the recorded order, drained at the end of each phase), whatever each
rank's own path; the order itself is merged over ranks after every backward (a MAX all-reduce of
first-use positions), so units that some ranks skip are still gathered by all. Gathers run on
an executor channel of their own (collectives.channel), so their timing never interleaves
differently with the reductions across ranks. What cannot be made consistent is a unit that
ranks call a different number of times, or in a different relative order, in the same step:
that is an error in the user's program under any ZeRO-3 (documented in docs/stage3.md).
"""

from __future__ import annotations

import contextlib
from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from zero_py._native import _C
from zero_py.collectives.work import issue
from zero_py.sharding.reducer import GradReducer
from zero_py.sharding.storage import GatherMeter, ShardedParams


def _in_backward() -> bool:
    """True while the autograd engine runs a backward pass on this thread (e.g. the forward
    that activation checkpointing recomputes)."""
    return torch._C._current_graph_task_id() != -1


def shard_parameters(params: Sequence[nn.Parameter], groups: Sequence[int],
                     unit_of: Dict[int, int], n_units: int, executor, align_bytes: int,
                     meter: GatherMeter, persistence_threshold: int,
                     uninitialized: Set[int]) -> ShardedParams:
    """The sharded storage of `params`, filled from their current values (rank 0's, broadcast),
    one bucket at a time: the caller's storage of a parameter is dropped as soon as its bucket
    is done, so no more than one unit is whole at a time beyond the model the caller built.
    Parameters with fewer than `persistence_threshold` elements go to the persistent unit
    (n_units: never freed). Buckets whose parameters are all in `uninitialized` (built on the
    meta device) are neither filled nor broadcast: replay_init fills their pieces later."""
    persistent = n_units
    units = [persistent if p.numel() < persistence_threshold else unit_of[id(p)] for p in params]
    flat = ShardedParams(params, groups, units, n_units + 1, executor, align_bytes, meter,
                         persistent_unit=persistent)
    with torch.no_grad():
        for b in range(flat.n_buckets):
            # the values to lay out, taken before materialize() points .data elsewhere
            values = {i: flat.params[i].detach() for i in flat.bucket_params[b]
                      if id(flat.params[i]) not in uninitialized}
            flat.materialize(b, values)
            del values
    return flat


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs; its backward runs once the gradients of those inputs are
    computed, i.e. when the unit's backward is over."""

    @staticmethod
    def forward(ctx, engine, unit, *tensors):
        ctx.engine, ctx.unit = engine, unit
        return tensors if len(tensors) != 1 else tensors[0]

    @staticmethod
    def backward(ctx, *grads):
        ctx.engine._post_backward(ctx.unit)
        return (None, None) + grads


class Stage3Engine:
    """Hooks and prefetch for one stage-3 model (see the module docstring).

    storages: the model's ShardedParams (the trainable ones, then the frozen ones if any), laid
    out over the same units; `executor` runs the small all-reduce that merges the order."""

    def __init__(self, model: nn.Module, units: List[Tuple[str, nn.Module]],
                 storages: Sequence[ShardedParams], executor, reducer: GradReducer,
                 reshard_after_forward: bool, prefetch_bytes: Optional[int]):
        self.model = model
        self.units = units
        self.storages = list(storages)
        self.flat = self.storages[0]
        self.executor = executor
        self.reducer = reducer
        self.reshard_after_forward = reshard_after_forward
        self._pending: Dict[int, list] = {}
        self._post_pending: List[int] = [0] * len(units)
        self._phase: Optional[int] = None
        self._order_pending = None
        self._hooks: list = []
        self._held: List[Set[int]] = []  # units held by open gathered() blocks
        self.raw = False  # True: model.state_dict() gives torch's own entries (the slices)
        n = len(units)
        unit_bytes = [max(sum(s.unit_bytes[u] for s in self.storages), 1) for u in range(n)]
        keep = [u == 0 or not reshard_after_forward for u in range(n)]
        budget = prefetch_bytes
        if budget is None:
            kept = sum(b for b, k in zip(unit_bytes, keep) if k)
            budget = kept + 2 * max([b for b, k in zip(unit_bytes, keep) if not k] or [0])
        self.prefetch = _C.Prefetch(unit_bytes, keep, int(budget))
        self._unit_bytes, self._budget = unit_bytes, int(budget)
        self.prefetch.set_order(list(range(n)))
        for storage in self.storages:  # failed gathers name the unit's module
            storage.unit_names = [name for name, _ in units]
        reducer.on_backward_end(self._end_backward)
        reducer.check_at_once = True  # a rank must not start the backward's gathers alone
        for u, (_, module) in enumerate(units):
            self._hooks.append(module.register_forward_pre_hook(
                self._make_pre_forward(u), with_kwargs=True))
            self._hooks.append(module.register_forward_hook(self._make_post_forward(u)))

    @property
    def persistent_unit(self) -> int:
        return len(self.units)

    # -- hooks --------------------------------------------------------------------------------

    def _make_pre_forward(self, u: int):
        def hook(module, args, kwargs):
            return self._pre_forward(u, args, kwargs)
        return hook

    def _make_post_forward(self, u: int):
        def hook(module, args, output):
            return self._post_forward(u, output)
        return hook

    def _pre_forward(self, u: int, args, kwargs):
        if _in_backward():
            # recomputation under activation checkpointing: the unit is needed again now
            if self._phase != _C.PF_BACKWARD:
                self._begin_backward()
            self._run(self.prefetch.need(u))
            self._wait(u)
            if torch.is_grad_enabled() and self._post_pending[u] == 0:
                return self._mark_inputs(u, args, kwargs)  # reentrant: this graph is backed
            return None
        if self._held:  # inside gathered(): run on the full values, no schedule
            if not any(u in held for held in self._held):
                raise RuntimeError(
                    f"zero_py stage 3: unit {self.units[u][0]!r} runs inside zero_py.gathered() "
                    "without being gathered; gather the whole model: zero_py.gathered(model)")
            return None
        if u == 0:
            self._begin_forward()
        elif self._phase is None:
            raise RuntimeError(
                f"zero_py stage 3: unit {self.units[u][0]!r} was called outside the forward of "
                "the model given to zero_py.initialize; call the model itself, or read the "
                "parameters inside `with zero_py.gathered(model):`")
        self._run(self.prefetch.need(u))
        self._wait(u)
        if torch.is_grad_enabled():
            return self._mark_inputs(u, args, kwargs)
        return None

    def _mark_inputs(self, u: int, args, kwargs):
        flat_args, spec = tree_flatten((args, kwargs))
        at = [k for k, a in enumerate(flat_args)
              if isinstance(a, torch.Tensor) and a.requires_grad]
        if not at:
            return None  # nothing to hang the marker on: the end of backward frees the unit
        self._post_pending[u] += 1
        out = _PostBackward.apply(self, u, *[flat_args[k] for k in at])
        if len(at) == 1:
            out = (out,)
        for k, t in zip(at, out):
            flat_args[k] = t
        return tree_unflatten(flat_args, spec)

    def _post_forward(self, u: int, output):
        if _in_backward():
            return None  # recomputation: its backward follows, which frees the unit
        if torch.is_grad_enabled():
            for t in tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(self._make_pre_backward(u))
        if self._held or self._phase is None:
            return None  # inside gathered()
        self._run(self.prefetch.done(u))
        if u == 0:
            self._run(self.prefetch.end())
            self._phase = None
        return None

    def _make_pre_backward(self, u: int):
        def hook(grad):
            if self._phase != _C.PF_BACKWARD:
                self._begin_backward()
            self._run(self.prefetch.need(u))
            self._wait(u)
            return None
        return hook

    def _post_backward(self, u: int) -> None:
        self._post_pending[u] -= 1
        if self._post_pending[u] == 0 and self._phase == _C.PF_BACKWARD:
            self._run(self.prefetch.done(u))

    # -- phases -------------------------------------------------------------------------------

    def _begin_forward(self) -> None:
        if self._phase is not None:  # a forward or backward that never ended (an exception)
            self._run(self.prefetch.end())
            self._phase = None
        if self._order_pending is not None:
            work, positions = self._order_pending
            work.wait()
            self._order_pending = None
            n = len(self.units)
            ranked = sorted((n - int(v), k) for k, v in enumerate(positions.tolist()) if v > 0)
            order = [k for _, k in ranked]
            self.prefetch.set_order(order)
            if self.reshard_after_forward:
                # the last units of the forward are the first of the backward: keep them
                # gathered in between rather than free them and gather them again at once.
                # The last one always (it is resident there anyway, next to the unit before
                # or after it), and the ones before it while they fit in what the prefetch
                # budget lets backward hold beside the root (by default the root plus two
                # units: the last two), so the peak stays the budget's
                keep = [u == 0 for u in range(n)]
                room = self._budget - self._unit_bytes[0]
                for k in reversed([k for k in order if k != 0]):
                    if any(keep[1:]) and self._unit_bytes[k] > room:
                        break
                    keep[k] = True
                    room -= self._unit_bytes[k]
                self.prefetch.set_keep(keep)
        self._phase = _C.PF_FORWARD if torch.is_grad_enabled() else _C.PF_FORWARD_EVAL
        self.prefetch.begin(self._phase)
        self._post_pending = [0] * len(self.units)

    def _begin_backward(self) -> None:
        if self._phase is not None:  # the model's forward did not end (a partial forward)
            self._run(self.prefetch.end())
        self._phase = _C.PF_BACKWARD
        self.prefetch.begin(_C.PF_BACKWARD)
        self.reducer.begin_pass()  # queues the end of backward, which calls _end_backward

    def _end_backward(self) -> None:
        """After the reducer ended this backward's pass (or skipped it under no_sync())."""
        if self._phase != _C.PF_BACKWARD:
            return  # a backward through none of this model's units
        with torch.no_grad():
            self._run(self.prefetch.end())
            self._phase = None
            self._post_pending = [0] * len(self.units)
            # agree on the next order: each unit's first-use position on any rank
            n = len(self.units)
            positions = torch.zeros(n, dtype=torch.int64, device=self.executor.device)
            seen = self.prefetch.seen()
            if seen:
                positions[torch.tensor(seen, dtype=torch.int64)] = torch.arange(
                    n, n - len(seen), -1, dtype=torch.int64).to(positions.device)
            work = issue("all-reduce of the units' order at the end of backward",
                         self.executor.all_reduce_max, positions)
            self._order_pending = (work, positions)

    # -- commands -----------------------------------------------------------------------------

    def _run(self, commands) -> None:
        for kind, u in commands:
            if kind == _C.PF_GATHER:
                self._gather(u)
            else:
                self._free(u)

    _PHASE_NAMES = {_C.PF_FORWARD: "the forward", _C.PF_FORWARD_EVAL: "a no_grad forward",
                    _C.PF_BACKWARD: "the backward"}

    def _gather(self, u: int) -> None:
        phase = self._PHASE_NAMES.get(self._phase, "zero_py.gathered()")
        works = [s.gather(b) for s in self.storages for b in s.unit_buckets[u]]
        self._pending[u] = [w.named(f"{w.what} for {phase}") for w in works]

    def _wait(self, u: int) -> None:
        for work in self._pending.pop(u, ()):
            work.wait()

    def _free(self, u: int) -> None:
        self._wait(u)
        for s in self.storages:
            for b in s.unit_buckets[u]:
                s.free(b)

    def is_gathered(self, u: int) -> bool:
        return all(s.is_gathered(b) for s in self.storages for b in s.unit_buckets[u])

    @contextlib.contextmanager
    def raw_state_dict(self):
        """model.state_dict() without the full-value hook inside the block."""
        self.raw, before = True, self.raw
        try:
            yield
        finally:
            self.raw = before

    # -- gathered access ------------------------------------------------------------------------

    def gathered(self, params: Optional[Set[int]], modifier_rank: Optional[int]):
        """Full values of the units holding `params` (ids; None: all). Collective. With
        `modifier_rank`, that rank's values are broadcast and stored into every rank's shards
        on exit (the caller syncs the optimizer's fp32 masters)."""
        units = sorted({s.param_unit[i] for s in self.storages
                        for i, p in enumerate(s.params) if params is None or id(p) in params})
        return self.hold(units, modifier_rank)

    @contextlib.contextmanager
    def hold(self, wanted: Sequence[int], modifier_rank: Optional[int] = None):
        """gathered() by unit ids. Collective."""
        if self._phase is not None:
            raise RuntimeError("zero_py.gathered() cannot be used inside the model's forward or "
                               "backward; use it between steps")
        opened = [u for u in wanted if not self.is_gathered(u)]
        # memory_report's gathered_peak is training's working set: what the caller holds
        # here (up to the whole model) is the caller's, and is not counted in it
        meter = self.flat.meter
        peak_before = meter.peak_bytes
        for u in opened:
            self._gather(u)
        for u in opened:
            self._wait(u)
        self._held.append(set(wanted))
        try:
            yield
            if modifier_rank is not None:
                with torch.no_grad():
                    for u in wanted:
                        pending = [(s, b, s.executor.broadcast(s.full_buffer(b), modifier_rank))
                                   for s in self.storages for b in s.unit_buckets[u]]
                        for s, b, work in pending:
                            work.wait()
                            s.load_pieces_from(b, s.full_buffer(b))
        finally:
            self._held.pop()
            for u in opened:
                self._free(u)
            meter.peak_bytes = max(peak_before, meter.bytes)
