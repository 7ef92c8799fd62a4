"""zero_py.load_checkpoint: resumes from a checkpoint written at any world size and stage.

Every rank first checks, without changing anything: the manifest against the files (format,
sizes, headers, the save every file belongs to, and the CRC-32C of a share of the files: file
k is read by rank k mod world size), and the checkpoint against the model and optimizer (names,
shapes, optimizer class and state, param groups, loss scaler, buffers). What each rank owns
(holdings.py: its slices of the parameters, fp32 masters and optimizer states; a parameter
outside the optimizer's storage, frozen under stages 1-2, whole) is read into staging tensors
and fresh state tensors, from the same pass that checks the checksums where the rank checks
the file that holds it (at an unchanged world size and layout: all of it), then from the other
files. The ranks agree on the outcome, so a bad checkpoint raises the same error on every rank;
only then is it installed (no I/O: a failure up to there changes nothing). Under stages 1-2
every rank then reads the other ranks' slices of the parameters straight into its flat buffers
(_read_replicas), from files their ranks have just read and checked: the page cache serves
them, for less than the all-gather a step ends with.
"""

from __future__ import annotations

import contextlib
from typing import Any, Dict, List, Optional, Tuple

import torch

from zero_py.checkpoint import feedback, plain
from zero_py.config import attached_schedule
from zero_py.checkpoint.holdings import Held, holdings, persistent_buffers
from zero_py.checkpoint.offloaded import streamed, write_pieces, write_records
from zero_py.checkpoint.reader import MANIFEST, Checkpoint, CheckpointError, agree, optimizer_of
from zero_py.checkpoint.save import wait_pending
from zero_py.optim.update import without_buffer
from zero_py.sharding.memory_order import MemoryOrder


def _differences(kind: str, saved: List[str], here: List[str]) -> Optional[str]:
    missing = [n for n in here if n not in set(saved)]
    unexpected = [n for n in saved if n not in set(here)]
    if not missing and not unexpected:
        return None
    parts = []
    if missing:
        parts.append(f"{len(missing)} {kind}(s) of the model are not in it (e.g. "
                     f"{', '.join(missing[:3])})")
    if unexpected:
        parts.append(f"it holds {len(unexpected)} {kind}(s) the model lacks (e.g. "
                     f"{', '.join(unexpected[:3])})")
    return "; ".join(parts)


