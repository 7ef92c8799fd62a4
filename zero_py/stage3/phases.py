"""The stage-3 engine's phases (a mixin of zero_py/stage3/engine.py): a forward or a backward
opened on the C prefetch schedule (prefetch.begin) and closed on it (prefetch.end); in backward
the skipped units' gathers issued at once (_skip_ahead), the last gathers issued before the
reducer's last reductions are waited for (_drain_backward), and a backward that raised ended
as it would have ended."""

from __future__ import annotations

import torch

from zero_py._native import _C

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


class Phases:
    """Needs the engine's units, flat, reducer, prefetch, _order, _keep, _phase, _schedule,
    _cursor, _lazy, _pending, _to_free, _ran, _backward_needs, _post_pending, _drained and
    _eval_alone, its commands (_run, _gather, _free, _scheduled), check_model, reads_alone
    and the order agreement (_apply_order)."""

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
