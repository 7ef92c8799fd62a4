"""IoEngine and DirectFile: the C direct-I/O engine from Python.

    engine = IoEngine(n_threads=4, max_inflight=32)
    buf = aligned_empty(8 << 20)                    # page-aligned uint8 tensor
    with DirectFile("states.bin", writable=True) as f:
        t = engine.write(f, buf, offset=0)          # returns at once: a ticket
        engine.wait(t)                              # the outcome (raises the request's error)

The engine keeps every submitted buffer alive until its ticket is waited for. With a direct
descriptor (DirectFile.direct), buffer address, size and offset must be multiples of IO_ALIGN;
aligned_empty gives such buffers. A file system that refuses O_DIRECT gets a page-cache
descriptor instead, said once per process with a warning.
"""

from __future__ import annotations

import errno
import mmap
import os
import warnings
import weakref
from typing import Dict, Optional

import torch

from zero_py._native import _C

IO_ALIGN: int = _C.IO_ALIGN
_READ, _WRITE = 0, 1
_warned_fallback = False


def aligned_empty(nbytes: int) -> torch.Tensor:
    """An uninitialized uint8 CPU tensor of `nbytes` (rounded up to IO_ALIGN) whose address is
    a multiple of IO_ALIGN (anonymous memory mapping: page-aligned)."""
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    size = max(IO_ALIGN, -(-nbytes // IO_ALIGN) * IO_ALIGN)
    return torch.frombuffer(mmap.mmap(-1, size), dtype=torch.uint8)


class DirectFile:
    """One file for the engine: opened for reading, or for writing (created; truncated unless
    truncate=False), with O_DIRECT when `direct` and the file system allows it."""

    def __init__(self, path, writable: bool = False, truncate: bool = True, direct: bool = True):
        global _warned_fallback
        self.path = os.fspath(path)
        self.fd, self.direct = _C.io_open(self.path, writable, truncate, direct)
        # a file dropped without close() (an optimizer collected after del) closes its
        # descriptor: the offload files are unlinked at once, so a leaked descriptor also kept
        # their reserved space on the drive until the process ended
        self._closer = weakref.finalize(self, os.close, self.fd)
        if direct and not self.direct and not _warned_fallback:
            _warned_fallback = True
            warnings.warn(f"zero_py: the file system of {self.path} refuses direct I/O "
                          "(O_DIRECT); its files go through the page cache", stacklevel=2)

    def fsync(self) -> None:
        os.fsync(self.fd)

    def truncate(self, nbytes: int) -> None:
        os.ftruncate(self.fd, nbytes)

    def close(self) -> None:
        if self.fd >= 0:
            self._closer.detach()
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> "DirectFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class IoEngine:
    """Worker threads running reads and writes of whole buffers (see the module docstring)."""

    def __init__(self, n_threads: Optional[int] = None, max_inflight: int = 32):
        if n_threads is None:
            n_threads = min(8, max(2, os.cpu_count() or 2))
        self._engine = _C.IoEngine(int(n_threads), int(max_inflight))
        self.max_inflight = int(max_inflight)  # submitted and not yet waited for, at most
        self._buffers: Dict[int, torch.Tensor] = {}  # ticket -> buffer kept alive

    def _submit(self, op: int, f: DirectFile, buf: torch.Tensor, offset: int) -> int:
        if buf.device.type != "cpu" or not buf.is_contiguous():
            raise ValueError("the engine reads and writes contiguous CPU tensors")
        nbytes = buf.numel() * buf.element_size()
        ticket = self._engine.submit(op, f.fd, buf.data_ptr(), nbytes, int(offset), f.direct)
        self._buffers[ticket] = buf
        return ticket

    def write(self, f: DirectFile, buf: torch.Tensor, offset: int) -> int:
        """Queues a write of all of `buf` at `offset`; returns its ticket."""
        return self._submit(_WRITE, f, buf, offset)

    def read(self, f: DirectFile, buf: torch.Tensor, offset: int) -> int:
        """Queues a read filling all of `buf` from `offset`; returns its ticket."""
        return self._submit(_READ, f, buf, offset)

    def wait(self, ticket: int, timeout_s: Optional[float] = None) -> None:
        """Waits for a request and raises its error: IndexError for a short read (the file
        ends first), RuntimeError when the device refused (disk full, I/O error) or the wait
        timed out (the request then still runs: wait again)."""
        try:
            self._engine.wait(ticket, -1 if timeout_s is None else int(timeout_s * 1000))
        except BaseException:
            try:
                self._engine.poll(ticket)  # still in flight (a timeout): keep its buffer
            except ValueError:
                self._buffers.pop(ticket, None)  # spent: the request failed
            raise
        self._buffers.pop(ticket, None)

    def done(self, ticket: int) -> bool:
        return self._engine.poll(ticket)

    def close(self) -> None:
        self._engine.close()
        self._buffers.clear()


def evict(path) -> None:
    """Drops a file's pages from the page cache (fsynced first, so they are clean and go):
    the next read comes from the disk. For benchmarks and tests."""
    fd = os.open(os.fspath(path), os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


_default: Optional[IoEngine] = None


def default_engine() -> IoEngine:
    """The process's shared engine (made at first use; the engine is thread-safe)."""
    global _default
    if _default is None:
        _default = IoEngine()
    return _default


class SequentialWriter:
    """A new file written front to back through the engine: bytes are copied into aligned
    staging buffers, and each full buffer is written while the next fills (n_buffers in
    flight at most). close() pads the last buffer to IO_ALIGN, truncates the file to the true
    length and fsyncs. Errors of the device come out as OSError naming the file."""

    def __init__(self, path, engine: Optional[IoEngine] = None, buffer_bytes: int = 8 << 20,
                 n_buffers: int = 4, direct: bool = True):
        self.engine = engine or default_engine()
        # a file that cannot be made (its directory absent, no permission, no space) is an
        # error of the device too: the callers' `except OSError` takes it (a rank's
        # save_checkpoint that raised another type alone left its peers waiting)
        self.path = os.fspath(path)
        self.file = self._engine_call(DirectFile, path, True, True, direct)
        size = max(IO_ALIGN, buffer_bytes // IO_ALIGN * IO_ALIGN)
        self._buffers = [aligned_empty(size) for _ in range(n_buffers)]
        self._views = [memoryview(b.numpy()) for b in self._buffers]
        self._tickets: list = [None] * n_buffers
        self._k = 0       # the buffer filling now
        self._fill = 0    # bytes in it
        self._offset = 0  # file offset of its first byte
        self.bytes = 0    # bytes written so far (the file's length)

    def _engine_call(self, fn, *args):
        try:
            return fn(*args)
        except (RuntimeError, ValueError, IndexError) as exc:
            raise OSError(errno.EIO, f"{self.path}: {exc}") from None

    def _flush(self, nbytes: int) -> None:
        """Writes buffer k's first nbytes (a multiple of IO_ALIGN) and moves to the next."""
        k = self._k
        buf = self._buffers[k][:nbytes]
        self._tickets[k] = self._engine_call(self.engine.write, self.file, buf, self._offset)
        self._offset += nbytes
        self._k = (k + 1) % len(self._buffers)
        self._fill = 0
        pending = self._tickets[self._k]
        if pending is not None:  # the next buffer's last write must be done before reuse
            self._tickets[self._k] = None
            self._engine_call(self.engine.wait, pending)

    def write(self, view: memoryview) -> None:
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        size = len(self._views[0])
        while len(view):
            take = min(len(view), size - self._fill)
            self._views[self._k][self._fill:self._fill + take] = view[:take]
            self._fill += take
            self.bytes += take
            view = view[take:]
            if self._fill == size:
                self._flush(size)

    def close(self, fsync: bool = True) -> int:
        try:
            if self._fill:
                tail = self._fill
                padded = -(-tail // IO_ALIGN) * IO_ALIGN
                self._views[self._k][tail:padded] = bytes(padded - tail)
                self._flush(padded)
            for k, t in enumerate(self._tickets):
                if t is not None:
                    self._tickets[k] = None
                    self._engine_call(self.engine.wait, t)
            self.file.truncate(self.bytes)  # the padding of the last block goes
            if fsync:
                self.file.fsync()
        finally:
            self.abort()
        return self.bytes

    def abort(self) -> None:
        """Closes the file, waiting for the writes in flight (their errors are dropped)."""
        for k, t in enumerate(self._tickets):
            if t is not None:
                self._tickets[k] = None
                try:
                    self.engine.wait(t)
                except (RuntimeError, ValueError, IndexError):
                    pass
        self.file.close()
