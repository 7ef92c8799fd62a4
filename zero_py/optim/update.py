"""The update of a rank's shard: the C kernel family for known optimizers, torch.optim else.

Both updaters see the same things: the flat layout, the reduced gradient pieces (any dtype),
and the fp32 masters (the parameter piece itself for fp32 buckets, a PieceStore piece for
the others). After an update the parameter pieces hold the new values in their own dtype, so
the optimizer only has to all-gather them.

FusedUpdate keeps optimizer state in flat fp32 tensors over the rank's shard space and runs
one C call per step over a table of segments; TorchUpdate runs any torch.optim class on 1-D
fp32 views of the masters, one per parameter slice, so per-parameter state and the skipping
of absent gradients work exactly as in torch.
"""

from __future__ import annotations

import re
import warnings
from array import array
from typing import Dict, List, Optional, Sequence

import torch

from zero_py import kernels
from zero_py.optim.lion import Lion
from zero_py.sharding.layout import FlatLayout, ShardSlice
from zero_py.sharding.storage import PieceStore

_KINDS = {torch.optim.AdamW: kernels.OPT_ADAMW, torch.optim.Adam: kernels.OPT_ADAM,
          torch.optim.SGD: kernels.OPT_SGD, torch.optim.Adagrad: kernels.OPT_ADAGRAD,
          Lion: kernels.OPT_LION}
_ADAM_KINDS = (kernels.OPT_ADAMW, kernels.OPT_ADAM)


def fused_kind(optimizer_class, groups: Sequence[dict]) -> Optional[int]:
    """The C kernel that computes what `optimizer_class` would for these groups, or None."""
    kind = _KINDS.get(optimizer_class)
    if kind is None:
        return None
    for g in groups:
        if g.get("capturable") or g.get("differentiable"):
            return None
        if any(isinstance(v, torch.Tensor) for k, v in g.items() if k != "params"):
            return None  # tensor hyperparameters (e.g. lr as a tensor) stay with torch
    # Adam or AdamW with either decoupled_weight_decay: each group's row picks AdamW's decay or
    # Adam's L2 term (FusedUpdate._group_row), as torch.optim.Adam's step does
    return kind


def refuse_unhonoured_options(groups: Sequence[dict], what: Optional[str] = None) -> None:
    """Refuses the torch.optim options zero_py cannot honour, rather than ignore them:
    differentiable=True, which asks torch.optim to record the update in the autograd graph (to
    differentiate through the step, e.g. meta-learning over non-leaf parameters). zero_py
    updates fp32 shards of the parameters outside autograd and all-gathers the result, so no
    graph could reach the parameters (torch.optim itself refuses it on leaf parameters).
    `what` names the dicts in the message (default: param group k)."""
    for k, g in enumerate(groups):
        if g.get("differentiable"):
            raise ValueError(
                f"differentiable=True ({what or f'param group {k}'}) cannot be honoured: "
                "zero_py updates fp32 shards of the parameters outside autograd and "
                "all-gathers them, so the step cannot be differentiated; drop differentiable "
                "(it changes no value)")


def initial_accumulator(defaults: dict) -> float:
    """Adagrad's accumulator before its first step, from the optimizer's defaults.
    torch.optim.Adagrad takes it from the constructor's initial_accumulator_value for every
    parameter, whatever a param group says (a group's own value is ignored), and so does
    zero_py: its loss curve is torch's."""
    return float(defaults.get("initial_accumulator_value", 0.0))


def warn_ignored_group_options(optimizer_class, defaults: dict, groups: Sequence[dict]) -> None:
    """Warns where a param group sets an option that optimizer_class ignores per group (torch
    ignores it too, silently): Adagrad's initial_accumulator_value."""
    if not issubclass(optimizer_class, torch.optim.Adagrad):
        return
    given = defaults.get("initial_accumulator_value")
    odd = sorted({g["initial_accumulator_value"] for g in groups
                  if g.get("initial_accumulator_value", given) != given})
    if odd:
        warnings.warn(f"a param group sets initial_accumulator_value={odd[0]!r}, but "
                      "torch.optim.Adagrad starts every accumulator at the constructor's "
                      f"initial_accumulator_value ({given!r}), and so does zero_py: pass the "
                      "value to the constructor (or to zero_py.initialize) instead",
                      stacklevel=3)


