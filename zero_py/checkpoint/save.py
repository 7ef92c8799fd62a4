"""zero_py.save_checkpoint: one directory that any world size and any stage resumes from.

Collective over the optimizer's group. Every rank writes one safetensors file of what it owns
(holdings.py: parameter slices, fp32 masters, optimizer states; rank 0 adds the buffers);
rank 0 writes manifest.json, which says which element range of which parameter each file
holds, with every file's size and CRC-32C. The files go to a hidden temporary directory beside
the target, are fsynced, and the directory is renamed to its final name only after every rank
reported success, so a crash at any point leaves the previous checkpoint as it was. Every
phase ends with the ranks agreeing: a failure on one rank raises the same error on all of them.
The format is described in docs/checkpoint.md.

Under hybrid sharding (collectives/hybrid.py) the replicas hold the same shards, so only the
shard group of global rank 0 writes: the checkpoint is the one a plain run over that shard
group writes, and loads as any other (into hybrid and plain runs alike). The other replicas
take part in the agreements and learn the outcome, for asynchronous saves too (over a gloo
group of the whole world, _async_executors).

Under offload_optimizer="nvme" the masters and states are Spans of the offload file
(offloaded.py), read through the store's ring as the file writer reaches them: the rank's
shard is never in memory whole (an asynchronous save reads them into its host copy). Under
offload_params="nvme" the parameter values are Spans of the parameter files' records, likewise.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import threading
import uuid
import weakref
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from zero_py.checkpoint import feedback, plain
from zero_py.checkpoint.files import (fsync_dir, publish_dir, read_json_file,
                                      remove_in_background, wait_for_removals,
                                      write_tensor_file, write_text_durably)
from zero_py.checkpoint.holdings import Held, holdings, persistent_buffers
from zero_py.checkpoint.offloaded import PieceReaders, Span, SpanReader, streamed
from zero_py.checkpoint.reader import (FORMAT, MANIFEST, VERSION, CheckpointError, agree,
                                       optimizer_of, rank_file)
from zero_py.collectives.objects import broadcast_json, gather_json
from zero_py.collectives.timeout import group_timeout
from zero_py.config import attached_schedule
from zero_py.optim.update import BUFFER


def _streamed_state(opt, s, reader: SpanReader) -> Optional[Dict[str, Any]]:
    """_slice_state's answer for an optimizer whose state is on NVMe, with Spans of the offload
    file in place of the master and state tensors (in the same order: the file is the same)."""
    if opt._step_count[s.param] == 0:
        return None
    update, flat = reader.update, opt._flat
    lo = flat.bucket_shard_offset[s.bucket] + s.piece_lo
    state: Dict[str, Any] = {}
    if opt._step_in_state():
        state["step"] = torch.tensor(float(opt._step_count[s.param]), dtype=torch.float32)
    for j, key in enumerate(update.keys):
        if key == BUFFER and s.param in update.no_momentum_yet:
            continue  # SGD stepped without momentum only: no buffer (as _slice_state)
        state[key] = reader.span(j + 1, lo, lo + s.numel)
    if opt._masters.dtype_of[s.bucket] is not None:
        state["master_param"] = reader.span(0, lo, lo + s.numel)
    return state


def _unstepped_master(opt, s, reader: Optional[SpanReader]):
    """The fp32 master of slice s of a parameter not stepped yet (a view, or a Span of the NVMe
    offload file), or None where its bucket has none (fp32: the parameter is its own). A save
    before the first step holds it too: the manifest says "master", and after a load of an
    fp32 checkpoint into a bf16 model it holds more than the parameter's bits."""
    if opt._masters.dtype_of[s.bucket] is None:
        return None
    if reader is not None:
        lo = opt._flat.bucket_shard_offset[s.bucket] + s.piece_lo
        return reader.span(0, lo, lo + s.numel)
    return opt._masters.piece(s.bucket)[s.piece_lo:s.piece_hi]


