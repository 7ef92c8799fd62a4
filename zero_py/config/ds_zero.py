"""The zero_optimization section of a DeepSpeed config: its keys read into the plan
(read_zero), then checked against the stage the config ends up with (check_zero)."""

from __future__ import annotations

import os
from typing import Callable, Dict

import torch.distributed as dist

from zero_py.config.ds_plan import (AUTO, NO_OFFLOAD, ConfigError, DeepSpeedPlan, Refused,
                                    always_refused, apply_section, as_section, fixed, flag,
                                    is_auto, number, off_only)


def _stage(plan, path, value):
    stage = number(path, value, integer=True)
    if stage == 0:
        raise Refused("stage 0 is plain data parallelism, not ZeRO: use DDP, or stage 1-3")
    if stage not in (1, 2, 3):
        raise ConfigError(f"{path} must be 0, 1, 2 or 3, got {value!r}")
    plan.stage = stage


def _reduce_bucket(plan, path, value):
    plan.reduce_bucket_numel = max(1, number(path, value, integer=True))


def _allgather_bucket(plan, path, value):
    plan.zero_kwargs["_allgather_bucket_numel"] = max(1, number(path, value, integer=True))


def _overlap(plan, path, value):
    plan.zero_kwargs["_overlap_comm"] = flag(path, value)


def _persistence(plan, path, value):
    # DeepSpeed keeps a parameter replicated when numel <= the threshold, zero_py when
    # numel < persistence_threshold
    plan.zero_kwargs["persistence_threshold"] = number(path, value, integer=True) + 1


def _prefetch_bucket(plan, path, value):
    numel = number(path, value, integer=True)
    plan.live_numel = numel if plan.live_numel is None else min(plan.live_numel, numel)


# the keys of DeepSpeed's offload sections (it refuses others: extra="forbid"); besides device,
# nvme_path, pin_memory and ratio (read below) they tune DeepSpeed's own swapper and CPU Adam,
# and do nothing here (docs/tools.md)
_OFFLOAD_KEYS = {
    "offload_optimizer": {"device", "nvme_path", "buffer_count", "pin_memory", "pipeline_read",
                          "pipeline_write", "fast_init", "ratio", "super_offload",
                          "cpuadam_cores_perc"},
    "offload_param": {"device", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu",
                      "pin_memory"},
}


def _offload(plan, path, value):
    section = as_section(path, value)
    name = path.rsplit(".", 1)[-1]
    for key in section:
        if key not in _OFFLOAD_KEYS[name]:
            plan.refuse(f"{path}.{key}", f"not a key of DeepSpeed's {name} section (its keys: "
                                         f"{', '.join(sorted(_OFFLOAD_KEYS[name]))}); check "
                                         "its spelling, or remove it")
    if section.get("super_offload", False) is not False:
        plan.refuse(f"{path}.super_offload", "DeepSpeed's SuperOffload is not implemented; "
                                             "zero_py offloads the whole update to its fused "
                                             "CPU kernels: set it to false or remove it")
    device = section.get("device", "none")
    if is_auto(device):
        plan.refuse(f"{path}.device", AUTO)
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
        plan.refuse(f"{path}.device", f"{device!r}: {NO_OFFLOAD}")
    # with device "none" the other keys (pin_memory, nvme_path, buffer_count, ...) configure an
    # offload that does not happen, in DeepSpeed as here; with "cpu" the NVMe ones likewise


def _legacy_offload(plan, path, value, key):
    """DeepSpeed's older flags (cpu_offload, cpu_offload_params): true is the "cpu" device."""
    if flag(path, value):
        plan.zero_kwargs[key] = "cpu"


