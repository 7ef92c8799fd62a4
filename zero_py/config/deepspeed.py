"""DeepSpeed configs for zero_py.initialize: `initialize(model, config="ds_config.json")`.

This module reads the config; ds_initialize.py applies it. translate(config) reads a
DeepSpeed config (a path to its JSON file, or the dict) into a DeepSpeedPlan: zero_py's options
for every key it honours, and a refusal (the key's dotted path and why) for every key it does
not. Nothing is skipped quietly: with strict=True (the default) any refusal raises one
ValueError listing them all; strict=False turns them into one warning and trains without those
keys. Values that are wrong whatever zero_py supports (a stage of 7, fp16 and bf16 both on,
batch sizes that do not multiply out) always raise.

What each key becomes (docs/tools.md has the full table):

- zero_optimization: stage -> stage; reduce_bucket_size (elements) -> bucket_bytes (stages
  1-2; both bucket sizes must agree: zero_py gathers by the buckets it reduces);
  stage3_param_persistence_threshold -> persistence_threshold; the smaller of
  stage3_prefetch_bucket_size and stage3_max_live_parameters (elements) -> prefetch_bytes.
  Keys that state what zero_py always does (contiguous_gradients, reduce_scatter, ...) are
  accepted with that value and refused with the other. offload_optimizer / offload_param with
  device "cpu" -> offload_optimizer="cpu" / offload_params="cpu"; device "nvme" with nvme_path
  -> offload_optimizer="nvme" / offload_params="nvme" and offload_dir=nvme_path (one directory:
  two different nvme_paths are refused).
- optimizer: Adam/AdamW/SGD/Adagrad/Lion -> torch.optim.Adam/AdamW/SGD/Adagrad, zero_py.Lion
  and its params. DeepSpeed's "Adam" decouples weight decay (adam_w_mode, default true), so
  it becomes AdamW unless adam_w_mode is false.
- scheduler: WarmupLR/WarmupDecayLR/WarmupCosineLR -> zero_py.config.schedules (torch LR
  schedulers), stepped after every step that was not skipped, as DeepSpeed's engine does.
- fp16 -> the model cast to float16 and a loss scaler (HysteresisLossScaler: DeepSpeed's
  policy; loss_scale > 0: a static one); bf16 -> the model cast to bfloat16.
- gradient_clipping -> optimizer.clip_grad_norm_(value) before every step.
- communication_data_type -> grad_reduce_dtype.
- zero_quantized_weights: true -> quantized_weights="int8"; zero_quantized_gradients: true ->
  quantized_grads="int4" (DeepSpeed's qwZ and qgZ widths; docs/scale-out.md).
- train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps: checked
  against each other and the world size (train = micro * accumulation * world), and given
  back on optimizer.ds_config; the training loop accumulates (see initialize()).

Absent keys: numerics follow DeepSpeed's defaults (adam_w_mode, the loss-scaling constants);
memory and speed knobs not given keep zero_py's defaults.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import json
import math
import os
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from zero_py.config import schedules
from zero_py.config.loss_scaling import HysteresisLossScaler
from zero_py.optim.lion import Lion
from zero_py.optim.loss_scaler import LossScaler

__all__ = ["ConfigError", "DeepSpeedPlan", "load", "translate"]

_NO_OFFLOAD = ("zero_py offloads the optimizer and the parameters to 'cpu' or 'nvme'; use one "
               "of them or 'none'")
_AUTO = ("'auto' is filled in by Hugging Face's Trainer from its own arguments; zero_py "
         "reads the config as it is: put the value")
_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16,
           "float16": torch.float16, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
_OPTIMIZERS = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD,
               "adagrad": torch.optim.Adagrad, "lion": Lion}
_SCHEDULERS = {"WarmupLR": schedules.WarmupLR, "WarmupDecayLR": schedules.WarmupDecayLR,
               "WarmupCosineLR": schedules.WarmupCosineLR}


class ConfigError(ValueError):
    """A value no setting of zero_py could honour (always raised, strict or not)."""


@dataclasses.dataclass
class DeepSpeedPlan:
    """What a DeepSpeed config asks of zero_py, key by key (see the module docstring)."""

    stage: Optional[int] = None
    optimizer_class: Optional[type] = None
    optimizer_kwargs: Dict[str, Any] = dataclasses.field(default_factory=dict)
    # zero_py options for initialize / ZeroOptimizer (bucket sizes still in elements here)
    zero_kwargs: Dict[str, Any] = dataclasses.field(default_factory=dict)
    reduce_bucket_numel: Optional[int] = None
    live_numel: Optional[int] = None  # stage-3 prefetch budget, in elements
    dtype: Optional[torch.dtype] = None  # fp16 / bf16: the model is cast to it
    loss_scaler: Optional[Callable[[], LossScaler]] = None
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

class _Refused(Exception):
    """Raised by a reader for a value zero_py does not honour (becomes a refusal)."""


def _is_auto(value) -> bool:
    return isinstance(value, str) and value.strip().lower() == "auto"


def _number(path: str, value, *, integer: bool = False, minimum: float = 0.0):
    if _is_auto(value):
        raise _Refused(_AUTO)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        raise ConfigError(f"{path} must be a number, got {value!r}")
    if value < minimum:
        raise ConfigError(f"{path} must be >= {minimum:g}, got {value!r}")
    if integer:
        if value != int(value):
            raise ConfigError(f"{path} must be a whole number, got {value!r}")
        return int(value)
    return float(value)


def _flag(path: str, value) -> bool:
    if _is_auto(value):
        raise _Refused(_AUTO)
    if not isinstance(value, bool):
        raise ConfigError(f"{path} must be true or false, got {value!r}")
    return value


def _section(path: str, value) -> Dict[str, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{path} must be a JSON object, got {value!r}")
    return value


def _fixed(expected, reason: str):
    """A reader for keys where zero_py has one behaviour: accept that value, refuse others."""
    def read(plan: DeepSpeedPlan, path: str, value) -> None:
        if isinstance(expected, bool):
            given = _flag(path, value)
        else:
            if _is_auto(value):
                raise _Refused(_AUTO)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"{path} must be a number, got {value!r}")
            given = value
        if given != expected:
            raise _Refused(reason)
    return read


def _refuse(reason: str):
    def read(plan: DeepSpeedPlan, path: str, value) -> None:
        raise _Refused(reason)
    return read


def _off_only(reason: str):
    """A feature section or flag that is accepted only when switched off."""
    def read(plan: DeepSpeedPlan, path: str, value) -> None:
        if isinstance(value, dict):
            if value.get("enabled") is False:
                return
        elif value is False:
            return
        raise _Refused(reason)
    return read


def _apply_section(plan: DeepSpeedPlan, prefix: str, section: Dict[str, Any],
                   readers: Dict[str, Callable]) -> None:
    for key, value in section.items():
        path = f"{prefix}.{key}" if prefix else key
        reader = readers.get(key)
        if reader is None:
            plan.refuse(path, "not a key zero_py knows (check its spelling against DeepSpeed's "
                              "config documentation, or remove it)")
            continue
        try:
            reader(plan, path, value)
        except _Refused as refusal:
            plan.refuse(path, str(refusal))


# -- zero_optimization --------------------------------------------------------------------------

def _stage(plan, path, value):
    stage = _number(path, value, integer=True)
    if stage == 0:
        raise _Refused("stage 0 is plain data parallelism, not ZeRO: use DDP, or stage 1-3")
    if stage not in (1, 2, 3):
        raise ConfigError(f"{path} must be 0, 1, 2 or 3, got {value!r}")
    plan.stage = stage


def _reduce_bucket(plan, path, value):
    plan.reduce_bucket_numel = max(1, _number(path, value, integer=True))


def _allgather_bucket(plan, path, value):
    plan.zero_kwargs["_allgather_bucket_numel"] = max(1, _number(path, value, integer=True))


def _overlap(plan, path, value):
    plan.zero_kwargs["_overlap_comm"] = _flag(path, value)


def _persistence(plan, path, value):
    plan.zero_kwargs["persistence_threshold"] = _number(path, value, integer=True)


def _prefetch_bucket(plan, path, value):
    numel = _number(path, value, integer=True)
    plan.live_numel = numel if plan.live_numel is None else min(plan.live_numel, numel)


def _offload(plan, path, value):
    section = _section(path, value)
    device = section.get("device", "none")
    if _is_auto(device):
        plan.refuse(f"{path}.device", _AUTO)
    elif device == "cpu":
        key = "offload_optimizer" if path.endswith("offload_optimizer") else "offload_params"
        plan.zero_kwargs[key] = "cpu"
        if section.get("pin_memory", True) is not True:
            plan.refuse(f"{path}.pin_memory", "zero_py always pins the host buffers of a GPU "
                                              "run (asynchronous copies need it); set it to "
                                              "true or remove it")
        ratio = section.get("ratio", 1.0)
        if ratio != 1.0:
            plan.refuse(f"{path}.ratio", f"{ratio!r}: zero_py offloads the whole optimizer "
                                         "(ratio 1.0), not a part of it")
    elif device == "nvme":
        key = "offload_optimizer" if path.endswith("offload_optimizer") else "offload_params"
        nvme_path = section.get("nvme_path")
        earlier = plan.zero_kwargs.get("offload_dir")
        if not isinstance(nvme_path, str) or not nvme_path:
            plan.refuse(f"{path}.device", "'nvme' needs nvme_path: the directory on the drive "
                                          "for the offload files")
        elif earlier is not None and earlier != nvme_path:
            plan.refuse(f"{path}.nvme_path", f"{nvme_path!r}: zero_py keeps the optimizer's "
                                             f"and the parameters' files in one offload_dir, "
                                             f"and the other section gives {earlier!r}; give "
                                             "both the same nvme_path")
        else:
            plan.zero_kwargs[key] = "nvme"
            plan.zero_kwargs["offload_dir"] = nvme_path
    elif device not in ("none", None):
        plan.refuse(f"{path}.device", f"{device!r}: {_NO_OFFLOAD}")
    # with device "none" the other keys (pin_memory, nvme_path, buffer_count, ...) configure an
    # offload that does not happen, in DeepSpeed as here; with "cpu" the NVMe ones likewise


def _legacy_offload(plan, path, value, key):
    """DeepSpeed's older flags (cpu_offload, cpu_offload_params): true is the "cpu" device."""
    if _flag(path, value):
        plan.zero_kwargs[key] = "cpu"