def state_keys(kind: int, groups: Sequence[dict]) -> List[str]:
    """The per-element state tensors of `kind`, in the kernel's state0, state1, state2 order."""
    if kind in _ADAM_KINDS:
        keys = ["exp_avg", "exp_avg_sq"]
        if any(g.get("amsgrad") for g in groups):
            keys.append("max_exp_avg_sq")
        return keys
    if kind == kernels.OPT_SGD:
        return ["momentum_buffer"] if any(g["momentum"] != 0 for g in groups) else []
    if kind == kernels.OPT_ADAGRAD:
        return ["sum"]
    return ["exp_avg"]  # Lion


BUFFER = "momentum_buffer"  # SGD's: torch.optim makes it at a parameter's first step with momentum
# Adam's: torch.optim makes it at a parameter's first step only where its group has amsgrad
MAX_SQ = "max_exp_avg_sq"


def optional_state(kind: Optional[int], group: dict) -> List[str]:
    """The state keys that a torch.optim state dict may lack for a parameter of `group` (and
    that a load then starts as torch.optim would): SGD's momentum buffer (none before a step
    with momentum), and Adam's max_exp_avg_sq in a group without amsgrad (zero_py keeps it for
    every parameter once any group has amsgrad; torch.optim only for those groups')."""
    if kind == kernels.OPT_SGD:
        return [BUFFER]
    if kind in _ADAM_KINDS and not group.get("amsgrad"):
        return [MAX_SQ]
    return []


def without_buffer(kind: Optional[int], keys: Sequence[str], saved: Sequence[str]) -> bool:
    """Whether a parameter's saved state keys `saved` are `keys` (what the update keeps, with or
    without a buffer) less SGD's momentum buffer: a parameter stepped only without momentum so
    far, which torch.optim holds no buffer for (its first step with momentum makes the buffer
    the gradient itself).
    Its state is saved without the buffer, and a load gives it none (FusedUpdate
    .no_momentum_yet), as torch.optim's state dicts carry it."""
    return (kind == kernels.OPT_SGD and BUFFER not in saved
            and list(saved) == [k for k in keys if k != BUFFER])


def added_state(kind: int, keys: Sequence[str], groups: Sequence[dict],
                fresh: Sequence[dict] = ()) -> Optional[List[str]]:
    """The state keys `groups` need beyond `keys` (what an update keeps): [] when none, SGD's
    ["momentum_buffer"] once a momentum is switched on after construction (torch.optim makes
    the buffer at the first step with momentum != 0: OneCycleLR cycles the momentum of an SGD
    built with momentum=0), Adam's ["max_exp_avg_sq"] where only groups of `fresh` (added by
    add_param_group, their parameters never stepped) have amsgrad (torch.optim makes it at
    their first step), and None for any other (amsgrad switched on for parameters that have
    stepped, which torch.optim.Adam cannot take either)."""
    extra = [k for k in state_keys(kind, groups) if k not in keys]
    if not extra or extra == [BUFFER]:
        return extra
    if extra == [MAX_SQ] and all(any(g is f for f in fresh)
                                 for g in groups if g.get("amsgrad")):
        return extra
    return None


def _by_param_group(message: str, group_of_row: Sequence[int]) -> str:
    """A kernel's refusal of a group row ("opt_step: group 2 (sgd): ...") naming the param
    group that row was made from (rows are per group and dtype, numbered as met), and saying
    that torch.optim may take what the fused kernel refuses."""
    found = re.match(r"opt_step: group (\d+) \((\w+)\): (.*)", message, re.S)
    if found is None or int(found.group(1)) >= len(group_of_row):
        return message
    return (f"param group {group_of_row[int(found.group(1))]}: {found.group(3)} (zero_py's "
            f"fused {found.group(2)} kernel takes no other value)")


