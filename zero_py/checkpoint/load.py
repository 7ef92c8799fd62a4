"""zero_py.load_checkpoint: resumes from a checkpoint written at any world size and stage.

Every rank first checks, without changing anything: the manifest against the files (format,
sizes, headers, the save every file belongs to, and the CRC-32C of a share of the files: file
k is read by rank k mod world size), and the checkpoint against the model and optimizer (names,
shapes, optimizer class and state, param groups, loss scaler, buffers). The ranks agree on the
outcome, so a bad checkpoint raises the same error on every rank. Only then does each rank read
what it owns (holdings.py): its slices of the parameters (under stages 1-2 an all-gather then
makes them every rank's, as after a step) and of the fp32 masters and optimizer states.
Parameters outside the optimizer's storage (frozen under stages 1-2) are read whole by every
rank.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from zero_py.checkpoint import plain
from zero_py.checkpoint.holdings import Held, holdings, persistent_buffers
from zero_py.checkpoint.reader import Checkpoint, CheckpointError, agree, optimizer_of
from zero_py.checkpoint.save import wait_pending


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


def _check(ck: Checkpoint, model, opt, held: Dict[str, Held], strict: bool) -> List[dict]:
    """Everything that must match before a byte is loaded; returns the param groups to set."""
    man = ck.manifest
    diff = _differences("parameter", list(ck.params), list(held))
    if diff:
        raise CheckpointError(f"{ck.path} does not fit this model: {diff}")
    for name, h in held.items():
        entry = ck.params[name]
        if tuple(entry["shape"]) != h.shape:
            raise CheckpointError(f"{ck.path}: parameter {name} has shape "
                                  f"{tuple(entry['shape'])} there, {h.shape} in this model")
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
    if opt.uses_fused_kernel:
        keys = opt._update.keys
        for name, h in held.items():
            st = ck.params[name].get("state")
            if h.index is not None and st is not None and st["keys"] != keys:
                raise CheckpointError(
                    f"{ck.path}: parameter {name} has optimizer state {st['keys']} there, this "
                    f"optimizer keeps {keys}: build it with the same options (e.g. amsgrad, "
                    "momentum)")
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
    decoded = [{k: plain.decode(v) for k, v in g.items() if k != "params"} for g in groups]
    try:
        new_groups = opt._check_hyperparameters(decoded)
    except ValueError as exc:
        raise CheckpointError(f"{ck.path}: {exc}") from None
    if man["loss_scaler"] is not None and opt.loss_scaler is None:
        raise CheckpointError(f"{ck.path} was saved with a loss scaler: build the optimizer "
                              "with loss_scaler=zero_py.LossScaler() to resume it")
    return new_groups


def _install(ck: Checkpoint, model, opt, held: Dict[str, Held], groups: List[dict]) -> None:
    man = ck.manifest
    opt._set_hyperparameters(groups)
    for name, h in held.items():
        entry = ck.params[name]
        same = entry["dtype"] == plain.dtype_name(h.dtype)
        kind = "param" if same or not entry.get("master") else "master"
        ck.read_into(kind, name, h.load_lo, h.load_hi, h.load_into)
    opt._update.reset()
    opt._allocate_states([h.slice for name, h in held.items() if h.slice is not None
                          and ck.params[name].get("step") and "state" in ck.params[name]
                          and ck.params[name]["state"]["keys"]])
    opt._step_count = [0] * len(opt._step_count)
    opt.sync_master_from_params()
    for name, h in held.items():
        if h.index is None:
            continue
        entry = ck.params[name]
        opt._step_count[h.index] = int(entry.get("step", 0))
        s = h.slice
        if s is None:
            continue
        st = entry.get("state") if entry.get("step") else None
        master_kind = "master" if entry.get("master") else "param"
        views = opt._state_views(s)
        if views is not None:  # the fused path: straight into the live tensors
            for key in st["keys"] if st is not None else ():
                ck.read_into(f"state/{key}", name, s.param_lo, s.param_hi, views[key])
            if "master_param" in views and entry["trainable"]:
                ck.read_into(master_kind, name, s.param_lo, s.param_hi, views["master_param"])
            continue
        state: Dict[str, Any] = {"step": opt._step_count[h.index]}
        if st is not None:
            for key in st["keys"]:
                state[key] = ck.read(f"state/{key}", name, s.param_lo, s.param_hi, torch.float32)
            state.update({k: plain.decode(v) for k, v in st["scalars"].items()})
            if st.get("step_tensor"):
                state["step"] = torch.tensor(float(state["step"]),
                                             dtype=plain.dtype_of(st["step_tensor"]))
        if opt._masters.piece(s.bucket) is not None and entry["trainable"]:
            # the fp32 value: the saved master, or the saved parameter when it had none (fp32)
            state["master_param"] = ck.read(master_kind, name, s.param_lo, s.param_hi,
                                            torch.float32)
        if st is not None:
            opt._install_slice(s, state)
        elif "master_param" in state:
            master = opt._masters.piece(s.bucket)
            master[s.piece_lo:s.piece_hi].copy_(state["master_param"])
    for name, buf in persistent_buffers(model).items():
        buf.copy_(ck.buffer(name))
    if opt.loss_scaler is not None and man["loss_scaler"] is not None:
        opt.loss_scaler.load_state_dict(plain.decode(man["loss_scaler"]))
    opt._sr_seed = opt._rounding_seed_base() + int(man["optimizer"]["rounding_steps"])
    opt.skipped_steps = int(man["optimizer"]["skipped_steps"])


def load_checkpoint(path, model, optimizer, *, verify: bool = True, strict: bool = True) -> Any:
    """Loads a checkpoint written by save_checkpoint, at any world size and any stage, into
    `model` and `optimizer` (as the user holds them: for stage 3, what zero_py.initialize
    returned), and returns the `extra` this rank saved (rank r gets what rank r saved; a rank
    the saving run did not have gets rank 0's). Collective.

    Checks everything before changing anything (see the module docstring); `verify=False` skips
    reading the files for their checksums (sizes and headers are still checked). `strict=False`
    loads a parameter that was frozen when saved and is trained now (its optimizer state starts
    empty) or the other way round. Training then continues as the saved run would have."""
    opt = optimizer_of(model, optimizer)
    ex = opt.executor
    wait_pending(opt)  # an asynchronous save of this optimizer finishes first
    error, ck, held, groups = None, None, None, None
    try:
        ck = Checkpoint.open(path)
        if verify:
            files = sorted(ck.manifest["files"])
            ck.verify(files[ex.rank::ex.world_size])
        held = holdings(model, opt)
        groups = _check(ck, model, opt, held, strict)
    except (CheckpointError, ValueError, TypeError, OSError, KeyError) as exc:
        error = f"{type(exc).__name__}: {exc}" if isinstance(exc, KeyError) else str(exc)
    agree(ex, error, "load_checkpoint")
    error = None
    try:
        with torch.no_grad():
            _install(ck, model, opt, held, groups)
        src = ex.rank if ex.rank < ck.manifest["world_size"] else 0
        extra = ck.extra(src)
    except (CheckpointError, OSError, ValueError) as exc:
        error = (f"reading {ck.path} failed after its checks passed ({exc}); the model and "
                 "optimizer are partly loaded: load again")
    finally:
        ck.close()
    agree(ex, error, "load_checkpoint")
    with torch.no_grad():
        flat = opt._flat
        # stages 1-2: every rank's slices to every rank; stage 3: refresh the units held whole
        flat.publish(ex, [] if flat.params_sharded else range(flat.n_buckets))
        frozen = getattr(flat, "frozen_storage", None)
        if frozen is not None:
            frozen.publish(ex, [])
    return extra
