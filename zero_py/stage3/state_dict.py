"""model.state_dict() and model.load_state_dict() under stage 3: full values.

Between uses a stage-3 parameter is its shard slice, so torch's own state dict would hold each
rank's slices under the full names. zero_py.initialize installs hooks on the model and on
every submodule that holds a sharded parameter, so that any of them (a block, a backbone, a
LoRA adapter) behaves as the model does:

- model.state_dict() (or sub.state_dict()) returns every parameter with its full shape and
  values (units are gathered one at a time, only those of the module's parameters, the
  values cloned).
- model.load_state_dict(sd) (or sub.load_state_dict(sd)) takes such a full dict (or any torch
  state dict of the same module) on every rank: each rank keeps its own slice of each value,
  with no communication, and the optimizer's fp32 masters follow. Shapes are checked before
  anything is written.

torch runs a module's children's state-dict hooks inside its own call; only the outermost
call acts (_Calls), so model.state_dict() gathers each unit once, as before, and a load is
sliced and synced once.

full_state_dict() gives the same values on one rank only (None elsewhere), cloned to the CPU.

Who must call them. Where every rank of the group runs on this host with its shards in shared
memory (ShardedParams.one_sided: gloo and CPU tensors, the default), model.state_dict() and
full_state_dict() read every rank's pieces from there, with no collective
(Stage3Engine.reads_alone), so one rank may call them alone: `if rank == 0:
model.save_pretrained(path)` saves the values every rank would. A peer in the middle of its
step is waited for (the shards' versions, collectives/peer_memory.py). Elsewhere (several
hosts, CUDA, ZP_SHM=0), and on a rank between finish() and the end of its step, they gather
collectively and every rank must call them at the same point (e.g. `sd = model.state_dict()`
on every rank, then `if rank == 0: torch.save(sd, path)`). Each call is announced first
(GradReducer.announce_gathered): a rank that calls it alone raises, on every rank that takes
part (the peers' next forward, backward or step compares with it) or, where the peers run no
collective of the group, after the process group's timeout, with an error that says to call
it on every rank; it never waits in a gather for ever. The announcement carries the units it
gathers, so ranks that ask for different submodules (blocks[0] here, blocks[1] there) raise
alike instead of pairing the gathers of different buckets.
"""

from __future__ import annotations

import contextlib
from typing import Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from zero_py.collectives.stats import control
from zero_py.collectives.work import issue
from zero_py.sharding import between_uses
from zero_py.sharding.storage import ShardedParams
from zero_py.stage3.engine import Stage3Engine


def _param_keys(model: nn.Module, engine: Stage3Engine
                ) -> Dict[str, Tuple[ShardedParams, int]]:
    """{name: (storage, index)} for every sharded parameter of the model (tied ones under each
    of their names)."""
    out = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        for s in engine.storages:
            i = s.index_of(p)
            if i is not None:
                out[name] = (s, i)
                break
    return out


def _collect(model: nn.Module, engine: Stage3Engine, sd: dict, prefix: str,
             dst: Optional[int], to_cpu: bool, what: str) -> None:
    """Replaces the sharded parameters' entries of `sd` by full values, cloned (on group rank
    `dst` only when given; entries elsewhere are removed). Gathers one unit at a time: from
    the peers' shards in shared memory, alone, where engine.reads_alone(); otherwise
    collectively, announced once as `what` (see the module docstring)."""
    me = engine.executor.rank
    engine.refuse_inside_pass(what)
    alone = engine.reads_alone()
    by_unit: Dict[int, List[Tuple[str, ShardedParams, int]]] = {}
    for name, (s, i) in _param_keys(model, engine).items():
        if prefix + name in sd:
            by_unit.setdefault(s.param_unit[i], []).append((prefix + name, s, i))
    if dst is not None and me != dst and alone:
        for entries in by_unit.values():  # nothing to gather for the other rank
            for key, _, _ in entries:
                sd.pop(key, None)
        return
    if not alone and by_unit:
        engine.announce(what, list(by_unit))
    for u in sorted(by_unit):
        entries = by_unit[u]
        with engine.hold([u], what=what, announced=True):
            for key, s, i in entries:
                if dst is None or me == dst:
                    value = s.full_view(i).detach()
                    sd[key] = value.to("cpu", copy=True) if to_cpu else value.clone()
                else:
                    sd.pop(key, None)