class _Update:
    """`host` (an offload.HostShard, or None) moves the update to host memory: its gradient
    copy, masters and staging replace `grads`, `masters` and the parameter pieces, and the
    state lives on the host."""

    def __init__(self, flat: FlatLayout, grads: PieceStore, masters: PieceStore,
                 param_groups: List[dict], host=None):
        self.flat = flat
        self.host = host
        self.grads = grads if host is None else host.grads
        self.masters = masters if host is None else host
        self.device = flat.device if host is None else torch.device("cpu")
        self.param_groups = param_groups  # the optimizer's own list: hyperparameters live there

    def master(self, b: int) -> torch.Tensor:
        piece = self.masters.piece(b)
        return self.flat.bucket_piece(b) if piece is None else piece

    def param_out(self, b: int) -> Optional[torch.Tensor]:
        """Where the kernel writes bucket b's new values in the parameter dtype: the parameter
        piece when it has a separate master, the host staging under offload, else None."""
        if self.host is not None:
            return self.host.param_out(b)
        return self.flat.bucket_piece(b) if self.masters.piece(b) is not None else None


class FusedUpdate(_Update):
    def __init__(self, kind: int, flat: FlatLayout, grads: PieceStore, masters: PieceStore,
                 param_groups: List[dict], host=None, defaults: Optional[dict] = None):
        super().__init__(flat, grads, masters, param_groups, host)
        self.kind = kind
        # the state's value before a parameter's first step (Adagrad's sum; 0 for the rest)
        self.initial_state = (initial_accumulator(defaults or {})
                              if kind == kernels.OPT_ADAGRAD else 0.0)
        self.keys = state_keys(kind, param_groups)
        self.states: Optional[List[torch.Tensor]] = None  # allocated at the first step or load
        # SGD: parameters whose every step so far had momentum 0, so that torch.optim holds no
        # momentum buffer for them: their first step with momentum is a first step (the
        # buffer is the gradient itself, not dampened)
        self.no_momentum_yet: set = set()

    def add_keys(self, keys: Sequence[str]) -> None:
        """Keeps the state `keys` too (added_state's answer), fresh (zero) where allocated."""
        if self.states is not None:
            self.states += self.fresh_states((), len(keys))
        self.keys = self.keys + list(keys)

    def note_step(self, used: Sequence[int], step_count: Sequence[int]) -> None:
        """After a step with the live groups: which parameters have no momentum buffer yet."""
        if self.kind != kernels.OPT_SGD:
            return
        flat = self.flat
        for i, u in enumerate(used):
            if not u:
                continue
            if self.param_groups[flat.bucket_group[flat.param_bucket[i]]]["momentum"] != 0:
                self.no_momentum_yet.discard(i)
            elif step_count[i] == 1:
                self.no_momentum_yet.add(i)

    def _ensure_states(self) -> List[torch.Tensor]:
        if self.states is None:
            self.states = self.fresh_states(())
        return self.states

    def fresh_states(self, filled: Sequence[ShardSlice],
                     count: Optional[int] = None) -> List[torch.Tensor]:
        """New state tensors (not installed: see adopt_states), one per key (or `count`), with
        their initial value (0, or Adagrad's initial_accumulator_value) everywhere but the
        slices `filled`, which the caller overwrites at once (a checkpoint load): their pages
        are written only once."""
        flat = self.flat
        states = [torch.empty(flat.shard_numel, dtype=torch.float32, device=self.device,
                              pin_memory=self.host is not None and flat.device.type == "cuda")
                  for _ in range(len(self.keys) if count is None else count)]
        holes = sorted((flat.bucket_shard_offset[s.bucket] + s.piece_lo,
                        flat.bucket_shard_offset[s.bucket] + s.piece_hi) for s in filled)
        k = 0
        for b in range(flat.n_buckets):
            r = flat.shard_range(b)
            init = self.initial_state
            at = r.start
            while k < len(holes) and holes[k][1] <= r.start:
                k += 1
            j = k
            while j < len(holes) and holes[j][0] < r.stop:
                lo, hi = max(holes[j][0], r.start), min(holes[j][1], r.stop)
                if lo > at:
                    for t in states:
                        t[at:lo].fill_(init)
                at = max(at, hi)
                j += 1
            if at < r.stop:
                for t in states:
                    t[at:r.stop].fill_(init)
        return states

    def allocate(self, filled: Sequence[ShardSlice]) -> None:
        """Installs fresh state tensors for a caller that fills the slices `filled` at once."""
        self.states = self.fresh_states(filled)

    def adopt_states(self, states: List[torch.Tensor],
                     keys: Optional[Sequence[str]] = None) -> None:
        """Installs state tensors made by fresh_states (and filled): one per key of `keys`
        (default: the keys kept now), which become the keys kept (a checkpoint load that adds
        SGD's momentum buffer)."""
        if keys is not None:
            self.keys = list(keys)
        self.states = states

    def views_in(self, states: List[torch.Tensor], s: ShardSlice,
                 keys: Optional[Sequence[str]] = None) -> Dict[str, torch.Tensor]:
        """Slice s's part of each tensor of `states` (the live ones or fresh ones), by key
        (`keys`: theirs, default the keys kept now)."""
        lo = self.flat.bucket_shard_offset[s.bucket] + s.piece_lo
        return {k: t[lo:lo + s.numel] for k, t in zip(self.keys if keys is None else keys,
                                                        states)}

    def _runs(self, b: int, used: Sequence[int], step_count: Sequence[int]):
        """Bucket b's piece as (piece_lo, piece_hi, step) runs: maximal stretches of parameter
        slices that got a gradient and share a step count. A run spans the padding between its
        slices, where master, gradient and state are zero and stay zero. (SGD reads the step
        only to know a first step, which for a parameter without momentum buffer is step 1.)"""
        run = None
        for s in self.flat.slices_of_bucket[b]:
            if not used[s.param]:
                if run is not None:
                    yield run
                run = None
                continue
            step = 1 if s.param in self.no_momentum_yet else step_count[s.param]
            if run is not None and run[2] == step:
                run = (run[0], s.piece_hi, step)
            else:
                if run is not None:
                    yield run
                run = (s.piece_lo, s.piece_hi, step)
        if run is not None:
            yield run

    def _group_row(self, g: dict, grad_dtype: torch.dtype, param_dtype: torch.dtype,
                   grad_scale: float, seed: int, stochastic_rounding: bool) -> list:
        # torch.optim.SGD reads nesterov only where the group has a momentum (its constructor
        # refuses nesterov without one, but not a param group's momentum=0)
        nesterov = bool(g.get("nesterov")) and self.kind == kernels.OPT_SGD and g["momentum"] != 0
        flags = kernels.opt_flags(bool(g.get("maximize")), bool(g.get("amsgrad")), nesterov,
                                  stochastic_rounding and param_dtype == torch.bfloat16)
        kind = self.kind
        if kind in _ADAM_KINDS:
            # a group's decoupled_weight_decay picks the kernel (AdamW's decay or Adam's L2
            # term), as it picks torch's, also when it is changed after construction
            decoupled = g.get("decoupled_weight_decay", kind == kernels.OPT_ADAMW)
            kind = kernels.OPT_ADAMW if decoupled else kernels.OPT_ADAM
        if kind in _ADAM_KINDS or kind == kernels.OPT_LION:
            beta1, beta2 = g["betas"]
        elif kind == kernels.OPT_SGD:
            beta1, beta2 = g["momentum"], g["dampening"]
        else:
            beta1, beta2 = g["lr_decay"], 0.0
        return kernels.opt_group_row(kind, kernels.dtype_code(grad_dtype),
                                     kernels.dtype_code(param_dtype), flags, g["lr"], beta1, beta2,
                                     g.get("eps", 0.0), g["weight_decay"], grad_scale, seed)

    def step(self, used: Sequence[int], step_count: Sequence[int], grad_scale: float,
             seed: int, stochastic_rounding: bool, buckets: Optional[Sequence[int]] = None,
             param_groups: Optional[Dict[int, dict]] = None) -> None:
        """One update of `buckets` (default: all) of the shard; `param_groups` ({group index:
        hyperparameters}) stands in for the live groups (overlap_step's guess)."""
        flat = self.flat
        groups = self.param_groups if param_groups is None else param_groups
        states = self._ensure_states()
        state_base = [t.data_ptr() for t in states] + [0] * (3 - len(states))
        rows = array("q")
        group_rows: List[list] = []
        row_of: Dict[tuple, int] = {}
        for b in range(flat.n_buckets) if buckets is None else buckets:
            runs = list(self._runs(b, used, step_count))
            if not runs:  # its group is not read (a group the step leaves alone may hold
                continue  # values the kernel refuses, as torch.optim never reads them)
            grad = self.grads.piece(b)
            master = self.master(b)
            param_out = self.param_out(b)
            param_dtype = flat.bucket_dtype(b)
            key = (flat.bucket_group[b], grad.dtype, param_dtype)
            if key not in row_of:
                row_of[key] = len(group_rows)
                group_rows.append(self._group_row(groups[key[0]], grad.dtype,
                                                  param_dtype, grad_scale, seed,
                                                  stochastic_rounding))
            g_size, p_size = grad.element_size(), param_dtype.itemsize
            shard_lo = flat.bucket_shard_offset[b]
            for lo, hi, step in runs:
                at = (shard_lo + lo) * 4  # fp32 bytes into the shard-space state tensors
                rows.extend(kernels.segment_row(
                    hi - lo, master=master.data_ptr() + lo * 4, grad=grad.data_ptr() + lo * g_size,
                    state0=state_base[0] and state_base[0] + at,
                    state1=state_base[1] and state_base[1] + at,
                    state2=state_base[2] and state_base[2] + at,
                    param_out=0 if param_out is None else param_out.data_ptr() + lo * p_size,
                    step=step, group=row_of[key]))
        # CPU: the C family on this process's threads; CUDA: one launch, same math and bits
        if not rows:
            return
        threads = (None if self.device.type != "cpu" else
                   self.host.threads if self.host is not None else torch.get_num_threads())
        try:
            kernels.optim_step_segments(rows, group_rows, self.device, n_threads=threads)
        except ValueError as exc:
            raise ValueError(_by_param_group(str(exc), [key[0] for key in row_of])) from None

    def check_groups(self, used: Sequence[int]) -> None:
        """Runs the kernel's checks of the hyperparameters of the param groups that the step
        with `used` (the same on every rank) updates, as a table without segments on the CPU.
        The optimizer calls it on every rank before a step changes anything, so that a value
        the kernel refuses (torch.optim may take it: its constructor checks only the defaults)
        is refused by every rank, whatever part of the shard each would update, and before the
        step counts or any bucket (offloaded steps go bucket by bucket) move. A group that the
        step leaves alone is not read, as torch.optim does not read it."""
        flat = self.flat
        stepped = sorted({flat.bucket_group[flat.param_bucket[i]] for i, u in enumerate(used)
                          if u})
        self.check_group_values(self.param_groups, stepped)

    def check_group_values(self, groups: Sequence[dict], which: Sequence[int]) -> None:
        """The kernel's checks of the hyperparameters of groups[k] for k in `which` (check_groups;
        load_checkpoint, on the loaded groups before anything changes): ValueError naming the
        param group."""
        rows = []
        for k in which:
            try:
                rows.append(self._group_row(groups[k], torch.float32, torch.float32, 1.0, 0,
                                            False))
            except (TypeError, ValueError, KeyError) as exc:  # lr="x", betas=0.9, no "lr"
                raise ValueError(
                    f"param group {k}: a hyperparameter the fused kernel cannot read "
                    f"({type(exc).__name__}: {exc}): lr, eps, weight_decay, momentum and "
                    "dampening must be numbers and betas a pair of numbers; nothing was "
                    "changed") from None
        try:
            kernels.optim_step_segments(array("q"), rows, torch.device("cpu"), n_threads=1)
        except ValueError as exc:
            raise ValueError(_by_param_group(str(exc), list(which))) from None

    def slice_state(self, s: ShardSlice, copy: bool = True) -> Dict[str, torch.Tensor]:
        """Slice s's per-element state tensors (copies, or views of the live state)."""
        if self.states is None:
            return {}
        r = slice(self.flat.bucket_shard_offset[s.bucket] + s.piece_lo,
                  self.flat.bucket_shard_offset[s.bucket] + s.piece_hi)
        return {k: t[r].clone() if copy else t[r] for k, t in zip(self.keys, self.states)}

    def install(self, s: ShardSlice, state: dict) -> None:
        """Slice s's state from `state`; an SGD state without a momentum buffer (absent or None,
        as torch.optim saves a parameter not stepped with momentum yet) gets none: zeros, and
        its next step with momentum is a first one (no_momentum_yet)."""
        absent = (self.kind == kernels.OPT_SGD and BUFFER in self.keys
                  and state.get(BUFFER) is None)
        # a parameter of a group without amsgrad, saved by torch.optim: no max yet (zeros)
        no_max = (MAX_SQ in self.keys and state.get(MAX_SQ) is None
                  and MAX_SQ in optional_state(self.kind, self.param_groups[
                      self.flat.bucket_group[s.bucket]]))
        missing = [k for k in self.keys if k not in state
                   and not (absent and k == BUFFER) and not (no_max and k == MAX_SQ)]
        if missing:
            raise ValueError(f"the loaded state of a parameter lacks {missing}; was it saved by "
                             "another optimizer class or with other options (e.g. amsgrad)?")
        states = self._ensure_states()
        lo = self.flat.bucket_shard_offset[s.bucket] + s.piece_lo
        for k, t in zip(self.keys, states):
            if (absent and k == BUFFER) or (no_max and k == MAX_SQ):
                t[lo:lo + s.numel].zero_()
            else:
                t[lo:lo + s.numel].copy_(state[k].reshape(-1))
        if absent:
            self.no_momentum_yet.add(s.param)
        else:
            self.no_momentum_yet.discard(s.param)

    def state_views(self, s: ShardSlice) -> Dict[str, torch.Tensor]:
        """Live views of slice s's state tensors (allocated at first use), to fill in place."""
        return self.views_in(self._ensure_states(), s)

    def reset(self) -> None:
        self.states = None
        self.no_momentum_yet = set()  # a loaded momentum buffer is one

    def state_bytes(self) -> int:
        return 0 if self.states is None else sum(t.numel() * 4 for t in self.states)


