"""NvmeStore: an offloaded optimizer's fp32 masters and states in a file (ZeRO-Infinity), streamed
through a small ring of aligned host buffers by the C direct-I/O engine (zero_py/io/).

File layout. The rank's shard space [0, shard_numel) is cut into chunks of `chunk_numel`
elements. Chunk k is one record of (1 + n_states) fp32 arrays of chunk_numel elements each:
the fp32 master, then each optimizer state (exp_avg, exp_avg_sq, ...); elements past the shard's
end and the layout's padding hold zeros. Every record has two slots in the file, at
(2 k + slot) * record_bytes; `slot[k]` names the one holding the last good step.

A step reads chunk k from its slot, updates it in the ring buffer, and writes it to the other
slot, while chunk k+1 is read and chunk k-1 written (the engine's threads, without the GIL).
Only when every write of the step has landed do the slots flip: a failed write (a full disk, an
I/O error) leaves the last good step on disk, and the parameters already updated are put back
from it. Host memory for the optimizer is the ring, whatever the model's size.

The file is created in `offload_dir`, its space reserved at once (posix_fallocate: a disk too
small is an error at construction, not in the middle of a step), and unlinked at once: the open
descriptor keeps it, and nothing is left behind when the process ends, however it ends.
"""

from __future__ import annotations

import contextlib
import errno
import os
import uuid
from typing import Callable, Iterable, List, Optional, Sequence

import torch

from zero_py.config import environment
from zero_py.io.engine import IO_ALIGN, DirectFile, IoEngine, aligned_empty
from zero_py.sharding.layout import FlatLayout

# one record: big enough for the disk, small for the caches (env ZP_OFFLOAD_CHUNK_BYTES)
DEFAULT_CHUNK_BYTES = 8 << 20
# records in host memory: one updated, reads ahead, writes behind (env ZP_OFFLOAD_RING)
DEFAULT_RING = 4


