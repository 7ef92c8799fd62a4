"""ZeRO stage 3: parameters sharded between uses, gathered unit by unit with prefetch.

Reading order. `assign_units` cuts the model into units by a wrap policy (the root module is
always unit 0) and gives every parameter to one unit: a parameter registered in several modules
(tied weights) goes to the innermost unit that contains all of them. `ShardedParams` lays the
trainable parameters out with the C planner, keyed by (unit, param group), so a unit is whole
buckets, and keeps only this rank's piece of every bucket (the shards). A unit's full
parameters live in one gather buffer per bucket whose storage is allocated by an all-gather
and released (resized to zero bytes) when the unit is freed; the parameters' .data are views
into those buffers all along, so tensors autograd saved during forward see the values again
once the unit is gathered for backward.

`Stage3Engine` installs the hooks and runs the C prefetch schedule (zero_py._C.Prefetch):
  pre-forward of a unit   -> need(u): gather it (and, ahead, the next units of the recorded
                             order within a live-bytes budget); wait for it
  post-forward            -> done(u): free it (kept until backward with
                             reshard_after_forward=False, and always for the root and the
                             last unit of the recorded order, which backward needs first)
  grad of a unit's output -> need(u) in the backward phase (gathered again)
  grad of a unit's inputs -> done(u): its backward is over, free it
  end of backward         -> drain the schedule, free everything, agree on the next order
Gradients are reduce-scattered as in stage 2 (zero_py.reducer: post-accumulate-grad hooks, the
C bucket schedule), so a unit's gradients leave as soon as its backward is done.

Every rank must issue its all-gathers in the same sequence. The schedule guarantees it for the
gathers it schedules (the recorded order, drained at the end of each phase), whatever each
rank's own path; the order itself is merged over ranks after every backward (a MAX all-reduce of
first-use positions), so units that some ranks skip are still gathered by all. Gathers run on
a process group of their own, so their timing never interleaves differently with the
reductions across ranks. What cannot be made consistent is a unit that ranks call a different
number of times, or in a different relative order, in the same step: that is an error in the
user's program under any ZeRO-3 (documented in docs/stage3.md).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple, Type, Union

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from zero_py._native import _C
from zero_py.executor import TorchDistExecutor
from zero_py.flat import FlatLayout, PieceStore
from zero_py.meta_init import realize_meta, replay_init
from zero_py.optimizer import ZeroOptimizer

WrapPolicy = Union[None, int, Sequence[Type[nn.Module]], Callable[[nn.Module, str], bool]]

DEFAULT_WRAP_THRESHOLD = 1_000_000  # parameters; the default policy wraps modules this large
_NO_BUCKET_LIMIT = 2**62  # stage 3 buckets are whole (unit, group, dtype) sets
_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


def _in_backward() -> bool:
    """True while the autograd engine runs a backward pass on this thread (e.g. the forward
    that activation checkpointing recomputes)."""
    return torch._C._current_graph_task_id() != -1


# -- units ------------------------------------------------------------------------------------

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

    def visit(m: nn.Module) -> Set[int]:
        mine = {id(p) for p in m.parameters(recurse=False)}
        for child in m.children():
            mine |= visit(child)
        # containers have no forward, so nothing would ever gather them: never units
        if (m is not model and not isinstance(m, _CONTAINERS)
                and wrap(m, names.get(id(m), ""), sum(params[i].numel() for i in mine))):
            wrapped.add(id(m))
            taken[id(m)] = mine
            return set()
        return mine

    visit(model)
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


# -- sharded storage --------------------------------------------------------------------------

def _free_storage(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(0)


def _alloc_storage(t: torch.Tensor) -> None:
    t.untyped_storage().resize_(t.numel() * t.element_size())


class ShardedParams(FlatLayout):
    """Trainable parameters of a stage-3 model: this rank's pieces persist (the shards, one
    compact tensor per dtype); full values exist only in gather buffers while a unit is gathered.

    Persistent parameters (below the persistence threshold) form a pseudo-unit of their own
    whose buffers are never freed: they are replicated, as in stage 2."""

    def __init__(self, params: Sequence[nn.Parameter], groups: Sequence[int],
                 unit_of: Sequence[int], n_units: int, world_size: int, rank: int,
                 align_bytes: int):
        n_groups = max(groups) + 1
        keys = [u * n_groups + g for u, g in zip(unit_of, groups)]
        super().__init__(params, groups, world_size, rank, align_bytes, _NO_BUCKET_LIMIT,
                         layout_keys=keys)
        self.n_units = n_units  # unit n_units - 1 may be the persistent pseudo-unit
        self.param_unit = list(unit_of)
        self.bucket_unit = [unit_of[ps[0]] for ps in self.bucket_params]
        self.unit_buckets: List[List[int]] = [[] for _ in range(n_units)]
        for b, u in enumerate(self.bucket_unit):
            self.unit_buckets[u].append(b)
        self.unit_bytes = [sum(self.bucket_numel[b] * self.bucket_dtype(b).itemsize
                               for b in bs) for bs in self.unit_buckets]
        self.shards = PieceStore(self, self.bucket_dtype, self.device)
        # One gather buffer per bucket, appended by Stage3Engine.build_flat as it fills the
        # shards bucket by bucket: each is allocated once, there, and only one is whole at a
        # time (the persistent pseudo-unit's stay allocated).
        self.gather_buffers: List[torch.Tensor] = []

    def bucket_piece(self, b: int) -> torch.Tensor:
        return self.shards.piece(b)

    def bucket_region(self, b: int) -> torch.Tensor:
        return self.gather_buffers[b]

    def param_view(self, i: int) -> torch.Tensor:
        b = self.param_bucket[i]
        lo = self.param_offset[i]
        return self.gather_buffers[b][lo:lo + self.params[i].numel()]

    def rewire(self, b: int) -> None:
        """Points bucket b's parameters' .data at their slots of its gather buffer (valid
        whenever the unit is gathered; zero bytes behind it otherwise). A view can only be
        made while the storage is allocated; it then lives on through frees."""
        for i in self.bucket_params[b]:
            p = self.params[i]
            p.data = self.param_view(i).view(p.shape)

    def load_pieces_from(self, b: int, full: torch.Tensor) -> None:
        """This rank's piece of bucket b from a full bucket `full`."""
        n = self.bucket_shard_numel[b]
        self.shards.piece(b).copy_(full[self.rank * n:(self.rank + 1) * n])

    def gathered_bytes(self) -> int:
        return sum(buf.untyped_storage().nbytes() for buf in self.gather_buffers)


