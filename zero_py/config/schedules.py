"""DeepSpeed's learning-rate schedules (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle) as
torch LR schedulers, so that a DeepSpeed config's `scheduler` section trains with the same
learning rates.

The step count follows DeepSpeed's: its `last_batch_iteration` is torch's `last_epoch - 1`.
Construction puts the rate of iteration -1 into the optimizer (the warm-up's start: min_lr, or
0 for WarmupCosineLR), as DeepSpeed's constructors do, and each step() advances one iteration.
Warm-up is "log" (rate grows with log(i + 1) / log(W)) or "linear" (i / W); W is at least 2.
"""

from __future__ import annotations

import math
from typing import List, Sequence, Union

import torch
from torch.optim.lr_scheduler import LRScheduler

_WARMUP_TYPES = ("log", "linear")
Rates = Union[float, Sequence[float]]


def _per_group(optimizer: torch.optim.Optimizer, value: Rates, name: str) -> List[float]:
    n = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise ValueError(f"{name} has {len(value)} values for {n} param groups; give one "
                             "value, or one per param group")
        return [float(v) for v in value]
    return [float(value)] * n


def _warmup_steps(steps) -> int:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"warmup_num_steps must be an int >= 0, got {steps!r}")
    return max(2, steps)


def _warmup_type(kind: str) -> str:
    if kind not in _WARMUP_TYPES:
        raise ValueError(f"warmup_type must be 'log' or 'linear', got {kind!r}")
    return kind


class WarmupLR(LRScheduler):
    """From warmup_min_lr to warmup_max_lr over warmup_num_steps steps, then constant.
    warmup_max_lr=None takes each param group's lr."""

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_min_lr: Rates = 0.0,
                 warmup_max_lr: Rates = None, warmup_num_steps: int = 1000,
                 warmup_type: str = "log"):
        if warmup_max_lr is None:
            warmup_max_lr = [g["lr"] for g in optimizer.param_groups]
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self.warmup_num_steps = _warmup_steps(warmup_num_steps)
        self.warmup_type = _warmup_type(warmup_type)
        super().__init__(optimizer)

    def _warmup_gamma(self, it: int) -> float:
        if self.warmup_type == "log":
            return math.log(it + 1) / math.log(self.warmup_num_steps)
        return it / self.warmup_num_steps

    def _gamma(self, it: int) -> float:
        return self._warmup_gamma(it) if it < self.warmup_num_steps else 1.0

    def get_lr(self) -> List[float]:
        it = self.last_epoch - 1  # DeepSpeed's last_batch_iteration
        if it < 0:
            return list(self.min_lrs)
        gamma = self._gamma(it)
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then a linear decay to 0 at total_num_steps."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int,
                 warmup_min_lr: Rates = 0.0, warmup_max_lr: Rates = 0.001,
                 warmup_num_steps: int = 1000, warmup_type: str = "log"):
        if isinstance(total_num_steps, bool) or not isinstance(total_num_steps, int) \
                or total_num_steps < 1:
            raise ValueError(f"total_num_steps must be an int >= 1, got {total_num_steps!r}")
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type)

    def _gamma(self, it: int) -> float:
        if it < self.warmup_num_steps:
            return self._warmup_gamma(it)
        span = max(1.0, float(self.total_num_steps - self.warmup_num_steps))
        return max(0.0, (self.total_num_steps - it) / span)


class WarmupCosineLR(LRScheduler):
    """Each param group's lr times a ratio: from warmup_min_ratio to 1 over warmup_num_steps,
    then a cosine down to cos_min_ratio at total_num_steps, where it stays."""

    def __init__(self, optimizer: torch.optim.Optimizer, total_num_steps: int,
                 warmup_min_ratio: float = 0.0, warmup_num_steps: int = 1000,
                 cos_min_ratio: float = 0.0001, warmup_type: str = "log"):
        if isinstance(total_num_steps, bool) or not isinstance(total_num_steps, int) \
                or total_num_steps < 1:
            raise ValueError(f"total_num_steps must be an int >= 1, got {total_num_steps!r}")
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = float(warmup_min_ratio)
        self.cos_min_ratio = float(cos_min_ratio)
        self.warmup_num_steps = _warmup_steps(warmup_num_steps)
        self.warmup_type = _warmup_type(warmup_type)
        self.org_lrs = [g["lr"] for g in optimizer.param_groups]
        super().__init__(optimizer)

    def ratio(self, it: int) -> float:
        if it < 0:
            return 0.0
        if it < self.warmup_num_steps:
            if self.warmup_type == "log":
                r = math.log(it + 1) / math.log(self.warmup_num_steps)
            else:
                r = it / self.warmup_num_steps
            return self.warmup_min_ratio + r * (1.0 - self.warmup_min_ratio)
        done = it - self.warmup_num_steps + 1
        span = max(1, self.total_num_steps - self.warmup_num_steps)
        progress = min(1.0, done / span)
        cosine = (1.0 + math.cos(math.pi * progress)) / 2.0
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def get_lr(self) -> List[float]:
        r = self.ratio(self.last_epoch - 1)
        return [lr * r for lr in self.org_lrs]