def _quantized(option: str, kind: str):
    """A ZeRO++ switch (true/false) as initialize's option: DeepSpeed's qwZ is int8, its qgZ
    int4 (initialize's quantized_grads="int8" has no DeepSpeed key)."""
    def read(plan, path, value):
        if _flag(path, value):
            plan.zero_kwargs[option] = kind
    return read


_ZERO_KEYS: Dict[str, Callable] = {
    "stage": _stage,
    "reduce_bucket_size": _reduce_bucket,
    "allgather_bucket_size": _allgather_bucket,
    "overlap_comm": _overlap,
    "stage3_param_persistence_threshold": _persistence,
    "param_persistence_threshold": _persistence,
    "stage3_prefetch_bucket_size": _prefetch_bucket,
    "prefetch_bucket_size": _prefetch_bucket,
    "stage3_max_live_parameters": _prefetch_bucket,
    "max_live_parameters": _prefetch_bucket,
    "offload_optimizer": _offload,
    "offload_param": _offload,
    "contiguous_gradients": _fixed(True, "zero_py always copies gradients into contiguous "
                                         "bucket buffers; set it to true or remove it"),
    "reduce_scatter": _fixed(True, "zero_py always reduce-scatters gradients; set it to true "
                                   "or remove it"),
    "allgather_partitions": _fixed(True, "zero_py always all-gathers the updated "
                                         "partitions; set it to true or remove it"),
    "ignore_unused_parameters": _fixed(True, "zero_py always skips parameters no rank used, "
                                             "as torch.optim does; set it to true or remove it"),
    "round_robin_gradients": _fixed(False, "zero_py does not reorder gradient partitions"),
    "load_from_fp32_weights": _fixed(True, "zero_py restores fp32 masters from the optimizer "
                                           "state dict when it carries them"),
    "elastic_checkpoint": _fixed(False, "elastic checkpoints are DeepSpeed's format; zero_py "
                                        "loads a consolidated optimizer state dict at any "
                                        "world size"),
    "stage3_gather_16bit_weights_on_model_save": _fixed(
        True, "under stage 3 zero_py's model.state_dict() always gathers full weights"),
    "stage3_gather_fp16_weights_on_model_save": _fixed(
        True, "under stage 3 zero_py's model.state_dict() always gathers full weights"),
    "gather_16bit_weights_on_model_save": _fixed(
        True, "under stage 3 zero_py's model.state_dict() always gathers full weights"),
    "sub_group_size": lambda plan, path, value: _number(path, value),  # see docs/tools.md
    "stage3_max_reuse_distance": _refuse(
        "zero_py keeps units for reuse within the prefetch budget "
        "(stage3_max_live_parameters), not by reuse distance; remove it"),
    "max_reuse_distance": _refuse(
        "zero_py keeps units for reuse within the prefetch budget "
        "(stage3_max_live_parameters), not by reuse distance; remove it"),
    "cpu_offload": lambda plan, path, value: _legacy_offload(plan, path, value,
                                                             "offload_optimizer"),
    "cpu_offload_params": lambda plan, path, value: _legacy_offload(plan, path, value,
                                                                    "offload_params"),
    "cpu_offload_use_pin_memory": lambda plan, path, value: _flag(path, value),
    "memory_efficient_linear": _fixed(False, "zero_py uses torch's own nn.Linear; set it to "
                                             "false or remove it"),
    "zero_quantized_weights": _quantized("quantized_weights", "int8"),
    "zero_quantized_nontrainable_weights": _off_only(
        "zero_py has no separate switch for frozen weights: under stage 3, "
        "zero_quantized_weights quantizes the gathers of frozen parameters too"),
    "zero_quantized_gradients": _quantized("quantized_grads", "int4"),
    "zero_hpz_partition_size": _fixed(1, "hierarchical partitioning (ZeRO++ hpZ) is not "
                                         "implemented"),
    "mics_shard_size": lambda plan, path, value: _mics_shard_size(plan, path, value),
    "use_multi_rank_bucket_allreduce": _fixed(True, "zero_py reduce-scatters; it has no "
                                                    "multi-rank all-reduce mode"),
}