def record_geometry(shard_numel: int, n_states: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES):
    """(chunk_numel, n_chunks, record_bytes) of a shard of `shard_numel` elements with
    `n_states` state arrays: each array of a record a multiple of IO_ALIGN, the record at most
    chunk_bytes (at least one aligned block per array), no larger than the shard needs."""
    width = 1 + n_states
    align = IO_ALIGN // 4  # elements per aligned block of one array
    per_array = max(align, chunk_bytes // 4 // width // align * align)
    chunk_numel = min(per_array, -(-max(1, shard_numel) // align) * align)
    return chunk_numel, -(-shard_numel // chunk_numel), chunk_numel * 4 * width


def reserved_file(directory: str, kind: str, rank: int, nbytes: int, label: str,
                  owner: str):
    """(path, DirectFile) of a new offload file in `directory` with `nbytes` reserved at once
    (posix_fallocate: a drive too small is an error now, not in the middle of a step) and
    unlinked at once (the descriptor keeps it; nothing outlives the process). Errors name the
    file (`label`: "offload", "parameter") or the space asked for `owner`'s file and what to
    change."""
    name = f"zero_py-{kind}-rank{rank}-{os.getpid()}-{uuid.uuid4().hex[:8]}.bin"
    path = os.path.join(directory, name)
    try:
        file = DirectFile(path, writable=True)
    except (OSError, RuntimeError, ValueError) as exc:
        raise OSError(errno.EIO, f"zero_py: cannot create the NVMe {label} file {path}: "
                                 f"{exc}") from None
    os.unlink(path)
    try:
        os.posix_fallocate(file.fd, 0, max(nbytes, IO_ALIGN))
    except OSError as exc:
        file.close()
        raise OSError(exc.errno, f"zero_py: cannot reserve {nbytes / 1e9:.2f} GB for {owner} "
                                 f"NVMe offload file in {directory} ({os.strerror(exc.errno)}): "
                                 "free space there or choose another offload_dir") from None
    return path, file


def check_offload_dir(offload_dir, who: str = "offload_optimizer") -> str:
    """offload_dir as a path, or a clear error: it must be an existing writable directory.
    `who`: the keyword that needs it, for the error."""
    if offload_dir is None:
        raise ValueError(f"{who}='nvme' needs offload_dir=PATH: a directory on the NVMe drive "
                         "for the offload files")
    path = os.fspath(offload_dir)
    if not os.path.isdir(path):
        raise ValueError(f"offload_dir {path!r} is not a directory: create it first (it should "
                         "be on a fast local drive)")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"offload_dir {path!r} is not writable by this process: pick a "
                         "directory it can create files in")
    return path


class _Checked:
    """The engine's calls with its errors (a short read, a refused write, a full disk) as
    OSError naming the offload directory."""

    def __init__(self, engine: IoEngine, where: str):
        self.engine, self.where = engine, where

    def __getattr__(self, name):
        fn = getattr(self.engine, name)

        def call(*args):
            try:
                return fn(*args)
            except (RuntimeError, IndexError, ValueError) as exc:
                raise OSError(errno.EIO, f"zero_py: the NVMe offload file in {self.where} "
                                         f"failed ({exc}); the optimizer keeps the state of "
                                         "its last good step") from None
        return call


class NvmeStore:
    """The file and ring of one rank's offloaded shard (see the module docstring).

    `n_states`: optimizer state arrays per element; `chunk_bytes`: the target size of one
    record; `ring`: records held in host memory at once (>= 2)."""

    def __init__(self, flat: FlatLayout, n_states: int, offload_dir, rank: int,
                 chunk_bytes: Optional[int] = None, ring: Optional[int] = None,
                 engine: Optional[IoEngine] = None):
        if chunk_bytes is None:
            chunk_bytes = environment.read("ZP_OFFLOAD_CHUNK_BYTES", DEFAULT_CHUNK_BYTES)
        if ring is None:
            ring = environment.read("ZP_OFFLOAD_RING", DEFAULT_RING)
        if ring < 2:
            raise ValueError(f"the NVMe ring needs at least 2 buffers, got {ring}")
        directory = check_offload_dir(offload_dir)
        self.flat = flat
        self.width = 1 + n_states  # fp32 arrays per element in a record
        self.chunk_numel, self.n_chunks, self.record_bytes = record_geometry(
            flat.shard_numel, n_states, chunk_bytes)
        self.engine = engine or IoEngine(n_threads=min(4, max(2, os.cpu_count() or 2)))
        self._own_engine = engine is None
        self.file_bytes = 2 * self.n_chunks * self.record_bytes
        self.path, self.file = reserved_file(directory, "optimizer", rank, self.file_bytes,
                                             "offload", "the optimizer's")
        self.ring = [aligned_empty(self.record_bytes) for _ in range(ring)]
        self.slot = bytearray(self.n_chunks)  # which slot of each record is current
        # inside transaction(): the chunks written so far (their other slot holds them)
        self._dirty: Optional[set] = None

    # -- geometry -------------------------------------------------------------------------------

    def chunk_range(self, k: int) -> range:
        """Chunk k's elements of the shard space."""
        return range(k * self.chunk_numel, min((k + 1) * self.chunk_numel, self.flat.shard_numel))

    def chunks_of(self, buckets: Iterable[int]) -> List[int]:
        """The chunks holding any element of `buckets`' pieces, in order."""
        out = set()
        for b in buckets:
            lo = self.flat.bucket_shard_offset[b]
            hi = lo + self.flat.bucket_shard_numel[b]
            if hi > lo:
                out.update(range(lo // self.chunk_numel, (hi - 1) // self.chunk_numel + 1))
        return sorted(out)

    def arrays(self, buf: torch.Tensor) -> List[torch.Tensor]:
        """A ring buffer's record as fp32 arrays: [master, state0, ...], chunk_numel each."""
        flat = buf.view(torch.float32)
        return [flat[j * self.chunk_numel:(j + 1) * self.chunk_numel] for j in range(self.width)]

    def _offset(self, k: int, slot: int) -> int:
        return (2 * k + slot) * self.record_bytes

    def host_bytes(self) -> int:
        return sum(b.numel() for b in self.ring)

    def _read_slot(self, k: int) -> int:
        """The slot a step reads chunk k from: the current one, or inside a transaction the one
        an earlier stream of the same transaction wrote."""
        if self._dirty is not None and k in self._dirty:
            return 1 - self.slot[k]
        return self.slot[k]

    @contextlib.contextmanager
    def transaction(self):
        """Several stream() calls as one step (offload_params="nvme" updates bucket by bucket):
        inside, the slots do not flip; a chunk streamed again is read from the slot this
        transaction wrote. On a clean exit every chunk written flips; on an error none does,
        and the file still holds the last good step."""
        if self._dirty is not None:
            raise RuntimeError("zero_py: an NVMe optimizer transaction is already open; this is "
                               "a bug, please report it")
        self._dirty = set()
        try:
            yield
        except BaseException:
            self._dirty = None
            raise
        dirty, self._dirty = self._dirty, None
        for k in dirty:
            self.slot[k] ^= 1

    # -- streaming ------------------------------------------------------------------------------

    def stream(self, chunks: Sequence[int], work: Callable[[int, torch.Tensor], None],
               read: bool = True, flip: bool = True) -> None:
        """For each chunk k in order: its current record into a ring buffer (read=False: the
        buffer is handed over uninitialized), work(k, buffer), then the buffer written to the
        record's other slot. Reads run ahead and writes behind, as far as the ring allows. The
        slots flip when every write has landed (flip=False: the caller flips them later with
        flip(), e.g. a checkpoint load once every rank agreed); on any error nothing flips (the
        file still holds the last good records) and the error is raised after the engine is
        idle."""
        engine, ring = _Checked(self.engine, os.path.dirname(self.path)), self.ring
        free = list(range(len(ring)))
        reads: dict = {}    # chunk -> (ticket, or None when not reading; buffer index)
        writes: list = []   # (ticket, buffer index), oldest first
        ahead = 0           # chunks[ahead] is the next to read

        def retire_oldest_write() -> None:
            ticket, i = writes.pop(0)
            engine.wait(ticket)
            free.append(i)

        def refill() -> None:
            nonlocal ahead
            while ahead < len(chunks) and free:
                k, i = chunks[ahead], free.pop(0)
                reads[k] = (engine.read(self.file, ring[i], self._offset(k, self._read_slot(k)))
                            if read else None, i)
                ahead += 1

        try:
            for k in chunks:
                if k not in reads:  # every buffer was busy when its turn to be read came
                    while not free:
                        retire_oldest_write()
                    refill()
                ticket, i = reads.pop(k)
                if ticket is not None:
                    engine.wait(ticket)
                work(k, ring[i])
                writes.append((engine.write(self.file, ring[i],
                                            self._offset(k, 1 - self.slot[k])), i))
                while writes and engine.done(writes[0][0]):
                    retire_oldest_write()
                refill()
            while writes:
                retire_oldest_write()
        except BaseException:
            self._drain(reads, writes)
            raise
        if not flip:
            return
        if self._dirty is not None:  # a transaction flips them at its end
            self._dirty.update(chunks)
            return
        self.flip(chunks)

    def flip(self, chunks: Iterable[int]) -> None:
        """Makes the other slot of each chunk the current one (its record written by a
        stream(..., flip=False) that completed)."""
        for k in chunks:
            self.slot[k] ^= 1

    def array_offset(self, k: int, j: int) -> int:
        """File offset of array j (0: the master, 1 + i: state i) of chunk k's current record
        (IO_ALIGN-aligned)."""
        return self._offset(k, self.slot[k]) + j * self.chunk_numel * 4

    def _drain(self, reads: dict, writes: list) -> None:
        """Waits for every request still in flight (their errors are dropped: the first one
        is being raised)."""
        for ticket, _ in list(reads.values()) + writes:
            if ticket is None:
                continue
            try:
                self.engine.wait(ticket)
            except (RuntimeError, IndexError, ValueError):
                pass
        reads.clear()
        writes.clear()

    def read_chunks(self, chunks: Sequence[int], work: Callable[[int, torch.Tensor], None]
                    ) -> None:
        """work(k, record) for each chunk, reading only (nothing is written, nothing flips)."""
        engine = _Checked(self.engine, os.path.dirname(self.path))
        for start in range(0, len(chunks), len(self.ring)):
            batch = chunks[start:start + len(self.ring)]
            tickets = [engine.read(self.file, self.ring[j], self._offset(k, self.slot[k]))
                       for j, k in enumerate(batch)]
            try:
                for t in tickets:
                    engine.wait(t)
            except BaseException:
                self._drain({}, [(t, 0) for t in tickets])
                raise
            for j, k in enumerate(batch):
                work(k, self.ring[j])

    def close(self) -> None:
        if self.file.fd >= 0:
            self.file.close()
        if self._own_engine:
            self.engine.close()
