"""ParamStore: a rank's stage-3 parameter shards in a file (offload_params="nvme", ZeRO-Infinity),
read and written through a small ring of aligned host buffers by the C direct-I/O engine
(zero_py/io/).

File layout. One record per bucket of the ShardedParams (a bucket is one (unit, param group,
dtype) set): the rank's piece of the bucket in the parameters' dtype, padded with zeros to a
multiple of IO_ALIGN. Every record has two slots, at base[b] and base[b] + record_bytes[b];
`slot[b]` names the one holding the last good values. The file is created in offload_dir, its
whole size reserved at once (posix_fallocate: a drive too small is an error at construction)
and unlinked at once (the descriptor keeps it; nothing outlives the process).

Who reads and writes it (ShardedParams, sharding/storage.py, drives it):
- a gather of bucket b reads record b into a ring buffer (issued ahead by read_ahead, which
  the stage-3 engine calls with the next units of its schedule, so reads overlap compute), and
  the caller copies the piece into its own slot of the gather buffer;
- the optimizer's step opens each touched bucket inside a transaction (open: the record read
  into a ring buffer, the next one read ahead; close: written to the other slot while the next
  bucket is updated). The slots flip only when every write of the step has landed, so a failed
  write leaves the last good parameters on disk (the optimizer's own file, NvmeStore, flips in
  the same step under the same rule);
- a write of one piece (construction, a load, gathered(modifier_rank)) goes to the other slot
  and flips once it has landed;
- a checkpoint's save holds each record in a ring buffer while the file writer copies its
  parameters' slices (hold / release, the next record read ahead), and its load writes every
  record to the other slot (write_aside), flipped only at the load's commit (flip), once every
  rank has agreed that the checkpoint is good.

Host memory is the ring: `ring` buffers of the largest record, whatever the number of units.
"""

from __future__ import annotations

import contextlib
import errno
import weakref
from typing import Dict, List, Optional, Sequence

import torch

from zero_py.config import environment
from zero_py.io.engine import IO_ALIGN, IoEngine, aligned_empty, default_engine
from zero_py.offload.nvme import check_offload_dir, reserved_file

# records in host memory: one in use, one read ahead, one being written (env ZP_OFFLOAD_PARAM_RING)
DEFAULT_PARAM_RING = 3


