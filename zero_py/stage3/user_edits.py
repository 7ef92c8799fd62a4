"""How stage 3 meets what user code does to a unit's modules and parameters while the unit is
gathered: the forward hooks a user (or torch.nn.utils) put on a unit, and a parameter's
`.data` replaced inside `zero_py.gathered()`; and what check_model says
of a parameter no longer registered where initialize found it for a reason other than a cast
(torch.func.functional_call over other tensors, prune).

Invariant: every forward hook on a unit runs while the unit is gathered, as under DDP, where
parameters are always whole (on the root: the post-hooks, which end the forward, and the
pre-hooks registered before initialize). torch runs a module's forward pre-hooks and hooks in
registration order, so the engine's pre-hook is registered first among them (prepend) and its
post-hook is moved back to the end of the hooks before each call (keep_post_hook_last), and
its pre-hook back to the front at each forward of the model (keep_pre_hooks_first)."""

from typing import Optional, Sequence

import torch
import torch.nn as nn

from zero_py.sharding.between_uses import describe


def keep_post_hook_last(module: nn.Module, hook_id: int) -> None:
    """Moves the engine's post-forward hook (its handle's id) after any forward hook
    registered since. A hook registered after initialize (e.g. an activation statistic that
    reads `module.weight`, or one that adds a term computed from it to the output) would
    otherwise run after the unit was freed, on this rank's shard slices: its values silently
    wrong, and a term that reaches the loss refused at backward. torch copies a module's
    hooks before running them, so moving one during the call's pre-hooks is safe."""
    hooks = module._forward_hooks
    if hooks and next(reversed(hooks)) != hook_id and hook_id in hooks:
        hooks.move_to_end(hook_id)


def keep_pre_hooks_first(units, hook_ids: Sequence[int]) -> None:
    """At the root's pre-forward: moves each unit's pre-forward hook (`hook_ids[u]`, u > 0)
    back before any pre-hook registered since with prepend=True, which would otherwise run
    on shard slices (a use that reaches the loss refused at backward: "got a gradient while
    its unit is not gathered"). The units' pre-hooks have not run yet in this forward."""
    for u in range(1, len(units)):
        hooks = units[u][1]._forward_pre_hooks
        if next(iter(hooks)) != hook_ids[u]:
            hooks.move_to_end(hook_ids[u], last=False)


def check_modifier_rank(what: str, modifier_rank: Optional[int], world_size: int) -> None:
    """Refuses, before anything is gathered, a modifier_rank that is not a rank of the group:
    it was found only by the broadcast on the block's exit, after the user's code had run,
    with a message ("broadcast: src 5 ...") that did not say what to pass."""
    if modifier_rank is None or (isinstance(modifier_rank, int) and not isinstance(
            modifier_rank, bool) and 0 <= modifier_rank < world_size):
        return
    raise ValueError(f"{what}: modifier_rank={modifier_rank!r} is not a rank of the model's "
                     f"process group: pass an int from 0 to {world_size - 1} (the group rank "
                     "whose edits every rank takes), or None; nothing was gathered")


