"""GradReducer's announcements (a mixin of zero_py/sharding/reducer.py): the Counts
(sharding/counts.py) it sends besides its passes' (the step's, with the param groups' settings
and the used mask riding on it; a stage-3 forward's; a gathered access's), and the check of the
last one, which raises on every rank where the ranks' announcements differ."""

from __future__ import annotations

from typing import Optional

import torch

from zero_py.sharding.counts import EVAL_FORWARD, FORWARD, FORWARD_NO_SYNC, GATHERED, Count
from zero_py.sharding.riders import unpack_any


class Announcements:
    """Needs the reducer's flat, executor, steps, sync_enabled, check_counts, riders,
    hyperparameters, forwards_since_step and the _count, _carry_used and _global_used it
    sets."""

    def _check_count(self) -> None:
        """Raises on every rank if the ranks' last pass or step announcements differ."""
        count, self._count = self._count, None
        if count is not None:
            count.check()

    def _counted(self, kind: int, passes: int) -> Count:
        """The step's Count, with the param groups' settings and the used mask riding on it."""
        self._carry_used = True
        try:
            return Count(self.executor, kind, self.steps, passes, hyper=self.hyperparameters(),
                         riders=self.riders)
        finally:
            self._carry_used = False

    def _take_used(self, rows: torch.Tensor) -> None:
        """The step's count delivers every rank's used mask: 'some rank had a gradient', on
        the host (its readers index it per parameter)."""
        self._global_used = unpack_any(rows, len(self.flat.params))

    def announce_forward(self, eval_forward: bool, problem: Optional[str] = None) -> None:
        """Stage 3, at the start of a forward whose gathers are collective: every rank must be
        starting the same forward (compared now, before any gather). `problem`: why this
        rank refuses it, raised on every rank (the others say which rank refused)."""
        if not self.check_counts:
            if problem is not None:
                raise RuntimeError(problem)
            return
        self._check_count()
        n = self.forwards_since_step + (not eval_forward)
        # a training forward says whether it runs inside no_sync(): the ranks' backwards of it
        # differ in collectives otherwise (its own comparison, counts.py), and no collective is
        # added for it
        kind = (EVAL_FORWARD if eval_forward else FORWARD if self.sync_enabled else
                FORWARD_NO_SYNC)
        self._count = Count(self.executor, kind, self.steps, n, problem, riders=self.riders)
        self._check_count()  # a refused forward is not counted: every rank raised alike
        self.forwards_since_step = n

    def announce_gathered(self, what: str, key: int = 0) -> None:
        """Stage 3, before the collective gathers of a state dict or zero_py.gathered(): every
        rank must be starting one (compared now, before any gather), with the same `key` (what
        it gathers, e.g. a number for its units). A rank whose peers go on to a forward,
        backward or step, or start one with another key, raises with them, naming each rank's
        call; a rank whose peers run no collective of the group raises after its timeout."""
        self._check_count()
        self._count = Count(self.executor, GATHERED, self.steps, key, what=what,
                             riders=self.riders)
        self._check_count()