def _mics_shard_size(plan: DeepSpeedPlan, path: str, value) -> None:
    """MiCS shards inside groups of mics_shard_size ranks and replicates across them: zero_py's
    hybrid sharding when a group is one node (hybrid="node"); -1 or the world size: plain."""
    if value == -1 and not isinstance(value, bool):
        return
    size = _number(path, value, integer=True, minimum=1)
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else None
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if size == world:
        return
    if local is not None and local.isdigit() and size == int(local):
        plan.zero_kwargs["hybrid"] = "node"
        return
    raise _Refused(f"zero_py's hybrid sharding from a config shards inside one node: "
                   f"mics_shard_size must be -1, the world size ({world}) or the ranks per node "
                   f"(LOCAL_WORLD_SIZE={local}); for other shard groups drop the key and pass "
                   "process_group= and replicate_group= to zero_py.initialize")


def _read_zero(plan: DeepSpeedPlan, path: str, value) -> None:
    section = _section(path, value)
    _apply_section(plan, path, section, _ZERO_KEYS)


# -- optimizer ----------------------------------------------------------------------------------

def _read_optimizer(plan: DeepSpeedPlan, path: str, value) -> None:
    section = _section(path, value)
    for key in section:
        if key not in ("type", "params"):
            plan.refuse(f"{path}.{key}", "not a key zero_py knows in the optimizer section "
                                         "(it reads type and params)")
    kind = section.get("type")
    if not isinstance(kind, str):
        raise ConfigError(f"{path}.type must name the optimizer, e.g. \"AdamW\"; got {kind!r}")
    params = dict(_section(f"{path}.params", section.get("params", {})))
    cls = _OPTIMIZERS.get(kind.lower())
    if cls is None:
        plan.refuse(f"{path}.type", f"{kind!r} has no zero_py counterpart; zero_py maps Adam, "
                                    "AdamW, SGD, Adagrad and Lion (or pass optimizer_class= to "
                                    "initialize and drop the optimizer section)")
        return
    for key in list(params):
        if _is_auto(params[key]):
            plan.refuse(f"{path}.params.{key}", _AUTO)
            del params[key]
    if cls in (torch.optim.Adam, torch.optim.AdamW):
        adam_w_mode = params.pop("adam_w_mode", True)
        if not isinstance(adam_w_mode, bool):
            raise ConfigError(f"{path}.params.adam_w_mode must be true or false")
        if cls is torch.optim.Adam and adam_w_mode:
            cls = torch.optim.AdamW  # DeepSpeed's Adam decouples weight decay by default
        params.pop("torch_adam", None)  # same math either way: zero_py's kernel or torch's
        if params.pop("bias_correction", True) is not True:
            plan.refuse(f"{path}.params.bias_correction",
                        "torch.optim's Adam and AdamW always correct bias; remove it")
        for key in ("fused", "foreach"):
            if key in params:
                params.pop(key)  # torch's implementation choice; zero_py runs its own kernel
    if "betas" in params and isinstance(params["betas"], list):
        params["betas"] = tuple(params["betas"])
    signature = inspect.signature(cls.__init__).parameters
    for key in list(params):
        if key not in signature or key in ("self", "params"):
            plan.refuse(f"{path}.params.{key}", f"{cls.__name__} takes no {key!r}")
            del params[key]
    try:
        cls([torch.zeros(1, requires_grad=True)], **params)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{path}.params: {cls.__name__} rejects them: {exc}") from None
    plan.optimizer_class, plan.optimizer_kwargs = cls, params


