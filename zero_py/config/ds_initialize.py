"""zero_py.initialize(model, config=...) for a DeepSpeed config: the config's plan
(deepspeed.translate) merged with the keywords the caller gave, the model cast for fp16/bf16,
and the hooks that do what DeepSpeed's engine does in the loop (clipping before every step, the
scheduler after every step that was not skipped) attached to the optimizer."""

from __future__ import annotations

import inspect
import warnings
from typing import Any, Callable, Dict

import torch
import torch.distributed as dist

from zero_py.config import attached_schedule
from zero_py.config.deepspeed import ConfigError, DeepSpeedPlan, translate

__all__ = ["initialize"]


def _explicit(explicit: Dict[str, Any], defaults: Dict[str, Any]) -> Dict[str, Any]:
    """The keywords the caller gave initialize: those differing from the defaults (stage and
    optimizer_class default to None, so giving them is always seen; a keyword given with its
    default value, e.g. persistence_threshold=0, cannot be told from an absent one)."""
    given = {}
    for key, value in explicit.items():
        default = defaults.get(key, inspect.Parameter.empty)
        if value is not default and not (value is None and default is None):
            if default is inspect.Parameter.empty or value != default \
                    or type(value) is not type(default):
                given[key] = value
    return given


def _conflict(name: str, mine, theirs, path: str) -> ConfigError:
    return ConfigError(f"{name}={mine!r} was given to initialize, but the DeepSpeed config sets "
                       f"{path} to {theirs!r}; give it in one place only")


def initialize(model: torch.nn.Module, config, strict: bool, explicit: Dict[str, Any],
               kwargs: Dict[str, Any], api_initialize: Callable):
    """zero_py.initialize(model, config=...): reads the config, merges it with the keywords
    given explicitly (a keyword the config also sets, with another value, is an error), casts
    the model for fp16/bf16, calls initialize, and attaches what the loop needs:

    - optimizer.lr_scheduler: the config's scheduler (None without one). It is stepped by the
      optimizer after every step that was not skipped (fp16 overflow), as DeepSpeed's engine
      steps it: do not call its step() yourself.
    - gradient_clipping: optimizer.clip_grad_norm_(value) runs at the start of every step().
    - optimizer.ds_config: the DeepSpeedPlan (batch sizes, gradient_accumulation_steps, ...).
      Gradient accumulation is the loop's, as with any torch.optim optimizer: divide the loss
      by gradient_accumulation_steps and call step() once every that many backward passes
      (optimizer.no_sync() saves the reductions of all but the last), which is what
      DeepSpeed's engine.backward() / engine.step() do for it.
    """
    process_group = explicit.get("process_group")
    hybrid = any(explicit.get(k) is not None for k in ("replicate_group", "device_mesh",
                                                        "hybrid"))
    # the batch sizes count every data-parallel rank: under hybrid sharding, every replica's
    world = (dist.get_world_size(None if hybrid else process_group) if dist.is_initialized()
             else None)
    stage = explicit.get("stage")
    plan = translate(config, world, 3 if stage is None else stage)
    if plan.refusals:
        listing = plan.describe_refusals()
        if strict:
            raise ValueError(f"the DeepSpeed config has {len(plan.refusals)} key(s) zero_py "
                             f"does not honour:\n{listing}\nchange or remove them, or pass "
                             "strict=False to train without them (with a warning)")
        warnings.warn(f"zero_py trains without {len(plan.refusals)} DeepSpeed config key(s) "
                      f"it does not honour:\n{listing}", stacklevel=3)
    defaults = {name: p.default for name, p in
                inspect.signature(api_initialize).parameters.items()}
    merged = _explicit(explicit, defaults)
    opt_kwargs = dict(kwargs)

    def take(target: Dict[str, Any], name: str, value, path: str) -> None:
        if name == "loss_scaler" and name in target:
            raise ConfigError("loss_scaler= was given to initialize, but the DeepSpeed config "
                              "makes one (its fp16 section: DeepSpeed's policy from its keys; "
                              "bf16 under stages 1-2: a scale of 1 that skips steps whose "
                              "gradients are not finite, as DeepSpeed does); give it in one "
                              "place only")
        if name in target and target[name] != value:
            raise _conflict(name, target[name], value, path)
        target[name] = value

    take(merged, "stage", plan.stage, "zero_optimization.stage")
    if plan.optimizer_class is not None:
        take(merged, "optimizer_class", plan.optimizer_class, "optimizer.type")
        for key, value in plan.optimizer_kwargs.items():
            take(opt_kwargs, key, value, f"optimizer.params.{key}")
        for key, value in plan.optimizer_defaults.items():
            opt_kwargs.setdefault(key, value)  # a keyword the config leaves out may be given
    # everything is checked before the model is cast (and, under stage 3, sharded): a call
    # that fails leaves it as it was
    param_dtype = plan.dtype or _model_dtype(model)
    grad_dtype = plan.zero_kwargs.get("grad_reduce_dtype") or param_dtype
    if plan.reduce_bucket_numel is not None:
        take(opt_kwargs, "bucket_bytes", plan.reduce_bucket_numel * grad_dtype.itemsize,
             "zero_optimization.reduce_bucket_size")
    if plan.live_numel is not None:
        take(merged, "prefetch_bytes", plan.live_numel * param_dtype.itemsize,
             "zero_optimization.stage3_prefetch_bucket_size / stage3_max_live_parameters")
    # (option, initialize's own keyword or the optimizer's, the config path it came from)
    for option, own, path in (
            ("persistence_threshold", True, "stage3_param_persistence_threshold (+ 1: "
                                            "DeepSpeed keeps numel <= it replicated)"),
            ("offload_optimizer", False, "offload_optimizer.device"),
            ("offload_dir", False, "offload_optimizer.nvme_path / offload_param.nvme_path"),
            ("offload_params", True, "offload_param.device"),
            ("hybrid", True, "mics_shard_size"),
            ("grad_reduce_dtype", False, None),
            ("quantized_weights", False, "zero_quantized_weights"),
            ("quantized_grads", False, "zero_quantized_gradients")):
        if option in plan.zero_kwargs:
            take(merged if own else opt_kwargs, option, plan.zero_kwargs[option],
                 f"zero_optimization.{path}" if path else "communication_data_type")
    if plan.loss_scaler is not None:
        take(opt_kwargs, "loss_scaler", plan.loss_scaler(), "fp16")
    _check_schedule(plan, explicit.get("params"))
    if plan.dtype is not None:
        model.to(plan.dtype)
    model, optimizer = api_initialize(model, **merged, **opt_kwargs)
    _attach(optimizer, plan)
    return model, optimizer


