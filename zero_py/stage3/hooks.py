"""The stage-3 engine's module hooks (a mixin of zero_py/stage3/engine.py): the pre- and
post-forward hooks of each unit and of each entry point, the hook on a unit's outputs that
starts its backward, and the marker on its inputs (_PostBackward) whose backward ends it. Each
hook asks the engine's phases (phases.py) and commands (engine.py) for the unit's gathers and
frees."""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from zero_py._native import _C
from zero_py.stage3.hold import TRAINING_FORWARD_HELD
from zero_py.stage3.user_edits import keep_post_hook_last, keep_pre_hooks_first


def not_traced(fn):
    """fn, run eagerly under torch.compile (torch._dynamo.disable) where torch has dynamo."""
    dynamo = getattr(torch, "_dynamo", None)
    return dynamo.disable(fn) if dynamo is not None and hasattr(dynamo, "disable") else fn


def _in_backward() -> bool:
    """True while the autograd engine runs a backward pass on this thread (e.g. the forward
    that activation checkpointing recomputes)."""
    return torch._C._current_graph_task_id() != -1


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


class ModuleHooks:
    """Needs the engine's units, reducer, _hook_ids, _phase, _held, _entries, _post_pending
    and prefetch, its commands (_run, _wait) and its phases (_begin_forward, _begin_backward,
    _close_phase, _skip_ahead)."""

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
        return not_traced(hook)

    def _make_post_forward(self, u: int):
        unit = self.units[u][1]

        def hook(module, args, output):
            return self._post_forward(u, output) if module is unit else None
        return not_traced(hook)

    # An entry point (entries.py) called on its own, outside the model's forward, runs as a
    # forward of the model: its call opens the phase as the root's does (the root unit, which
    # holds the entry's own parameters, gathered until its end), and its units run in it.
    def _make_entry_pre(self, entry: nn.Module):
        def hook(module, args, kwargs):
            if module is not entry or self._phase is not None or self._held or _in_backward():
                return None  # inside the model's forward (its usual use), gathered(), a recompute
            self._entries.append(entry)
            return self._pre_forward(0, args, kwargs)
        return not_traced(hook)

    def _make_entry_post(self, entry: nn.Module):
        def hook(module, args, output):
            if self._entries and self._entries[-1] is entry and module is entry:
                self._entries.pop()
                return self._post_forward(0, output)
            return None
        return not_traced(hook)

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