def _check(ck: Checkpoint, model, opt, held: Dict[str, Held],
           strict: bool) -> Tuple[List[dict], Optional[List[str]]]:
    """Everything that must match before a byte is loaded; returns the param groups to set and
    the fused update's state keys under them (None on the torch.optim path)."""
    man = ck.manifest
    diff = _differences("parameter", list(ck.params), list(held))
    if diff:
        raise CheckpointError(f"{ck.path} does not fit this model: {diff}")
    for name, h in held.items():
        entry = ck.params[name]
        if tuple(entry["shape"]) != h.shape:
            raise CheckpointError(f"{ck.path}: parameter {name} has shape "
                                  f"{tuple(entry['shape'])} there, {h.shape} in this model")
        saved = MemoryOrder.from_dim_order(h.shape, entry.get("dim_order"))
        here = h.order if h.order is not None else MemoryOrder.row_major_of(h.shape)
        if saved.element_order != here.element_order:
            raise CheckpointError(
                f"{ck.path}: parameter {name} was saved in memory order {saved.describe()}, "
                f"it is {here.describe()} in this model; give the model the memory format it "
                "was saved with (e.g. model.to(memory_format=torch.channels_last)) before "
                "zero_py.initialize / ZeroOptimizer, or consolidate the checkpoint "
                "(python -m zero_py consolidate) and load the full weights")
        if strict and entry["trainable"] != (h.index is not None):
            was = "trained" if entry["trainable"] else "frozen"
            now = "trained" if h.index is not None else "frozen"
            raise CheckpointError(
                f"{ck.path}: parameter {name} was {was} when saved and is {now} here; pass "
                "strict=False to load its values anyway (its optimizer state then starts "
                "empty, or is left out)")
    buffers = persistent_buffers(model)
    diff = _differences("buffer", list(man["buffers"]), list(buffers))
    if diff:
        raise CheckpointError(f"{ck.path} does not fit this model: {diff}")
    for name, b in buffers.items():
        if tuple(man["buffers"][name]["shape"]) != tuple(b.shape):
            raise CheckpointError(f"{ck.path}: buffer {name} has shape "
                                  f"{tuple(man['buffers'][name]['shape'])} there, "
                                  f"{tuple(b.shape)} here")
    cls = opt.optimizer_class
    mine = f"{cls.__module__}.{cls.__qualname__}"
    saved_opt = man["optimizer"]
    if saved_opt["class"] != mine:
        raise CheckpointError(f"{ck.path} holds the state of {saved_opt['class']}; this "
                              f"optimizer runs {mine}: build it with the same class")
    names = {id(p): n for n, p in model.named_parameters()}
    groups = saved_opt["param_groups"]
    if len(groups) != len(opt.param_groups):
        raise CheckpointError(f"{ck.path} has {len(groups)} param groups, this optimizer "
                              f"{len(opt.param_groups)}: build it with the same groups")
    for k, (saved, group) in enumerate(zip(groups, opt.param_groups)):
        here = [names[id(p)] for p in group["params"] if id(p) in names]
        if sorted(saved["params"]) != sorted(here):
            raise CheckpointError(f"{ck.path}: param group {k} holds other parameters there "
                                  f"({len(saved['params'])}) than here ({len(here)}): build the "
                                  "optimizer with the same groups")
    decoded = [{k: ck.decoded(f"optimizer.param_groups[{i}][{k!r}]", v)
                for k, v in g.items() if k != "params"} for i, g in enumerate(groups)]
    try:
        new_groups = opt._check_hyperparameters(decoded)
        if opt.uses_fused_kernel:  # values the kernel refuses: every step after would fail
            opt._update.check_group_values(new_groups, range(len(new_groups)))
        # the fused update's state keys under the saved groups: SGD's momentum buffer is added
        # when they switch a momentum on that this optimizer was built without (OneCycleLR)
        keys = (opt._update.keys + opt._state_to_add(new_groups) if opt.uses_fused_kernel
                else None)
    except (ValueError, TypeError, KeyError) as exc:
        kind = "" if isinstance(exc, ValueError) else f"{type(exc).__name__}: "
        raise CheckpointError(f"{ck.path}: {MANIFEST}'s optimizer.param_groups: {kind}{exc}") \
            from None
    for name, h in held.items():
        st = ck.params[name].get("state")
        if keys is not None and h.index is not None and st is not None and st["keys"] != keys \
                and not without_buffer(opt._kind, keys, st["keys"]):
            raise CheckpointError(
                f"{ck.path}: parameter {name} has optimizer state {st['keys']} there, this "
                f"optimizer keeps {keys}: build it with the same options (e.g. amsgrad, "
                "momentum)")
    if man["loss_scaler"] is not None and opt.loss_scaler is None:
        raise CheckpointError(f"{ck.path} was saved with a loss scaler: build the optimizer "
                              "with loss_scaler=zero_py.LossScaler() to resume it")
    if man["loss_scaler"] is not None:  # checked here: the commit must not fail halfway
        try:
            opt.loss_scaler.check_state(ck.decoded("loss_scaler", man["loss_scaler"]))
        except ValueError as exc:
            raise CheckpointError(f"{ck.path}: {MANIFEST}'s loss_scaler: {exc}") from None
    try:  # a DeepSpeed config's scheduler (absent from checkpoints saved without one)
        attached_schedule.check(opt, ck.decoded("lr_scheduler", man.get("lr_scheduler")))
    except ValueError as exc:
        raise CheckpointError(f"{ck.path}: {MANIFEST}'s lr_scheduler: {exc}") from None
    return new_groups, keys