def full_state_dict(model: nn.Module, engine: Stage3Engine, rank: int
                    ) -> Optional[Dict[str, torch.Tensor]]:
    """The model's state dict with full tensors, cloned to the CPU, on group rank `rank`;
    None elsewhere. Collective, except where engine.reads_alone() (module docstring)."""
    with engine.raw_state_dict():
        sd = model.state_dict()
    params = {k for k in _param_keys(model, engine) if k in sd}
    _collect(model, engine, sd, "", rank, to_cpu=True, what="zero_py.full_state_dict()")
    if engine.executor.rank != rank:
        return None
    # the parameters are CPU clones already; buffers and the rest are cloned here
    return {k: v if k in params else v.detach().to("cpu", copy=True) for k, v in sd.items()}


class _Calls:
    """The nesting of the state_dict() (or load_state_dict()) calls in progress over the
    modules that carry the hooks: torch calls a module's children's state_dict() from its
    own, so each hooked module sees the call, and only the outermost acts (one gather per
    unit, one announcement; a load sliced and synced once)."""

    def __init__(self):
        self.stack: List[Tuple[nn.Module, str]] = []

    def enter(self, module: nn.Module, prefix: str) -> bool:
        """Opens a call; True when it is the outermost one. A call nested in the open one is
        a direct child's, under the prefix torch gives it; anything else means the open ones
        were left by a call that raised, and are dropped."""
        if self.stack:
            top, top_prefix = self.stack[-1]
            if (prefix.startswith(top_prefix) and prefix.endswith(".")
                    and top._modules.get(prefix[len(top_prefix):-1]) is module):
                self.stack.append((module, prefix))
                return False
            self.stack.clear()
        self.stack.append((module, prefix))
        return True

    def leave(self, module: nn.Module, prefix: str) -> bool:
        """Closes the call; True when it was the outermost one (False for one that is not
        open: its outermost call was dropped)."""
        if not self.stack or self.stack[-1][0] is not module or self.stack[-1][1] != prefix:
            return False
        self.stack.pop()
        return not self.stack