# -- the post-backward marker -----------------------------------------------------------------

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


# -- the engine -------------------------------------------------------------------------------

class Stage3Engine:
    """Hooks and prefetch for one stage-3 model (see the module docstring)."""

    def __init__(self, model: nn.Module, units: List[Tuple[str, nn.Module]],
                 unit_of: Dict[int, int], executor: TorchDistExecutor,
                 gather_executor: TorchDistExecutor, reshard_after_forward: bool,
                 persistence_threshold: int, prefetch_bytes: Optional[int]):
        self.model = model
        self.units = units
        self.unit_of = unit_of
        self.executor = executor
        self.gather_executor = gather_executor
        self.reshard_after_forward = reshard_after_forward
        self.persistence_threshold = persistence_threshold
        self.prefetch_bytes = prefetch_bytes
        self.flat: Optional[ShardedParams] = None
        self.reducer = None
        self.prefetch = None
        self._pending: Dict[int, list] = {}
        self._post_pending: List[int] = [0] * len(units)
        self._phase: Optional[int] = None
        self._order_pending = None
        self._hooks: list = []
        self._held: List[Set[int]] = []  # units held by open gathered() blocks
        self.uninitialized: Set[int] = set()  # params built on the meta device, not yet filled

    # -- layout -------------------------------------------------------------------------------

    def build_flat(self, managed: List[nn.Parameter], groups_of: List[int],
                   align_bytes: int) -> ShardedParams:
        """The sharded layout of the trainable parameters, filled from their current values
        (rank 0's), one bucket at a time: each bucket's gather buffer is allocated here, once,
        the parameters' .data become views of it, and its storage is released again unless it
        belongs to the persistent pseudo-unit. The caller's storage of a parameter is dropped
        as soon as its bucket is done, so no more than one unit is whole at a time beyond the
        model the caller built. Buckets whose parameters are all still to be initialized
        (built on the meta device) are neither filled nor broadcast: replay_init fills their
        pieces later, and regathers the persistent ones."""
        persistent = len(self.units)  # pseudo-unit id
        unit_of = []
        for p in managed:
            small = p.numel() < self.persistence_threshold
            unit_of.append(persistent if small else self.unit_of[id(p)])
        n_units = len(self.units) + 1
        flat = ShardedParams(managed, groups_of, unit_of, n_units, self.executor.world_size,
                             self.executor.rank, align_bytes)
        self.flat = flat
        with torch.no_grad():
            for b in range(flat.n_buckets):
                members = flat.bucket_params[b]
                # the values to lay out, taken before rewire() points .data elsewhere
                values = {i: flat.params[i].detach() for i in members
                          if id(flat.params[i]) not in self.uninitialized}
                buf = torch.empty(flat.bucket_numel[b], dtype=flat.bucket_dtype(b),
                                  device=flat.device)
                flat.gather_buffers.append(buf)
                # views can only be made while the storage exists; they live on through frees
                flat.rewire(b)
                if values:
                    for lo, hi in flat.bucket_gaps[b]:
                        buf[lo:hi].zero_()
                    for i, value in values.items():
                        flat.param_view(i).copy_(value.reshape(-1))
                    del values  # the caller's storage of these parameters can go now
                    self.gather_executor.broadcast(buf, 0).wait()
                    flat.load_pieces_from(b, buf)
                # else every parameter of the bucket is built on the meta device: its piece
                # stays zeros (padding included) until replay_init stores the values
                if flat.bucket_unit[b] != persistent:
                    _free_storage(buf)
        return flat

    @property
    def persistent_unit(self) -> int:
        return len(self.units)

    # -- hooks --------------------------------------------------------------------------------

    def attach(self, reducer) -> None:
        """Starts managing the model: the prefetch schedule and the module hooks."""
        flat = self.flat
        self.reducer = reducer
        n = len(self.units)
        unit_bytes = [max(flat.unit_bytes[u], 1) for u in range(n)]
        keep = [u == 0 or not self.reshard_after_forward for u in range(n)]
        budget = self.prefetch_bytes
        if budget is None:
            kept = sum(b for b, k in zip(unit_bytes, keep) if k)
            budget = kept + 2 * max([b for b, k in zip(unit_bytes, keep) if not k] or [0])
        self.prefetch = _C.Prefetch(unit_bytes, keep, int(budget))
        self.prefetch.set_order(list(range(n)))
        for u, (_, module) in enumerate(self.units):
            self._hooks.append(module.register_forward_pre_hook(
                self._make_pre_forward(u), with_kwargs=True))
            self._hooks.append(module.register_forward_hook(self._make_post_forward(u)))

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
                # the last unit of the forward is the first of the backward: keep it gathered
                # in between rather than free it and gather it again at once (the peak is the
                # same: it is resident there anyway, next to the unit before or after it)
                keep = [u == 0 for u in range(n)]
                last = [k for k in order if k != 0]
                if last:
                    keep[last[-1]] = True
                self.prefetch.set_keep(keep)
        self._phase = _C.PF_FORWARD if torch.is_grad_enabled() else _C.PF_FORWARD_EVAL
        self.prefetch.begin(self._phase)
        self._post_pending = [0] * len(self.units)

    def _begin_backward(self) -> None:
        if self._phase is not None:  # the model's forward did not end (a partial forward)
            self._run(self.prefetch.end())
        self._phase = _C.PF_BACKWARD
        self.prefetch.begin(_C.PF_BACKWARD)
        if not self.reducer._pass_open:
            self.reducer._begin_pass()
        torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _end_backward(self) -> None:
        with torch.no_grad():
            if self.reducer._pass_open:
                self.reducer._end_pass()
            self._run(self.prefetch.end())
            self._phase = None
            self._post_pending = [0] * len(self.units)
            # agree on the next order: each unit's first-use position on any rank
            n = len(self.units)
            positions = torch.zeros(n, dtype=torch.int64)
            for pos, k in enumerate(self.prefetch.seen()):
                positions[k] = n - pos
            self._order_pending = (self.executor.all_reduce_max(positions), positions)

    # -- commands -----------------------------------------------------------------------------

    def _run(self, commands) -> None:
        for kind, u in commands:
            if kind == _C.PF_GATHER:
                self._gather(u)
            else:
                self._free(u)

    def _gather(self, u: int) -> None:
        flat = self.flat
        pending = []
        for b in flat.unit_buckets[u]:
            buf = flat.gather_buffers[b]
            _alloc_storage(buf)
            pending.append(self.gather_executor.all_gather(buf, flat.shards.piece(b)))
        self._pending[u] = pending

    def _wait(self, u: int) -> None:
        for work in self._pending.pop(u, ()):
            work.wait()

    def _free(self, u: int) -> None:
        self._wait(u)
        for b in self.flat.unit_buckets[u]:
            _free_storage(self.flat.gather_buffers[b])

    def regather_resident(self) -> None:
        """After the optimizer changed the shards: refresh every unit whose full values exist
        (the persistent pseudo-unit, and any unit held by gathered())."""
        flat = self.flat
        pending = []
        for b in range(flat.n_buckets):
            buf = flat.gather_buffers[b]
            if buf.untyped_storage().nbytes():
                pending.append(self.gather_executor.all_gather(buf, flat.shards.piece(b)))
        for work in pending:
            work.wait()

    # -- gathered access ------------------------------------------------------------------------

    @contextlib.contextmanager
    def gathered(self, params: Optional[Set[int]], modifier_rank: Optional[int]):
        """Full values of the units holding `params` (ids; None: all). Collective."""
        flat = self.flat
        if self._phase is not None:
            raise RuntimeError("zero_py.gathered() cannot be used inside the model's forward or "
                               "backward; use it between steps")
        wanted = sorted({flat.param_unit[i] for i, p in enumerate(flat.params)
                         if params is None or id(p) in params})
        opened = [u for u in wanted if not flat.gather_buffers[flat.unit_buckets[u][0]]
                  .untyped_storage().nbytes()] if flat.n_buckets else []
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
                        pending = [(b, self.gather_executor.broadcast(flat.gather_buffers[b],
                                                                      modifier_rank))
                                   for b in flat.unit_buckets[u]]
                        for b, work in pending:
                            work.wait()
                            flat.load_pieces_from(b, flat.gather_buffers[b])
                            self._on_modified(b)
        finally:
            self._held.pop()
            for u in opened:
                self._free(u)

    def _on_modified(self, b: int) -> None:
        """Hook for the optimizer: bucket b's piece got new values (fp32 masters follow)."""