class _Plan:
    """Where every byte this rank reads goes before the load commits: staging tensors for the
    parameters, fp32 masters and the torch.optim path's states, fresh (not yet installed) state
    tensors for the fused path; and the file segments that fill them."""

    def __init__(self) -> None:
        self.params: List[Tuple[Held, torch.Tensor]] = []
        self.masters: List[Tuple[Any, torch.Tensor]] = []        # (slice, fp32 values)
        self.copies: List[Tuple[torch.Tensor, torch.Tensor]] = []  # (fresh state, staged)
        self.slices: List[Tuple[Held, Dict[str, Any]]] = []      # torch.optim path's states
        self.fresh: Optional[List[torch.Tensor]] = None
        self.keys: Optional[List[str]] = None  # the fresh tensors' state keys, in order
        self.segments: list = []
        # offload_optimizer="nvme": the masters and states go straight to the offload file's
        # other slots (offloaded.write_records), flipped at the commit
        self.records = False
        # offload_params="nvme": the parameter values go straight to the parameter files' other
        # slots (offloaded.write_pieces), flipped at the commit (the storages, once written)
        self.on_file = False
        self.piece_files: list = []
        # grad_error_feedback's residuals this rank gets back (feedback.py; none: zeros)
        self.feedback: Dict[int, torch.Tensor] = {}
        # SGD: the parameters saved without a momentum buffer (stepped without momentum only):
        # FusedUpdate.no_momentum_yet after the commit
        self.no_buffer: set = set()

    def stage(self, ck: Checkpoint, kind: str, name: str, lo: int, hi: int,
              out: Optional[torch.Tensor] = None) -> torch.Tensor:
        t, segs = ck.stage(kind, name, lo, hi, out)
        self.segments.extend(segs)
        return t


def _plan(ck: Checkpoint, opt, held: Dict[str, Held], keys: Optional[List[str]]) -> _Plan:
    """What this rank reads (its own ranges) and where it goes; reads nothing yet."""
    plan = _Plan()
    for name, h in held.items():
        if h.on_file is not None:  # written to its parameter file (write_pieces)
            plan.on_file = True
            continue
        plan.params.append((h, plan.stage(ck, ck.value_kind(name, h.dtype), name, h.load_lo,
                                          h.load_hi)))
    with_state = {name for name, h in held.items() if h.slice is not None
                  and ck.params[name].get("step") and ck.params[name].get("state")}
    if keys is not None:
        plan.no_buffer = {held[n].index for n in with_state
                          if without_buffer(opt._kind, keys, ck.params[n]["state"]["keys"])}
    if streamed(opt) is not None:
        plan.records = True
        return plan
    if opt.uses_fused_kernel:
        plan.keys = keys
        plan.fresh = opt._update.fresh_states([held[n].slice for n in with_state], len(keys))
    for name, h in held.items():
        s = h.slice
        if s is None:
            continue
        entry = ck.params[name]
        if opt._masters.piece(s.bucket) is not None and entry["trainable"]:
            # the fp32 value: the saved master, or the saved parameter when it had none (fp32)
            kind = "master" if entry.get("master") else "param"
            plan.masters.append((s, plan.stage(ck, kind, name, s.param_lo, s.param_hi)))
        if name not in with_state:
            continue
        st = entry["state"]
        if plan.fresh is not None:
            views = opt._update.views_in(plan.fresh, s, plan.keys)
            for key in plan.keys:
                if key not in st["keys"]:  # SGD's momentum buffer of a parameter with none yet
                    views[key].zero_()  # (fresh_states left the slice to be filled)
                    continue
                t = plan.stage(ck, f"state/{key}", name, s.param_lo, s.param_hi, views[key])
                if t is not views[key]:
                    plan.copies.append((views[key], t))
            continue
        state: Dict[str, Any] = {key: plan.stage(ck, f"state/{key}", name, s.param_lo,
                                                 s.param_hi) for key in st["keys"]}
        state.update({k: ck.decoded(f"params[{name!r}].state.scalars[{k!r}]", v)
                      for k, v in st["scalars"].items()})
        state["step"] = int(entry["step"])
        if st.get("step_tensor"):
            state["step"] = torch.tensor(float(entry["step"]),
                                         dtype=plain.dtype_of(st["step_tensor"]))
        plan.slices.append((h, state))
    return plan