class OneCycle(LRScheduler):
    """DeepSpeed's OneCycle: the rate climbs from cycle_min_lr to cycle_max_lr over
    cycle_first_step_size steps and back over cycle_second_step_size (optionally in stairs),
    then decays as cycle_min_lr / (1 + decay_lr_rate * i / decay_step_size). With
    cycle_momentum and an optimizer that has betas, beta1 moves the other way between
    cycle_max_mom and cycle_min_mom (then grows by decay_mom_rate), and beta2 is set to 0.99,
    as DeepSpeed sets it; without betas (SGD) the momentum is left alone, as there."""

    def __init__(self, optimizer: torch.optim.Optimizer, cycle_min_lr: Rates,
                 cycle_max_lr: Rates, decay_lr_rate: float = 0.0,
                 cycle_first_step_size: int = 2000, cycle_second_step_size: int = None,
                 cycle_first_stair_count: int = 0, cycle_second_stair_count: int = None,
                 decay_step_size: int = 0, cycle_momentum: bool = True,
                 cycle_min_mom: Rates = 0.8, cycle_max_mom: Rates = 0.9,
                 decay_mom_rate: float = 0.0):
        first = float(cycle_first_step_size)
        second = first if cycle_second_step_size is None else float(cycle_second_step_size)
        if not first > 0 or not second >= 0:
            raise ValueError(f"cycle_first_step_size must be > 0 and cycle_second_step_size "
                             f">= 0, got {cycle_first_step_size!r}, {cycle_second_step_size!r}")
        self.first_step_size, self.second_step_size = first, second
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = (cycle_first_stair_count if cycle_second_stair_count is None
                                   else cycle_second_stair_count)
        self.decay_step_size = decay_step_size
        self.min_lrs = _per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        self.decay_lr_rate = float(decay_lr_rate)
        self.skip_lr_decay = math.isclose(decay_step_size, 0) or math.isclose(decay_lr_rate, 0)
        self.cycle_momentum = bool(cycle_momentum) and "betas" in optimizer.defaults
        self.decay_mom_rate = float(decay_mom_rate)
        self.skip_mom_decay = math.isclose(decay_step_size, 0) or math.isclose(decay_mom_rate, 0)
        self.min_moms = [[m, 0.99] for m in _per_group(optimizer, cycle_min_mom, "cycle_min_mom")]
        self.max_moms = [[m, 0.99] for m in _per_group(optimizer, cycle_max_mom, "cycle_max_mom")]
        super().__init__(optimizer)

    def _scale(self, it: int) -> float:
        batch = it + 1
        cycle = math.floor(1 + batch / self.total_size)
        x = 1.0 + batch / self.total_size - cycle
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:
            within = batch % self.total_size
            if within <= self.first_step_size:
                position = within * stairs / self.first_step_size
            else:
                position = (self.total_size - within) * stairs / self.second_step_size
            scale = math.floor(position) / stairs
        return scale

    def get_lr(self) -> List[float]:
        it = self.last_epoch - 1  # DeepSpeed's last_batch_iteration
        if it < 0:
            return list(self.min_lrs)
        if it < self.total_size:
            scale = self._scale(it)
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        factor = 1 + self.decay_lr_rate * (it - self.total_size + 1) / self.decay_step_size
        return [lo / factor for lo in self.min_lrs]

    def _betas(self, it: int) -> List[tuple]:
        if it < 0:
            return [tuple(m) for m in self.min_moms]
        if it < self.total_size:
            scale = self._scale(it)
            return [(hi[0] - (hi[0] - lo[0]) * scale, lo[1])
                    for lo, hi in zip(self.min_moms, self.max_moms)]
        if self.skip_mom_decay:
            return [tuple(m) for m in self.max_moms]
        factor = 1 + self.decay_mom_rate * (it - self.total_size + 1) / self.decay_step_size
        return [(b0 * factor, b1) for b0, b1 in self.max_moms]

    def step(self, epoch=None) -> None:
        super().step(epoch)
        if self.cycle_momentum:
            for group, betas in zip(self.optimizer.param_groups, self._betas(self.last_epoch - 1)):
                group["betas"] = betas