def _unit_names(units) -> List[str]:
    return [name or "<root>" for name, _ in units]


# -- the optimizer ----------------------------------------------------------------------------

class Stage3Optimizer(ZeroOptimizer):
    """ZeroOptimizer over a stage-3 model's shards: built by zero_py.initialize(..., stage=3).

    Everything of ZeroOptimizer applies (param groups, schedulers, clipping, loss scaling,
    state dicts, consolidation); after a step the shards are the new parameters, and units are
    gathered from them at their next use."""

    _STAGES = (3,)
    # a stage-3 bucket is a whole unit: one reduction in flight (it overlaps the backward of the
    # next unit) keeps the gradient working set at two unit-sized buffers
    _MAX_REDUCTIONS_IN_FLIGHT = 1

    def __init__(self, engine: "Stage3Engine", params, optimizer_class, **kwargs):
        self._engine = engine
        super().__init__(params, optimizer_class, stage=3, **kwargs)
        engine._on_modified = self._sync_master_bucket
        engine.attach(self._reducer)

    def _make_flat(self, managed, groups_of, align_bytes, bucket_bytes):
        return self._engine.build_flat(managed, groups_of, align_bytes)

    def _publish(self, buckets: List[int]) -> None:
        self._engine.regather_resident()

    def _sync_master_bucket(self, b: int) -> None:
        master = self._masters.piece(b)
        if master is not None:
            master.copy_(self._flat.bucket_piece(b))

    def memory_report(self) -> Dict[str, int]:
        """Bytes this rank holds for model states (see ZeroOptimizer.memory_report): params
        counts the shards, the persistent parameters' buffers, frozen parameters and the most
        gathered bytes held at once (gathered_peak, also reported alone)."""
        report = super().memory_report()
        fp = self._flat
        ids = {id(p) for p in fp.params}
        frozen = sum(p.numel() * p.element_size() for p in self._all_params if id(p) not in ids)
        persistent = sum(fp.bucket_numel[b] * fp.bucket_dtype(b).itemsize
                         for b in fp.unit_buckets[self._engine.persistent_unit])
        peak = self._engine.prefetch.peak_bytes
        report["params"] = fp.shards.nbytes() + persistent + frozen + peak
        report["gathered_peak"] = peak
        report["padding"] = sum((hi - lo) * fp.bucket_dtype(b).itemsize
                                for b in range(fp.n_buckets) for lo, hi in fp.bucket_gaps[b])
        return report