def _check_schedule(plan: DeepSpeedPlan, params) -> None:
    """The scheduler section's per-param-group values (lists) against the groups the optimizer
    will have (`params` given as a list of group dicts: one per dict; else one), before the
    model is touched."""
    if plan.scheduler is None:
        return
    cls, kwargs = plan.scheduler
    n = (len(params) if isinstance(params, (list, tuple)) and params
         and all(isinstance(g, dict) for g in params) else 1)
    probe = torch.optim.SGD([{"params": [torch.zeros(1, requires_grad=True)]}
                             for _ in range(n)], lr=1e-3)
    try:
        cls(probe, **kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"scheduler.params: {cls.__name__} rejects them for this optimizer's "
                          f"{n} param group(s): {exc}") from None


def _model_dtype(model: torch.nn.Module) -> torch.dtype:
    for p in model.parameters():
        if p.requires_grad:
            return p.dtype
    return torch.float32


def _attach(optimizer, plan: DeepSpeedPlan) -> None:
    optimizer.ds_config = plan
    optimizer.lr_scheduler = None
    if plan.gradient_clipping is not None:
        clip = plan.gradient_clipping

        def clip_before_step(opt, args, kwargs):
            opt.clip_grad_norm_(clip)
        optimizer.register_step_pre_hook(clip_before_step)
    if plan.scheduler is not None:
        cls, params = plan.scheduler
        scheduler = cls(optimizer, **params)
        optimizer.lr_scheduler = scheduler

        def advance_schedule(opt, args, kwargs):
            if not opt.last_step_skipped:
                scheduler.step()
        optimizer.register_step_post_hook(advance_schedule)
        _save_schedule_with(optimizer)


def _save_schedule_with(optimizer) -> None:
    """optimizer.state_dict() carries the scheduler's state and load_state_dict() restores it
    (zero_py.save_checkpoint / load_checkpoint do so too: attached_schedule.py), as
    DeepSpeed's engine checkpoints its scheduler: a resumed run does not restart the warm-up."""
    loading = {}

    def add_schedule(opt, state_dict):
        state_dict[attached_schedule.KEY] = attached_schedule.state_of(opt)

    def take_schedule(opt, state_dict):
        state_dict = dict(state_dict)
        loading["state"] = attached_schedule.check(opt, state_dict.pop(attached_schedule.KEY,
                                                                        None))
        return state_dict

    def restore_schedule(opt):
        attached_schedule.load(opt, loading.pop("state", None))

    optimizer.register_state_dict_post_hook(add_schedule)
    optimizer.register_load_state_dict_pre_hook(take_schedule)
    optimizer.register_load_state_dict_post_hook(restore_schedule)
