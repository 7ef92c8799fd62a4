"""Checkpoints of what is offloaded to NVMe: the rank's fp32 masters and optimizer states
(offload_optimizer="nvme", the offload file of zero_py/offload/nvme.py) and its stage-3
parameter pieces (offload_params="nvme", zero_py/offload/param_store.py), copied between those
files and the checkpoint's files a few records at a time, never read whole into memory.

Saving. Each master/<name> and state/<key>/<name> tensor of the rank file is a Span: elements
[lo, hi) of the shard space in one array of the offload records (0: the master, 1 + i: state i).
SpanReader reads the spans of one rank file in file order. A span is cut at chunk boundaries
into windows, each widened to whole IO_ALIGN blocks (the direct-I/O rule), and the windows are
packed into the store's own ring buffers; the C engine reads up to a ring's worth of windows
ahead of the one the file writer is copying (and summing) into its staging. The rank file holds
the same tensors, in the same order, as a save of the resident optimizer. Each param/<name>
tensor of a parameter on NVMe is a Span of its piece's record (PieceReader, one per parameter
file): a record is read into the parameter store's ring once, the next one read ahead, and held
while the file writer copies the slices of its parameters.

Loading. write_records assembles each record of the offload file in a ring buffer, chunk after
chunk: the masters and states of the saved run (read with pread from the checkpoint's files,
straight into the record where the dtype allows), the values the parameters are about to get
(masters of what the checkpoint holds no master for), initial states elsewhere, zeros in the
padding: what a load of the resident optimizer writes back. Each record goes to the slot that
does not hold the optimizer's current state (NvmeStore.stream(..., flip=False)), and the slots
flip only in the load's commit, once every rank agreed that the checkpoint is good.
write_pieces does the same for the parameter records (ShardedParams.write_pieces_aside, then
flip_pieces at the commit). A load that fails anywhere before the commit leaves the optimizer's
and the parameters' current records as they were.

Host memory either way: the stores' rings (there anyway), the file writer's staging (a save) and
at most one chunk (or one parameter slice) of scratch for a cast (a load), whatever the model's
size. `stats` records what the last transfer of the optimizer's records held, for tests and for
memory_report-style accounting.
"""

from __future__ import annotations

import bisect
import errno
from collections import deque
from typing import Dict, Iterator, List, Optional, Tuple

import torch

from zero_py.checkpoint.reader import Checkpoint
from zero_py.io.engine import IO_ALIGN
from zero_py.optim.streamed import StreamedUpdate

# the last save's or load's copy of an offloaded optimizer: the most bytes of the store's ring
# it held at once ("ring_bytes"), the largest scratch it allocated ("scratch_bytes"), and its
# requests to the offload file (reads of a save, record writes of a load)
stats: Dict[str, int] = {"ring_bytes": 0, "scratch_bytes": 0, "requests": 0}


def streamed(opt) -> Optional[StreamedUpdate]:
    """The optimizer's StreamedUpdate when its state is on NVMe and not resident (inside
    opt.resident() the in-memory paths apply), else None."""
    update = opt._update
    if isinstance(update, StreamedUpdate) and not update.is_resident:
        return update
    return None


class Span:
    """A checkpoint tensor read from an offload file when the file writer reaches it: what
    TensorFileWriter.write takes in place of a tensor (dtype, shape, numel, parts()). `reader`
    (a SpanReader or PieceReader) gives the bytes of its span number `index`."""

    def __init__(self, reader, index: int, numel: int, dtype: torch.dtype = torch.float32):
        self.reader, self.index, self.shape, self.dtype = reader, index, (numel,), dtype

    def numel(self) -> int:
        return self.shape[0]

    def element_size(self) -> int:
        return self.dtype.itemsize

    def parts(self) -> Iterator[torch.Tensor]:
        """The span's bytes in order, as uint8 tensors valid until the next one is asked for."""
        return self.reader.parts(self.index)

    def materialize(self) -> torch.Tensor:
        """The span as a tensor of its own (an asynchronous save's host copy)."""
        out = torch.empty(self.numel(), dtype=self.dtype)
        flat, at = out.view(torch.uint8), 0
        for part in self.parts():
            flat[at:at + part.numel()].copy_(part)
            at += part.numel()
        return out


