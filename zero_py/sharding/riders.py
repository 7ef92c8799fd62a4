"""Riders: small per-rank data that travels in the columns of the next Count's all-reduce
(sharding/counts.py) instead of an all-reduce of its own.

Each control all-reduce is a round trip every rank waits for (on a GPU a device-to-host copy
that stalls the CPU too), and a step already has a Count at each point where the ranks must
agree (the forward, the backward, the step). So what the ranks only need to exchange by the
next such point rides on it: the mask of the parameters that got a gradient (read by the
step's count) and stage 3's order of first uses (the engine's, read by the next forward).

A Riders holds the slots of one GradReducer, fixed in number and width once training starts
(every Count of a group has the same shape on every rank: a rank one count ahead pairs it with
another count, never with a collective of another size). A slot is [carried, payload...]:
`fill()` gives this rank's payload for the Count being built, or None (the columns stay zero);
once the Count's checks pass on every rank, `deliver(rows)` gets every rank's payload (a rank
that carried nothing gives zeros) wherever some rank carried one. A Count that raises delivers
nothing: a slot that keeps its payload pending sends it again in the next Count.

Adding a slot: add(width, fill, deliver) before the first Count, on every rank alike. Values
must be >= 0 (a Count is a MAX all-reduce of rows that are zero but for their rank's).
"""

from __future__ import annotations

from typing import Callable, List, Optional, Tuple

import torch

# fill() -> this rank's payload (int64, at most `width` values) or None
Fill = Callable[[], Optional[torch.Tensor]]
# deliver(rows): every rank's payload, an int64 CPU tensor of (ranks, width)
Deliver = Callable[[torch.Tensor], None]


class Riders:
    def __init__(self):
        self._slots: List[Tuple[int, int, Fill, Deliver]] = []  # (first column, width, ...)
        self.width = 0  # columns after a Count's own, flags included

    def add(self, width: int, fill: Fill, deliver: Deliver) -> None:
        self._slots.append((self.width, width, fill, deliver))
        self.width += 1 + width

    def payload(self) -> Optional[torch.Tensor]:
        """This rank's columns for a Count being built (None: no slot carries anything)."""
        out = None
        for lo, width, fill, _ in self._slots:
            values = fill()
            if values is None:
                continue
            if values.numel() > width or (values.numel() and int(values.min()) < 0):
                raise RuntimeError(f"zero_py internal: a rider of {values.numel()} values in a "
                                   f"slot of {width}, or a negative one")
            if out is None:
                out = torch.zeros(self.width, dtype=torch.int64)
            out[lo] = 1
            out[lo + 1:lo + 1 + values.numel()] = values
        return out

    def deliver(self, rows: torch.Tensor, listed: List[List[int]]) -> None:
        """After a Count's checks passed: `rows` are its columns past its own, every rank's
        (an int64 CPU tensor of (ranks, width)), `listed` the same as lists."""
        for lo, width, _, deliver in self._slots:
            if any(r[lo] for r in listed):
                deliver(rows[:, lo + 1:lo + 1 + width])


def pack_bytes(flags: bytearray, width: int) -> torch.Tensor:
    """0/1 bytes as int64 values (8 a value; rows are never summed across ranks: each rank
    fills its own row), `width` = words_for(len(flags))."""
    if not width:  # frombuffer takes no empty buffer
        return torch.zeros(0, dtype=torch.int64)
    padded = bytearray(width * 8)
    padded[:len(flags)] = flags
    return torch.frombuffer(padded, dtype=torch.int64)


def unpack_any(rows: torch.Tensor, n: int) -> torch.Tensor:
    """The OR over ranks of pack_bytes' rows: a uint8 tensor of n 0/1 values."""
    return rows.contiguous().view(torch.uint8)[:, :n].amax(0)


def words_for(n: int) -> int:
    return (n + 7) // 8
