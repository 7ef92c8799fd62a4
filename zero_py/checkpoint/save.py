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
group of the whole world, async_save.py: async_executors).

Under offload_optimizer="nvme" the masters and states are Spans of the offload file
(offloaded.py), read through the store's ring as the file writer reaches them: the rank's
shard is never in memory whole (an asynchronous save reads them into its host copy). Under
offload_params="nvme" the parameter values are Spans of the parameter files' records, likewise.

This module is the save's phases and their agreements; what it writes and where it publishes
are their own modules: payload.py (a rank's tensors and its record), manifest.py (what rank 0
writes), rotation.py (what a save may replace; keep_last) and async_save.py (AsyncSave).
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import uuid
from typing import Any, Dict, List, Optional, Tuple

import torch

from zero_py.checkpoint import plain
from zero_py.checkpoint.async_save import (AsyncSave, async_executors, host_copy, in_flight,
                                           wait_pending)
from zero_py.checkpoint.files import (fsync_dir, publish_dir, remove_in_background,
                                      wait_for_removals, write_tensor_file, write_text_durably)
from zero_py.checkpoint.holdings import Held, holdings
from zero_py.checkpoint.manifest import complete_manifest, manifest_base
from zero_py.checkpoint.offloaded import PieceReaders, SpanReader, streamed
from zero_py.checkpoint.payload import rank_payload
from zero_py.checkpoint.reader import (FORMAT, MANIFEST, VERSION, CheckpointError, agree,
                                       optimizer_of, rank_file)
from zero_py.checkpoint.rotation import NUMBERED, not_replaceable, rotate
from zero_py.collectives.objects import broadcast_json, gather_json
from zero_py.config import attached_schedule

# AsyncSave and wait_pending are imported from here by checkpoint/__init__.py and load.py
__all__ = ["save_checkpoint", "AsyncSave", "wait_pending"]


def _close(reader: Optional[SpanReader], pieces: PieceReaders) -> None:
    if reader is not None:
        reader.close()
    pieces.close()


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
            manifest = complete_manifest(base, records)
            write_text_durably(os.path.join(tmp, MANIFEST), json.dumps(manifest, indent=1))
            fsync_dir(tmp)
            old = publish_dir(tmp, path)
        except (OSError, CheckpointError, TypeError, ValueError) as exc:
            outcome = f"save_checkpoint({path}) failed, the previous checkpoint is kept: {exc}"
            shutil.rmtree(tmp, ignore_errors=True)
        else:  # published: whatever follows leaves this checkpoint whole
            if old is not None:
                remove_in_background(old)  # the checkpoint this save replaced
            failed = rotate(path, keep_last) if keep_last is not None else []
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
    elif keep_last is not None and not NUMBERED.match(base):
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
                tensors, record = rank_payload(model, opt, held, extra, reader, pieces)
                if async_save and writes:  # training may change it all once this returns
                    tensors = host_copy(tensors)
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
        error = not_replaceable(path)
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
    manifest = manifest_base(model, opt, held, save_id) if world.rank == 0 else None
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
    writers, everyone = async_executors(opt)
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
    in_flight[opt] = handle
    thread.start()
    return handle