# -- the public entry ---------------------------------------------------------------------------

def initialize(model: nn.Module, optimizer_class: Type[torch.optim.Optimizer] = torch.optim.AdamW,
               *, stage: int = 3, wrap_policy: WrapPolicy = None, params=None,
               process_group: Optional[dist.ProcessGroup] = None,
               reshard_after_forward: bool = True, persistence_threshold: int = 0,
               prefetch_bytes: Optional[int] = None,
               init_fn: Optional[Callable[[nn.Module], None]] = None, **kwargs):
    """Prepares `model` for ZeRO training and returns (model, optimizer): the same call for
    every stage.

    Stages 1 and 2 return the model unchanged and a ZeroOptimizer over its parameters. Stage 3
    shards the parameters too: the model is cut into units by `wrap_policy` (None: every module
    holding at least 1M parameters not already in a smaller unit; an int: that parameter count;
    module classes, e.g. {Block}; or a callable(module, name) -> bool), each unit's parameters
    exist only as shards between uses, and hooks gather them for forward and backward.

    Stage-3 options:
        reshard_after_forward: free a unit after its forward (default) or keep it until its
            backward (no second gather; stage-2 memory for parameters).
        persistence_threshold: parameters with fewer elements stay replicated (never gathered).
        prefetch_bytes: the most bytes of gathered units held at once by prefetching
            (default: the units kept whole plus twice the largest other unit).
        init_fn: for a model built on the meta device: called on every module after the
            modules' reset_parameters(), like model.apply(init_fn) after construction.
    A model whose parameters are on the meta device (built under `with torch.device("meta")`)
    is materialized module by module: it never exists whole on a rank, and gets the values an
    ordinary build from the same seed gives (see replay_init).

    `params` are param groups (dicts with "params") over the model's parameters (default: all
    of them, one group); other keyword arguments go to ZeroOptimizer (bucket_bytes,
    grad_reduce_dtype, loss_scaler, ...) and to optimizer_class (lr, betas, ...)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"initialize takes an nn.Module, got {type(model).__name__}")
    if stage in (1, 2):
        extra = {"wrap_policy": wrap_policy, "init_fn": init_fn, "prefetch_bytes": prefetch_bytes}
        given = [k for k, v in extra.items() if v is not None]
        if given or persistence_threshold or not reshard_after_forward:
            raise ValueError(f"{given or 'stage-3 options'} only apply to stage=3; drop them "
                             f"for stage {stage}")
        if any(p.is_meta for p in model.parameters()):
            raise ValueError("a model on the meta device needs stage=3 (partitioned "
                             "construction); build it on a real device for stages 1-2")
        opt = ZeroOptimizer(model.parameters() if params is None else params, optimizer_class,
                            stage=stage, process_group=process_group, **kwargs)
        model._zero_py = opt
        return model, opt
    if stage != 3:
        raise ValueError(f"stage must be 1, 2 or 3, got {stage!r}")
    if not isinstance(persistence_threshold, int) or persistence_threshold < 0:
        raise ValueError(f"persistence_threshold must be an int >= 0, got "
                         f"{persistence_threshold!r}")
    if prefetch_bytes is not None and (not isinstance(prefetch_bytes, int) or prefetch_bytes < 0):
        raise ValueError(f"prefetch_bytes must be None or an int >= 0, got {prefetch_bytes!r}")
    if getattr(model, "_zero_py", None) is not None:
        raise ValueError("this model is already managed by zero_py; initialize it once")
    units, unit_of = assign_units(model, wrap_policy)
    executor = TorchDistExecutor(process_group)
    group = executor.group
    if executor.world_size > 1:  # gathers get a communicator of their own (see above)
        ranks = [executor.global_rank(r) for r in range(executor.world_size)]
        gather_executor = TorchDistExecutor(dist.new_group(ranks, backend=dist.get_backend(group)))
    else:
        gather_executor = executor
    meta = any(p.is_meta for p in model.parameters())
    device = torch.device("cpu")
    uninitialized: Set[int] = set()
    if meta:
        before = dict(model.named_parameters(remove_duplicate=False))
        uninitialized = realize_meta(model, device)
        # the replacements belong to the units of the parameters they replace
        unit_of = {id(p): unit_of[id(before[n])]
                   for n, p in model.named_parameters(remove_duplicate=False)}
        if params is not None:
            raise ValueError("param groups cannot be given for a meta-device model (its "
                             "parameters are replaced while it is materialized); pass params=None")
    engine = Stage3Engine(model, units, unit_of, executor, gather_executor,
                          bool(reshard_after_forward), persistence_threshold, prefetch_bytes)
    engine.uninitialized = uninitialized
    opt = Stage3Optimizer(engine, model.parameters() if params is None else params,
                          optimizer_class, process_group=process_group, **kwargs)
    if meta:
        replay_init(model, engine, init_fn)
        opt.sync_master_from_params()
    elif init_fn is not None:
        raise ValueError("init_fn applies to models built on the meta device only; initialize "
                         "an ordinary model before calling zero_py.initialize")
    model._zero_py = opt
    return model, opt


def _managed_by(model_or_params) -> Tuple[Optional[ZeroOptimizer], Optional[Set[int]]]:
    if isinstance(model_or_params, nn.Module):
        opt = getattr(model_or_params, "_zero_py", None)
        ids = {id(p) for p in model_or_params.parameters()}
        if opt is None:  # a submodule: find the managed model above it by its parameters
            return None, ids
        return opt, ids
    params = list(model_or_params)
    return None, {id(p) for p in params}


@contextlib.contextmanager
def gathered(module_or_params, modifier_rank: Optional[int] = None, *,
             optimizer: Optional[ZeroOptimizer] = None):
    """Full parameters inside the block. Collective: every rank enters it with the same
    arguments.

    `module_or_params`: a model given to zero_py.initialize, one of its submodules, or some of
    its parameters (then pass `optimizer=`, the one initialize returned, unless the model
    itself is given). With `modifier_rank=r`, rank r's edits made in the block (under
    torch.no_grad()) are broadcast and become every rank's parameters (shards and fp32 masters)
    on exit; without it, edits are discarded. Under stages 1-2 the parameters are always full;
    the block then only applies the modifier rank's edits."""
    opt, ids = _managed_by(module_or_params)
    opt = optimizer or opt
    if opt is None:
        raise ValueError("zero_py.gathered needs the model given to zero_py.initialize, or "
                         "optimizer= (what initialize returned) with a submodule or parameters")
    if isinstance(opt, Stage3Optimizer):
        with opt._engine.gathered(ids, modifier_rank):
            yield
        return
    yield
    if modifier_rank is not None:
        with torch.no_grad():
            for p in opt._flat.params:
                if id(p) in ids:
                    opt.executor.broadcast(p.data, modifier_rank).wait()
        opt.sync_master_from_params()


