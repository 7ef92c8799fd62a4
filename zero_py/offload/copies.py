"""The copy queue between the device and the host memory of an offloaded optimizer: copies run
beside the caller, in submission order, and each returns a handle to wait on.

CUDA: one copy stream. A copy first waits (by an event) for the work already queued on the
caller's current stream, which produced its source; its handle is an event recorded after it.
The host waits on the handle before it reads a host destination; the current stream waits on it
before it reads a device destination. Host buffers are pinned, so the copies are asynchronous.

CPU (the "device" is host memory: every CPU run, and the test suite): one worker thread. torch's
copy releases the GIL, so a copy runs beside the optimizer kernel's threads and beside backward.
The queue is FIFO: two copies into the same destination land in submission order.
"""

from __future__ import annotations

import concurrent.futures
import threading
from typing import Optional

import torch


class Copy:
    """A submitted copy: wait() returns once its destination holds the values (host side), or
    once the current stream is ordered after it (a device destination)."""

    __slots__ = ("_future", "_event")

    def __init__(self, future: Optional[concurrent.futures.Future] = None, event=None):
        self._future, self._event = future, event

    def wait(self) -> None:
        if self._future is not None:
            self._future.result()  # re-raises the copy's own error here, in the caller
        elif self._event is not None:
            self._event.synchronize()

    def order_device(self) -> None:
        """Makes the current CUDA stream wait for the copy (no host wait); on the CPU, waits."""
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)
        else:
            self.wait()


DONE = Copy()  # a handle with nothing to wait for


class CopyQueue:
    """Copies between `device` and host memory, in order, beside the caller."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._pool: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._lock = threading.Lock()

    def submit(self, dst: torch.Tensor, src: torch.Tensor) -> Copy:
        """dst.copy_(src), after the current stream's queued work (CUDA) or on the copy thread."""
        if self._stream is not None:
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                dst.copy_(src, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._stream)
            # the caller's tensors must outlive the copy: the caching allocator is told that the
            # copy stream uses them (a device tensor freed early would be reused under it)
            for t in (dst, src):
                if t.is_cuda:
                    t.record_stream(self._stream)
            return Copy(event=event)
        with self._lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="zero_py-offload-copy")
        return Copy(future=self._pool.submit(_copy, dst, src))

    def close(self) -> None:
        """Waits for the copies in flight and stops the copy thread (a later submit starts it
        again)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        if self._stream is not None:
            self._stream.synchronize()


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    with torch.no_grad():
        dst.copy_(src)
