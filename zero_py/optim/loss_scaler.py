"""Dynamic loss scaling for fp16 training, built into ZeroOptimizer.

The same policy as torch.amp.GradScaler, so a run matches DDP + GradScaler step for step: the
loss is multiplied by `scale` before backward; a step whose gradients hold an inf or nan (on
any rank: the check is global) is skipped and the scale multiplied by backoff_factor; after
growth_interval steps in a row without overflow the scale is multiplied by growth_factor.
Unlike GradScaler, the scale never falls below min_scale.
"""

from __future__ import annotations

import math

_STATE_KEYS = ("scale", "growth_tracker", "growth_factor", "backoff_factor", "growth_interval",
               "min_scale", "dynamic")

class LossScaler:
    """fp16 loss scaling for ZeroOptimizer: ``ZeroOptimizer(..., loss_scaler=LossScaler())``,
    then ``optimizer.scale_loss(loss).backward()`` and ``optimizer.step()``, which skips a step
    whose gradients overflow on any rank (``optimizer.last_step_skipped``) and updates
    ``scale`` by the policy above. ``dynamic=False`` keeps ``init_scale`` fixed (a static
    scale); the state travels in the optimizer's state dicts and checkpoints."""

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
        if not isinstance(dynamic, bool):
            raise TypeError(f"dynamic must be True or False, got {dynamic!r}")
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

    @staticmethod
    def check_state(state) -> dict:
        """A loaded state, checked as the constructor checks its arguments; changes nothing.
        Returns it normalized (floats, ints, a bool)."""
        if not isinstance(state, dict):
            raise ValueError(f"a LossScaler state must be a dict, got {type(state).__name__}")
        lacking = [k for k in _STATE_KEYS if k not in state]
        if lacking:
            raise ValueError(f"the LossScaler state lacks {lacking}: load the dict that "
                             "LossScaler.state_dict() (or the optimizer's state_dict()) returned")
        out = {}
        try:
            for key in ("scale", "growth_factor", "backoff_factor", "min_scale"):
                out[key] = float(state[key])
            for key in ("growth_tracker", "growth_interval"):
                if float(state[key]) != int(state[key]):
                    raise ValueError
                out[key] = int(state[key])
        except (TypeError, ValueError):
            raise ValueError(f"the LossScaler state's {key!r} must be a number, got "
                             f"{state[key]!r}") from None
        if not isinstance(state["dynamic"], bool):
            raise ValueError(f"the LossScaler state's 'dynamic' must be a bool, got "
                             f"{state['dynamic']!r}")
        out["dynamic"] = state["dynamic"]
        checks = [("scale", math.isfinite(out["scale"]) and out["scale"] > 0,
                   "a positive finite number"),
                  ("growth_factor", out["growth_factor"] > 1.0, "> 1"),
                  ("backoff_factor", 0.0 < out["backoff_factor"] < 1.0, "in (0, 1)"),
                  ("growth_interval", out["growth_interval"] >= 1, ">= 1"),
                  ("min_scale", math.isfinite(out["min_scale"]) and out["min_scale"] > 0,
                   "a positive finite number"),
                  ("growth_tracker", 0 <= out["growth_tracker"] < out["growth_interval"],
                   "in [0, growth_interval)")]
        for key, ok, want in checks:
            if not ok:
                raise ValueError(f"the LossScaler state's {key!r} must be {want}, got "
                                 f"{state[key]!r}")
        return out

    def load_state_dict(self, state: dict) -> None:
        """Takes a state from state_dict(), checked first: a bad state (missing keys, a NaN or
        negative scale) is refused and the scaler stays as it was."""
        checked = self.check_state(state)
        for key, value in checked.items():
            setattr(self, key, value)