def _record_order(h: Held) -> tuple:
    """Where a parameter on NVMe sits in its file (trainable before frozen, then bucket and
    offset); the others after them. A rank file in this order reads each record of the
    parameter files once (the persistent unit's bucket holds parameters from every block), and
    the optimizer's records in shard-space order."""
    if h.on_file is None or h.on_file[1] is None:
        return (1,)
    s = h.on_file[1]
    return (0, h.index is None, s.bucket, s.piece_lo)


def _rank_payload(model, opt, held: Dict[str, Held], extra, reader: Optional[SpanReader] = None,
                  records: Optional[PieceReaders] = None
                  ) -> Tuple[List[Tuple[str, Any]], Dict[str, Any]]:
    """This rank's tensors (file order) and its record for the manifest. With `reader` (the
    optimizer's state is on NVMe), its masters and states are Spans read as the file is
    written; so are the values of parameters on NVMe (Held.on_file), through `records`."""
    tensors: List[Tuple[str, Any]] = []
    pieces: Dict[str, List[int]] = {}
    states: Dict[str, Dict[str, Any]] = {}
    items = list(held.items())
    if any(h.on_file is not None for h in held.values()):
        items.sort(key=lambda item: _record_order(item[1]))
    for name, h in items:
        if h.hi == h.lo:
            continue
        pieces[name] = [h.lo, h.hi]
        tensors.append((f"param/{name}", h.values if h.on_file is None else records.span(h)))
        if h.slice is None:
            continue
        state = (opt._slice_state(h.slice, copy=False) if reader is None
                 else _streamed_state(opt, h.slice, reader))
        if state is None:  # not stepped yet: no state, but its fp32 master (the manifest
            master = _unstepped_master(opt, h.slice, reader)  # says it has one)
            if master is not None:
                tensors.append((f"master/{name}", master))
            continue
        keys, scalars = [], {}
        for key, value in state.items():
            if key == "master_param":
                tensors.append((f"master/{name}", value))
            elif (isinstance(value, (torch.Tensor, Span)) and len(value.shape) == 1
                  and value.numel() == h.hi - h.lo):
                keys.append(key)
                tensors.append((f"state/{key}/{name}", value))
            elif key != "step":
                scalars[key] = plain.encode(value, None, f"optimizer state {key!r} of {name}")
        step = state.get("step")
        states[name] = {"keys": keys, "scalars": scalars,
                        "step_tensor": None if not isinstance(step, torch.Tensor)
                        else plain.dtype_name(step.dtype)}
    if opt.executor.rank == 0:
        for name, buf in persistent_buffers(model).items():
            tensors.append((f"buffer/{name}", buf.detach()))
    extra_tensors: List[Tuple[str, torch.Tensor]] = []

    def sink(t: torch.Tensor) -> str:
        key = f"extra/{len(extra_tensors)}"
        extra_tensors.append((key, t.detach()))
        return key

    encoded = None if extra is None else plain.encode(extra, sink, "extra")
    tensors.extend(extra_tensors)
    residuals, fed = feedback.payload(opt)  # grad_error_feedback's residuals
    tensors.extend(residuals)
    record = {"pieces": pieces, "states": states, "extra": encoded, "feedback": fed}
    return tensors, record


