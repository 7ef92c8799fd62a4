"""Units: how a stage-3 model is cut into pieces that are gathered whole.

A wrap policy names the modules that become units (module classes, a parameter count, or a
callable); the root module is always unit 0. Every parameter belongs to one unit: a parameter
registered in several modules (tied weights) goes to the innermost unit that contains all of
them. Containers (ModuleList, ModuleDict) are never units: nothing calls them, so nothing
would gather them. Nor are the children of nn.MultiheadAttention and nn.TransformerEncoderLayer,
whose forwards read the children's parameters without calling them (_LEAVES).
"""

from __future__ import annotations

from typing import Callable, Dict, List, Sequence, Set, Tuple, Type, Union

import torch.nn as nn

WrapPolicy = Union[None, int, Sequence[Type[nn.Module]], Callable[[nn.Module, str], bool]]

DEFAULT_WRAP_THRESHOLD = 1_000_000  # parameters; the default policy wraps modules this large
_CONTAINERS = (nn.ModuleList, nn.ModuleDict)
# modules whose forward reads their children's parameters without calling the children
# (nn.MultiheadAttention passes out_proj.weight to F.multi_head_attention_forward; the fast
# path of nn.TransformerEncoderLayer reads every child's): their children are never units, as
# nothing would gather them (FSDP's size-based policy forces nn.MultiheadAttention as a leaf)
_LEAVES = (nn.MultiheadAttention, nn.TransformerEncoderLayer)


def _policy_fn(policy: WrapPolicy) -> Callable[[nn.Module, str, int], bool]:
    """policy(module, name, unassigned_params) -> wrap it."""
    if policy is None:
        policy = DEFAULT_WRAP_THRESHOLD
    if isinstance(policy, bool):
        raise TypeError("wrap_policy must be a parameter count, module classes or a callable, "
                        f"not {policy!r}")
    if isinstance(policy, int):
        if policy < 1:
            raise ValueError(f"wrap_policy as a parameter count must be >= 1, got {policy}")
        return lambda m, name, n: n >= policy
    if isinstance(policy, type):
        policy = (policy,)
    if isinstance(policy, (tuple, list, set, frozenset)):
        classes = tuple(policy)
        if any(isinstance(c, type) and issubclass(c, _CONTAINERS) for c in classes):
            raise ValueError("wrap_policy cannot name nn.ModuleList or nn.ModuleDict: containers "
                             "are never called, so their units would never be gathered; name "
                             "the classes of the modules they hold")
        if not classes or not all(isinstance(c, type) and issubclass(c, nn.Module)
                                  for c in classes):
            raise TypeError("wrap_policy as a collection must hold nn.Module subclasses, e.g. "
                            f"{{Block}}; got {policy!r}")
        return lambda m, name, n: isinstance(m, classes)
    if callable(policy):
        return lambda m, name, n: bool(policy(m, name))
    raise TypeError("wrap_policy must be None, a parameter count (int), a collection of "
                    f"nn.Module classes or a callable(module, name) -> bool; got {policy!r}")


def assign_units(model: nn.Module, policy: WrapPolicy) -> Tuple[List[Tuple[str, nn.Module]],
                                                               Dict[int, int]]:
    """Cuts `model` into units. Returns the units as (name, module), the root first and the
    rest in module order, and {id(param): unit} for every parameter of the model."""
    wrap = _policy_fn(policy)
    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    owners: Dict[int, List[nn.Module]] = {}  # param -> modules that register it
    params: Dict[int, nn.Parameter] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            owners.setdefault(id(p), []).append(m)
            params[id(p)] = p
    # size-based policies count the parameters not already taken by a wrapped descendant:
    # decide bottom-up (post-order), as a size-based wrap policy does
    wrapped: Set[int] = set()
    taken: Dict[int, Set[int]] = {}

    def visit(m: nn.Module, in_leaf: bool) -> Set[int]:
        mine = {id(p) for p in m.parameters(recurse=False)}
        for child in m.children():
            mine |= visit(child, in_leaf or isinstance(m, _LEAVES))
        # containers have no forward, so nothing would ever gather them: never units; nor
        # the children of a module that reads their parameters itself (_LEAVES)
        if (m is not model and not in_leaf and not isinstance(m, _CONTAINERS)
                and wrap(m, names.get(id(m), ""), sum(params[i].numel() for i in mine))):
            wrapped.add(id(m))
            taken[id(m)] = mine
            return set()
        return mine

    visit(model, False)
    units: List[Tuple[str, nn.Module]] = [("", model)]
    for name, m in model.named_modules():
        if id(m) in wrapped:
            units.append((name, m))
    unit_index = {id(m): u for u, (_, m) in enumerate(units)}
    # the chain of units enclosing each module, outermost first
    chain: Dict[int, List[int]] = {}

    def walk(m: nn.Module, above: List[int]) -> None:
        here = above + [unit_index[id(m)]] if id(m) in unit_index and m is not model else above
        chain[id(m)] = here
        for child in m.children():
            if id(child) not in chain:
                walk(child, here)

    walk(model, [0])
    unit_of: Dict[int, int] = {}
    for pid, mods in owners.items():
        common = chain[id(mods[0])]
        for m in mods[1:]:
            other = chain[id(m)]
            k = 0
            while k < min(len(common), len(other)) and common[k] == other[k]:
                k += 1
            common = common[:k]
        unit_of[pid] = common[-1]
    return units, unit_of