def param_record_bytes(piece_bytes: int) -> int:
    """The bytes a piece of `piece_bytes` takes in the file (one slot) and in a ring buffer."""
    return max(IO_ALIGN, -(-piece_bytes // IO_ALIGN) * IO_ALIGN)


class ParamStore:
    """The parameter file and ring of one ShardedParams (see the module docstring).

    `flat`: the layout (bucket_shard_numel, bucket_dtype); `what`: "parameters" or "frozen
    parameters", for the file name and errors; `ring`: buffers held in host memory (>= 2)."""

    def __init__(self, flat, offload_dir, rank: int, what: str = "parameters",
                 ring: Optional[int] = None, engine: Optional[IoEngine] = None):
        if ring is None:
            ring = environment.read("ZP_OFFLOAD_PARAM_RING", DEFAULT_PARAM_RING)
        if ring < 2:
            raise ValueError(f"the NVMe parameter ring needs at least 2 buffers, got {ring}")
        self.directory = check_offload_dir(offload_dir, "offload_params")
        self.what = what
        self.n_buckets = flat.n_buckets
        self.piece_numel = list(flat.bucket_shard_numel)
        self.dtype = [flat.bucket_dtype(b) for b in range(flat.n_buckets)]
        self.piece_bytes = [n * d.itemsize for n, d in zip(self.piece_numel, self.dtype)]
        self.record_bytes = [param_record_bytes(n) for n in self.piece_bytes]
        self.base: List[int] = []
        at = 0
        for r in self.record_bytes:
            self.base.append(at)
            at += 2 * r
        self.file_bytes = at
        # the process's shared engine: a model makes two stores (trainable, frozen), and a
        # process may make many models; their threads would add up
        self.engine = engine or default_engine()
        kind = "frozen" if what.startswith("frozen") else "params"
        self.path, self.file = reserved_file(self.directory, kind, rank, self.file_bytes,
                                             "parameter", f"the {what}'")
        weakref.finalize(self, self.file.close)  # the file goes with the store (its space too)
        self.buffer_bytes = max(self.record_bytes, default=IO_ALIGN)
        self.ring = [aligned_empty(self.buffer_bytes) for _ in range(ring)]
        self.slot = bytearray(self.n_buckets)  # which slot of each record is current
        self._free = list(range(ring))
        self._reads: Dict[int, tuple] = {}  # bucket -> (ticket, buffer): read ahead, not taken
        self._txn: Optional[dict] = None    # the open transaction (begin .. commit/abort)
        self._plain_writes: list = []       # (ticket, buffer) of a write outside one

    # -- geometry and errors ----------------------------------------------------------------

    def _offset(self, b: int, slot: int) -> int:
        return self.base[b] + slot * self.record_bytes[b]

    def view(self, b: int, i: int) -> torch.Tensor:
        """Ring buffer i as bucket b's piece (its dtype, its numel)."""
        return self.ring[i][:self.piece_bytes[b]].view(self.dtype[b])

    def host_bytes(self) -> int:
        return sum(buf.numel() for buf in self.ring)

    def _fail(self, exc: Exception, doing: str) -> OSError:
        return OSError(errno.EIO, f"zero_py: the NVMe offload file of the {self.what} in "
                                  f"{self.directory} failed while {doing} ({exc}); the "
                                  "parameters keep their last good step")

    def _call(self, doing: str, fn, *args):
        try:
            return fn(*args)
        except (RuntimeError, IndexError, ValueError) as exc:
            raise self._fail(exc, doing) from None

    def _take_buffer(self) -> int:
        """A free ring buffer; when none is free, the oldest read ahead is given up (its
        record is read again when needed), or else the oldest write behind is waited for."""
        if not self._free and self._reads:
            self._drop_read(next(iter(self._reads)))
        writes = self._writes()
        while not self._free and writes:
            ticket, i = writes.pop(0)
            try:
                self._call(f"writing the {self.what}", self.engine.wait, ticket)
            finally:
                self._free.append(i)
        if not self._free:
            raise RuntimeError("zero_py: the NVMe parameter ring has no free buffer; this is a "
                               "bug, please report it")
        return self._free.pop(0)

    def _drop_read(self, b: int) -> None:
        ticket, i = self._reads.pop(b)
        try:
            self.engine.wait(ticket)
        except (RuntimeError, IndexError, ValueError):
            pass  # given up: a failure shows when the record is read again
        self._free.append(i)

    # -- reads ------------------------------------------------------------------------------

    def _current(self, b: int) -> int:
        """The slot a read of record b takes: the last good one, or, inside a transaction, the
        one this transaction wrote."""
        if self._txn is not None and b in self._txn["written"]:
            return 1 - self.slot[b]
        return self.slot[b]

    def read_ahead(self, buckets: Sequence[int]) -> None:
        """Starts reading `buckets`' records into free ring buffers (one buffer is left for the
        read that is needed now); taken by read_into or open."""
        for b in buckets:
            if len(self._free) <= 1:
                return
            if b in self._reads or self.piece_bytes[b] == 0:
                continue
            i = self._free.pop(0)
            try:
                ticket = self._call(f"reading the {self.what} ahead", self.engine.read,
                                    self.file, self.ring[i][:self.record_bytes[b]],
                                    self._offset(b, self._current(b)))
            except BaseException:
                self._free.append(i)
                raise
            self._reads[b] = (ticket, i)

    def _load(self, b: int) -> int:
        """Record b in a ring buffer (read ahead, or read now); returns the buffer's index."""
        if b in self._reads:
            ticket, i = self._reads.pop(b)
        else:
            i = self._take_buffer()
            try:
                ticket = self._call(f"reading the {self.what}", self.engine.read, self.file,
                                    self.ring[i][:self.record_bytes[b]],
                                    self._offset(b, self._current(b)))
            except BaseException:
                self._free.append(i)
                raise
        try:
            self._call(f"reading the {self.what}", self.engine.wait, ticket)
        except BaseException:
            self._free.append(i)
            raise
        return i

    def read_into(self, b: int, out: torch.Tensor) -> None:
        """Bucket b's piece (its last good values) copied into `out` (any device)."""
        if self.piece_bytes[b] == 0:
            return
        i = self._load(b)
        try:
            out.copy_(self.view(b, i))
        finally:
            self._free.append(i)

    def hold(self, b: int) -> int:
        """Record b (its last good values) in a ring buffer, read ahead or read now, until
        release(i): the buffer's index (view(b, i) is the piece). Read only."""
        return self._load(b)

    def release(self, i: int) -> None:
        self._free.append(i)

    # -- writes -----------------------------------------------------------------------------

    def _forget(self, b: int) -> None:
        """A read ahead of record b is stale once b is written."""
        if b in self._reads:
            self._drop_read(b)

    def write(self, b: int, values: torch.Tensor) -> None:
        """Bucket b's piece from `values`: written to the other slot, current once it landed.
        Inside a transaction the write counts with the transaction's."""
        if self.piece_bytes[b] == 0:
            return
        self._forget(b)
        i = self._take_buffer()
        view = self.view(b, i)
        view.copy_(values.reshape(-1))
        self.ring[i][self.piece_bytes[b]:self.record_bytes[b]].zero_()
        self._submit_write(b, i)
        if self._txn is None:
            self._finish_writes()
            self.slot[b] ^= 1

    def _submit_write(self, b: int, i: int) -> None:
        ticket = None
        try:
            ticket = self._call(f"writing the {self.what}", self.engine.write, self.file,
                                self.ring[i][:self.record_bytes[b]],
                                self._offset(b, 1 - self.slot[b]))
        finally:
            if ticket is None:
                self._free.append(i)
        self._writes().append((ticket, i))
        if self._txn is not None:
            self._txn["written"].add(b)

    def _writes(self) -> list:
        """The writes in flight: the transaction's, or a single write's."""
        return self._txn["writes"] if self._txn is not None else self._plain_writes

    def _finish_writes(self) -> None:
        """Waits for every write in flight; the first error is raised once all are done."""
        writes, first = self._writes(), None
        while writes:
            ticket, i = writes.pop(0)
            try:
                self._call(f"writing the {self.what}", self.engine.wait, ticket)
            except OSError as exc:
                first = first or exc
            self._free.append(i)
        if first is not None:
            raise first

    def write_aside(self, buckets: Sequence[int], fill) -> None:
        """Each bucket's piece as fill(b, piece) makes it (the piece zeroed first) written to the
        slot that is not current, several writes in flight; none becomes current until
        flip(buckets). Returns once every write has landed; raises the first error after all
        have ended (the current slots are untouched either way)."""
        if self._txn is not None:
            raise RuntimeError("zero_py: a parameter-file transaction is open during a write "
                               "aside; this is a bug, please report it")
        try:
            for b in buckets:
                if self.piece_bytes[b] == 0:
                    continue
                i = self._take_buffer()
                try:
                    self.ring[i][:self.record_bytes[b]].zero_()
                    fill(b, self.view(b, i))
                except BaseException:
                    self._free.append(i)
                    raise
                self._submit_write(b, i)
        except BaseException:
            with contextlib.suppress(OSError):
                self._finish_writes()  # the buffers back; the first error is the one raised
            raise
        self._finish_writes()

    def flip(self, buckets: Sequence[int]) -> None:
        """The slots write_aside wrote become the current ones."""
        for b in buckets:
            if self.piece_bytes[b]:
                self._forget(b)  # a read ahead of the slot that is no longer current
                self.slot[b] ^= 1

    # -- the step's transaction -------------------------------------------------------------

    @contextlib.contextmanager
    def transaction(self, buckets: Sequence[int]):
        """A step over `buckets` (in order): inside, open(b) gives bucket b's piece in a ring
        buffer and close(b) writes it to the other slot. On a clean exit every write has landed
        and the slots flip; on an error nothing flips (the last good values stay current)."""
        if self._txn is not None:
            raise RuntimeError("zero_py: a parameter-file transaction is already open; this is "
                               "a bug, please report it")
        self._txn = {"written": set(), "writes": [], "order": list(buckets), "open": {}}
        try:
            yield self
            self._finish_writes()
        except BaseException:
            txn = self._txn
            for i in txn["open"].values():
                self._free.append(i)
            txn["open"].clear()
            for ticket, i in txn["writes"]:
                try:
                    self.engine.wait(ticket)
                except (RuntimeError, IndexError, ValueError):
                    pass  # the first error is the one being raised
                self._free.append(i)
            for b in txn["written"]:
                self._forget(b)  # reads ahead of the discarded slots
            self._txn = None
            raise
        written, self._txn = self._txn["written"], None
        for b in written:
            self._forget(b)  # a read ahead of the slot that is no longer current
            self.slot[b] ^= 1

    def open(self, b: int) -> torch.Tensor:
        """Inside a transaction: bucket b's piece in a ring buffer, to update in place; the next
        buckets of the transaction are read ahead while it is used."""
        txn = self._txn
        # a buffer for the read ahead: the oldest write behind must finish first
        while len(self._free) < 2 and txn["writes"]:
            ticket, i = txn["writes"].pop(0)
            try:
                self._call(f"writing the {self.what}", self.engine.wait, ticket)
            finally:
                self._free.append(i)
        i = self._load(b)
        txn["open"][b] = i
        order = txn["order"]
        if b in order:
            k = order.index(b)
            self.read_ahead(order[k + 1:k + 2])
        return self.view(b, i)

    def close(self, b: int) -> None:
        """Inside a transaction: bucket b's piece (opened) goes to its other slot (behind)."""
        i = self._txn["open"].pop(b)
        self.ring[i][self.piece_bytes[b]:self.record_bytes[b]].zero_()
        self._submit_write(b, i)

    def shutdown(self) -> None:
        for b in list(self._reads):
            self._drop_read(b)
        self.file.close()