def install(model: nn.Module, engine: Stage3Engine, optimizer) -> None:
    """The state-dict hooks of a stage-3 model, on the root and on every submodule that holds
    a sharded parameter (see the module docstring)."""
    loading: List[Optional[contextlib.ExitStack]] = [None]  # residency of a load in progress
    saves, loads = _Calls(), _Calls()
    managed = {id(p) for s in engine.storages for p in s.params}
    names = {}  # how announcements name a submodule's call
    for name, m in model.named_modules():
        names.setdefault(id(m), "model.state_dict()" if m is model else
                         f"model.{name}.state_dict()")

    # a deep copy of the model (inside gathered(): AveragedModel, an EMA teacher) keeps these
    # hooks: on the copy, a plain model, they do nothing (a load there announced a collective
    # load of this model, and one rank loading its copy alone aborted gloo)
    hooked = set()

    def before_save(module, prefix, keep_vars):
        if id(module) in hooked:
            saves.enter(module, prefix)

    def on_save(module, sd, prefix, local_metadata):
        if id(module) in hooked and saves.leave(module, prefix) and not engine.raw:
            what = names.get(id(module), "a submodule's state_dict()")
            _collect(module, engine, sd, prefix, None, to_cpu=False, what=what)

    def before_load(module, sd, prefix, local_metadata, strict, missing, unexpected, errors):
        if id(module) not in hooked or not loads.enter(module, prefix):
            return  # inside the load of a module above, which did this module's part
        try:
            _before_load(module, sd, prefix)
        except BaseException:
            loads.leave(module, prefix)
            raise

    def _before_load(module, sd, prefix):
        keys = _param_keys(module, engine)
        bad = []
        for name, (s, i) in keys.items():
            value = sd.get(prefix + name)
            if isinstance(value, torch.Tensor) and tuple(value.shape) != s.param_shapes[i]:
                bad.append(f"{prefix + name}: {tuple(value.shape)} given, the parameter is "
                           f"{s.param_shapes[i]}")
        problem = ("zero_py stage 3: load_state_dict got values of the wrong shape (nothing "
                   "was loaded): " + "; ".join(bad)) if bad else None
        _start_load(problem)
        if problem is not None:
            raise RuntimeError(problem)
        # offload_params="nvme": the shards in memory while torch copies the slices into them,
        # written back by after_load (a stack left open by a load that raised is closed first)
        if loading[0] is not None:
            loading[0].close()
        loading[0] = contextlib.ExitStack()
        loading[0].enter_context(between_uses.writes_allowed())  # torch's copies of the slices
        for s in engine.storages:
            loading[0].enter_context(s.resident())
            # one-sided readers on other ranks (a state dict or no_grad forward right after
            # their own load) wait until this rank's load has ended
            loading[0].enter_context(s.writing())
        for name, (s, i) in keys.items():
            value = sd.get(prefix + name)
            if not isinstance(value, torch.Tensor) or s.is_gathered(s.param_bucket[i]):
                continue  # a gathered parameter is its full view: torch copies the full value
            sl = s.slice_of_param.get(i)
            flat = s.flat_of(i, value.detach())  # the slice is a range in memory order
            sd[prefix + name] = flat[sl.param_lo:sl.param_hi] if sl is not None else flat[:0]

    def _start_load(problem: Optional[str]) -> None:
        """Where peers read this rank's shards one-sided (one host, shared memory), every
        rank's reads before the load end before any rank writes: a load is collective (every
        rank calls it), so a MAX all-reduce here is its barrier, and carries a refusal to
        every rank (sd = model.state_dict(); model.load_state_dict(sd) raced: a slow rank
        still reading found a fast one's shards loaded, ahead of its own)."""
        if not any(s.one_sided for s in engine.storages):
            if problem is not None:
                raise RuntimeError(problem)
            return
        flag = torch.tensor([int(problem is not None)], dtype=torch.int64,
                            device=engine.executor.device)
        with control():
            issue("the all-reduce that starts a stage-3 load_state_dict (every rank calls it)",
                  engine.executor.all_reduce_max, flag).wait()
        if problem is None and int(flag[0]):
            raise RuntimeError("zero_py stage 3: another rank refused this load_state_dict "
                               "(values of the wrong shape there; see its error): nothing was "
                               "loaded")

    def after_load(module, incompatible):
        # torch gives a post hook no prefix: the call open on this module is the one ending
        if not loads.stack or loads.stack[-1][0] is not module:
            return
        if not loads.leave(module, loads.stack[-1][1]):
            return
        stack, loading[0] = loading[0], None
        with stack or contextlib.nullcontext(), torch.no_grad():
            for s in engine.storages:  # gathered buckets got full values: their pieces follow
                for b in range(s.n_buckets):
                    if s.is_gathered(b):
                        s.load_pieces_from(b, s.full_buffer(b))
            optimizer.follow_loaded_params()

    for module in model.modules():
        if not any(id(p) in managed for p in module.parameters()):
            continue  # nothing sharded below: torch's own state dict is right
        hooked.add(id(module))
        module.register_state_dict_pre_hook(before_save)
        module._register_state_dict_hook(on_save)
        module._register_load_state_dict_pre_hook(before_load, with_module=True)
        module.register_load_state_dict_post_hook(after_load)