def _manifest_base(model, opt, held: Dict[str, Held], save_id: str) -> dict:
    """Everything of the manifest but what the rank files report, read from the optimizer
    now (an asynchronous save finishes while training goes on)."""
    fp = opt._flat
    names = {id(p): n for n, p in model.named_parameters()}
    params: Dict[str, dict] = {}
    for name, h in held.items():
        entry = {"shape": list(h.shape), "dtype": plain.dtype_name(h.dtype),
                 "requires_grad": h.requires_grad, "trainable": h.index is not None,
                 "pieces": []}
        if h.index is not None:
            entry["step"] = opt._step_count[h.index]
            entry["master"] = opt._masters.dtype_of[fp.param_bucket[h.index]] is not None
        params[name] = entry
    groups = []
    for g in opt.param_groups:
        hyper = {k: plain.encode(v, None, f"param group option {k!r}")
                 for k, v in g.items() if k != "params"}
        groups.append({"params": [names[id(p)] for p in g["params"] if id(p) in names], **hyper})
    buffers = {name: {"shape": list(b.shape), "dtype": plain.dtype_name(b.dtype)}
               for name, b in persistent_buffers(model).items()}
    aliases = {n: names[id(p)] for n, p in model.named_parameters(remove_duplicate=False)
               if n != names[id(p)]}  # tied parameters under their other names
    steps = [e["step"] for e in params.values() if "step" in e]
    cls = opt.optimizer_class
    return {
        "format": FORMAT, "version": VERSION, "save_id": save_id,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "step": max(steps, default=0), "world_size": opt.executor.world_size,
        "stage": opt.stage,
        "optimizer": {"class": f"{cls.__module__}.{cls.__qualname__}",
                      "fused": opt.uses_fused_kernel, "param_groups": groups,
                      "rounding_steps": opt._sr_seed - opt._rounding_seed_base(),
                      "skipped_steps": opt.skipped_steps},
        "loss_scaler": None if opt.loss_scaler is None else
        plain.encode(opt.loss_scaler.state_dict(), None, "loss scaler state"),
        # a DeepSpeed config's scheduler (optimizer.lr_scheduler), as DeepSpeed checkpoints it
        "lr_scheduler": plain.encode(attached_schedule.state_of(opt), None,
                                     "lr scheduler state"),
        "params": params, "aliases": aliases, "buffers": buffers,
        "versions": {"torch": torch.__version__},
    }


def _complete_manifest(manifest: dict, records: List[dict]) -> dict:
    """The manifest with what every rank reported: its pieces, states, file size and CRC."""
    params = manifest["params"]
    for r, rec in enumerate(records):
        for name, (lo, hi) in rec["pieces"].items():
            params[name]["pieces"].append([r, lo, hi])
        for name, st in rec["states"].items():
            params[name].setdefault("state", st)
    for name, entry in params.items():
        entry["pieces"].sort(key=lambda x: x[1])
        if entry.get("step") and "state" not in entry:
            raise CheckpointError(f"no rank reported the optimizer state of {name}")
    manifest["files"] = {rank_file(r): {"rank": r, "bytes": rec["bytes"],
                                        "crc32c": rec["crc32c"],
                                        "extra": rec["extra"] is not None,
                                        **({"feedback": rec["feedback"]}
                                           if rec.get("feedback") else {})}
                         for r, rec in enumerate(records)}
    return manifest


_NUMBERED = re.compile(r"^(.*?)(\d+)$")
# a save's temporary directory; not its '.old' (publish_dir's fallback without an atomic swap:
# the previous checkpoint, the only copy of it if the save died before the new one took its name)
_LEFT_BEHIND = re.compile(r"^\.(.+)\.tmp-[0-9a-f]{32}$")


def _finished_manifest(path: str) -> Optional[dict]:
    """The manifest of the finished zero_py checkpoint at `path` (a directory, not a link),
    or None where there is none: only such a directory is ever ours to replace or delete."""
    if os.path.islink(path) or not os.path.isdir(path):
        return None
    try:  # a regular file: a FIFO there made the save wait forever, /dev/zero fill memory
        man = read_json_file(os.path.join(path, MANIFEST))
    except (OSError, ValueError):
        return None
    return man if isinstance(man, dict) and man.get("format") == FORMAT else None


def _not_replaceable(path: str) -> Optional[str]:
    """Why a save may not publish at `path`, or None. Publishing swaps out whatever is there
    and deletes it, so it goes only where nothing is, over an empty directory or over an
    earlier checkpoint: a file, a link or a directory of other things is the user's."""
    if not os.path.lexists(path) or _finished_manifest(path) is not None:
        return None
    if os.path.isdir(path) and not os.path.islink(path) and not os.listdir(path):
        return None
    what = ("a symbolic link" if os.path.islink(path) else
            "a directory that is not a zero_py checkpoint" if os.path.isdir(path) else
            "a file")
    return (f"{path} exists and is {what}; a save replaces the path whole (deleting what is "
            "there), so it writes only where nothing is, into an empty directory or over an "
            "earlier checkpoint: remove it or save elsewhere")


