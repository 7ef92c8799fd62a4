"""The ranks' agreement on the order of the units (a mixin of zero_py/stage3/engine.py): each
rank's first uses of the units at the end of a backward ride on the next Count of its reducer
(sharding/riders.py); every rank merges the delivered rows into one order (merge_orders) at its
next forward, and keeps gathered from forward to backward the last units of that order that fit
in the prefetch budget."""

from __future__ import annotations

from typing import List, Optional, Set

import torch


def merge_orders(rows: List[List[int]], n_units: int) -> List[int]:
    """One order of the units consistent with every rank's sequence of first uses (`rows`: per
    rank, its length then the unit ids), the same on every rank: a topological order of "u came
    right before v on some rank", the lowest unit id first among the units free to go (units no
    rank used take their module order). Where ranks disagree (a cycle), the lowest id of what
    is left goes next; the ranks that used the units otherwise then gather them on their own."""
    after: List[Set[int]] = [set() for _ in range(n_units)]
    before = [0] * n_units
    for row in rows:
        seq = row[1:1 + row[0]]
        for a, b in zip(seq, seq[1:]):
            if b not in after[a] and a != b:
                after[a].add(b)
                before[b] += 1
    order: List[int] = []
    done = [False] * n_units
    while len(order) < n_units:
        free = [u for u in range(n_units) if not done[u] and before[u] == 0]
        u = free[0] if free else next(v for v in range(n_units) if not done[v])
        done[u] = True
        order.append(u)
        for v in after[u]:
            before[v] -= 1
    return order


class OrderAgreement:
    """Needs the engine's units, prefetch, reshard_after_forward, _budget, _unit_bytes and the
    _order_seen, _order_carried and _order_rows it sets up."""

    def _set_order(self, order: List[int]) -> None:
        self.prefetch.set_order(order)
        self._order = list(order)

    def _set_keep(self, keep: List[bool]) -> None:
        self.prefetch.set_keep(keep)
        self._keep = list(keep)

    def _order_fill(self) -> Optional[torch.Tensor]:
        self._order_carried = self._order_seen
        if self._order_seen is None:
            return None
        return torch.tensor([len(self._order_seen)] + self._order_seen, dtype=torch.int64)

    def _order_deliver(self, rows: torch.Tensor) -> None:
        """Every rank's first uses (a rank without any: a zero row), as the Count that carried
        them passed its checks on every rank alike."""
        self._order_rows = rows.tolist()
        if self._order_seen is self._order_carried:
            self._order_seen = None

    def _apply_order(self) -> None:
        """The order merged from the last delivered first uses, on every rank alike."""
        if self._order_rows is not None:
            rows, self._order_rows = self._order_rows, None
            order = merge_orders(rows, len(self.units))
            used = {u for row in rows for u in row[1:1 + row[0]]}
            self._set_order(order)
            if self.reshard_after_forward:
                # the last units of the forward are the first of the backward: keep them
                # gathered in between rather than free them and gather them again at once.
                # The last one always (it is resident there anyway, next to the unit before
                # or after it), and the ones before it while they fit in what the prefetch
                # budget lets backward hold beside the root (by default the root plus two
                # units: the last two), so the peak stays the budget's
                n = len(self.units)
                keep = [u == 0 for u in range(n)]
                room = self._budget - self._unit_bytes[0]
                for k in reversed([k for k in order if k != 0 and k in used]):
                    if any(keep[1:]) and self._unit_bytes[k] > room:
                        break
                    keep[k] = True
                    room -= self._unit_bytes[k]
                self._set_keep(keep)
