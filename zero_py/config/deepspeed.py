"""DeepSpeed configs for zero_py.initialize: `initialize(model, config="ds_config.json")`.

This module reads the config (ds_plan.py: the plan and the readers' primitives; ds_zero.py:
the zero_optimization section); ds_initialize.py applies it. translate(config) reads a
DeepSpeed config (a path to its JSON file, or the dict) into a DeepSpeedPlan: zero_py's options
for every key it honours, and a refusal (the key's dotted path and why) for every key it does
not. Nothing is skipped quietly: with strict=True (the default) any refusal raises one
ValueError listing them all; strict=False turns them into one warning and trains without those
keys. Values that are wrong whatever zero_py supports (a stage of 7, fp16 and bf16 both on,
batch sizes that do not multiply out) always raise.

What each key becomes (docs/tools.md has the full table):

- zero_optimization: stage -> stage; reduce_bucket_size (elements) -> bucket_bytes (stages
  1-2; both bucket sizes must agree: zero_py gathers by the buckets it reduces);
  stage3_param_persistence_threshold + 1 -> persistence_threshold (DeepSpeed: numel <= it);
  the smaller of stage3_prefetch_bucket_size and stage3_max_live_parameters (elements) ->
  prefetch_bytes.
  Keys that state what zero_py always does (contiguous_gradients, reduce_scatter, ...) are
  accepted with that value and refused with the other. offload_optimizer / offload_param with
  device "cpu" -> offload_optimizer="cpu" / offload_params="cpu"; device "nvme" with nvme_path
  -> offload_optimizer="nvme" / offload_params="nvme" and offload_dir=nvme_path (one directory:
  two different nvme_paths are refused).
- optimizer: Adam/AdamW/SGD/Adagrad/Lion -> torch.optim.Adam/AdamW/SGD/Adagrad, zero_py.Lion
  and its params (keys left out take DeepSpeed's defaults); another type, as DeepSpeed does,
  the torch.optim class of that exact name. DeepSpeed's "Adam" decouples weight decay
  (adam_w_mode, default true), so it becomes AdamW unless adam_w_mode is false.
- scheduler: WarmupLR/WarmupDecayLR/WarmupCosineLR/OneCycle -> zero_py.config.schedules (torch LR
  schedulers); another type, as DeepSpeed does, the torch.optim.lr_scheduler class of that
  exact name; stepped after every step that was not skipped, as DeepSpeed's engine does, and
  saved with the optimizer (attached_schedule.py).
- fp16 -> the model cast to float16 and a loss scaler (HysteresisLossScaler: DeepSpeed's
  policy; loss_scale > 0: a static one); bf16 -> the model cast to bfloat16 and, under stages
  1-2 with check_grad_overflow (default true), a static scale of 1: steps whose gradients are
  not finite are skipped, as DeepSpeed's stages 1-2 skip them.
- gradient_clipping -> optimizer.clip_grad_norm_(value) before every step; left out, 1.0
  (DeepSpeed's default since 0.19.3; 0 turns clipping off, as DeepSpeed's default did before).
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

import inspect
import math
from typing import Callable, Dict, Optional

import torch
import torch.distributed as dist

from zero_py.config import schedules
from zero_py.config.ds_plan import (AUTO, ConfigError, DeepSpeedPlan, Refused,
                                    always_refused, apply_section, as_section, flag, is_auto,
                                    load, number, off_only)
from zero_py.config.ds_zero import check_zero, read_zero
from zero_py.config.loss_scaling import HysteresisLossScaler
from zero_py.optim.lion import Lion
from zero_py.optim.loss_scaler import LossScaler

__all__ = ["ConfigError", "DeepSpeedPlan", "load", "translate"]

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "fp16": torch.float16,
           "float16": torch.float16, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
_OPTIMIZERS = {"adam": torch.optim.Adam, "adamw": torch.optim.AdamW, "sgd": torch.optim.SGD,
               "adagrad": torch.optim.Adagrad, "lion": Lion}
# DeepSpeed's own optimizers' defaults where they differ from the zero_py class's (its FusedAdam
# and CPU Adam take weight_decay=0, torch's AdamW 0.01; its Lion lr=1e-3, betas=(0.9, 0.999),
# zero_py's 1e-4 and (0.9, 0.99)): a key the config leaves out trains with DeepSpeed's value.
# With torch_adam: true DeepSpeed builds torch's Adam/AdamW, so torch's defaults hold.
_DS_DEFAULTS = {torch.optim.AdamW: {"weight_decay": 0.0},
                Lion: {"lr": 1e-3, "betas": (0.9, 0.999), "weight_decay": 0.0}}
_SCHEDULERS = {"WarmupLR": schedules.WarmupLR, "WarmupDecayLR": schedules.WarmupDecayLR,
               "WarmupCosineLR": schedules.WarmupCosineLR, "OneCycle": schedules.OneCycle}


# -- optimizer ----------------------------------------------------------------------------------

def _read_optimizer(plan: DeepSpeedPlan, path: str, value) -> None:
    section = as_section(path, value)
    for key in section:
        if key not in ("type", "params"):
            plan.refuse(f"{path}.{key}", "not a key zero_py knows in the optimizer section "
                                         "(it reads type and params)")
    kind = section.get("type")
    if not isinstance(kind, str):
        raise ConfigError(f"{path}.type must name the optimizer, e.g. \"AdamW\"; got {kind!r}")
    params = dict(as_section(f"{path}.params", section.get("params", {})))
    cls = _OPTIMIZERS.get(kind.lower()) or _torch_class(torch.optim, kind,
                                                         torch.optim.Optimizer)
    torch_adam = False
    if cls is None:
        plan.refuse(f"{path}.type", f"{kind!r} has no zero_py counterpart; zero_py maps Adam, "
                                    "AdamW, SGD, Adagrad, Lion and, as DeepSpeed does, any "
                                    "torch.optim class by its exact name (e.g. RMSprop); or "
                                    "pass optimizer_class= to initialize and drop the "
                                    "optimizer section")
        return
    for key in list(params):
        if is_auto(params[key]):
            plan.refuse(f"{path}.params.{key}", AUTO)
            del params[key]
    if cls in (torch.optim.Adam, torch.optim.AdamW):
        adam_w_mode = params.pop("adam_w_mode", True)
        if not isinstance(adam_w_mode, bool):
            raise ConfigError(f"{path}.params.adam_w_mode must be true or false")
        if cls is torch.optim.Adam and adam_w_mode:
            cls = torch.optim.AdamW  # DeepSpeed's Adam decouples weight decay by default
        # same math either way (zero_py's kernel or torch's), but torch's defaults
        torch_adam = params.pop("torch_adam", False)
        if not isinstance(torch_adam, bool):
            raise ConfigError(f"{path}.params.torch_adam must be true or false")
        if params.pop("bias_correction", True) is not True:
            plan.refuse(f"{path}.params.bias_correction",
                        "torch.optim's Adam and AdamW always correct bias; remove it")
        for key in ("fused", "foreach"):
            if key in params:
                params.pop(key)  # torch's implementation choice; zero_py runs its own kernel
    defaults = {} if cls in (torch.optim.Adam, torch.optim.AdamW) and torch_adam else \
        {k: v for k, v in _DS_DEFAULTS.get(cls, {}).items() if k not in params}
    if "betas" in params and isinstance(params["betas"], list):
        params["betas"] = tuple(params["betas"])
    signature = inspect.signature(cls.__init__).parameters
    for key in list(params):
        if key not in signature or key in ("self", "params"):
            plan.refuse(f"{path}.params.{key}", f"{cls.__name__} takes no {key!r}")
            del params[key]
    try:
        cls([torch.zeros(1, requires_grad=True)], **defaults, **params)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{path}.params: {cls.__name__} rejects them: {exc}") from None
    plan.optimizer_class, plan.optimizer_kwargs = cls, params
    plan.optimizer_defaults = defaults


def _torch_class(module, name: str, base: type) -> Optional[type]:
    """DeepSpeed's fallback for a type it does not have itself: getattr(torch.optim, name)
    (or torch.optim.lr_scheduler), the exact name of a class."""
    found = getattr(module, name, None) if not name.startswith("_") else None
    return found if isinstance(found, type) and issubclass(found, base) else None


# -- scheduler ----------------------------------------------------------------------------------

# DeepSpeed's own schedules zero_py does not provide (DeepSpeed looks these up before torch's)
_DS_ONLY_SCHEDULERS = ("LRRangeTest",)
# torch schedulers a JSON config cannot drive: they take a metric in step() or other schedulers
# or functions as arguments
_NOT_FROM_JSON = ("ReduceLROnPlateau", "LambdaLR", "MultiplicativeLR", "SequentialLR",
                  "ChainedScheduler")

def _read_scheduler(plan: DeepSpeedPlan, path: str, value) -> None:
    section = as_section(path, value)
    for key in section:
        if key not in ("type", "params"):
            plan.refuse(f"{path}.{key}", "not a key zero_py knows in the scheduler section "
                                         "(it reads type and params)")
    kind = section.get("type")
    cls = _SCHEDULERS.get(kind) if isinstance(kind, str) else None
    if cls is None and isinstance(kind, str) and kind not in _DS_ONLY_SCHEDULERS \
            and kind not in _NOT_FROM_JSON:
        cls = _torch_class(torch.optim.lr_scheduler, kind, torch.optim.lr_scheduler.LRScheduler)
    if cls is None:
        plan.refuse(f"{path}.type", f"{kind!r} is not one zero_py provides (WarmupLR, "
                                    "WarmupDecayLR, WarmupCosineLR, OneCycle, and as DeepSpeed "
                                    "does a torch.optim.lr_scheduler class by its exact name, "
                                    "but for those a JSON config cannot drive); build the "
                                    "scheduler yourself and drop the section")
        return
    params = dict(as_section(f"{path}.params", section.get("params", {})))
    resume_key = "last_batch_iteration" if cls in _SCHEDULERS.values() else "last_epoch"
    last = params.pop(resume_key, -1)
    if last != -1:
        plan.refuse(f"{path}.params.{resume_key}",
                    "zero_py starts schedules at the beginning; resume with load_checkpoint "
                    "or the optimizer's load_state_dict(), which restore the schedule")
    signature = inspect.signature(cls.__init__).parameters
    for key in list(params):
        if is_auto(params[key]):
            plan.refuse(f"{path}.params.{key}", AUTO)
            del params[key]
        elif key not in signature or key in ("self", "optimizer"):
            plan.refuse(f"{path}.params.{key}", f"{kind} takes no {key!r}")
            del params[key]
    for key in ("total_num_steps", "warmup_num_steps"):
        if key in params:
            params[key] = number(f"{path}.params.{key}", params[key], integer=True)
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
    section = as_section(path, value)
    enabled = section.get("enabled", False)
    if is_auto(enabled):
        plan.refuse(f"{path}.enabled", AUTO)
        return
    if not flag(f"{path}.enabled", enabled):
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
        if flag(f"{path}.auto_cast", section.get("auto_cast", False)):
            plan.refuse(f"{path}.auto_cast", "zero_py does not wrap the forward in autocast; "
                                             "use torch.autocast in the model or the loop")
        if flag(f"{path}.fp16_master_weights_and_grads",
                section.get("fp16_master_weights_and_grads", False)):
            plan.refuse(f"{path}.fp16_master_weights_and_grads",
                        "zero_py keeps fp32 masters of every non-fp32 parameter")
    except Refused as refusal:
        plan.refuse(path, str(refusal))
    try:
        static = number(f"{path}.loss_scale", section.get("loss_scale", 0))
        power = number(f"{path}.initial_scale_power", section.get("initial_scale_power", 16),
                       integer=True)
        window = number(f"{path}.loss_scale_window", section.get("loss_scale_window", 1000),
                        integer=True, minimum=1)
        hysteresis = number(f"{path}.hysteresis", section.get("hysteresis", 2), integer=True,
                            minimum=1)
        consecutive = flag(f"{path}.consecutive_hysteresis",
                           section.get("consecutive_hysteresis", False))
        min_scale = number(f"{path}.min_loss_scale", section.get("min_loss_scale", 1))
    except Refused as refusal:
        plan.refuse(path, str(refusal))
        return
    if static > 0:
        plan.loss_scaler = lambda: LossScaler(init_scale=static, min_scale=min(1.0, static),
                                              dynamic=False)
    else:
        if min_scale == 0:
            # DeepSpeed's scale then halves with no floor: the smallest positive float is one
            min_scale = math.ulp(0.0)
        if min_scale > 2.0**power:
            raise ConfigError(f"{path}.min_loss_scale must be in [0, 2**initial_scale_power], "
                              f"got {min_scale}")
        plan.loss_scaler = lambda: HysteresisLossScaler(
            init_scale=2.0**power, scale_window=window, min_scale=min_scale,
            hysteresis=hysteresis, consecutive_hysteresis=consecutive)


def _read_bf16(plan: DeepSpeedPlan, path: str, value) -> None:
    section = as_section(path, value)
    enabled = section.get("enabled", False)
    for key in section:
        if key not in ("enabled", "check_grad_overflow"):
            plan.refuse(f"{path}.{key}", "not a key zero_py honours in the bf16 section (zero_py "
                                         "keeps fp32 masters and fp32 optimizer states)")
    if "check_grad_overflow" in section:
        try:
            plan.check_grad_overflow = flag(f"{path}.check_grad_overflow",
                                            section["check_grad_overflow"])
        except Refused as refusal:
            plan.refuse(f"{path}.check_grad_overflow", str(refusal))
    if is_auto(enabled):
        plan.refuse(f"{path}.enabled", AUTO)
        return
    if flag(f"{path}.enabled", enabled):
        if plan.dtype is not None:
            raise ConfigError("fp16.enabled and bf16.enabled are both true; enable one")
        plan.dtype = torch.bfloat16


# -- the rest of the top level ------------------------------------------------------------------

def _batch_key(name: str):
    def read(plan, path, value):
        setattr(plan, name, number(path, value, integer=True, minimum=1))
    return read


_DEFAULT_CLIPPING = 1.0


def _SKIP_NONFINITE() -> LossScaler:
    return LossScaler(init_scale=1.0, min_scale=1.0, dynamic=False)


def _clipping(plan, path, value):
    clip = number(path, value)
    plan.gradient_clipping = clip if clip > 0 else None


def _comm_dtype(plan, path, value):
    dtype = _DTYPES.get(str(value).lower()) if isinstance(value, str) else None
    if dtype is None:
        raise ConfigError(f"{path} must be \"fp32\", \"fp16\" or \"bf16\", got {value!r}")
    plan.zero_kwargs["grad_reduce_dtype"] = dtype


def _predivide(plan, path, value):
    if number(path, value) != 1.0:
        raise Refused("zero_py averages gradients over the ranks (divides by the world size "
                      "before reducing); other factors are not implemented")


def _aio(plan, path, value):
    # DeepSpeed's libaio tuning (block_size, queue_depth, thread_count, ...) for its own NVMe
    # swapper; zero_py's NVMe offload streams through its own engine (ZP_OFFLOAD_RING,
    # ZP_OFFLOAD_CHUNK_BYTES), so the section changes nothing, as the offload sections'
    # buffer_count and buffer_size do not, and a ZeRO-Infinity config carries it
    if not isinstance(value, dict):
        raise ConfigError(f"{path} must be a JSON object (DeepSpeed's libaio settings), got "
                          f"{value!r}")


_LOGGING = "zero_py prints and logs nothing itself; log from the training loop, or remove it"

_TOP_KEYS: Dict[str, Callable] = {
    "zero_optimization": read_zero,
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
    "prescale_gradients": lambda plan, path, value: flag(path, value),
    "gradient_predivide_factor": _predivide,
    # zero_py runs any torch.optim class (the fused kernels or the class itself)
    "zero_allow_untested_optimizer": lambda plan, path, value: flag(path, value),
    "zero_force_ds_cpu_optimizer": off_only(
        "zero_py never runs DeepSpeed's CPU Adam: offload_optimizer='cpu' and 'nvme' update "
        "with zero_py's own fused CPU kernels; set it to false or remove it"),
    "steps_per_print": always_refused(_LOGGING),
    "wall_clock_breakdown": off_only(_LOGGING),
    "memory_breakdown": off_only(_LOGGING),
    "dump_state": off_only(_LOGGING),
    "sparse_gradients": off_only("zero_py trains dense gradients only"),
    "amp": off_only("apex AMP is not supported; use the bf16 or fp16 section"),
    "activation_checkpointing": always_refused("use torch.utils.checkpoint in the model; zero_py "
                                               "supports it under every stage"),
    "aio": _aio,
}


def translate(config, world_size: Optional[int] = None, stage: int = 3) -> DeepSpeedPlan:
    """Reads a DeepSpeed config (path or dict) into a DeepSpeedPlan. `world_size` checks the
    batch sizes (default: the world's size when torch.distributed is initialized). `stage`:
    the stage when the config names none (zero_py's default, or the one given initialize)."""
    cfg = load(config)
    plan = DeepSpeedPlan()
    # a feature section switched off has nothing to honour
    apply_section(plan, "", cfg, _TOP_KEYS, lambda value: None
                  if isinstance(value, dict) and value.get("enabled") is False else
                  "not a key zero_py honours (a DeepSpeed feature zero_py does not have, or a "
                  "misspelling); remove it")
    if plan.stage is None:
        plan.stage = stage
    if "gradient_clipping" not in cfg:
        # DeepSpeed's default since 0.19.3 (microsoft/DeepSpeed#8068; 0 before): "0" turns it off
        plan.gradient_clipping = _DEFAULT_CLIPPING
    check_zero(plan)
    if plan.dtype is torch.bfloat16 and plan.check_grad_overflow and plan.stage in (1, 2):
        # DeepSpeed's stages 1-2 skip a bf16 step whose gradients are not finite
        # (bf16.check_grad_overflow, default true since 0.19.3; its stage 3 checks fp16 only):
        # a static scale of 1 skips such steps and scales nothing
        plan.loss_scaler = _SKIP_NONFINITE
    if world_size is None and dist.is_available() and dist.is_initialized():
        world_size = dist.get_world_size()
    _check_batch(plan, world_size, "gradient_accumulation_steps" in cfg)
    return plan



def _check_batch(plan: DeepSpeedPlan, world_size: Optional[int], gas_given: bool) -> None:
    """DeepSpeed's rules: train = micro x accumulation x world; of the three, the one the config
    leaves out is derived from the others (accumulation 1 when two are left out)."""
    train, micro = plan.train_batch_size, plan.train_micro_batch_size_per_gpu
    gas = plan.gradient_accumulation_steps
    if world_size is None:
        return
    if train is not None and micro is not None and not gas_given:
        if train % (micro * world_size) or train < micro * world_size:
            raise ConfigError(
                f"train_batch_size ({train}) must be a multiple of train_micro_batch_size_per_gpu "
                f"({micro}) x world size ({world_size}) = {micro * world_size}: "
                "gradient_accumulation_steps is derived from them; fix one of them")
        plan.gradient_accumulation_steps = train // (micro * world_size)
    elif train is not None and micro is not None:
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