def _rotate(path: str, keep_last: int) -> List[str]:
    """After a save to `path`: removes the checkpoints named like it (same name, another number)
    beyond the keep_last newest (by step, then number), never `path` itself (a run restarted
    from scratch saves smaller steps under new names: the checkpoint just written is kept, and
    the keep_last - 1 newest others), and never a directory without a finished zero_py manifest
    (or whose step is not a number). Also removes the temporary directories that saves of the
    other checkpoints named like it left behind (their rank 0 died mid-save). Returns what
    could not be removed: '<path> (<why>)'."""
    parent, base = os.path.split(path)
    stem = _NUMBERED.match(base).group(1)
    found = []
    try:
        names = os.listdir(parent)
    except OSError as exc:
        return [f"{parent} ({exc.strerror or exc}: its checkpoints could not be listed)"]
    for name in names:
        m = _NUMBERED.match(name)
        full = os.path.join(parent, name)
        left = _LEFT_BEHIND.match(name)
        if left is not None:
            # what a save of another checkpoint of this run left when its rank 0 died (killed,
            # or SIGTERM from torchrun): only a save of that same name used to remove it
            other = _NUMBERED.match(left.group(1))
            if other is not None and other.group(1) == stem and left.group(1) != base:
                shutil.rmtree(full, ignore_errors=True)
            continue
        if not m or m.group(1) != stem or full == path:
            continue
        man = _finished_manifest(full)  # None: not a finished zero_py checkpoint, not ours
        step = man.get("step") if man is not None else None
        if isinstance(step, int) and not isinstance(step, bool):
            found.append((step, int(m.group(2)), full))
    found.sort()
    failed = []
    for _, _, full in found[:max(0, len(found) - (keep_last - 1))]:
        try:
            _remove_checkpoint(full)
        except OSError as exc:
            failed.append(f"{full} ({exc.strerror or exc}"
                          + (f": {exc.filename}" if exc.filename not in (None, full) else "")
                          + ")")
    if len(failed) < len(found):
        try:
            fsync_dir(parent)
        except OSError:
            pass  # the removals stand; only their durability is unsure
    return failed


def _remove_checkpoint(full: str) -> None:
    """Removes an old checkpoint directory, its manifest last: one that cannot be removed whole
    stays a finished checkpoint (which a load refuses for its missing files) that the next
    rotation tries again, never a directory of files no rotation takes."""
    names = sorted(os.listdir(full), key=lambda n: (n == MANIFEST, n))
    for name in names:
        entry = os.path.join(full, name)
        if os.path.isdir(entry) and not os.path.islink(entry):
            shutil.rmtree(entry)
        else:
            os.unlink(entry)
    os.rmdir(full)


def _close(reader: Optional[SpanReader], pieces: PieceReaders) -> None:
    if reader is not None:
        reader.close()
    pieces.close()


def _host_copy(tensors: List[Tuple[str, Any]]) -> List[Tuple[str, torch.Tensor]]:
    """An asynchronous save's copy of what it writes, taken before the call returns: tensors
    copied to host memory, Spans read from the NVMe offload file (the next step overwrites the
    records they come from)."""
    return [(name, t.materialize() if isinstance(t, Span) else t.detach().to("cpu", copy=True))
            for name, t in tensors]


class AsyncSave:
    """A save_checkpoint(..., async_save=True) in flight: the rank's file is written, and the
    checkpoint published, on a thread while training goes on. wait() returns the path, or
    raises the save's CheckpointError (on every rank). The next save_checkpoint or
    load_checkpoint with the same optimizer waits for it first; call wait() before
    torch.distributed.destroy_process_group()."""

    def __init__(self, path: str, thread: threading.Thread, outcome: Dict[str, Any]):
        self.path = path
        self._thread = thread
        self._outcome = outcome

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> str:
        self._thread.join()
        if self._outcome.get("error") is not None:
            raise CheckpointError(self._outcome["error"])
        return self.path