def full_state_dict(model: nn.Module, rank: int = 0) -> Optional[Dict[str, torch.Tensor]]:
    """The model's state_dict with full tensors (cloned, on CPU) on group rank `rank`, None
    elsewhere. Under stage 3 the units are gathered one at a time. Collective."""
    opt = getattr(model, "_zero_py", None)
    if opt is None:
        raise ValueError("full_state_dict needs a model given to zero_py.initialize")
    me = opt.executor.rank
    out: Dict[str, torch.Tensor] = {}
    keys = model.state_dict(keep_vars=True)
    if not isinstance(opt, Stage3Optimizer):
        return {k: v.detach().clone() for k, v in keys.items()} if me == rank else None
    engine = opt._engine
    flat = opt._flat
    by_unit: Dict[int, List[str]] = {}
    param_index = {id(p): i for i, p in enumerate(flat.params)}
    for k, v in keys.items():
        i = param_index.get(id(v))
        if i is None:
            if me == rank:
                out[k] = v.detach().clone()
        else:
            by_unit.setdefault(flat.param_unit[i], []).append(k)
    for u in sorted(by_unit):
        ids = {id(flat.params[i]) for i in range(len(flat.params)) if flat.param_unit[i] == u}
        with engine.gathered(ids, None):
            if me == rank:
                for k in by_unit[u]:
                    out[k] = keys[k].detach().clone()
    return {k: out[k] for k in keys} if me == rank else None
