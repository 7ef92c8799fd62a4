"""DeepSpeed's dynamic loss-scaling policy, as a zero_py.LossScaler that ZeroOptimizer drives.

It differs from torch.amp.GradScaler's policy (the base class) in two ways that change which
steps run, so a DeepSpeed config's `fp16` section needs this class to train the same way:

- hysteresis: an overflow lowers the scale only once `hysteresis` overflows have been seen
  since the hysteresis was last refilled (it is refilled when the scale grows, or after every
  clean step with consecutive_hysteresis); the other overflows only skip their step;
- growth: the scale doubles when the number of clean steps since the last overflow (or the
  start), counting the current one, is 1 more than a multiple of loss_scale_window
  (window + 1, 2 * window + 1, ...), where GradScaler doubles at window, 2 * window, ...

Every overflow skips its step, as in DeepSpeed. Unlike DeepSpeed, reaching min_loss_scale does
not stop the run: the scale stays there and overflowing steps go on being skipped.
"""

from __future__ import annotations

from zero_py.optim.loss_scaler import LossScaler


class HysteresisLossScaler(LossScaler):
    def __init__(self, init_scale: float = 2.0**16, scale_window: int = 1000,
                 min_scale: float = 1.0, hysteresis: int = 2,
                 consecutive_hysteresis: bool = False):
        if isinstance(hysteresis, bool) or not isinstance(hysteresis, int) or hysteresis < 1:
            raise ValueError(f"hysteresis must be an int >= 1, got {hysteresis!r}")
        super().__init__(init_scale=init_scale, growth_factor=2.0, backoff_factor=0.5,
                         growth_interval=scale_window, min_scale=min_scale, dynamic=True)
        self.hysteresis = hysteresis
        self.consecutive_hysteresis = bool(consecutive_hysteresis)
        self.hysteresis_left = hysteresis  # overflows still tolerated before a backoff
        self.clean_steps = 0  # clean steps since the last overflow, or the start

    def update(self, found_nonfinite: bool) -> None:
        if found_nonfinite:
            if self.hysteresis_left <= 1:
                self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            else:
                self.hysteresis_left -= 1
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.consecutive_hysteresis:
            self.hysteresis_left = self.hysteresis
        if self.clean_steps > 1 and (self.clean_steps - 1) % self.growth_interval == 0:
            self.hysteresis_left = self.hysteresis
            self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        return {**super().state_dict(), "hysteresis": self.hysteresis,
                "consecutive_hysteresis": self.consecutive_hysteresis,
                "hysteresis_left": self.hysteresis_left, "clean_steps": self.clean_steps}

    @staticmethod
    def check_state(state) -> dict:
        """LossScaler.check_state, with the hysteresis entries where `state` has them (a plain
        LossScaler's state has none: they start afresh). Changes nothing."""
        out = LossScaler.check_state(state)
        for key in ("hysteresis", "hysteresis_left", "clean_steps"):
            if key in state:
                value, least = state[key], 0 if key == "clean_steps" else 1
                if isinstance(value, bool) or not isinstance(value, int) or value < least:
                    raise ValueError(f"the LossScaler state's {key!r} must be an int >= {least}, "
                                     f"got {value!r}")
                out[key] = value
        if "consecutive_hysteresis" in state:
            if not isinstance(state["consecutive_hysteresis"], bool):
                raise ValueError("the LossScaler state's 'consecutive_hysteresis' must be a "
                                 f"bool, got {state['consecutive_hysteresis']!r}")
            out["consecutive_hysteresis"] = state["consecutive_hysteresis"]
        return out

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.hysteresis = int(state.get("hysteresis", self.hysteresis))
        self.consecutive_hysteresis = bool(state.get("consecutive_hysteresis",
                                                     self.consecutive_hysteresis))
        self.hysteresis_left = int(state.get("hysteresis_left", self.hysteresis))
        self.clean_steps = int(state.get("clean_steps", 0))