def adopt_replaced_data(storages, units: Sequence[int], modifier: bool) -> None:
    """At the end of a `gathered()` block over `units`: a parameter given another tensor as
    `.data` there (`p.data = t`, as torch.nn.utils.vector_to_parameters and some EMA code
    do) becomes its gathered view again. With a modifier rank (`modifier`) its new values are
    copied into the view first, which is what the broadcast sends; they were silently dropped
    before (the next free put the shard slice back). Without one the block's edits are
    dropped, which for a whole new tensor was silent too: it is refused here, naming the
    parameter (raised on the ranks that replaced one; the block's exit is not collective). A
    tensor of another element count cannot be the parameter: it is left for check_model."""
    dropped = []
    with torch.no_grad(), torch._C.DisableTorchFunctionSubclass():
        for s in storages:
            for u in units:
                for b in s.unit_buckets[u]:
                    for i in s.bucket_params[b]:
                        p, view = s.params[i], s.full_view(i)
                        if (view is None or p.data_ptr() == view.data_ptr()
                                or p.numel() != view.numel()):
                            continue
                        if modifier:
                            view.copy_(p.data.reshape(view.shape))
                        else:
                            dropped.append(describe(p))
                        p.data = view
    if dropped:
        more = f" (and {len(dropped) - 1} more)" if len(dropped) > 1 else ""
        raise RuntimeError(
            f"zero_py stage 3: the .data of parameter {dropped[0]}{more} was replaced inside "
            "a read-only `zero_py.gathered(model)` (`p.data = t`, e.g. by "
            "torch.nn.utils.vector_to_parameters): without modifier_rank the block's edits "
            "are dropped on exit, so this one would be lost. Write it inside `with "
            "zero_py.gathered(model, modifier_rank=0):` on every rank (rank 0's values become "
            "every rank's), or load the values with model.load_state_dict(...).")

def param_versions(storages, units: Sequence[int]) -> dict:
    """The version counters of the parameters of `units` (ids to counts), at the start of a
    read-only `gathered()` block: refuse_dropped_writes compares them at its end."""
    return {id(s.params[i]): s.params[i]._version for s in storages for u in units
            for b in s.unit_buckets[u] for i in s.bucket_params[b]}


def refuse_dropped_writes(storages, units: Sequence[int], before: dict) -> None:
    """At the end of a read-only `gathered()` block over `units`: a parameter written in place
    there (`p.mul_(...)`, `nn.init.*_`, `p.copy_(t)`: its version counter moved) would have
    its edit dropped when the unit is freed, silently. Refused, naming the parameter (on the
    ranks that wrote; the block's exit is not collective)."""
    written = [describe(s.params[i]) for s in storages for u in units
               for b in s.unit_buckets[u] for i in s.bucket_params[b]
               if before.get(id(s.params[i]), s.params[i]._version) != s.params[i]._version]
    if written:
        more = f" (and {len(written) - 1} more)" if len(written) > 1 else ""
        raise RuntimeError(
            f"zero_py stage 3: parameter {written[0]}{more} was written in place inside a "
            "read-only `zero_py.gathered(model)` (no modifier_rank): the block's edits are "
            "dropped when it ends, so this one is lost. Write it inside `with "
            "zero_py.gathered(model, modifier_rank=0):` on every rank (rank 0's values become "
            "every rank's), or load the values with model.load_state_dict(...).")


def changed_registration(module: nn.Module, name: str, attr: str, param: torch.Tensor,
                         now) -> Optional[str]:
    """check_model's message for a sharded parameter that `module` no longer registers as
    `attr` where the change is not a cast (whose message check_model gives): None otherwise.
    `now` is what `module._parameters[attr]` holds instead."""
    prefix = name[:len(name) - len(attr)]
    if now is not None and not isinstance(now, nn.Parameter):
        return (
            f"zero_py stage 3: parameter {name!r} is a plain tensor in this forward, as inside "
            "torch.func.functional_call(model, tensors, ...) with tensors other than the "
            "model's own Parameters (per-sample gradients under torch.func.grad and vmap, a "
            "MAML inner step). Stage 3 gathers and trains the Parameters it sharded, and "
            "between uses they are this rank's 1-D shard slices, which such a call cannot "
            "compute with. Use stage 1 or 2 for it (both match DDP there); "
            "functional_call with dict(model.named_parameters()) itself works under stage 3.")
    moved = [k for k, q in module._parameters.items() if q is param]
    if now is None and moved:
        return (
            f"zero_py stage 3: parameter {name!r} is now registered as {prefix + moved[0]!r} "
            "after zero_py.initialize (as torch.nn.utils.prune and "
            "torch.nn.utils.parametrize do when they reparametrize a weight); stage 3's "
            "gathers and state dicts follow the model as initialize saw it. Prune or "
            "reparametrize before zero_py.initialize (both match DDP then).")
    return None