def _commit(ck: Checkpoint, model, opt, held: Dict[str, Held], groups: List[dict],
            plan: _Plan) -> None:
    """Installs what the plan staged: no I/O but the buffers (rank 0's file, small)."""
    man = ck.manifest
    buffers = {name: ck.buffer(name) for name in persistent_buffers(model)}
    opt._set_hyperparameters(groups)
    for h, t in plan.params:
        h.load_into.copy_(t)
    for storage in plan.piece_files:  # written by offloaded.write_pieces
        storage.flip_pieces()
    feedback.install(opt, plan.feedback)
    if not plan.records:
        opt._update.reset()
    opt._step_count = [0] * len(opt._step_count)
    for name, h in held.items():
        if h.index is not None:
            opt._step_count[h.index] = int(ck.params[name].get("step", 0))
    if plan.records:  # written by offloaded.write_records: they become the current ones
        store = opt._update.store
        store.flip(range(store.n_chunks))
    else:
        _commit_optimizer(opt, plan)
    if opt.uses_fused_kernel:
        opt._update.no_momentum_yet = set(plan.no_buffer)
    for name, buf in persistent_buffers(model).items():
        buf.copy_(buffers[name])
    if opt.loss_scaler is not None and man["loss_scaler"] is not None:
        opt.loss_scaler.load_state_dict(plain.decode(man["loss_scaler"]))
    attached_schedule.load(opt, attached_schedule.check(
        opt, plain.decode(man.get("lr_scheduler"))))
    opt._sr_seed = opt._rounding_seed_base() + int(man["optimizer"]["rounding_steps"])
    opt.skipped_steps = int(man["optimizer"]["skipped_steps"])


def _commit_optimizer(opt, plan: _Plan) -> None:
    """The masters and states the plan staged in memory, installed."""
    opt.sync_master_from_params()
    for s, t in plan.masters:
        opt._masters.piece(s.bucket)[s.piece_lo:s.piece_hi].copy_(t)
    if plan.fresh is not None:
        for dst, t in plan.copies:
            dst.copy_(t)
        opt._update.adopt_states(plan.fresh, plan.keys)
    for h, state in plan.slices:
        opt._install_slice(h.slice, {k: (v.float() if isinstance(v, torch.Tensor) and v.dim()
                                          else v) for k, v in state.items()})


def _read_replicas(ck: Checkpoint, opt, held: Dict[str, Held]) -> None:
    """Stages 1-2, after the commit: the values of the other ranks' slices of every parameter in
    the optimizer's storage, straight into this rank's flat buffers, from the files the other
    ranks have just read and checked (so from the page cache): what the all-gather at the end
    of a step gives, for a fraction of its cost (no staging copy, no collective). Pieces
    stored in another dtype (a bf16 parameter with an fp32 master) go through a temporary and
    are cast."""
    flat = opt._flat
    for name, h in held.items():
        if h.index is None:
            continue
        kind = ck.value_kind(name, h.dtype)
        full = flat.param_view(h.index)
        for lo, hi in ((0, h.lo), (h.hi, h.numel)):
            if hi > lo:
                ck.read_into(kind, name, lo, hi, full[lo:hi])


def load_checkpoint(path, model, optimizer, *, verify: bool = True, strict: bool = True) -> Any:
    """Loads a checkpoint written by save_checkpoint, at any world size and any stage, into
    `model` and `optimizer` (as the user holds them: for stage 3, what zero_py.initialize
    returned), and returns the `extra` this rank saved (rank r gets what rank r saved; a rank
    the saving run did not have gets rank 0's). Collective.

    Checks everything before changing anything (see the module docstring); `verify=False` skips
    reading the files for their checksums (sizes and headers are still checked). `strict=False`
    loads a parameter that was frozen when saved and is trained now (its optimizer state starts
    empty) or the other way round. Training then continues as the saved run would have."""
    with optimizer_of(model, optimizer)._comm.outside():  # in no step's comm_stats
        return _load_checkpoint(path, model, optimizer, verify=verify, strict=strict)