# per optimizer: the gloo group asynchronous saves finish on (training keeps the optimizer's
# own group busy meanwhile) and the save in flight
_async_groups: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_in_flight: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def wait_pending(opt) -> None:
    """Waits for opt's asynchronous save in flight, if any (its error is raised by its own
    wait(), not here: a later call must not fail for an earlier save)."""
    pending = _in_flight.pop(opt, None)
    if pending is not None:
        pending._thread.join()


def _async_executors(opt):
    """The gloo groups an asynchronous save of `opt` finishes on, made at its first one with
    the timeout of the optimizer's group (a peer that dies mid-save is noticed as soon as in
    training): (over the ranks of this rank's shard group, whose writing replica writes; over
    every rank of a hybrid run, or None without hybrid sharding). Every rank makes both, even
    where it does not write: torch names a group made with use_local_synchronization by its
    ranks and the number of groups the process has, so all ranks must keep making as many
    groups for later ones (the next optimizer's) to match."""
    pair = _async_groups.get(opt)
    if pair is None:
        from zero_py.collectives.torch_dist import TorchDistExecutor

        ex = opt.executor
        timeout = group_timeout(getattr(ex, "group", None))

        def executor(ranks):
            group = dist.new_group(ranks, backend="gloo", use_local_synchronization=True,
                                   timeout=timeout)
            return TorchDistExecutor(group, torch.device("cpu"))
        hybrid = getattr(ex, "world", None) is not None
        everyone = executor(list(range(dist.get_world_size()))) if hybrid else None
        shard = executor([ex.global_rank(r) for r in range(ex.world_size)])
        pair = _async_groups[opt] = (shard, everyone)
    return pair


def _finish(ex, path: str, tmp: str, tensors, record: dict, meta: dict, base: Optional[dict],
            keep_last: Optional[int]) -> Optional[str]:
    """Writes this rank's file, then rank 0 publishes the checkpoint when every rank has
    written its own. Collective over `ex`; returns None, or the error every rank raises.
    A collective that fails (a peer died or stopped: the group's timeout) raises; rank 0 then
    removes the temporary directory, so a survivor leaves no partial save behind."""
    try:
        return _write_and_publish(ex, path, tmp, tensors, record, meta, base, keep_last)
    except BaseException:
        if ex.rank == 0:  # unpublished: its files; published: the checkpoint it replaced
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_and_publish(ex, path: str, tmp: str, tensors, record: dict, meta: dict,
                       base: Optional[dict], keep_last: Optional[int]) -> Optional[str]:
    """_finish's body."""
    error = None
    try:
        record["bytes"], crc = write_tensor_file(os.path.join(tmp, rank_file(ex.rank)),
                                                 tensors, meta)
        record["crc32c"] = f"{crc:08x}"
    except Exception as exc:  # noqa: BLE001 - any failure of one rank is every rank's error:
        # raised on this rank alone, it left the others waiting in the gather below (a hang)
        why = str(exc) if isinstance(exc, OSError) else f"{type(exc).__name__}: {exc}"
        error = f"rank {ex.rank} could not write {rank_file(ex.rank)}: {why}"
        if not os.path.isdir(tmp):
            error += (f" ({tmp} is not there on rank {ex.rank}: rank 0 makes the save's "
                      "directory next to the path it was given, so every rank must pass the "
                      "same path, on a file system that every rank sees)")
    del tensors
    records = gather_json(ex, {"error": error, **record}, 0)
    outcome = None
    if ex.rank == 0:
        errors = [r["error"] for r in records if r["error"]]
        try:
            if errors:
                raise CheckpointError("; ".join(errors))
            manifest = _complete_manifest(base, records)
            write_text_durably(os.path.join(tmp, MANIFEST), json.dumps(manifest, indent=1))
            fsync_dir(tmp)
            old = publish_dir(tmp, path)
        except (OSError, CheckpointError, TypeError, ValueError) as exc:
            outcome = f"save_checkpoint({path}) failed, the previous checkpoint is kept: {exc}"
            shutil.rmtree(tmp, ignore_errors=True)
        else:  # published: whatever follows leaves this checkpoint whole
            if old is not None:
                remove_in_background(old)  # the checkpoint this save replaced
            failed = _rotate(path, keep_last) if keep_last is not None else []
            if failed:
                outcome = (f"save_checkpoint({path}): the checkpoint is saved, whole, but "
                           f"keep_last={keep_last} could not remove {len(failed)} older "
                           f"checkpoint(s): {'; '.join(failed)}. Remove them yourself (or make "
                           "them removable: the next save with keep_last tries again)")
    return broadcast_json(ex, outcome)


