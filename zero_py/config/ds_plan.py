"""The plan a DeepSpeed config becomes (DeepSpeedPlan), and the readers its sections share.

deepspeed.py reads the config's top level into a DeepSpeedPlan, ds_zero.py its
zero_optimization section. A reader takes (plan, dotted path, value): it sets the plan's
options, raises Refused for a value zero_py does not honour (the plan records it with the
path), or ConfigError for a value that is wrong whatever zero_py supports.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
import os
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from zero_py.optim.loss_scaler import LossScaler

NO_OFFLOAD = ("zero_py offloads the optimizer and the parameters to 'cpu' or 'nvme'; use one "
             "of them or 'none'")
AUTO = ("'auto' is filled in by Hugging Face's Trainer from its own arguments; zero_py "
       "reads the config as it is: put the value")


class ConfigError(ValueError):
    """A value no setting of zero_py could honour (always raised, strict or not)."""


@dataclasses.dataclass
class DeepSpeedPlan:
    """What a DeepSpeed config asks of zero_py, key by key (see the module docstring)."""

    stage: Optional[int] = None
    optimizer_class: Optional[type] = None
    optimizer_kwargs: Dict[str, Any] = dataclasses.field(default_factory=dict)
    # DeepSpeed's defaults for the optimizer keys the config leaves out (where they differ
    # from the zero_py class's): used unless initialize is given the keyword
    optimizer_defaults: Dict[str, Any] = dataclasses.field(default_factory=dict)
    # zero_py options for initialize / ZeroOptimizer (bucket sizes still in elements here)
    zero_kwargs: Dict[str, Any] = dataclasses.field(default_factory=dict)
    reduce_bucket_numel: Optional[int] = None
    live_numel: Optional[int] = None  # stage-3 prefetch budget, in elements
    dtype: Optional[torch.dtype] = None  # fp16 / bf16: the model is cast to it
    loss_scaler: Optional[Callable[[], LossScaler]] = None
    check_grad_overflow: bool = True  # bf16: skip a step whose gradients are not finite
    gradient_clipping: Optional[float] = None
    gradient_accumulation_steps: int = 1
    train_micro_batch_size_per_gpu: Optional[int] = None
    train_batch_size: Optional[int] = None
    scheduler: Optional[Tuple[type, Dict[str, Any]]] = None
    refusals: List[Tuple[str, str]] = dataclasses.field(default_factory=list)

    def refuse(self, path: str, reason: str) -> None:
        self.refusals.append((path, reason))

    def describe_refusals(self) -> str:
        return "\n".join(f"  {path}: {reason}" for path, reason in self.refusals)


def load(config) -> Dict[str, Any]:
    """The config as a dict: a path to a JSON file, or a dict (copied)."""
    if isinstance(config, dict):
        return copy.deepcopy(config)
    if isinstance(config, (str, os.PathLike)):
        try:
            with open(config) as f:
                data = json.load(f)
        except FileNotFoundError:
            raise FileNotFoundError(f"DeepSpeed config file {os.fspath(config)!r} not found; "
                                    "pass the path of the JSON file or the dict") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"DeepSpeed config {os.fspath(config)!r} is not valid JSON: "
                              f"{exc}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"DeepSpeed config {os.fspath(config)!r} holds a "
                              f"{type(data).__name__}, not a JSON object")
        return data
    raise TypeError(f"config must be a path to a DeepSpeed JSON file or a dict, got "
                    f"{type(config).__name__}")


# -- value readers ------------------------------------------------------------------------------

class Refused(Exception):
    """Raised by a reader for a value zero_py does not honour (becomes a refusal)."""


def is_auto(value) -> bool:
    return isinstance(value, str) and value.strip().lower() == "auto"


def number(path: str, value, *, integer: bool = False, minimum: float = 0.0):
    if is_auto(value):
        raise Refused(AUTO)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ConfigError(f"{path} must be a number, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{path} must be >= {minimum:g}, got {value!r}")
    if integer:
        if value != int(value):
            raise ConfigError(f"{path} must be a whole number, got {value!r}")
        return int(value)
    return float(value)


def flag(path: str, value) -> bool:
    if is_auto(value):
        raise Refused(AUTO)
    if not isinstance(value, bool):
        raise ConfigError(f"{path} must be true or false, got {value!r}")
    return value


def as_section(path: str, value) -> Dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{path} must be a JSON object, got {value!r}")
    return value


def fixed(expected, reason: str):
    """A reader for keys where zero_py has one behaviour: accept that value, refuse others."""
    def read(plan: DeepSpeedPlan, path: str, value) -> None:
        if isinstance(expected, bool):
            given = flag(path, value)
        else:
            if is_auto(value):
                raise Refused(AUTO)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"{path} must be a number, got {value!r}")
            given = value
        if given != expected:
            raise Refused(reason)
    return read


def always_refused(reason: str):
    def read(plan: DeepSpeedPlan, path: str, value) -> None:
        raise Refused(reason)
    return read


def off_only(reason: str):
    """A feature section or flag that is accepted only when switched off."""
    def read(plan: DeepSpeedPlan, path: str, value) -> None:
        if isinstance(value, dict):
            if value.get("enabled") is False:
                return
        elif value is False:
            return
        raise Refused(reason)
    return read


_UNKNOWN = ("not a key zero_py knows (check its spelling against DeepSpeed's config "
            "documentation, or remove it)")


def apply_section(plan: DeepSpeedPlan, prefix: str, section: Dict[str, Any],
                  readers: Dict[str, Callable],
                  unknown: Callable[[Any], Optional[str]] = lambda value: _UNKNOWN) -> None:
    """Runs each key's reader; a key without one is refused for unknown(value) (None: the key
    is passed over)."""
    for key, value in section.items():
        path = f"{prefix}.{key}" if prefix else key
        reader = readers.get(key)
        if reader is None:
            reason = unknown(value)
            if reason is not None:
                plan.refuse(path, reason)
            continue
        try:
            reader(plan, path, value)
        except Refused as refusal:
            plan.refuse(path, str(refusal))
