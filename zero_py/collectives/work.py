"""Work: a collective in flight, the one handle every executor returns.

An executor's calls are asynchronous; the caller decides when to wait, so reductions overlap
with backward and gathers with compute. wait() makes the result usable by the caller: for
torch.distributed work it blocks the host until the collective is done; for the native NCCL
executor it makes the caller's current CUDA stream wait (the host does not). A follow-up
(`then`, e.g. summing a received chunk) runs once, at the first wait().

Every Work says what it is (`what`: "all-gather of unit 'blocks.1' (bucket 3)"): executors give
a default, callers that know the unit or bucket name it (named()). When the collective fails
(a peer died, raised and stopped answering until the group's timeout, or issued other
collectives) wait() raises CollectiveError, a RuntimeError whose text says which operation this
rank was waiting for and why it gave up; a later wait() raises the same error again.
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol, Sequence


class CollectiveError(RuntimeError):
    """A collective that did not complete on this rank: `what` it was, `reason` (the
    transport's error: a timeout, a closed connection, a peer found dead)."""

    def __init__(self, what: str, reason):
        if isinstance(reason, CollectiveError):
            reason = reason.reason  # named again by a caller that knows more: one layer
        self.what, self.reason = what, str(reason)
        super().__init__(
            f"zero_py: {what} did not complete: {self.reason}. A peer rank died, raised and "
            "stopped taking part, or ran other collectives than this rank (every rank must run "
            "the same forwards, backwards and steps); this rank gave up after the process "
            "group's timeout or as soon as the peer was found gone")


def issue(what: str, fn: Callable, *args) -> "Work":
    """fn(*args), a call that starts a collective, as a Work named `what`; an error raised while
    starting it becomes a CollectiveError naming `what` too."""
    try:
        work = fn(*args)
    except RuntimeError as exc:
        raise CollectiveError(what, exc) from exc
    return named(work, what)


def named(work, what: str) -> "Work":
    """`work` (a Work, or any handle with wait() that an executor object of the caller's
    returned) as a Work named `what`."""
    if not isinstance(work, Work):
        work = Work(work)
    work.what = what
    return work


class Handle(Protocol):
    """What Work wraps: a torch.distributed Work, an NCCL stream handle, several of them."""

    def wait(self) -> None: ...

    def is_completed(self) -> bool: ...


class Work:
    """A collective in flight: wait() finishes it for the caller and runs the follow-up once;
    is_completed() asks without blocking; synchronize() also blocks the host (NCCL)."""

    __slots__ = ("_handle", "_then", "_keep", "_error", "what")

    def __init__(self, handle: Optional[Handle] = None,
                 then: Optional[Callable[[], None]] = None, keep: tuple = (),
                 what: str = "a collective"):
        self._handle = handle
        self._then = then
        self._keep = keep  # tensors the collective reads or writes, alive until wait()
        self._error: Optional[CollectiveError] = None
        self.what = what

    def is_completed(self) -> bool:
        if self._error is not None:
            return True
        try:
            return self._handle is None or self._handle.is_completed()
        except RuntimeError as exc:  # the transport failed: wait() raises it
            self._error = CollectiveError(self.what, exc)
            return True

    def named(self, what: str) -> "Work":
        self.what = what
        return self

    def wait(self) -> None:
        if self._error is not None:
            raise self._error
        try:
            if self._handle is not None:
                self._handle.wait()
                self._handle = None
                self._keep = ()
            if self._then is not None:
                then, self._then = self._then, None
                then()
        except RuntimeError as exc:
            self._handle, self._then, self._keep = None, None, ()
            self._error = CollectiveError(self.what, exc)
            raise self._error from exc

    def synchronize(self) -> None:
        """wait(), with the host blocked until the collective finished (for work that wait()
        only orders on a stream)."""
        sync = getattr(self._handle, "synchronize", None)
        if sync is not None:
            sync()
        self.wait()


class AllOf:
    """Several handles as one: wait() waits for them all, in order. `timeout` (a timedelta, or
    None) is handed to each torch.distributed handle's wait: the group's timeout as it is now,
    which gloo's point-to-point waits would otherwise take from when the group connected."""

    __slots__ = ("_handles", "_timeout")

    def __init__(self, handles: Sequence[Handle], timeout=None):
        self._handles = list(handles)
        self._timeout = timeout

    def is_completed(self) -> bool:
        return all(h.is_completed() for h in self._handles)

    def wait(self) -> None:
        for h in self._handles:
            if self._timeout is not None:
                h.wait(self._timeout)
            else:
                h.wait()
        self._handles = []