# -- scheduler ----------------------------------------------------------------------------------

def _read_scheduler(plan: DeepSpeedPlan, path: str, value) -> None:
    section = _section(path, value)
    for key in section:
        if key not in ("type", "params"):
            plan.refuse(f"{path}.{key}", "not a key zero_py knows in the scheduler section "
                                         "(it reads type and params)")
    kind = section.get("type")
    cls = _SCHEDULERS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        plan.refuse(f"{path}.type", f"{kind!r} is not one zero_py provides (WarmupLR, "
                                    "WarmupDecayLR, WarmupCosineLR); build the torch scheduler "
                                    "yourself and drop the section")
        return
    params = dict(_section(f"{path}.params", section.get("params", {})))
    last = params.pop("last_batch_iteration", -1)
    if last != -1:
        plan.refuse(f"{path}.params.last_batch_iteration",
                    "zero_py starts schedules at the beginning; resume by loading the "
                    "scheduler's state_dict()")
    signature = inspect.signature(cls.__init__).parameters
    for key in list(params):
        if _is_auto(params[key]):
            plan.refuse(f"{path}.params.{key}", _AUTO)
            del params[key]
        elif key not in signature or key in ("self", "optimizer"):
            plan.refuse(f"{path}.params.{key}", f"{kind} takes no {key!r}")
            del params[key]
    for key in ("total_num_steps", "warmup_num_steps"):
        if key in params:
            params[key] = _number(f"{path}.params.{key}", params[key], integer=True)
    if "total_num_steps" in signature and "total_num_steps" not in params:
        plan.refuse(f"{path}.params.total_num_steps", f"{kind} needs total_num_steps")
        return
    if not any(isinstance(v, (list, tuple)) for v in params.values()):
        # checked now rather than after the model is sharded (per-group lists are checked
        # against the real param groups when the scheduler is built)
        probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1e-3)
        try:
            cls(probe, **params)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{path}.params: {kind} rejects them: {exc}") from None
    plan.scheduler = (cls, params)


