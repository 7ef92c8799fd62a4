"""The public entry points for every stage: initialize, gathered, full_state_dict (and
full_shape, from sharding/storage.py).

Stages 1-2 are an optimizer (ZeroOptimizer) over the model's parameters in flat buffers.
Stage 3 shards the parameters too: initialize cuts the model into units
(sharding/units.py), builds the sharded storage of the trainable and of the frozen parameters
(stage3/shard.py: shard_parameters), hands the trainable one to ZeroOptimizer, starts the
engine (hooks and prefetch) and installs the state-dict hooks (stage3/state_dict.py). Every
stage reaches its collectives through collectives.make_executor, so stage 3 runs on the native
NCCL executor for CUDA models as stages 1-2 do.

This module is initialize; the rest of the entry points' code lives beside it, one subject a
module: model_checks.py (the models initialize refuses), stage3_agreement.py (what the ranks
agree on before stage 3 shards anything), buffers.py (buffer broadcast and broadcast_buffers),
stage3/hf_methods.py (a Hugging Face model's generate and num_parameters under stage 3) and
full_values.py (gathered and full_state_dict, re-exported here).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Optional, Set, Type

import torch
import torch.distributed as dist
import torch.nn as nn

# _BufferSync, _SyncedGenerate and _FullNumParameters were defined here: a model saved whole
# (torch.save) with them on it names them here, so they stay importable from this module
from zero_py.buffers import _BufferSync as _BufferSync
from zero_py.buffers import buffer_entries, start_buffers
from zero_py.collectives import channel, make_executor, make_hybrid_executor, quantized
from zero_py.full_values import full_state_dict, gathered
from zero_py.model_checks import (refuse_data_parallel_wrappers, refuse_in_place_forward_writes,
                                  refuse_sparse_gradients)
from zero_py.optim import compat
from zero_py.optim.arguments import (DEFAULT_ALIGN_BYTES, DEFAULT_QUANTIZE_BLOCK, PARAM_DTYPES,
                                     check_kind_options, check_no_aliased_buffers,
                                     check_no_shared_storage)
from zero_py.optim.optimizer import ZeroOptimizer
from zero_py.optim.update import fused_kind
from zero_py.sharding.storage import GatherMeter, full_shape
from zero_py.sharding.units import WrapPolicy, assign_units
from zero_py.stage3 import state_dict as stage3_state_dict
from zero_py.stage3.engine import Stage3Engine
from zero_py.stage3.hf_methods import _FullNumParameters, _SyncedGenerate, takes_synced_gpus
from zero_py.stage3.meta_init import realize_meta, replay_init
from zero_py.stage3.shard import shard_parameters
from zero_py.stage3_agreement import (agree_param_file, agree_stage3, check_params_on_nvme,
                                      param_file, param_groups)

__all__ = ["initialize", "gathered", "full_state_dict", "full_shape"]


def initialize(model: nn.Module, optimizer_class: Optional[Type[torch.optim.Optimizer]] = None,
               *, stage: Optional[int] = None, wrap_policy: WrapPolicy = None, params=None,
               process_group: Optional[dist.ProcessGroup] = None,
               replicate_group: Optional[dist.ProcessGroup] = None, device_mesh=None,
               hybrid: Optional[str] = None, reshard_after_forward: bool = True,
               persistence_threshold: int = 0,
               prefetch_bytes: Optional[int] = None,
               init_fn: Optional[Callable[[nn.Module], None]] = None, executor="auto",
               device: Optional[torch.device] = None, offload_params: Optional[str] = None,
               config=None, strict: bool = True, broadcast_buffers: bool = False, **kwargs):
    """Prepares `model` for ZeRO training and returns (model, optimizer): the same call for
    every stage.

    Stages 1 and 2 return the model unchanged and a ZeroOptimizer over its parameters. Stage 3
    shards the parameters too: the model is cut into units by `wrap_policy` (None: every module
    holding at least 1M parameters not already in a smaller unit; an int: that parameter count;
    module classes, e.g. {Block}; or a callable(module, name) -> bool), each unit's parameters
    exist only as shards between uses, and hooks gather them for forward and backward. Frozen
    parameters (requires_grad=False) are sharded too; a model with no trainable parameter (a
    reference, reward or teacher model, inference) gets an optimizer with nothing to update
    (step() does nothing; it serves save/load_checkpoint). Between uses a parameter is its slice
    of this rank's shard (1-D; zero_py.full_shape(p) gives its real shape); read full values
    inside `with zero_py.gathered(model):`. model.state_dict() / load_state_dict() take and give
    full values (who must call them: zero_py/stage3/state_dict.py). Cast and move the model
    before initialize: a cast or move after it is refused at the next forward or step.

    Stage-3 options:
        reshard_after_forward: free a unit after its forward (default) or keep it until its
            backward (no second gather; stage-2 memory for parameters).
        persistence_threshold: parameters with fewer elements stay replicated (never gathered).
        prefetch_bytes: the most bytes of gathered units held at once by prefetching
            (default: the units kept whole plus twice the largest other unit).
        init_fn: for a model built on the meta device: called on every module after the
            modules' reset_parameters(), like model.apply(init_fn) after construction.
        device: where a model built on the meta device is materialized (default: the current
            CUDA device in an NCCL group, else the CPU); for other models, their device.
        offload_params: "cpu" keeps this rank's parameter shards in host memory; each unit's
            shard is copied to the device as its (prefetched) gather starts. On a GPU it needs
            offload_optimizer="cpu" (the step then reads and writes the host shards).
            "nvme" keeps them in a file under offload_dir, read for each gather (ahead, as
            the prefetch schedule goes) through a small ring of host buffers and updated
            bucket by bucket by the step; it needs offload_optimizer="nvme" (both files flip
            together after a step, so a failed write keeps the last good step).
    offload_optimizer="cpu" (every stage; a ZeroOptimizer keyword) keeps the fp32 masters and
    optimizer states in host memory and runs the step there (docs/offload.md).
    A model whose parameters are on the meta device (built under `with torch.device("meta")`)
    is materialized module by module: it never exists whole on a rank, and gets the values an
    ordinary build from the same seed gives (see zero_py/stage3/meta_init.py).

    Buffers (BatchNorm running statistics, ...) are broadcast from rank 0 here, for every
    stage. `broadcast_buffers=True` also broadcasts them before each forward as DDP's
    broadcast_buffers=True does (before every forward that follows a forward run with
    gradients enabled outside no_sync(), and before the first): every rank must then run
    those forwards together.

    Before anything is laid out or sent, the ranks check that they agree on the model
    (parameter names, shapes, dtypes, requires_grad, stage-3 units, buffers) and the settings;
    a difference is a ValueError on every rank naming the first one (zero_py/optim/agreement.py).

    Hybrid sharding (shard inside a group, replicate across groups): `process_group=` (the
    shard group) with `replicate_group=`, or `device_mesh=` (2-D, dims ("replicate",
    "shard")), or `hybrid="node"` (one shard group per node, from torchrun's environment).
    Every stage shards in the shard group only and averages gradients over every rank, as DDP
    over the world does (zero_py/collectives/hybrid.py, docs/scale-out.md).

    `executor`: "auto" (zero_py's NCCL executor for CUDA models in an NCCL group),
    "torch", "nccl" or an executor object, as for ZeroOptimizer. `params` are param groups
    (dicts with "params") over the model's parameters (default: all of them, one group); other
    keyword arguments go to ZeroOptimizer (bucket_bytes, grad_reduce_dtype, loss_scaler, ...)
    and to optimizer_class (lr, betas, ...). optimizer_class defaults to torch.optim.AdamW and
    stage to 3.

    `config`: a DeepSpeed config (path to its JSON file, or the dict) whose zero_optimization,
    optimizer, scheduler, fp16/bf16, gradient_clipping and batch-size keys become these options
    (zero_py/config/deepspeed.py; docs/tools.md). A key zero_py does not honour is an error
    naming its path, or with strict=False one warning listing them; a keyword given here that
    the config sets otherwise is an error."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"initialize takes an nn.Module, got {type(model).__name__}")
    if compat.manager_of(model) is not None:
        raise ValueError("this model is already managed by zero_py: call zero_py.initialize "
                         "once per model and keep the (model, optimizer) it returned")
    refuse_data_parallel_wrappers(model)
    refuse_sparse_gradients(model)
    names = {id(p): n for n, p in model.named_parameters()}
    compat.check_unowned(model.parameters(), lambda p: repr(names.get(id(p), "?")))
    if not isinstance(broadcast_buffers, bool):
        raise TypeError(f"broadcast_buffers must be True or False, got {broadcast_buffers!r}")
    if config is not None:
        from zero_py.config import ds_initialize
        explicit = {k: v for k, v in locals().items()
                    if k not in ("model", "config", "strict", "kwargs", "ds_initialize", "names")}
        return ds_initialize.initialize(model, config, strict, explicit, kwargs, initialize)
    if strict is not True:
        raise ValueError("strict applies to a DeepSpeed config only; pass config= with it")
    optimizer_class = torch.optim.AdamW if optimizer_class is None else optimizer_class
    stage = 3 if stage is None else stage
    if stage in (1, 2):
        extra = {"wrap_policy": wrap_policy, "init_fn": init_fn, "prefetch_bytes": prefetch_bytes,
                 "device": device, "offload_params": offload_params}
        given = [k for k, v in extra.items() if v is not None]
        if given or persistence_threshold or not reshard_after_forward:
            raise ValueError(f"{given or 'stage-3 options'} only apply to stage=3; drop them "
                             f"for stage {stage}")
        if any(p.is_meta for p in model.parameters()):
            raise ValueError("a model on the meta device needs stage=3 (partitioned "
                             "construction); build it on a real device for stages 1-2")
        # the trainable ones: those the optimizer moves into its flat buffers (`params` is
        # left unread here, it may be a generator)
        check_no_aliased_buffers([p for p in model.parameters() if p.requires_grad],
                                 model.named_buffers(), lambda p: repr(names[id(p)]))
        opt = ZeroOptimizer(model.parameters() if params is None else params, optimizer_class,
                            stage=stage, process_group=process_group, executor=executor,
                            replicate_group=replicate_group, device_mesh=device_mesh,
                            hybrid=hybrid, _param_names=names,
                            _agreement=buffer_entries(model), **kwargs)
        start_buffers(model, opt, broadcast_buffers)
        model._zero_py = compat.ModelManager(opt, weak=True)  # the model goes on without it
        opt._comm.mark()  # the first step's counts start after the set-up's broadcasts
        return model, opt
    if stage != 3:
        raise ValueError(f"stage must be 1, 2 or 3, got {stage!r}")
    if not isinstance(persistence_threshold, int) or persistence_threshold < 0:
        raise ValueError(f"persistence_threshold must be an int >= 0, got "
                         f"{persistence_threshold!r}")
    if prefetch_bytes is not None and (not isinstance(prefetch_bytes, int) or prefetch_bytes < 0):
        raise ValueError(f"prefetch_bytes must be None or an int >= 0, got {prefetch_bytes!r}")
    if offload_params not in (None, "none", "cpu", "nvme"):
        raise ValueError(f"offload_params must be None, 'none', 'cpu' (the parameter shards "
                         f"in host memory) or 'nvme' (in a file under offload_dir), got "
                         f"{offload_params!r}")
    host_shards = offload_params == "cpu"
    params_on_nvme = offload_params == "nvme"
    meta = any(p.is_meta for p in model.parameters())
    if meta and params is not None:
        raise ValueError("param groups cannot be given for a meta-device model (its "
                         "parameters are replaced while it is materialized); pass params=None")
    if not meta and init_fn is not None:
        raise ValueError("init_fn applies to models built on the meta device only; initialize "
                         "an ordinary model before calling zero_py.initialize")
    units, unit_of = assign_units(model, wrap_policy)
    real = [p for p in model.parameters() if not p.is_meta]
    devices = {p.device for p in real}
    if len(devices) > 1:
        raise ValueError(f"the parameters are on several devices ({sorted(map(str, devices))}); "
                         "zero_py shards one device per rank: move the model to one device")
    if devices:
        here = devices.pop()
        if device is not None and torch.device(device) != here:
            raise ValueError(f"device={device} but the model's parameters are on {here}; move "
                             "the model, or leave device unset")
        device = here
    elif device is None:
        nccl = dist.is_initialized() and "nccl" in str(dist.get_backend(process_group)).lower()
        device = torch.device("cuda", torch.cuda.current_device()) if nccl \
            else torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    if host_shards and device.type == "cuda" and kwargs.get("offload_optimizer") != "cpu":
        raise ValueError("offload_params='cpu' on a GPU needs offload_optimizer='cpu' too: the "
                         "step must run where the parameter shards are (host memory)")
    # everything that can be refused is checked before the model is touched; a refusal is
    # raised after the ranks' agreement, which carries it (a rank refused alone makes every
    # rank raise)
    problem: Optional[Exception] = None
    groups = None
    try:
        if params_on_nvme:
            check_params_on_nvme(kwargs)
        defaults = ZeroOptimizer.check_arguments(optimizer_class, **kwargs)
        groups = None if meta else param_groups(model.parameters() if params is None
                                                 else params)
        # the optimizer's own refusals, before anything is sharded: raised by ZeroOptimizer
        # after it, they left the parameters as this rank's shard slices (a model neither
        # trainable nor usable as a plain model)
        check_kind_options(optimizer_class, fused_kind(optimizer_class, [
            {**defaults, **{k: v for k, v in g.items() if k != "params"}}
            for g in groups or [{}]]),
            {p.dtype for g in groups for p in g["params"]} if groups else
            {p.dtype for p in model.parameters()}, kwargs.get("stochastic_rounding", False),
            kwargs.get("offload_optimizer"), kwargs.get("overlap_step", 0.0), 3)
        strangers = [p for g in groups or () for p in g["params"] if id(p) not in unit_of]
        if strangers:
            raise ValueError(f"params holds {len(strangers)} tensor(s) that are not parameters "
                             "of the model (e.g. of shape "
                             f"{tuple(strangers[0].shape)}); stage 3 shards the model's own "
                             "parameters: give param groups over model.parameters()")
        if groups is not None and params is not None and not any(
                p.requires_grad and p.numel() > 0 and id(p) in unit_of
                for g in groups for p in g["params"]) and any(
                p.requires_grad and p.numel() > 0 for p in model.parameters()):
            raise ValueError(
                "params holds none of the model's trainable parameters: give param groups over "
                "them (a model with no trainable parameter at all is sharded for inference "
                "with params=None)")
        refuse_in_place_forward_writes(model)
        check_no_shared_storage(list(model.parameters()), lambda p: repr(names[id(p)]))
        check_no_aliased_buffers(list(model.parameters()), model.named_buffers(),
                                 lambda p: repr(names[id(p)]))
        for i, (name, p) in enumerate(model.named_parameters()):
            if p.numel() == 0:
                continue
            if not p.requires_grad and p.dtype not in PARAM_DTYPES:
                # _check_param's "cast the model" misleads for a frozen int8/float8 weight of a
                # quantized base model, which is not to be trained
                # a model with nothing to train is refused by stages 1-2: not them, then
                trains = any(q.requires_grad and q.numel() > 0 for q in model.parameters())
                raise ValueError(
                    f"parameter {name!r} (index {i}) is frozen with dtype {p.dtype}: stage 3 "
                    "shards frozen parameters too, in float32, bfloat16 and float16 only; " + (
                        "use stage 1 or 2 (they keep frozen parameters whole, in any dtype), or "
                        if trains else "keep this model, which has no trainable parameter, a "
                        "plain model on every rank, or ") + "hold it as a buffer "
                    "(module.register_buffer), which every stage keeps whole")
            if p.is_meta:
                ZeroOptimizer._check_param(torch.empty(0, dtype=p.dtype), i, name)
            else:
                ZeroOptimizer._check_param(p, i, name)
        quantized.check_dtypes(kwargs.get("quantized_weights"), kwargs.get("quantized_grads"),
                               kwargs.get("grad_reduce_dtype"),
                               {p.dtype for p in model.parameters()})
    except (TypeError, ValueError) as exc:
        problem = exc
    try:
        dp = (make_hybrid_executor(process_group, replicate_group, device_mesh, hybrid, device,
                                   executor)
              or make_executor(process_group, device, executor))
    except (RuntimeError, TypeError, ValueError):
        if problem is not None:
            raise problem from None
        raise
    agree_stage3(model, dp, optimizer_class, groups, units, unit_of, kwargs, {
        "reshard_after_forward": bool(reshard_after_forward),
        "persistence_threshold": persistence_threshold, "prefetch_bytes": prefetch_bytes,
        "meta": meta, "init_fn": init_fn,
        "offload_params": offload_params if offload_params != "none" else None}, problem)
    if problem is not None:
        raise problem
    gather = channel(dp)  # gathers never interleave with the reductions
    # qwZ: the gathers carry int8 (a rank's own piece stays exact; collectives/quantized.py)
    gather = quantized.wrap(gather, quantized.spec(
        kwargs.get("quantized_weights"), kwargs.get("quantize_block", DEFAULT_QUANTIZE_BLOCK),
        "quantized_weights", ("bf16", "int8")))
    uninitialized: Set[int] = set()
    if meta:
        before = dict(model.named_parameters(remove_duplicate=False))
        uninitialized = realize_meta(model, device)
        # the replacements belong to the units of the parameters they replace
        unit_of = {id(p): unit_of[id(before[n])]
                   for n, p in model.named_parameters(remove_duplicate=False)}
    if groups is None:  # a meta model's parameters were replaced: take them now
        groups = param_groups(model.parameters())
    trainable, groups_of = [], []
    seen: Set[int] = set()
    for gi, g in enumerate(groups):
        for p in g["params"]:
            if id(p) in unit_of and p.requires_grad and p.numel() > 0 and id(p) not in seen:
                seen.add(id(p))
                trainable.append(p)
                groups_of.append(gi)
    frozen = [p for p in model.parameters() if not p.requires_grad and p.numel() > 0]
    # the optimizer's own rule: quantization blocks never straddle two parameters
    align = quantized.layout_align_bytes(
        kwargs.get("align_bytes", DEFAULT_ALIGN_BYTES),
        kwargs.get("quantize_block", DEFAULT_QUANTIZE_BLOCK),
        kwargs.get("quantized_weights") == "int8" or kwargs.get("quantized_grads") is not None)
    meter = GatherMeter()
    n_units = len(units)
    frozen_storage = None
    files = {}
    if params_on_nvme:
        files = {"param_file": param_file(kwargs["offload_dir"], dp.rank, "parameters"),
                 "on_made": lambda flat: agree_param_file(dp, flat)}
    storage = shard_parameters(trainable, groups_of, unit_of, n_units, gather, align, meter,
                               persistence_threshold, uninitialized, host_shards, device=device,
                               **files)
    if frozen:
        if params_on_nvme:
            files["param_file"] = param_file(kwargs["offload_dir"], dp.rank,
                                              "frozen parameters")
        frozen_storage = shard_parameters(frozen, [0] * len(frozen), unit_of, n_units, gather,
                                          align, meter, persistence_threshold, uninitialized,
                                          host_shards, **files)
    try:
        opt = ZeroOptimizer(groups, optimizer_class, stage=3, process_group=process_group,
                            executor=dp, storage=storage,
                            _param_names={id(p): n for n, p in model.named_parameters()},
                            **kwargs)
    except BaseException as exc:  # e.g. the NVMe offload file refused on a rank
        if hasattr(exc, "add_note"):  # Python 3.11+
            exc.add_note("zero_py: the model's parameters were already sharded (each is this "
                         "rank's 1-D slice now): build the model again before another "
                         "zero_py.initialize")
        raise
    storage.frozen_storage = frozen_storage
    engine = Stage3Engine(model, units, [s for s in (storage, frozen_storage) if s is not None],
                          dp, opt.reducer, bool(reshard_after_forward), prefetch_bytes)
    opt._engine = engine
    if meta:
        # on NVMe each bucket's piece is written to its record once filled (filling()); a
        # write of the shards, as shard_parameters' (one-sided readers wait for its end)
        with contextlib.ExitStack() as writing:
            for s in engine.storages:
                writing.enter_context(s.writing())
            replay_init(model, engine, uninitialized, init_fn)
            opt.sync_master_from_params()
    stage3_state_dict.install(model, engine, opt)
    start_buffers(model, opt, broadcast_buffers)
    # generate()'s forwards are no_grad: collective ones need synced_gpus, but where they gather
    # alone (one host, shared memory) it would make a rank that generates alone (rank 0
    # sampling for its log) wait for ever in transformers' all-reduce of "finished"
    if dp.world_size > 1 and not engine.eval_gathers_alone and takes_synced_gpus(model):
        model.generate = _SyncedGenerate(model)
    # Hugging Face's num_parameters() sums p.numel(), this rank's slices between uses: it
    # counts the full parameters instead (its own code, numel() being the full count inside)
    if callable(getattr(type(model), "num_parameters", None)):
        model.num_parameters = _FullNumParameters(model)
    model._zero_py = compat.ModelManager(opt)
    opt._comm.mark()  # the first step's counts start after the set-up's broadcasts
    return model, opt