def _load_checkpoint(path, model, optimizer, *, verify: bool = True, strict: bool = True) -> Any:
    """load_checkpoint's body."""
    opt = optimizer_of(model, optimizer)
    ex = opt.executor
    wait_pending(opt)  # an asynchronous save of this optimizer finishes first
    error, ck, held, groups, plan, extra = None, None, None, None, None, None
    try:
        ck = Checkpoint.open(path)
        held = holdings(model, opt)
        groups, keys = _check(ck, model, opt, held, strict)
        with torch.no_grad():
            plan = _plan(ck, opt, held, keys)
            # this rank's share of the files, checked (verify) and read whole in one pass
            # (sequential reads), taking what it needs of them on the way
            files = sorted(ck.manifest["files"])
            ck.verify(files[ex.rank::ex.world_size], plan.segments, check=verify)
            # the rest of what this rank owns, from the files the other ranks check (none at an
            # unchanged world size and layout): it counts once the agreement below says that
            # every file's checksum held
            ck.fill(plan.segments)
            # into the offload files' other slots: nothing changes yet
            if plan.on_file:
                plan.piece_files = write_pieces(ck, held)
            if plan.records:
                write_records(ck, opt, held, {id(h): t for h, t in plan.params})
            plan.feedback = feedback.stage(ck, opt, ex.rank)
        extra = ck.extra(ex.rank if ex.rank < ck.manifest["world_size"] else 0)
    except (CheckpointError, ValueError, TypeError, OSError) as exc:
        error = str(exc)
    except Exception as exc:  # noqa: BLE001 - any other failure of one rank: raised on every
        error = f"{type(exc).__name__}: {exc}"  # rank by the agreement, not left to hang it
    if error is not None and ck is not None:
        ck.close()
    # every rank read the same save (a save published to the path meanwhile, or different
    # paths, would load different states on different ranks)
    agree(ex, error, "load_checkpoint", ck.manifest.get("save_id") if ck is not None else None)
    flat = opt._flat
    try:
        with torch.no_grad(), contextlib.ExitStack() as writing:
            # stage 3: one-sided readers of this rank's shards wait until they are loaded
            for storage in (flat, getattr(flat, "frozen_storage", None)):
                if hasattr(storage, "writing"):
                    writing.enter_context(storage.writing())
            _commit(ck, model, opt, held, groups, plan)
            if not flat.params_sharded:
                try:
                    _read_replicas(ck, opt, held)
                except (CheckpointError, OSError, ValueError) as exc:
                    error = (f"the optimizer state and this rank's parameter slices are "
                             f"loaded, but reading the other ranks' parameter values from "
                             f"{ck.path} failed ({exc}); load the checkpoint again")
    finally:
        ck.close()
    if flat.params_sharded:  # stage 3: refresh the units held whole
        # as the saved run holds them (quantized_weights): through the wire once a step has
        # published them, exact before (construction broadcasts them) and always for frozen
        # ones, which no step publishes (quantized after a load, they resumed 8e-3 off)
        with torch.no_grad():
            flat.publish(ex, [], exact=not any(opt._step_count))
            frozen = getattr(flat, "frozen_storage", None)
            if frozen is not None:
                frozen.publish(ex, [], exact=True)
    else:
        agree(ex, error, "load_checkpoint")
        _publish_quantized(opt)
    return extra


def _publish_quantized(opt) -> None:
    """Stages 1-2 with quantized_weights: the other ranks' pieces, read exactly above, become
    what the saved run's publishes left in them, each peer's piece quantized on the wire, so that
    the run goes on as the uninterrupted one (whose copies of its peers' pieces were never
    exact: int8 weights resumed 1.6e-4 off in the masters after two steps). Only the buckets a
    step has published (a parameter's step count above 0): the others still hold
    construction's exact values in the saved run too."""
    if getattr(opt._wire, "weights", None) is None:
        return
    flat = opt._flat
    published = [b for b in range(flat.n_buckets)
                 if any(opt._step_count[i] for i in flat.bucket_params[b])]
    with torch.no_grad():
        flat.publish(opt._wire, published)