# -- precision ----------------------------------------------------------------------------------

def _read_fp16(plan: DeepSpeedPlan, path: str, value) -> None:
    section = _section(path, value)
    enabled = section.get("enabled", False)
    if _is_auto(enabled):
        plan.refuse(f"{path}.enabled", _AUTO)
        return
    if not _flag(f"{path}.enabled", enabled):
        return  # the other keys configure a mode that is off
    if plan.dtype is not None:
        raise ConfigError("fp16.enabled and bf16.enabled are both true; enable one")
    plan.dtype = torch.float16
    known = {"enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
             "consecutive_hysteresis", "min_loss_scale", "auto_cast",
             "fp16_master_weights_and_grads"}
    for key in section:
        if key not in known:
            plan.refuse(f"{path}.{key}", "not a key zero_py knows in the fp16 section")
    try:
        if _flag(f"{path}.auto_cast", section.get("auto_cast", False)):
            plan.refuse(f"{path}.auto_cast", "zero_py does not wrap the forward in autocast; "
                                             "use torch.autocast in the model or the loop")
        if _flag(f"{path}.fp16_master_weights_and_grads",
                 section.get("fp16_master_weights_and_grads", False)):
            plan.refuse(f"{path}.fp16_master_weights_and_grads",
                        "zero_py keeps fp32 masters of every non-fp32 parameter")
    except _Refused as refusal:
        plan.refuse(path, str(refusal))
    try:
        static = _number(f"{path}.loss_scale", section.get("loss_scale", 0))
        power = _number(f"{path}.initial_scale_power", section.get("initial_scale_power", 16),
                        integer=True)
        window = _number(f"{path}.loss_scale_window", section.get("loss_scale_window", 1000),
                         integer=True, minimum=1)
        hysteresis = _number(f"{path}.hysteresis", section.get("hysteresis", 2), integer=True,
                             minimum=1)
        consecutive = _flag(f"{path}.consecutive_hysteresis",
                            section.get("consecutive_hysteresis", False))
        min_scale = _number(f"{path}.min_loss_scale", section.get("min_loss_scale", 1))
    except _Refused as refusal:
        plan.refuse(path, str(refusal))
        return
    if static > 0:
        plan.loss_scaler = lambda: LossScaler(init_scale=static, min_scale=min(1.0, static),
                                              dynamic=False)
    else:
        if min_scale <= 0 or min_scale > 2.0**power:
            raise ConfigError(f"{path}.min_loss_scale must be in (0, 2**initial_scale_power], "
                              f"got {min_scale}")
        plan.loss_scaler = lambda: HysteresisLossScaler(
            init_scale=2.0**power, scale_window=window, min_scale=min_scale,
            hysteresis=hysteresis, consecutive_hysteresis=consecutive)


