"""The LR scheduler a DeepSpeed config attaches to the optimizer (optimizer.lr_scheduler), in
what the optimizer saves: DeepSpeed's engine saves and restores its scheduler with every
checkpoint, so a run resumed from zero_py.save_checkpoint or from optimizer.state_dict() goes on
with the schedule where it was, not from the warm-up's start.

state_of(opt) is the entry saved ({"class": ..., "state": scheduler.state_dict()}, or None
without a scheduler); check(opt, saved) checks a saved entry against the scheduler this
optimizer has and returns the state to load (None: nothing to load), changing nothing;
load(opt, state) loads it. A saved entry where the optimizer has no scheduler (built without
the config's) is passed over: the saved learning rates are restored with the param groups.
"""

from __future__ import annotations

from typing import Any, Optional

from torch.optim.lr_scheduler import LRScheduler

__all__ = ["check", "load", "scheduler_of", "state_of"]

KEY = "lr_scheduler"


def scheduler_of(opt) -> Optional[LRScheduler]:
    scheduler = getattr(opt, KEY, None)
    return scheduler if isinstance(scheduler, LRScheduler) else None


def state_of(opt) -> Optional[dict]:
    scheduler = scheduler_of(opt)
    if scheduler is None:
        return None
    return {"class": type(scheduler).__name__, "state": scheduler.state_dict()}


def _same_kind(saved: Any, here: Any) -> bool:
    if isinstance(here, bool) or isinstance(saved, bool):
        return type(saved) is type(here)
    if isinstance(here, float):
        return isinstance(saved, (int, float))
    if isinstance(here, (list, tuple)):
        return isinstance(saved, (list, tuple)) and len(saved) == len(here) and \
            all(_same_kind(s, h) for s, h in zip(saved, here))
    return here is None and saved is None or type(saved) is type(here)


def check(opt, saved: Any) -> Optional[dict]:
    """The scheduler state to load from a saved entry (None: nothing to load); ValueError
    naming what does not fit this optimizer's scheduler. Changes nothing."""
    scheduler = scheduler_of(opt)
    if saved is None or scheduler is None:
        return None
    if not isinstance(saved, dict) or not isinstance(saved.get("state"), dict):
        raise ValueError(f"the saved {KEY} entry is {str(saved)[:100]}, not "
                         "{'class': ..., 'state': {...}}")
    name = type(scheduler).__name__
    if saved.get("class") != name:
        raise ValueError(f"it was saved with a {saved.get('class')!r} scheduler, this "
                         f"optimizer's (the config's scheduler section) is {name!r}: use the "
                         "same scheduler section")
    state, here = saved["state"], scheduler.state_dict()
    if set(state) != set(here):
        raise ValueError(f"the saved {name} state has the entries {sorted(state)}, this one "
                         f"{sorted(here)}")
    for key, value in here.items():
        if not _same_kind(state[key], value):
            raise ValueError(f"the saved {name} state's {key!r} is {state[key]!r}, which does "
                             f"not fit this scheduler's ({value!r}): use the same scheduler "
                             "section and param groups")
    return state


def load(opt, state: Optional[dict]) -> None:
    if state is not None:
        scheduler_of(opt).load_state_dict(state)
