"""Work: a collective in flight, the one handle every executor returns.

An executor's calls are asynchronous; the caller decides when to wait, so reductions overlap
with backward and gathers with compute. wait() makes the result usable by the caller: for
torch.distributed work it blocks the host until the collective is done; for the native NCCL
executor it makes the caller's current CUDA stream wait (the host does not). A follow-up
(`then`, e.g. summing a received chunk) runs once, at the first wait().
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol, Sequence


class Handle(Protocol):
    """What Work wraps: a torch.distributed Work, an NCCL stream handle, several of them."""

    def wait(self) -> None: ...

    def is_completed(self) -> bool: ...


class Work:
    """A collective in flight: wait() finishes it for the caller and runs the follow-up once;
    is_completed() asks without blocking; synchronize() also blocks the host (NCCL)."""

    __slots__ = ("_handle", "_then", "_keep")

    def __init__(self, handle: Optional[Handle] = None,
                 then: Optional[Callable[[], None]] = None, keep: tuple = ()):
        self._handle = handle
        self._then = then
        self._keep = keep  # tensors the collective reads or writes, alive until wait()

    def is_completed(self) -> bool:
        return self._handle is None or self._handle.is_completed()

    def wait(self) -> None:
        if self._handle is not None:
            self._handle.wait()
            self._handle = None
            self._keep = ()
        if self._then is not None:
            then, self._then = self._then, None
            then()

    def synchronize(self) -> None:
        """wait(), with the host blocked until the collective finished (for work that wait()
        only orders on a stream)."""
        sync = getattr(self._handle, "synchronize", None)
        if sync is not None:
            sync()
        self.wait()


class AllOf:
    """Several handles as one: wait() waits for them all, in order."""

    __slots__ = ("_handles",)

    def __init__(self, handles: Sequence[Handle]):
        self._handles = list(handles)

    def is_completed(self) -> bool:
        return all(h.is_completed() for h in self._handles)

    def wait(self) -> None:
        for h in self._handles:
            h.wait()
        self._handles = []