def _read_bf16(plan: DeepSpeedPlan, path: str, value) -> None:
    section = _section(path, value)
    enabled = section.get("enabled", False)
    for key in section:
        if key != "enabled":
            plan.refuse(f"{path}.{key}", "not a key zero_py honours in the bf16 section (zero_py "
                                         "keeps fp32 masters and fp32 optimizer states)")
    if _is_auto(enabled):
        plan.refuse(f"{path}.enabled", _AUTO)
        return
    if _flag(f"{path}.enabled", enabled):
        if plan.dtype is not None:
            raise ConfigError("fp16.enabled and bf16.enabled are both true; enable one")
        plan.dtype = torch.bfloat16


# -- the rest of the top level ------------------------------------------------------------------

def _batch_key(name: str):
    def read(plan, path, value):
        setattr(plan, name, _number(path, value, integer=True, minimum=1))
    return read


def _clipping(plan, path, value):
    clip = _number(path, value)
    plan.gradient_clipping = clip if clip > 0 else None


def _comm_dtype(plan, path, value):
    dtype = _DTYPES.get(str(value).lower()) if isinstance(value, str) else None
    if dtype is None:
        raise ConfigError(f"{path} must be \"fp32\", \"fp16\" or \"bf16\", got {value!r}")
    plan.zero_kwargs["grad_reduce_dtype"] = dtype


def _predivide(plan, path, value):
    if _number(path, value) != 1.0:
        raise _Refused("zero_py averages gradients over the ranks (divides by the world size "
                       "before reducing); other factors are not implemented")


_LOGGING = "zero_py prints and logs nothing itself; log from the training loop, or remove it"

_TOP_KEYS: Dict[str, Callable] = {
    "zero_optimization": _read_zero,
    "optimizer": _read_optimizer,
    "scheduler": _read_scheduler,
    "fp16": _read_fp16,
    "bf16": _read_bf16,
    "bfloat16": _read_bf16,
    "gradient_clipping": _clipping,
    "gradient_accumulation_steps": _batch_key("gradient_accumulation_steps"),
    "train_batch_size": _batch_key("train_batch_size"),
    "train_micro_batch_size_per_gpu": _batch_key("train_micro_batch_size_per_gpu"),
    "communication_data_type": _comm_dtype,
    # the average over ranks is the same whether it is divided before or after reducing
    "prescale_gradients": lambda plan, path, value: _flag(path, value),
    "gradient_predivide_factor": _predivide,
    # zero_py runs any torch.optim class (the fused kernels or the class itself)
    "zero_allow_untested_optimizer": lambda plan, path, value: _flag(path, value),
    "zero_force_ds_cpu_optimizer": _off_only(_NO_OFFLOAD),
    "steps_per_print": _refuse(_LOGGING),
    "wall_clock_breakdown": _off_only(_LOGGING),
    "memory_breakdown": _off_only(_LOGGING),
    "dump_state": _off_only(_LOGGING),
    "sparse_gradients": _off_only("zero_py trains dense gradients only"),
    "amp": _off_only("apex AMP is not supported; use the bf16 or fp16 section"),
    "activation_checkpointing": _refuse("use torch.utils.checkpoint in the model; zero_py "
                                        "supports it under every stage"),
    "aio": _refuse(_NO_OFFLOAD + " (aio configures NVMe offload)"),
}


