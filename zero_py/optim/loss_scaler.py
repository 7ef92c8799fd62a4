"""Dynamic loss scaling for fp16 training, built into ZeroOptimizer.

The same policy as torch.amp.GradScaler, so a run matches DDP + GradScaler step for step: the
loss is multiplied by `scale` before backward; a step whose gradients hold an inf or nan (on
any rank: the check is global) is skipped and the scale multiplied by backoff_factor; after
growth_interval steps in a row without overflow the scale is multiplied by growth_factor.
Unlike GradScaler, the scale never falls below min_scale.
"""

from __future__ import annotations

import math


class LossScaler:
    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000,
                 min_scale: float = 1.0, dynamic: bool = True):
        if not (math.isfinite(init_scale) and init_scale > 0):
            raise ValueError(f"init_scale must be a positive finite number, got {init_scale}")
        if not growth_factor > 1.0:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        if not (isinstance(growth_interval, int) and growth_interval >= 1):
            raise ValueError(f"growth_interval must be an int >= 1, got {growth_interval!r}")
        if not 0.0 < min_scale <= init_scale:
            raise ValueError(f"min_scale must be in (0, init_scale], got {min_scale}")
        self.scale = float(init_scale)
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = growth_interval
        self.min_scale = float(min_scale)
        self.dynamic = dynamic
        self.growth_tracker = 0  # steps since the last overflow or growth

    def update(self, found_nonfinite: bool) -> None:
        """After a step: back off on overflow, grow after growth_interval clean steps."""
        if not self.dynamic:
            return
        if found_nonfinite:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.growth_tracker = 0
            return
        self.growth_tracker += 1
        if self.growth_tracker == self.growth_interval:
            self.scale *= self.growth_factor
            self.growth_tracker = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "growth_factor": self.growth_factor, "backoff_factor": self.backoff_factor,
                "growth_interval": self.growth_interval, "min_scale": self.min_scale,
                "dynamic": self.dynamic}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.growth_tracker = int(state["growth_tracker"])
        for key in ("growth_factor", "backoff_factor", "min_scale"):
            setattr(self, key, float(state[key]))
        self.growth_interval = int(state["growth_interval"])
        self.dynamic = bool(state["dynamic"])