def _quantized(option: str, kind: str):
    """A ZeRO++ switch (true/false) as initialize's option: DeepSpeed's qwZ is int8, its qgZ
    int4 (initialize's quantized_grads="int8" has no DeepSpeed key)."""
    def read(plan, path, value):
        if flag(path, value):
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
    "contiguous_gradients": fixed(True, "zero_py always copies gradients into contiguous "
                                        "bucket buffers; set it to true or remove it"),
    "reduce_scatter": fixed(True, "zero_py always reduce-scatters gradients; set it to true "
                                  "or remove it"),
    "allgather_partitions": fixed(True, "zero_py always all-gathers the updated "
                                        "partitions; set it to true or remove it"),
    "ignore_unused_parameters": fixed(True, "zero_py always skips parameters no rank used, "
                                            "as torch.optim does; set it to true or remove it"),
    "round_robin_gradients": fixed(False, "zero_py does not reorder gradient partitions"),
    "load_from_fp32_weights": fixed(True, "zero_py restores fp32 masters from the optimizer "
                                          "state dict when it carries them"),
    "elastic_checkpoint": fixed(False, "elastic checkpoints are DeepSpeed's format; zero_py "
                                       "loads a consolidated optimizer state dict at any "
                                       "world size"),
    "stage3_gather_16bit_weights_on_model_save": fixed(
        True, "under stage 3 zero_py's model.state_dict() always gathers full weights"),
    "stage3_gather_fp16_weights_on_model_save": fixed(
        True, "under stage 3 zero_py's model.state_dict() always gathers full weights"),
    "gather_16bit_weights_on_model_save": fixed(
        True, "under stage 3 zero_py's model.state_dict() always gathers full weights"),
    "sub_group_size": lambda plan, path, value: number(path, value),  # see docs/tools.md
    "stage3_max_reuse_distance": always_refused(
        "zero_py keeps units for reuse within the prefetch budget "
        "(stage3_max_live_parameters), not by reuse distance; remove it"),
    "max_reuse_distance": always_refused(
        "zero_py keeps units for reuse within the prefetch budget "
        "(stage3_max_live_parameters), not by reuse distance; remove it"),
    "cpu_offload": lambda plan, path, value: _legacy_offload(plan, path, value,
                                                             "offload_optimizer"),
    "cpu_offload_params": lambda plan, path, value: _legacy_offload(plan, path, value,
                                                                    "offload_params"),
    "cpu_offload_use_pin_memory": lambda plan, path, value: flag(path, value),
    "memory_efficient_linear": fixed(False, "zero_py uses torch's own nn.Linear; set it to "
                                            "false or remove it"),
    "zero_quantized_weights": _quantized("quantized_weights", "int8"),
    "zero_quantized_nontrainable_weights": off_only(
        "zero_py has no separate switch for frozen weights: under stage 3, "
        "zero_quantized_weights quantizes the gathers of frozen parameters too"),
    "zero_quantized_gradients": _quantized("quantized_grads", "int4"),
    "zero_hpz_partition_size": fixed(1, "hierarchical partitioning (ZeRO++ hpZ) is not "
                                        "implemented"),
    "mics_shard_size": lambda plan, path, value: _mics_shard_size(plan, path, value),
    "use_multi_rank_bucket_allreduce": fixed(True, "zero_py reduce-scatters; it has no "
                                                   "multi-rank all-reduce mode"),
}


def _mics_shard_size(plan: DeepSpeedPlan, path: str, value) -> None:
    """MiCS shards inside groups of mics_shard_size ranks and replicates across them: zero_py's
    hybrid sharding when a group is one node (hybrid="node"); -1 or the world size: plain."""
    if value == -1 and not isinstance(value, bool):
        return
    size = number(path, value, integer=True, minimum=1)
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else None
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if size == world:
        return
    if local is not None and local.isdigit() and size == int(local):
        plan.zero_kwargs["hybrid"] = "node"
        return
    raise Refused(f"zero_py's hybrid sharding from a config shards inside one node: "
                  f"mics_shard_size must be -1, the world size ({world}) or the ranks per node "
                  f"(LOCAL_WORLD_SIZE={local}); for other shard groups drop the key and pass "
                  "process_group= and replicate_group= to zero_py.initialize")


def read_zero(plan: DeepSpeedPlan, path: str, value) -> None:
    section = as_section(path, value)
    apply_section(plan, path, section, _ZERO_KEYS)


def check_zero(plan: DeepSpeedPlan) -> None:
    zk = plan.zero_kwargs
    stage = plan.stage
    gather = zk.pop("_allgather_bucket_numel", None)
    overlap = zk.pop("_overlap_comm", None)
    if zk.get("offload_params") == "nvme" and zk.get("offload_optimizer") != "nvme":
        zk.pop("offload_params")
        plan.refuse("zero_optimization.offload_param.device",
                    f"'nvme' needs offload_optimizer.device 'nvme' too in zero_py (this config "
                    f"gives {zk.get('offload_optimizer') or 'none'!r}), with the same nvme_path: "
                    "a step writes each bucket's parameters and optimizer states together; "
                    "offload both to NVMe, or the parameters to 'cpu'")
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
        for key, name in (("persistence_threshold", "stage3_param_persistence_threshold"),
                          ("offload_params", "offload_param")):
            if key in zk:
                zk.pop(key)
                plan.refuse(f"zero_optimization.{name}", f"applies to stage 3 only (this "
                                                         f"config is stage {stage})")
        # DeepSpeed's ZeRO++ switches act in its stage-3 engine only: its stages 1-2 ignore them
        # and communicate at full precision, where zero_py's options would quantize
        for key, name in (("quantized_weights", "zero_quantized_weights"),
                          ("quantized_grads", "zero_quantized_gradients")):
            if key in zk:
                zk.pop(key)
                plan.refuse(f"zero_optimization.{name}",
                            f"DeepSpeed applies it under stage 3 only (this config is stage "
                            f"{stage}, where DeepSpeed communicates at full precision); remove "
                            f"it, or pass {key}= to initialize to quantize stage {stage}'s "
                            "collectives")
        if plan.live_numel is not None:
            plan.live_numel = None
            plan.refuse("zero_optimization.stage3_prefetch_bucket_size",
                        f"the stage3_* prefetch settings apply to stage 3 only (this config is "
                        f"stage {stage})")