class SpanReader:
    """The spans of one rank file, read from the offload file in the order they are written
    (see the module docstring). Spans must be consumed in the order they were made; close()
    waits for the reads still in flight (the ring is the store's: a step must not reuse a
    buffer the engine still fills)."""

    def __init__(self, update: StreamedUpdate):
        self.update, self.store = update, update.store
        self.spans: List[Tuple[int, int, int]] = []  # (array, shard lo, shard hi)
        self._windows: Optional[Iterator[tuple]] = None
        self._next: Optional[tuple] = None  # the window that did not fit the last batch
        self._batches: deque = deque()      # (buffer, tickets, [(span, view)]) read ahead
        self._free: List[int] = []
        self._held = 0                      # ring bytes of the batches in flight
        self._tickets = 0                   # reads submitted and not yet waited for (the
        # engine refuses more than its max_inflight: small windows fill a batch with many)
        stats.update(ring_bytes=0, scratch_bytes=0, requests=0)

    def span(self, array: int, lo: int, hi: int) -> Span:
        self.spans.append((array, lo, hi))
        return Span(self, len(self.spans) - 1, hi - lo)

    def _iter_windows(self) -> Iterator[tuple]:
        cn = self.store.chunk_numel
        block = IO_ALIGN // 4  # fp32 elements per aligned block
        for i, (j, lo, hi) in enumerate(self.spans):
            for k in range(lo // cn, (hi - 1) // cn + 1) if hi > lo else ():
                base = k * cn
                a, z = max(lo, base) - base, min(hi, base + cn) - base
                a0, z0 = a // block * block, min(cn, -(-z // block) * block)
                yield i, k, j, a, z, a0, z0

    def _error(self, exc: Exception) -> OSError:
        return OSError(errno.EIO, f"reading the optimizer's NVMe offload file {self.store.path} "
                                  f"for the checkpoint failed ({exc})")

    def _submit(self) -> None:
        """Packs the next windows into a free ring buffer and queues their reads."""
        store = self.store
        b = self._free.pop(0)
        buf = store.ring[b]
        tickets, views, at = [], [], 0
        while True:
            w = self._next if self._next is not None else next(self._windows, None)
            self._next = None
            if w is None:
                break
            i, k, j, a, z, a0, z0 = w
            nbytes = (z0 - a0) * 4
            if at + nbytes > buf.numel() or self._tickets >= store.engine.max_inflight:
                self._next = w  # the next batch's first window
                break
            try:
                tickets.append(store.engine.read(store.file, buf[at:at + nbytes],
                                                 store.array_offset(k, j) + a0 * 4))
            except (RuntimeError, ValueError, IndexError) as exc:
                self._batches.append((b, tickets, views, at))
                raise self._error(exc) from None
            views.append((i, buf[at + (a - a0) * 4:at + (z - a0) * 4]))
            stats["requests"] += 1
            self._tickets += 1
            at += nbytes
        if not views:
            self._free.append(b)
            return
        self._held += at
        stats["ring_bytes"] = max(stats["ring_bytes"], self._held)
        self._batches.append((b, tickets, views, at))

    def _fill(self) -> None:
        while (self._free and self._tickets < self.store.engine.max_inflight
               and (self._next is not None or self._windows is not None)):
            before = len(self._batches)
            self._submit()
            if len(self._batches) == before:  # no window left
                break

    def parts(self, index: int) -> Iterator[torch.Tensor]:
        if self._windows is None:
            self._windows = self._iter_windows()
            self._free = list(range(len(self.store.ring)))
        while True:
            self._fill()
            if not self._batches:
                return
            b, tickets, views, nbytes = self._batches[0]
            while tickets:
                ticket = tickets.pop(0)
                self._tickets -= 1
                try:
                    self.store.engine.wait(ticket)
                except (RuntimeError, ValueError, IndexError) as exc:
                    raise self._error(exc) from None
            while views:
                i, view = views[0]
                if i != index:
                    if i < index:
                        raise RuntimeError("zero_py: checkpoint spans read out of order; this "
                                           "is a bug, please report it")
                    return
                views.pop(0)
                yield view
            self._batches.popleft()
            self._held -= nbytes
            self._free.append(b)

    def close(self) -> None:
        """Waits for every read in flight (their errors dropped: a save that stops early has
        already failed with its own)."""
        while self._batches:
            b, tickets, _, _ = self._batches.popleft()
            for t in tickets:
                try:
                    self.store.engine.wait(t)
                except (RuntimeError, ValueError, IndexError):
                    pass
            self._free.append(b)
        self._held = self._tickets = 0


class PieceReader:
    """The param/<name> spans of one rank file whose values are in one ShardedParams' NVMe
    parameter file, read from its records in file order (see the module docstring): a record is
    held in the parameter store's ring while consecutive spans lie in it, and the next record
    the spans need is read ahead meanwhile. close() gives the ring back."""

    def __init__(self, storage):
        self.store = storage.nvme
        self.spans: List[Tuple[int, int, int]] = []  # (bucket, piece lo, piece hi)
        self._next_other: List[Optional[int]] = []   # the next span's bucket other than its own
        self._held: Optional[Tuple[int, int]] = None  # (bucket, ring buffer)

    def span(self, s, dtype: torch.dtype) -> Span:
        """The span of ShardSlice `s` (parameter values of `dtype`)."""
        self.spans.append((s.bucket, s.piece_lo, s.piece_lo + s.numel))
        return Span(self, len(self.spans) - 1, s.numel, dtype)

    def parts(self, index: int) -> Iterator[torch.Tensor]:
        if len(self._next_other) != len(self.spans):  # the spans are all made: link them
            self._next_other = [None] * len(self.spans)
            for k in range(len(self.spans) - 2, -1, -1):
                b, c = self.spans[k][0], self.spans[k + 1][0]
                self._next_other[k] = c if c != b else self._next_other[k + 1]
        b, lo, hi = self.spans[index]
        if self._held is not None and self._held[0] != b:
            self._release()
        if self._held is None:
            self._held = (b, self.store.hold(b))
            ahead = self._next_other[index]
            if ahead is not None:
                self.store.read_ahead([ahead])
        size = self.store.dtype[b].itemsize
        yield self.store.view(b, self._held[1]).view(torch.uint8)[lo * size:hi * size]

    def _release(self) -> None:
        if self._held is not None:
            self.store.release(self._held[1])
            self._held = None

    def close(self) -> None:
        self._release()


class PieceReaders:
    """One PieceReader per parameter file that a save's holdings name (Held.on_file)."""

    def __init__(self) -> None:
        self._readers: Dict[int, PieceReader] = {}

    def span(self, h) -> Span:
        storage, s = h.on_file
        reader = self._readers.get(id(storage))
        if reader is None:
            reader = self._readers[id(storage)] = PieceReader(storage)
        return reader.span(s, h.dtype)

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()


def write_pieces(ck: Checkpoint, held) -> list:
    """A load's parameter values into the other slots of every parameter file that `held` (the
    rank's holdings) names, bucket by bucket (see the module docstring); returns those storages,
    whose flip_pieces() the load's commit calls."""
    files: Dict[int, tuple] = {}
    for name, h in held.items():
        if h.on_file is not None:
            storage, s = h.on_file
            _, by_param = files.setdefault(id(storage), (storage, {}))
            if s is not None:
                by_param[s.param] = (name, h)
    for storage, by_param in files.values():
        def fill(b: int, piece: torch.Tensor, storage=storage, by_param=by_param) -> None:
            for s in storage.slices_of_bucket[b]:
                name, h = by_param[s.param]
                ck.read_into(ck.value_kind(name, h.dtype), name, s.param_lo, s.param_hi,
                             piece[s.piece_lo:s.piece_lo + s.numel])
        storage.write_pieces_aside(fill)
    return [storage for storage, _ in files.values()]


def write_records(ck: Checkpoint, opt, held, staged) -> None:
    """A load's optimizer state into the offload file's other slots, record by record (see the
    module docstring); the caller flips them (NvmeStore.flip) at its commit. `held`: the rank's
    holdings; `staged`: {id(Held): the staged tensor of the values its parameter gets} (read
    from the checkpoint instead for a parameter whose values go to an NVMe parameter file)."""
    update = opt._update
    store, flat = update.store, opt._flat
    by_param = {h.index: (name, h) for name, h in held.items() if h.slice is not None}
    with_state = {name for name, h in held.items() if h.slice is not None
                  and ck.params[name].get("step") and ck.params[name].get("state")}
    has_master = [d is not None for d in opt._masters.dtype_of]
    initial = update.initial_state  # Adagrad's sum before a first step; 0 for the rest
    offsets = list(flat.bucket_shard_offset)
    stats.update(ring_bytes=0, scratch_bytes=0, requests=0)

    def read(kind: str, name: str, lo: int, hi: int, out: torch.Tensor) -> None:
        t, segments = ck.stage(kind, name, lo, hi, out)
        if t is not out:  # stored in another dtype: a chunk's worth of scratch, cast
            stats["scratch_bytes"] = max(stats["scratch_bytes"], t.numel() * t.element_size())
        ck.fill(segments)
        if t is not out:
            out.copy_(t)

    def fill(k: int, buf: torch.Tensor) -> None:
        arrays = store.arrays(buf)
        c = store.chunk_range(k)
        for a in arrays:
            a.zero_()
        # the buckets lie in the shard space in index order: start at the one holding c.start
        for b in range(max(0, bisect.bisect_right(offsets, c.start) - 1), flat.n_buckets):
            off = flat.bucket_shard_offset[b]
            if off >= c.stop:
                break
            lo, hi = max(c.start, off), min(c.stop, off + flat.bucket_shard_numel[b])
            if lo >= hi:
                continue
            if initial != 0.0:  # the initial state over the piece, padding included
                for a in arrays[1:]:
                    a[lo - c.start:hi - c.start].fill_(initial)
            for s in flat.slices_of_bucket[b]:
                x0, x1 = max(off + s.piece_lo, lo), min(off + s.piece_hi, hi)
                if x0 >= x1:
                    continue
                name, h = by_param[s.param]
                entry = ck.params[name]
                p0 = s.param_lo + x0 - off - s.piece_lo  # the parameter's elements [p0, p1)
                p1 = p0 + x1 - x0
                dst = slice(x0 - c.start, x1 - c.start)
                if has_master[b] and entry["trainable"]:
                    read("master" if entry.get("master") else "param", name, p0, p1,
                         arrays[0][dst])
                else:  # the master is the value the parameter gets, in its own dtype
                    t = staged.get(id(h))
                    if t is None:  # on a parameter file: as write_pieces reads it
                        t = torch.empty(p1 - p0, dtype=h.dtype)
                        stats["scratch_bytes"] = max(stats["scratch_bytes"],
                                                     t.numel() * t.element_size())
                        ck.read_into(ck.value_kind(name, h.dtype), name, p0, p1, t)
                    else:
                        t = t[p0 - h.load_lo:p1 - h.load_lo]
                    arrays[0][dst].copy_(t.to(flat.bucket_dtype(b)))
                if name in with_state:
                    saved = entry["state"]["keys"]
                    for j, key in enumerate(update.keys):
                        if key in saved:  # else SGD's momentum buffer of a parameter with
                            read(f"state/{key}", name, p0, p1, arrays[j + 1][dst])  # none yet

        stats["requests"] += 1
        stats["ring_bytes"] = min(len(store.ring), stats["requests"]) * store.record_bytes

    store.stream(list(range(store.n_chunks)), fill, read=False, flip=False)
