"""The stage-3 engine: hooks that gather each unit before its forward and backward, free it
after, and the C prefetch schedule that decides what is gathered ahead.

Reading order. sharding/units.py cuts the model into units; sharding/storage.py's
ShardedParams keeps this rank's shards and gathers a unit's buckets on demand (between uses a
parameter is its own shard slice, never a tensor without storage); shard.py's
shard_parameters() builds the storages from the model's values. Stage3Engine installs the
hooks and runs the C prefetch schedule (zero_py._C.Prefetch):
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
rank's own path; the order itself is merged over ranks after every backward (merge_orders: a
topological order of every rank's first uses, which ride on the next Count), so units that some
ranks skip are still gathered by all. Gathers run on an executor channel of their own
(collectives.channel). Two channels can deadlock when a rank waits on one for a peer that waits
on the other, so in backward a rank issues the gathers of units its forward did not run as soon
as the schedule reaches them (_skip_ahead, freed once complete, never waited for there), the
reducer sends those units' gradients as zeros at once (GradReducer.mark_unused, DDP's
find_unused_parameters), and the backward's last gathers are issued before its last reductions
are waited for (_drain_backward). A gather only this rank makes (a no_grad forward, which a
rank may run alone; a unit reached out of the order, or run twice by this rank only) copies
every rank's shard out of shared memory, with no collective, where the ranks share a host
(ShardedParams.gather_one_sided); elsewhere such gathers are collective, and a no_grad forward
is announced first (GradReducer.announce_forward) so that one rank's alone is refused on every
rank. docs/stage3.md, "Control flow that differs between ranks".
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from zero_py._native import _C
from zero_py.sharding.reducer import GradReducer
from zero_py.sharding.storage import ShardedParams
from zero_py.stage3.drain import DrainGathers
from zero_py.stage3.entries import entry_points
from zero_py.stage3.model_changes import ModelChanges
from zero_py.stage3.hold import TRAINING_FORWARD_HELD, hold_units
from zero_py.stage3.user_edits import keep_post_hook_last, keep_pre_hooks_first


def _not_traced(fn):
    """fn, run eagerly under torch.compile (torch._dynamo.disable) where torch has dynamo."""
    dynamo = getattr(torch, "_dynamo", None)
    return dynamo.disable(fn) if dynamo is not None and hasattr(dynamo, "disable") else fn


def _weakly(method):
    """A callable that runs the bound `method` while its object lives (else nothing)."""
    ref = weakref.WeakMethod(method)

    def call():
        m = ref()
        if m is not None:
            m()
    return call


def _guard_module_hooks() -> None:
    """Makes torch.compile guard on module hooks, once per process. By default dynamo does
    not (torch._dynamo.config.skip_nnmodule_hook_guards): code it compiled for a module class
    before the engine hooked modules of it (a model compiled before initialize, another
    stage-3 model with another wrap policy) ran again without the hooks whenever the
    parameters had the shapes it was compiled for, so a unit ran without being announced and
    its backward failed (`... its unit did not run in this rank's forward`). The code compiled
    until then carries no such guard: it is dropped (torch._dynamo.reset(); what is compiled
    again guards on hooks)."""
    config = getattr(getattr(torch, "_dynamo", None), "config", None)
    if getattr(config, "skip_nnmodule_hook_guards", False):
        config.skip_nnmodule_hook_guards = False
        torch._dynamo.reset()


def _in_backward() -> bool:
    """True while the autograd engine runs a backward pass on this thread (e.g. the forward
    that activation checkpointing recomputes)."""
    return torch._C._current_graph_task_id() != -1


# the frame of a module's call (nn.Module._call_impl): _forward_running looks for the model's
_MODULE_CALL = nn.Module._call_impl.__code__

# the engine's phase between the backward's last gathers and the end of its pass (the C
# schedule's phase is closed already)
_BACKWARD_ENDING = -2


def _forget_autocast_casts() -> None:
    """As a forward or a backward starts, drops the casts of parameters that torch.autocast
    caches for its region (keyed by the parameter: the lower-precision copy and its autograd
    edge, made at the first use). A pass after another in the same region (a second
    micro-batch, a training forward after a no_grad one, a backward run inside the region
    whose checkpointed blocks are recomputed) was given the copies the earlier pass made from
    units freed since, and its backward failed in AccumulateGrad ("The size of tensor a (144)
    must match the size of tensor b (32)"). Within a pass the copies stay shared, as under
    DDP (a unit called twice uses one cast). Outside autocast the cache is empty."""
    torch.clear_autocast_cache()


def merge_orders(rows: List[List[int]], n_units: int) -> List[int]:
    """One order of the units consistent with every rank's sequence of first uses (`rows`: per
    rank, its length then the unit ids), the same on every rank: a topological order of "u came
    right before v on some rank", the lowest unit id first among the units free to go (units no
    rank used take their module order). Where ranks disagree (a cycle), the lowest id of what
    is left goes next; the ranks that used the units otherwise then gather them on their own."""
    after: List[Set[int]] = [set() for _ in range(n_units)]
    before = [0] * n_units
    for row in rows:
        seq = row[1:1 + row[0]]
        for a, b in zip(seq, seq[1:]):
            if b not in after[a] and a != b:
                after[a].add(b)
                before[b] += 1
    order: List[int] = []
    done = [False] * n_units
    while len(order) < n_units:
        free = [u for u in range(n_units) if not done[u] and before[u] == 0]
        u = free[0] if free else next(v for v in range(n_units) if not done[v])
        done[u] = True
        order.append(u)
        for v in after[u]:
            before[v] -= 1
    return order


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
    out over the same units; `executor` their group; `reducer` the trainable storage's, whose
    Counts carry the ranks' first uses that merge into the order (sharding/riders.py)."""

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
        self._eval_alone = True  # the current no_grad forward gathers alone (_begin_forward)
        # the next order: this rank's first uses at its last backward's end, riding on the next
        # Count (sharding/riders.py) until it delivers every rank's (_order_rows), which the
        # next forward merges (its own all-reduce was one more round trip a step)
        self._order_seen: Optional[List[int]] = None
        self._order_carried: Optional[List[int]] = None
        self._order_rows: Optional[List[List[int]]] = None
        # weakly, as the reducer's other callbacks into the engine (_weakly): the model's hooks
        # keep the reducer alive, which must not keep a dropped optimizer's engine
        me = weakref.ref(self)
        reducer.riders.add(len(units) + 1,
                           lambda: None if me() is None else me()._order_fill(),
                           lambda rows: None if me() is None else me()._order_deliver(rows))
        self._hooks: list = []
        self._held: List[Set[int]] = []  # units held by open gathered() blocks
        self._to_free: List[int] = []  # freed once the backward's pass ended
        self._backward_needs: Set[int] = set()  # units this backward will need
        # units run by the training forwards since the last backward began: a backward may
        # reach several forwards' graphs (an encoder run alone, then the model on its output)
        self._ran: Set[int] = set()
        self._lazy: List[int] = []  # skipped units to free once their gathers completed
        self._drained = DrainGathers(self.storages)  # the end of backward's, for the peers
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
        self._order: List[int] = []
        self._keep = keep
        self._schedule: List[int] = []  # the open phase's common sequence of gathers
        self._cursor = 0  # how far this rank's scheduled gathers went along it
        self._set_order(list(range(n)))
        for storage in self.storages:  # failed gathers name the unit's module
            storage.unit_names = [name for name, _ in units]
        # what initialize saw of the model: check_model() finds what was changed since
        self._changes = ModelChanges(model, self.storages)
        # how errors name each parameter (between_uses.describe): its first name, its unit
        names: Dict[int, str] = {}
        for n, p in model.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), n)
        for s in self.storages:
            for i, p in enumerate(s.params):
                u = s.param_unit[i]
                where = ("kept whole: persistence_threshold" if u == s.persistent_unit else
                         f"unit {units[u][0] or '(the root module)'!r}")
                p._zero_py_describe = f"{names.get(id(p), '?')!r} ({where})"
        # weakly: the parameters' gradient hooks hold the reducer from C++, where the garbage
        # collector cannot see them, so a strong reference from the reducer to the engine (and
        # through it the model and its optimizer) kept a dropped stage-3 model alive for ever
        reducer.before_backward_end(_weakly(self._drain_backward))
        reducer.on_backward_end(_weakly(self._end_backward))
        reducer.on_failed_backward(_weakly(self._failed_backward))
        reducer.check_at_once = True  # a rank must not start the backward's gathers alone
        _guard_module_hooks()
        self._hook_ids = []  # a unit's hooks run while it is gathered (user_edits.py)
        for u, (_, module) in enumerate(units):
            self._hooks.append(module.register_forward_pre_hook(
                self._make_pre_forward(u), with_kwargs=True, prepend=True))
            self._hooks.append(module.register_forward_hook(self._make_post_forward(u)))
            self._hook_ids.append((self._hooks[-2].id, self._hooks[-1].id))
        # after the root's own post-forward hook, and also when its forward raised: a forward
        # that raised (on every rank alike: a bad batch, out of memory) ends its phase at once,
        # freeing the units it gathered, instead of holding them until the next forward
        self._hooks.append(units[0][1].register_forward_hook(
            _not_traced(lambda module, args, output: self._forward_ended()
                        if module is units[0][1] else None), always_call=True))
        self._entries: List[nn.Module] = []  # entry points whose call opened the phase
        for entry in entry_points(model, units):
            self._hooks.append(entry.register_forward_pre_hook(
                self._make_entry_pre(entry), with_kwargs=True, prepend=True))
            self._hooks.append(entry.register_forward_hook(self._make_entry_post(entry)))
            self._hooks.append(entry.register_forward_hook(
                _not_traced(lambda module, args, output, entry=entry: self._entry_ended(entry)
                            if module is entry else None), always_call=True))

    @property
    def persistent_unit(self) -> int:
        return len(self.units)

    @property
    def eval_gathers_alone(self) -> bool:
        """Whether a no_grad forward gathers every unit from the peers' shards in shared memory,
        with no collective (every storage one-sided): a rank may then run it alone, and ranks
        may run different numbers of them."""
        return all(s.one_sided for s in self.storages)

    def reads_alone(self) -> bool:
        """Whether a read-only gathered access (model.state_dict(), full_state_dict(),
        gathered() without a modifier rank) gathers from the peers' shards in shared memory
        now, with no collective, so that one rank may make it alone: every storage one-sided,
        and this rank not between finish() and the end of its step (clip_grad_norm_ then
        step()), where a peer may be writing its shards with no version to wait for."""
        return self.eval_gathers_alone and not self.reducer.updating

    def check_model(self) -> Optional[str]:
        """None, or what was changed in the model since zero_py.initialize that stage 3 would
        silently undo (model_changes.py), or a gradient hook it would run too late. Run at
        each forward and step."""
        return self._changes.submodules() or self.reducer.late_hook() or self._changes.params()

    # -- hooks --------------------------------------------------------------------------------

    # The hooks swap each parameter between its 1-D shard slice and its full view: dynamo must
    # not trace them (its graphs do not guard against the swap, and torch.compile(model) then
    # fails in inductor's size asserts), so they run eagerly between the compiled parts.
    # A deep copy of the model (made inside gathered(): AveragedModel, an EMA teacher) keeps
    # these hooks, the same functions: on the copy, whose parameters are plain, they do nothing
    # (they would gather this model's unit, collectively where a rank may run the copy alone).
    def _make_pre_forward(self, u: int):
        unit = self.units[u][1]

        def hook(module, args, kwargs):
            if module is not unit:
                return None
            if u:  # the root's post-hooks end the forward: they stay in their order
                keep_post_hook_last(unit, self._hook_ids[u][1])
            else:
                keep_pre_hooks_first(self.units, [pre for pre, _ in self._hook_ids])
            return self._pre_forward(u, args, kwargs)
        return _not_traced(hook)

    def _make_post_forward(self, u: int):
        unit = self.units[u][1]

        def hook(module, args, output):
            return self._post_forward(u, output) if module is unit else None
        return _not_traced(hook)

    # An entry point (entries.py) called on its own, outside the model's forward, runs as a
    # forward of the model: its call opens the phase as the root's does (the root unit, which
    # holds the entry's own parameters, gathered until its end), and its units run in it.
    def _make_entry_pre(self, entry: nn.Module):
        def hook(module, args, kwargs):
            if module is not entry or self._phase is not None or self._held or _in_backward():
                return None  # inside the model's forward (its usual use), gathered(), a recompute
            self._entries.append(entry)
            return self._pre_forward(0, args, kwargs)
        return _not_traced(hook)

    def _make_entry_post(self, entry: nn.Module):
        def hook(module, args, output):
            if self._entries and self._entries[-1] is entry and module is entry:
                self._entries.pop()
                return self._post_forward(0, output)
            return None
        return _not_traced(hook)

    def _entry_ended(self, entry: nn.Module) -> None:
        """After an entry point's forward, returned or raised: one that raised ends its phase
        (as _forward_ended does for the root's)."""
        if self._entries and self._entries[-1] is entry:
            self._entries.pop()
            self._forward_ended()

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
            if torch.is_grad_enabled():  # its backward is refused (TRAINING_FORWARD_HELD)
                self.reducer.grads_refused = TRAINING_FORWARD_HELD
            if not any(u in held for held in self._held):
                raise RuntimeError(
                    f"zero_py stage 3: unit {self.units[u][0]!r} runs inside zero_py.gathered() "
                    "without being gathered; gather the whole model: zero_py.gathered(model)")
            return None
        if u == 0:
            self.reducer.grads_refused = None
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
            training = self._phase == _C.PF_FORWARD
            self._run(self.prefetch.end())
            if training:
                self._ran.update(self.prefetch.seen())
            self._phase = None
        return None

    def _forward_ended(self) -> None:
        """After the root's forward, returned or raised: a forward phase still open here is
        one that raised (a returning one closed it in _post_forward). Ended as the next
        forward would end it (_close_phase: its scheduled gathers issued, every unit freed)."""
        if _in_backward() or self._held:
            return
        if self._phase in (_C.PF_FORWARD, _C.PF_FORWARD_EVAL):
            with torch.no_grad():
                self._close_phase()

    def _make_pre_backward(self, u: int):
        def hook(grad):
            if torch.is_grad_enabled():
                # the autograd engine runs a backward's hooks in grad mode only for
                # create_graph=True; refused before anything is gathered or announced
                raise RuntimeError(
                    f"zero_py stage 3: a backward with create_graph=True reached unit "
                    f"{self.units[u][0] or '(root)'!r} (e.g. torch.autograd.grad(..., "
                    "create_graph=True) for a gradient penalty, or a double backward). Its "
                    "graph of gradients would keep the unit's gathered parameters, which stage "
                    "3 frees after the unit's backward, so the backward through it would read "
                    "freed memory. Use stage 1 or 2 for double backward (their parameters stay "
                    "whole), or compute the penalty without create_graph")
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
            self._skip_ahead()

    def _skip_ahead(self) -> None:
        """In backward: gathers (and frees) at once the units of the schedule, from the
        cursor on, that this rank will not need, up to the next one it will. Every rank
        issues the common sequence of gathers; a rank that skips units would otherwise issue
        theirs only when it needs a later unit or at the end of backward, while a peer that
        needs them waits, and this rank may meanwhile wait for that peer's reductions: both
        would wait for ever. Skipped at once, every gather a peer can need before this rank's
        next wait is issued."""
        self._reap()
        while self._phase == _C.PF_BACKWARD and self._cursor < len(self._schedule):
            u = self._schedule[self._cursor]
            if u in self._backward_needs:
                return
            self._run(self.prefetch.need(u), lazy=True)
            if self._cursor < len(self._schedule) and self._schedule[self._cursor] == u:
                self._cursor += 1  # resident already: passed without a gather
            self._run(self.prefetch.done(u), lazy=True)

    def _reap(self, block: bool = False) -> None:
        """Frees the skipped units whose gathers completed (all of them with block)."""
        for u in list(self._lazy):
            if block or all(w.is_completed() for w in self._pending.get(u, ())):
                self._lazy.remove(u)
                self._free(u)

    # -- phases -------------------------------------------------------------------------------

    def _set_order(self, order: List[int]) -> None:
        self.prefetch.set_order(order)
        self._order = list(order)

    def _set_keep(self, keep: List[bool]) -> None:
        self.prefetch.set_keep(keep)
        self._keep = list(keep)

    def _open_phase(self, phase: int) -> None:
        """prefetch.begin(phase), and the phase's schedule as the C schedule has it
        (prefetch.h): the order, or in backward the order reversed without the keep units."""
        self.prefetch.begin(phase)
        if phase == _C.PF_BACKWARD:
            self._schedule = [u for u in reversed(self._order) if not self._keep[u]]
        else:
            self._schedule = list(self._order)
        self._cursor = 0

    def _close_phase(self) -> None:
        """Ends a phase left open (a forward or backward that raised, a partial forward)."""
        self._reap(block=True)
        if self._phase == _BACKWARD_ENDING:
            self._drained.wait()
            for u in self._to_free:
                self._free(u)
            self._to_free = []
        elif self._phase is not None:
            self._run(self.prefetch.end())
        self._phase = None

    def _order_fill(self) -> Optional[torch.Tensor]:
        self._order_carried = self._order_seen
        if self._order_seen is None:
            return None
        return torch.tensor([len(self._order_seen)] + self._order_seen, dtype=torch.int64)

    def _order_deliver(self, rows: torch.Tensor) -> None:
        """Every rank's first uses (a rank without any: a zero row), as the Count that carried
        them passed its checks on every rank alike."""
        self._order_rows = rows.tolist()
        if self._order_seen is self._order_carried:
            self._order_seen = None

    def _apply_order(self) -> None:
        """The order merged from the last delivered first uses, on every rank alike."""
        if self._order_rows is not None:
            rows, self._order_rows = self._order_rows, None
            order = merge_orders(rows, len(self.units))
            used = {u for row in rows for u in row[1:1 + row[0]]}
            self._set_order(order)
            if self.reshard_after_forward:
                # the last units of the forward are the first of the backward: keep them
                # gathered in between rather than free them and gather them again at once.
                # The last one always (it is resident there anyway, next to the unit before
                # or after it), and the ones before it while they fit in what the prefetch
                # budget lets backward hold beside the root (by default the root plus two
                # units: the last two), so the peak stays the budget's
                n = len(self.units)
                keep = [u == 0 for u in range(n)]
                room = self._budget - self._unit_bytes[0]
                for k in reversed([k for k in order if k != 0 and k in used]):
                    if any(keep[1:]) and self._unit_bytes[k] > room:
                        break
                    keep[k] = True
                    room -= self._unit_bytes[k]
                self._set_keep(keep)

    def _begin_forward(self) -> None:
        _forget_autocast_casts()
        self.reducer.settle_failed_backward()
        self._close_phase()
        phase = _C.PF_FORWARD if torch.is_grad_enabled() else _C.PF_FORWARD_EVAL
        problem = self.check_model()
        # between finish() and the end of the step (clip_grad_norm_, then step()) a peer may
        # be writing its shards with no version to wait for: a no_grad forward there is
        # collective, as reads_alone() makes a state dict
        self._eval_alone = self.reads_alone()
        if phase == _C.PF_FORWARD or not self._eval_alone:
            # its gathers are collective: every rank must be starting this forward (a no_grad
            # forward gathers alone where the shards are in shared memory); a rank whose model
            # changed refuses it in the announcement, so that every rank raises
            self.reducer.announce_forward(phase == _C.PF_FORWARD_EVAL, problem)
        elif problem is not None:
            raise RuntimeError(problem)
        # after the announcement, which may have carried the last backward's first uses
        self._apply_order()
        self._phase = phase
        self._open_phase(self._phase)
        self._post_pending = [0] * len(self.units)

    def _begin_backward(self) -> None:
        _forget_autocast_casts()
        # a backward that raised before this one: its phase ends first (_failed_backward)
        self.reducer.settle_failed_backward()
        if self.reducer.sync_enabled:
            self.reducer.check_complete()
        self._close_phase()
        self._phase = _C.PF_BACKWARD
        self._open_phase(_C.PF_BACKWARD)
        if self.reducer.begin_pass():  # queues the end of backward, which calls _end_backward
            # the units this rank's forward did not run give no gradient: their buckets go
            # now, as DDP's find_unused_parameters, not at the end (peers that ran them wait)
            ran = set(self.prefetch.seen()) | self._ran | {self.persistent_unit}
            self.reducer.mark_unused(i for i, u in enumerate(self.flat.param_unit)
                                     if u not in ran)
        # and backward needs no unit that its forwards did not run (recomputation included):
        # those are gathered and freed as the schedule reaches them (_skip_ahead)
        self._backward_needs = set(self.prefetch.seen()) | self._ran | {0}
        self._ran = set()
        self._skip_ahead()

    def _drain_backward(self) -> None:
        """At the end of backward, before the reducer's last reductions: issues the gathers
        left in the phase's schedule (every rank issues them: a rank that skipped units must
        not make its peers wait for them while it waits for reductions); their frees, which
        wait for them, come after (_end_backward)."""
        self._to_free = []
        if self._phase != _C.PF_BACKWARD:
            return
        commands = list(self.prefetch.end())
        drained = self._drained.prepare([u for kind, u in commands if kind == _C.PF_GATHER])
        for kind, u in commands:
            if kind != _C.PF_GATHER:
                self._to_free.append(u)
            elif drained and self._scheduled(u):  # for the peers only (drain.py)
                self._drained.issue(u, "the end of the backward")
            else:
                self._gather(u, not drained and self._scheduled(u))
        self._phase = _BACKWARD_ENDING

    def _failed_backward(self) -> None:
        """A backward that raised (GradReducer.settle_failed_backward, every rank at the same
        point): its phase ends as the backward would have, the gathers left in its schedule
        issued (every rank issues them) and every unit it holds freed."""
        with torch.no_grad():
            self._close_phase()
        self._to_free = []
        self._post_pending = [0] * len(self.units)

    def _end_backward(self) -> None:
        """After the reducer ended this backward's pass (or skipped it under no_sync())."""
        if self._phase != _BACKWARD_ENDING:
            return  # a backward through none of this model's units
        with torch.no_grad():
            self._drained.wait()
            self._reap(block=True)
            for u in self._to_free:
                self._free(u)
            self._to_free = []
            self._phase = None
            self._post_pending = [0] * len(self.units)
            # agree on the next order: every rank's sequence of first uses rides on the next
            # Count (a row each), merged on every rank alike (merge_orders, _apply_order)
            self._order_seen = list(self.prefetch.seen())

    # -- commands -----------------------------------------------------------------------------

    def _run(self, commands, lazy: bool = False) -> None:
        """Carries out the schedule's commands. lazy: a FREE waits for nothing; the unit is
        freed once its gather completed (_reap), so a skipped unit never blocks this rank."""
        for kind, u in commands:
            if kind == _C.PF_GATHER:
                if u in self._lazy:  # gathered again before its skipped gather was reaped
                    self._lazy.remove(u)
                    self._free(u)
                self._gather(u, self._scheduled(u))
            elif lazy and u in self._pending:
                self._lazy.append(u)
            else:
                self._free(u)

    def _scheduled(self, u: int) -> bool:
        """Whether the schedule's GATHER of u is one of the phase's common sequence (every
        rank issues it, in the same place), rather than an unscheduled gather: u needed behind
        the cursor or outside the order, by this rank only (prefetch.h). The scheduled gathers
        walk the schedule in order, passing resident units, so the one of u lies ahead."""
        try:
            k = self._schedule.index(u, self._cursor)
        except ValueError:
            return False
        self._cursor = k + 1
        return True

    _PHASE_NAMES = {_C.PF_FORWARD: "the forward", _C.PF_FORWARD_EVAL: "a no_grad forward",
                    _C.PF_BACKWARD: "the backward"}

    def _gather(self, u: int, scheduled: bool = True, alone: Optional[bool] = None,
                exact: bool = False) -> None:
        """Starts gathering unit u: collectively, or from the peers' shards in shared memory
        with no collective (a no_grad forward, which one rank may run alone, and a gather only
        this rank makes) where the storages allow it; `alone` decides instead where given (a
        read-only hold that reads_alone()). `exact`: a collective gather bypasses a quantized
        wire (a one-sided one reads the shards as they are anyway)."""
        phase = self._PHASE_NAMES.get(self._phase, "zero_py.gathered()")
        if alone is None:
            # an unscheduled gather of a training forward or backward reads alone: every
            # rank is in that pass, so none is writing its shards
            alone = ((self._phase == _C.PF_FORWARD_EVAL and self._eval_alone)
                     or (not scheduled and all(s.one_sided for s in self.storages)))
        if alone:
            self._pending[u] = [
                s.gather_one_sided(b, f"one-sided gather of {s.describe_bucket(b)} for {phase}")
                for s in self.storages for b in s.unit_buckets[u]]
            return
        # collective: right where every rank makes the same unscheduled gathers (a unit run
        # twice per forward on every rank); across hosts, ranks must agree on them
        works = [s.gather(b, exact=exact) for s in self.storages for b in s.unit_buckets[u]]
        self._pending[u] = [w.named(f"{w.what} for {phase}") for w in works]
        # offload_params="nvme": the next units' records start being read now, so the disk
        # works while this gather and the compute before the next ones run
        ahead = self._schedule[self._cursor:self._cursor + 2] if self._phase is not None else ()
        for s in self.storages:
            s.read_ahead([b for v in ahead for b in s.unit_buckets[v]])

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
        """Full values of the units holding `params` (ids; None: all). Collective, except
        read-only where reads_alone(). With `modifier_rank`, that rank's values are broadcast
        and stored into every rank's shards on exit (the caller syncs the optimizer's fp32
        masters)."""
        units = sorted({s.param_unit[i] for s in self.storages
                        for i, p in enumerate(s.params) if params is None or id(p) in params})
        return self.hold(units, modifier_rank)

    def announce(self, what: str, units: Sequence[int] = (),
                 modifier_rank: Optional[int] = None) -> None:
        """Before the collective gathers of `what` (e.g. "model.state_dict()") of `units`:
        every rank must be starting it, on the same units (a submodule's state dict or
        gathered(): ranks that name different modules would pair the gathers of different
        buckets), or every rank that takes part in the comparison raises, and a rank that
        calls it alone raises after the process group's timeout at the latest
        (GradReducer.announce_gathered), rather than wait in a gather for ever."""
        key = 0
        for u in sorted(set(units)):  # the same number on every rank for the same units
            key = (key * 1000003 + u + 1) % (2 ** 61 - 1)
        if modifier_rank is not None:  # each rank would broadcast from its own (a hang)
            key = (key * 1000003 + modifier_rank + 1) % (2 ** 61 - 1)
            what = f"{what} with modifier_rank={modifier_rank}"
        self.reducer.announce_gathered(what, key)

    def _forward_running(self) -> bool:
        """Whether the model's forward is running on this thread: its module call is on the
        stack. A forward phase open without it was ended by a KeyboardInterrupt or another
        BaseException, for which torch runs no always_call hook (_forward_ended)."""
        frame = sys._getframe(1)
        while frame is not None:
            if frame.f_code is _MODULE_CALL and (frame.f_locals.get("self") is self.model or
                                                 frame.f_locals.get("self") in self._entries):
                return True
            frame = frame.f_back
        return False

    def refuse_inside_pass(self, what: str) -> None:
        self.reducer.settle_failed_backward()  # a backward that raised is over
        if (self._phase in (_C.PF_FORWARD, _C.PF_FORWARD_EVAL) and not self._held
                and not self._forward_running()):
            with torch.no_grad():
                self._close_phase()  # an interrupted forward: over
        if self._phase is not None:
            raise RuntimeError(f"{what} cannot be used inside the model's forward or backward; "
                               "use it between steps")

    def hold(self, wanted: Sequence[int], modifier_rank: Optional[int] = None,
             what: str = "zero_py.gathered()", announced: bool = False):
        """gathered() by unit ids (stage3/hold.py)."""
        return hold_units(self, wanted, modifier_rank, what, announced)