def save_checkpoint(path, model, optimizer, extra: Any = None, *,
                    keep_last: Optional[int] = None, async_save: bool = False):
    """Saves the model's parameters and buffers, the optimizer's fp32 masters and states, its
    hyperparameters and loss-scaler state, and `extra`, as the directory `path`. Collective:
    every rank of the optimizer's group calls it with the same path.

    `model`, `optimizer`: as the user holds them (for stage 3, what zero_py.initialize
    returned). `extra`: plain data (numbers, strings, lists, dicts, tensors: an LR scheduler's
    state_dict(), a data-loader position, RNG states), each rank's own; load_checkpoint gives
    each rank back its own. `keep_last=k`: after this save, keep only the k newest checkpoints
    named like `path` with another number (e.g. ckpt/step_00100, ckpt/step_00200), by step:
    this one and the k - 1 newest others. An older one that cannot be removed raises
    CheckpointError on every rank, naming it; the checkpoint saved is whole all the same.
    Returns the absolute path. Loads at any world size and stage: see load_checkpoint.

    `async_save=True`: what the rank saves is copied to host memory now (so training may go on
    and change it), and the file is written and the checkpoint published on a thread; returns
    an AsyncSave (wait() gives the path or raises). The copy costs the rank's share of the
    checkpoint in host memory until the write ends."""
    with optimizer_of(model, optimizer)._comm.outside():  # in no step's comm_stats
        return _save_checkpoint(path, model, optimizer, extra, keep_last=keep_last,
                                async_save=async_save)