class TorchUpdate(_Update):
    def __init__(self, optimizer_class, flat: FlatLayout, grads: PieceStore, masters: PieceStore,
                 param_groups: List[dict], host=None, class_kwargs: Optional[dict] = None):
        super().__init__(flat, grads, masters, param_groups, host)
        groups = [{"params": [], **{k: v for k, v in g.items() if k != "params"}}
                  for g in param_groups]
        self.views: Dict[int, torch.Tensor] = {}
        for s in flat.slices:
            view = self.master(s.bucket)[s.piece_lo:s.piece_hi]
            self.views[s.param] = view
            groups[flat.bucket_group[s.bucket]]["params"].append(view)
        # class_kwargs: what the class takes besides its hyperparameters (kept in its defaults,
        # which the groups carry), such as a custom optimizer's constructor argument
        self.inner = optimizer_class(groups, **(class_kwargs or {})) if self.views else None

    def step(self, used: Sequence[int], step_count: Sequence[int], grad_scale: float,
             seed: int, stochastic_rounding: bool) -> None:
        if self.inner is None:
            return
        if self.host is not None:
            for b in range(self.flat.n_buckets):
                self.host.grads_ready(b)
        for i, view in self.views.items():
            s = self.flat.slice_of_param[i]
            if not used[i]:
                view.grad = None
                continue
            g = self.grads.piece(s.bucket)[s.piece_lo:s.piece_hi]
            if g.dtype != torch.float32 or grad_scale != 1.0:
                g = g.float() * grad_scale
            view.grad = g
        for mine, inner in zip(self.param_groups, self.inner.param_groups):
            inner.update({k: v for k, v in mine.items() if k != "params"})
        self.inner.step()
        if self.host is not None:
            self.host.push_all()
            return
        for b in range(self.flat.n_buckets):
            master = self.masters.piece(b)
            if master is not None:
                self.flat.bucket_piece(b).copy_(master)

    def slice_state(self, s: ShardSlice, copy: bool = True) -> Dict[str, object]:
        state = self.inner.state.get(self.views[s.param]) if self.inner is not None else None
        return {k: (v.clone() if copy and isinstance(v, torch.Tensor) else v)
                for k, v in (state or {}).items()}

    def install(self, s: ShardSlice, state: dict) -> None:
        view = self.views[s.param]
        self.inner.state[view] = {
            k: (v.detach().to(view.device, view.dtype if v.is_floating_point() and v.dim() > 0
                              else v.dtype).clone()
                if isinstance(v, torch.Tensor) else v)
            for k, v in state.items() if k != "master_param"}

    def reset(self) -> None:
        if self.inner is not None:
            self.inner.state.clear()

    def state_bytes(self) -> int:
        if self.inner is None:
            return 0
        return sum(v.numel() * v.element_size() for st in self.inner.state.values()
                   for v in st.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