def translate(config, world_size: Optional[int] = None, stage: int = 3) -> DeepSpeedPlan:
    """Reads a DeepSpeed config (path or dict) into a DeepSpeedPlan. `world_size` checks the
    batch sizes (default: the world's size when torch.distributed is initialized). `stage`:
    the stage when the config names none (zero_py's default, or the one given initialize)."""
    cfg = load(config)
    plan = DeepSpeedPlan()
    for key, value in cfg.items():
        reader = _TOP_KEYS.get(key)
        if reader is None:
            if isinstance(value, dict) and value.get("enabled") is False:
                continue  # a feature section switched off: nothing to honour
            plan.refuse(key, "not a key zero_py honours (a DeepSpeed feature zero_py does not "
                             "have, or a misspelling); remove it")
            continue
        try:
            reader(plan, key, value)
        except _Refused as refusal:
            plan.refuse(key, str(refusal))
    if plan.stage is None:
        plan.stage = stage
    _check_zero(plan)
    if world_size is None and dist.is_available() and dist.is_initialized():
        world_size = dist.get_world_size()
    _check_batch(plan, world_size)
    return plan


def _check_zero(plan: DeepSpeedPlan) -> None:
    zk = plan.zero_kwargs
    stage = plan.stage
    gather = zk.pop("_allgather_bucket_numel", None)
    overlap = zk.pop("_overlap_comm", None)
    if stage == 3:
        if plan.reduce_bucket_numel is not None:
            plan.refuse("zero_optimization.reduce_bucket_size",
                        "under stage 3 zero_py reduces each unit's gradients as one bucket "
                        "(wrap_policy sets the unit size); remove it")
            plan.reduce_bucket_numel = None
        if gather is not None:
            plan.refuse("zero_optimization.allgather_bucket_size",
                        "under stage 3 zero_py gathers each unit whole (wrap_policy sets the "
                        "unit size); remove it")
        if overlap is False:
            plan.refuse("zero_optimization.overlap_comm",
                        "under stage 3 zero_py always prefetches and reduces during backward")
    else:
        if gather is not None and gather != (plan.reduce_bucket_numel or gather):
            plan.refuse("zero_optimization.allgather_bucket_size",
                        "zero_py gathers parameters by the same buckets it reduces: set it "
                        "equal to reduce_bucket_size, or remove it")
        if plan.reduce_bucket_numel is None and gather is not None:
            plan.reduce_bucket_numel = gather
        if stage == 2 and overlap is False:
            plan.refuse("zero_optimization.overlap_comm",
                        "stage 2 always reduces gradients during backward in zero_py; set it "
                        "to true or remove it")
        if stage == 1 and overlap is True:
            plan.refuse("zero_optimization.overlap_comm",
                        "stage 1 reduces gradients in step() in zero_py, without overlap; use "
                        "stage 2 to overlap, or set it to false")
        for key, name in (("persistence_threshold", "stage3_param_persistence_threshold"),):
            if key in zk:
                zk.pop(key)
                plan.refuse(f"zero_optimization.{name}", f"applies to stage 3 only (this "
                                                         f"config is stage {stage})")
        if plan.live_numel is not None:
            plan.live_numel = None
            plan.refuse("zero_optimization.stage3_prefetch_bucket_size",
                        f"the stage3_* prefetch settings apply to stage 3 only (this config is "
                        f"stage {stage})")


def _check_batch(plan: DeepSpeedPlan, world_size: Optional[int]) -> None:
    train, micro = plan.train_batch_size, plan.train_micro_batch_size_per_gpu
    gas = plan.gradient_accumulation_steps
    if world_size is None:
        return
    if train is not None and micro is not None:
        if train != micro * gas * world_size:
            raise ConfigError(
                f"train_batch_size ({train}) must equal train_micro_batch_size_per_gpu "
                f"({micro}) x gradient_accumulation_steps ({gas}) x world size "
                f"({world_size}) = {micro * gas * world_size}; fix one of them")
    elif train is not None:
        if train % (gas * world_size):
            raise ConfigError(
                f"train_batch_size ({train}) is not divisible by gradient_accumulation_steps "
                f"({gas}) x world size ({world_size}); fix one of them")
        plan.train_micro_batch_size_per_gpu = train // (gas * world_size)
    elif micro is not None:
        plan.train_batch_size = micro * gas * world_size