def _save_checkpoint(path, model, optimizer, extra: Any = None, *,
                     keep_last: Optional[int] = None, async_save: bool = False):
    """save_checkpoint's body."""
    opt = optimizer_of(model, optimizer)
    ex = opt.executor
    world = getattr(ex, "world", ex)  # hybrid sharding: every replica (else the group)
    writes = getattr(ex, "replica_rank", 0) == 0  # one replica writes the files
    wait_pending(opt)  # one save in flight per optimizer
    # compared across ranks in the first agreement, before the paths part (as given: ranks on
    # different hosts may resolve one relative path differently)
    call = (f"save_checkpoint({os.fspath(path)!r}, keep_last={keep_last!r}, "
            f"async_save={bool(async_save)})")
    path = os.path.abspath(os.fspath(path))
    parent, base = os.path.split(path)
    error = None
    if keep_last is not None and (not isinstance(keep_last, int) or isinstance(keep_last, bool)
                                  or keep_last < 1):
        error = f"keep_last must be an int >= 1 or None, got {keep_last!r}"
    elif keep_last is not None and not _NUMBERED.match(base):
        error = (f"keep_last needs checkpoint names that end in a number, to tell which are "
                 f"older (e.g. {base}_00100); {base!r} does not")
    tensors: List[Tuple[str, Any]] = []
    record: Dict[str, Any] = {}
    held: Dict[str, Held] = {}
    # offload_optimizer="nvme": the masters and states stream from the offload file
    update = streamed(opt)
    reader = SpanReader(update) if update is not None else None
    pieces = PieceReaders()  # offload_params="nvme": the parameters' records, likewise
    if error is None:
        try:
            held = holdings(model, opt)
            # what rank 0 puts in the manifest, refused here on every rank (not on rank 0 alone)
            plain.encode(attached_schedule.state_of(opt), None, "lr scheduler state")
            with torch.no_grad():
                tensors, record = _rank_payload(model, opt, held, extra, reader, pieces)
                if async_save and writes:  # training may change it all once this returns
                    tensors = _host_copy(tensors)
        except (TypeError, ValueError, CheckpointError) as exc:
            error = str(exc)
        except OSError as exc:  # reading the NVMe offload file
            error = f"rank {ex.rank} could not read its state for the checkpoint: {exc}"
        except Exception as exc:  # noqa: BLE001 - any other failure of one rank (the host
            # copy out of memory, a torch error): raised on every rank by the agreement, not
            # left to hang the others in it
            error = f"rank {ex.rank} could not gather its state: {type(exc).__name__}: {exc}"
        finally:
            if async_save:
                _close(reader, pieces)
    agree(ex, error, "save_checkpoint", call=call)

    wait_for_removals()  # what the last save replaced is gone before this one writes
    save_id = broadcast_json(world, uuid.uuid4().hex if world.rank == 0 else None)
    tmp = os.path.join(parent, f".{base}.tmp-{save_id}")
    error = None
    if world.rank == 0:
        error = _not_replaceable(path)
    if world.rank == 0 and error is None:
        try:
            os.makedirs(parent, exist_ok=True)
            for name in os.listdir(parent):  # what a crashed save of this path left behind
                if name.startswith(f".{base}.tmp-"):
                    shutil.rmtree(os.path.join(parent, name), ignore_errors=True)
            os.mkdir(tmp)
        except OSError as exc:
            error = f"cannot create the checkpoint directory next to {path}: {exc}"
    try:
        agree(ex, error, "save_checkpoint")
    except BaseException:  # a peer died or stopped here: leave no empty temporary behind
        if world.rank == 0 and error is None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise

    step = max(opt._step_count, default=0)
    meta = {"format": FORMAT, "version": str(VERSION), "save_id": save_id, "rank": str(ex.rank),
            "world_size": str(ex.world_size), "step": str(step)}
    if record.get("extra") is not None:
        meta["extra"] = json.dumps(record["extra"])
    manifest = _manifest_base(model, opt, held, save_id) if world.rank == 0 else None
    if not writes:
        tensors = []  # another replica writes the files: nothing to copy or keep
    if not async_save:
        try:
            outcome = (_finish(getattr(ex, "shard", ex), path, tmp, tensors, record, meta,
                               manifest, keep_last) if writes else None)
        finally:
            _close(reader, pieces)  # a write that stopped early leaves reads in flight
        if world is not ex:  # the writing replica's outcome, on every replica
            outcome = broadcast_json(world, outcome)
        if outcome is not None:
            raise CheckpointError(outcome)
        return path
    writers, everyone = _async_executors(opt)
    result: Dict[str, Any] = {}

    def run() -> None:
        outcome = None
        try:
            if writes:
                outcome = _finish(writers, path, tmp, tensors, record, meta, manifest,
                                  keep_last)
        except Exception as exc:  # noqa: BLE001 - a peer that died: the group's error
            outcome = f"save_checkpoint({path}) failed: {type(exc).__name__}: {exc}"
        if everyone is not None:  # hybrid: every replica learns what the writers found
            try:
                said = [e for e in gather_json(everyone, outcome, None) if e]
                outcome = "; ".join(dict.fromkeys(said)) or None
            except Exception as exc:  # noqa: BLE001 - a peer that died
                outcome = outcome or (f"save_checkpoint({path}) failed: "
                                      f"{type(exc).__name__}: {exc}")
        result["error"] = outcome

    thread = threading.Thread(target=run, name="zero_py-checkpoint-save")
    handle = AsyncSave(path, thread, result)
    _in_flight[opt] = handle
    thread.start()
    return handle
