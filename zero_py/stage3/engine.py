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

This file holds the class, its construction, the schedule's commands (gather, wait, free) and
gathered access; its mixins hold the rest: the module hooks (hooks.py), the phases
(phases.py: _skip_ahead, _drain_backward) and the ranks' agreement on the order (order.py:
merge_orders).
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch
import torch.nn as nn

from zero_py._native import _C
from zero_py.sharding.reducer import GradReducer
from zero_py.sharding.storage import ShardedParams
from zero_py.stage3.drain import DrainGathers
from zero_py.stage3.entries import entry_points
from zero_py.stage3.hold import hold_units
from zero_py.stage3.hooks import ModuleHooks, not_traced
from zero_py.stage3.model_changes import ModelChanges
from zero_py.stage3.order import OrderAgreement, merge_orders
from zero_py.stage3.phases import Phases

__all__ = ["Stage3Engine", "merge_orders"]  # merge_orders: order.py (tests import it here)


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


# the frame of a module's call (nn.Module._call_impl): _forward_running looks for the model's
_MODULE_CALL = nn.Module._call_impl.__code__


class Stage3Engine(ModuleHooks, Phases, OrderAgreement):
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
            not_traced(lambda module, args, output: self._forward_ended()
                        if module is units[0][1] else None), always_call=True))
        self._entries: List[nn.Module] = []  # entry points whose call opened the phase
        for entry in entry_points(model, units):
            self._hooks.append(entry.register_forward_pre_hook(
                self._make_entry_pre(entry), with_kwargs=True, prepend=True))
            self._hooks.append(entry.register_forward_hook(self._make_entry_post(entry)))
            self._hooks.append(entry.register_forward_hook(
                not_traced(lambda module, args, output, entry=entry: self._entry_ended(entry)
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
