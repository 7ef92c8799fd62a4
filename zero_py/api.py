"""The public entry points for every stage: initialize, gathered, full_state_dict (and
full_shape, from sharding/storage.py).

Stages 1-2 are an optimizer (ZeroOptimizer) over the model's parameters in flat buffers.
Stage 3 shards the parameters too: initialize cuts the model into units
(sharding/units.py), builds the sharded storage of the trainable and of the frozen parameters
(stage3/shard.py: shard_parameters), hands the trainable one to ZeroOptimizer, starts the
engine (hooks and prefetch) and installs the state-dict hooks (stage3/state_dict.py). Every
stage reaches its collectives through collectives.make_executor, so stage 3 runs on the native
NCCL executor for CUDA models as stages 1-2 do.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import weakref
from typing import Any, Callable, Dict, List, Optional, Set, Tuple, Type

import torch
import torch.distributed as dist
import torch.nn as nn

from zero_py.collectives import channel, make_executor, make_hybrid_executor, quantized
from zero_py.offload import ParamStore, check_offload_dir
from zero_py.optim import agreement, compat
from zero_py.optim.arguments import (DEFAULT_ALIGN_BYTES, DEFAULT_QUANTIZE_BLOCK, PARAM_DTYPES,
                                     check_kind_options, check_no_aliased_buffers,
                                     check_no_shared_storage, fingerprint)
from zero_py.optim.optimizer import ZeroOptimizer
from zero_py.optim.update import fused_kind
from zero_py.sharding.between_uses import full_numel
from zero_py.sharding.storage import GatherMeter, full_shape
from zero_py.sharding.units import WrapPolicy, assign_units
from zero_py.stage3 import state_dict as stage3_state_dict
from zero_py.stage3.engine import Stage3Engine
from zero_py.stage3.shard import shard_parameters
from zero_py.stage3.meta_init import realize_meta, replay_init
from zero_py.stage3.user_edits import check_modifier_rank

__all__ = ["initialize", "gathered", "full_state_dict", "full_shape"]


def _param_groups(params) -> List[dict]:
    """Param groups as torch.optim normalizes them: a list of dicts with a list of params."""
    groups = list(params)
    if not groups:
        return []
    if not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    out = []
    for g in groups:
        ps = g["params"]
        out.append({**g, "params": [ps] if isinstance(ps, torch.Tensor) else list(ps)})
    return out


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
    _refuse_data_parallel_wrappers(model)
    _refuse_sparse_gradients(model)
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
                            _agreement=_buffer_entries(model), **kwargs)
        _start_buffers(model, opt, broadcast_buffers)
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
            _check_params_on_nvme(kwargs)
        defaults = ZeroOptimizer.check_arguments(optimizer_class, **kwargs)
        groups = None if meta else _param_groups(model.parameters() if params is None
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
        _refuse_in_place_forward_writes(model)
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
    _agree_stage3(model, dp, optimizer_class, groups, units, unit_of, kwargs, {
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
        groups = _param_groups(model.parameters())
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
        files = {"param_file": _param_file(kwargs["offload_dir"], dp.rank, "parameters"),
                 "on_made": lambda flat: _agree_param_file(dp, flat)}
    storage = shard_parameters(trainable, groups_of, unit_of, n_units, gather, align, meter,
                               persistence_threshold, uninitialized, host_shards, device=device,
                               **files)
    if frozen:
        if params_on_nvme:
            files["param_file"] = _param_file(kwargs["offload_dir"], dp.rank,
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
    _start_buffers(model, opt, broadcast_buffers)
    # generate()'s forwards are no_grad: collective ones need synced_gpus, but where they gather
    # alone (one host, shared memory) it would make a rank that generates alone (rank 0
    # sampling for its log) wait for ever in transformers' all-reduce of "finished"
    if dp.world_size > 1 and not engine.eval_gathers_alone and _takes_synced_gpus(model):
        model.generate = _SyncedGenerate(model)
    # Hugging Face's num_parameters() sums p.numel(), this rank's slices between uses: it
    # counts the full parameters instead (its own code, numel() being the full count inside)
    if callable(getattr(type(model), "num_parameters", None)):
        model.num_parameters = _FullNumParameters(model)
    model._zero_py = compat.ModelManager(opt)
    opt._comm.mark()  # the first step's counts start after the set-up's broadcasts
    return model, opt


def _refuse_data_parallel_wrappers(model: nn.Module) -> None:
    """A model (or a submodule) wrapped in DDP, DataParallel or FSDP: its wrapper reduces or
    shards the gradients too (under stages 2-3 DDP writes its averaged gradient back after
    zero_py took it; under stage 1 every gradient crosses the wire twice)."""
    kinds = [nn.DataParallel, nn.parallel.DistributedDataParallel]
    for path, name in (("torch.distributed.fsdp", "FullyShardedDataParallel"),
                       ("torch.distributed.fsdp", "FSDPModule")):
        try:
            kinds.append(getattr(importlib.import_module(path), name))
        except (ImportError, AttributeError):
            pass  # an older torch without it
    for name, m in model.named_modules():
        if isinstance(m, tuple(kinds)):
            raise ValueError(
                f"{'the model' if not name else f'submodule {name!r}'} is wrapped in "
                f"{type(m).__name__}: zero_py reduces (and shards) the gradients itself, so "
                "the wrapper would reduce them a second time. Give zero_py.initialize the "
                "bare model (drop the DDP(...) / FSDP wrapper; `model.module` is the one "
                "inside)")


def _refuse_sparse_gradients(model: nn.Module) -> None:
    """An nn.Embedding / nn.EmbeddingBag with sparse=True and a trainable weight gives sparse
    gradients, which zero_py does not reduce: refused here rather than in the first backward
    (after a forward, on every rank)."""
    for name, m in model.named_modules():
        if (isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse
                and m.weight.requires_grad):
            raise ValueError(
                f"{type(m).__name__} {name or '(root)'!r} has sparse=True: its weight gets "
                "sparse gradients, which zero_py does not reduce or shard. Construct it with "
                "sparse=False (the default; dense gradients train to the same values), or "
                "freeze its weight")


def _refuse_in_place_forward_writes(model: nn.Module) -> None:
    """Stage 3: an nn.Embedding / nn.EmbeddingBag with max_norm renormalizes the rows it looks
    up in place during its forward. Under stage 3 its weight there is the gathered full view,
    freed after the forward, so the renormalization would be lost (the model then drifts from
    DDP's, where it persists)."""
    for name, m in model.named_modules():
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.max_norm is not None:
            raise ValueError(
                f"{type(m).__name__} {name or '(root)'!r} has max_norm={m.max_norm}: its "
                "forward renormalizes the weight's rows in place, which under stage 3 writes "
                "into the gathered copy freed after the forward (the renormalization would be "
                "lost); use stage 1 or 2 for it, or max_norm=None")


def _check_params_on_nvme(kwargs: dict) -> None:
    """offload_params="nvme" needs the optimizer on NVMe too, with an offload_dir."""
    if kwargs.get("offload_optimizer") != "nvme":
        raise ValueError(
            "offload_params='nvme' needs offload_optimizer='nvme' (with the same offload_dir): "
            "the step updates each bucket's parameters and optimizer states together and flips "
            "both files only when every write has landed, so a failed write keeps the last good "
            f"step; got offload_optimizer={kwargs.get('offload_optimizer')!r}. Pass "
            "offload_optimizer='nvme', or offload_params='cpu'")
    if kwargs.get("offload_dir") is None:
        raise ValueError("offload_params='nvme' needs offload_dir=PATH: a directory on the NVMe "
                         "drive for the parameter and optimizer files")
    check_offload_dir(kwargs["offload_dir"], "offload_params")


def _param_file(offload_dir, rank: int, what: str):
    """The factory of a ShardedParams' ParamStore (offload_params="nvme")."""
    return lambda flat: ParamStore(flat, offload_dir, rank, what)


def _agree_param_file(executor, flat) -> None:
    """After each rank tried to make its parameter file: every rank goes on, or every rank
    raises (the rank that failed its own OSError, the others an error naming it)."""
    problem = getattr(flat, "param_file_error", None)
    try:
        agreement.check(executor, [("the NVMe parameter file", f"failed: {problem}"
                                    if problem else "made")],
                        "zero_py.initialize(offload_params='nvme')")
    except ValueError:
        if problem is not None:
            raise problem from None
        raise
    if problem is not None:
        raise problem


def _takes_synced_gpus(model: nn.Module) -> bool:
    """Whether the model's class has a generate() with transformers' synced_gpus keyword."""
    generate = getattr(type(model), "generate", None)
    if not callable(generate):
        return False
    try:
        return "synced_gpus" in inspect.signature(generate).parameters
    except (TypeError, ValueError):
        return False


class _SyncedGenerate:
    """model.generate under stage 3 with several ranks whose no_grad forwards gather
    collectively (across hosts, CUDA, ZP_SHM=0): synced_gpus=True unless the caller passes it.
    Every forward gathers parameters collectively, so a rank that has finished generating must
    keep running forwards until all have: transformers turns this on by itself only for
    DeepSpeed and FSDP. A class, not a closure, so that torch.save(model) pickles."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, *args, **kwargs):
        kwargs.setdefault("synced_gpus", True)
        return type(self.model).generate(self.model, *args, **kwargs)


class _FullNumParameters:
    """model.num_parameters under stage 3 (a Hugging Face model): the class's own method, run
    where numel() of a parameter between uses is its full count (between_uses.full_numel),
    so it counts the model, not this rank's shard slices. A class, so that torch.save(model)
    pickles."""

    def __init__(self, model: nn.Module):
        self.model = model

    def __call__(self, *args, **kwargs):
        with full_numel():
            return type(self.model).num_parameters(self.model, *args, **kwargs)


# ZeroOptimizer's own settings (the rest of initialize's keywords go to the optimizer class)
_ZERO_OPTIONS = ("bucket_bytes", "align_bytes", "grad_reduce_dtype", "loss_scaler",
                 "stochastic_rounding", "offload_optimizer")


def _buffer_entries(model: nn.Module) -> List[Tuple[str, Any]]:
    return [(f"buffer {name}", {"shape": list(b.shape), "dtype": str(b.dtype)})
            for name, b in model.named_buffers()]


def _agree_stage3(model: nn.Module, executor, optimizer_class, groups: Optional[List[dict]],
                  units, unit_of, kwargs: dict, stage3_options: dict,
                  problem: Optional[Exception]) -> None:
    """Stage 3's agreement (optim/agreement.py), before the first gather or broadcast: whether
    the arguments were accepted, the settings, every parameter with its unit (the wrap
    policy's result), the buffers."""
    if problem is not None:
        agreement.check(executor, [("arguments", f"refused: {problem}")], "zero_py.initialize")
        return
    defaults = inspect.signature(ZeroOptimizer.__init__).parameters
    options = {k: kwargs.get(k, defaults[k].default) for k in _ZERO_OPTIONS}
    # offload_dir is a local path: each rank may use its own drive
    options.update({k: v for k, v in kwargs.items() if k not in options and k != "offload_dir"})
    options.update(stage3_options)
    if groups is None:  # a meta model: one group of every parameter
        groups = _param_groups(model.parameters())
    group_of = {id(p): k for k, g in enumerate(groups) for p in g["params"]}
    unit_name = [name or "(root)" for name, _ in units]
    entries = [agreement.param_entry(i, name, p, unit=unit_name[unit_of[id(p)]],
                                     group=group_of.get(id(p)))
               for i, (name, p) in enumerate(model.named_parameters())]
    entries += _buffer_entries(model)
    entries.append(("units", [[n, type(m).__name__] for n, m in units]))
    agreement.check(executor, [("arguments", "accepted")] + fingerprint(
        3, executor, optimizer_class, options, groups, entries), "zero_py.initialize")


def _broadcast_buffers(model: nn.Module, executor) -> None:
    """Every rank's buffers become rank 0's: one broadcast per dtype (buffers flattened)."""
    by_dtype: Dict[torch.dtype, List[torch.Tensor]] = {}
    for b in model.buffers():
        if b.numel() > 0 and not b.is_meta:
            by_dtype.setdefault(b.dtype, []).append(b)
    with torch.no_grad():
        for bufs in by_dtype.values():
            flat = torch.cat([b.detach().reshape(-1).to(executor.device) for b in bufs])
            # as bytes: the backends do not all take every dtype (gloo: bool, float8)
            executor.broadcast(flat.view(torch.uint8), 0).wait()
            at = 0
            for b in bufs:
                b.copy_(flat[at:at + b.numel()].view(b.shape).to(b.device, b.dtype))
                at += b.numel()


class _BufferSync:
    """broadcast_buffers=True: rank 0's buffers before each forward, as DDP decides it (before
    a forward that follows one run with gradients enabled and outside no_sync, and before the
    first)."""

    def __init__(self, model: nn.Module, opt: ZeroOptimizer):
        # the optimizer weakly, and its hooks go with it: the model holds them, and must not
        # keep a dropped stages 1-2 optimizer alive (compat.ModelManager)
        self.model, self.opt = model, weakref.ref(opt)
        self.pending = True
        opt._buffer_hooks = compat.release_on_collect(opt, [
            model.register_forward_pre_hook(self._pre_forward, prepend=True),
            model.register_forward_hook(self._post_forward)])

    def __deepcopy__(self, memo):
        # a copy of the model keeps these hooks, bound to this object: they skip the copy
        return self

    def _pre_forward(self, module, args) -> None:
        if self.pending and module is self.model:
            _broadcast_buffers(self.model, self.opt().executor)

    def _post_forward(self, module, args, output) -> None:
        if module is self.model:
            self.pending = torch.is_grad_enabled() and self.opt().reducer.sync_enabled


def _start_buffers(model: nn.Module, opt: ZeroOptimizer, every_forward: bool) -> None:
    ranks = getattr(opt.executor, "data_parallel_size", opt.executor.world_size)
    if ranks == 1 or not any(True for _ in model.buffers()):
        return
    _broadcast_buffers(model, opt.executor)
    if every_forward:
        opt._buffer_sync = _BufferSync(model, opt)


def _managed_by(model_or_params) -> Tuple[Optional[ZeroOptimizer], Optional[Set[int]]]:
    if isinstance(model_or_params, nn.Module):
        opt = compat.manager_of(model_or_params)
        return opt, {id(p) for p in model_or_params.parameters()}
    return None, {id(p) for p in model_or_params}


def _engine(opt) -> Optional[Stage3Engine]:
    return getattr(opt, "_engine", None)


@contextlib.contextmanager
def gathered(module_or_params, modifier_rank: Optional[int] = None, *,
             optimizer: Optional[ZeroOptimizer] = None):
    """Full parameters inside the block. Every rank enters it with the same arguments, except
    under stage 3 without a modifier rank where the ranks share one host's memory (CPU ranks
    on gloo, the default): there each rank reads every rank's shards on its own, and one rank
    may enter it alone (see zero_py/stage3/state_dict.py). Elsewhere a rank that enters it
    alone raises (after the process group's timeout at the latest).

    `module_or_params`: a model given to zero_py.initialize, one of its submodules, or some of
    its parameters (then pass `optimizer=`, the one initialize returned, unless the model
    itself is given). With `modifier_rank=r`, rank r's edits made in the block (under
    torch.no_grad()) are broadcast and become every rank's parameters (shards and fp32 masters)
    on exit; without it, edits are discarded. Under stages 1-2 the parameters are always full;
    the block then only applies the modifier rank's edits."""
    opt, ids = _managed_by(module_or_params)
    opt = optimizer or opt
    if opt is None:
        raise ValueError("zero_py.gathered needs the model given to zero_py.initialize, or "
                         "optimizer= (what initialize returned) with a submodule or parameters")
    engine = _engine(opt)
    if engine is not None:
        with engine.gathered(ids, modifier_rank):
            yield
        if modifier_rank is not None:
            opt.sync_master_from_params()
        return
    # before the block: found by the broadcast on exit, the ranks had kept their own edits
    check_modifier_rank("zero_py.gathered()", modifier_rank, opt.executor.world_size)
    fp = opt._flat
    requantize = modifier_rank is not None and quantized.weights_quantized(opt._wire)
    buckets = sorted({fp.param_bucket[i] for i, p in enumerate(fp.params) if id(p) in ids})
    if requantize:
        # quantized_weights: the peers' pieces here are quantized copies, which the broadcast
        # below would make every rank's own pieces; the block starts from the exact values
        with torch.no_grad():
            fp.all_gather(opt.executor, buckets)
    try:
        yield
        if modifier_rank is not None:
            with torch.no_grad():
                # a parameter given new values as a whole in the block (`p.data = t`, as
                # vector_to_parameters does) is an edit too: into the flat buffer, where the
                # broadcast and the step read it (step() would refuse it otherwise)
                for i in fp.moved_params():
                    p = fp.params[i]
                    if id(p) in ids and p.numel() == fp.param_numel[i]:
                        view = fp.param_view(i)
                        view.copy_(p.data.reshape(-1))
                        p.data = view.view_as(p)
                for p in fp.params:
                    if id(p) in ids:
                        opt.executor.broadcast(p.data, modifier_rank).wait()
            opt.sync_master_from_params()
    finally:
        if requantize:  # the copies as a publish of the (new) pieces leaves them
            with torch.no_grad():
                fp.all_gather(opt._wire, buckets)


def full_state_dict(model: nn.Module, rank: int = 0) -> Optional[Dict[str, torch.Tensor]]:
    """The model's state_dict with full tensors (cloned, on the CPU) on group rank `rank`, None
    elsewhere. Under stage 3 the units are gathered one at a time. Collective: every rank
    calls it, except under stage 3 where the ranks share one host's memory (then `rank` may
    call it alone; see zero_py/stage3/state_dict.py). The values are the trained ones, exact,
    with quantized_weights too (stages 1-2: where model.state_dict() holds the peers' pieces
    as the wire's copies)."""
    opt = compat.manager_of(model)
    if opt is None:
        raise ValueError("full_state_dict needs a model given to zero_py.initialize")
    engine = _engine(opt)
    if engine is not None:
        with opt._comm.outside():  # its gathers are in no step's comm_stats
            return stage3_state_dict.full_state_dict(model, engine, rank)
    if quantized.weights_quantized(opt._wire):
        with opt._comm.outside():
            return _exact_flat_state_dict(model, opt, rank)
    if opt.executor.rank != rank:
        return None
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def _exact_flat_state_dict(model: nn.Module, opt: ZeroOptimizer, rank: int
                           ) -> Optional[Dict[str, torch.Tensor]]:
    """Stages 1-2 with quantized_weights: every rank holds its peers' pieces as int8 (or bf16)
    copies, so the trained values are put together from every rank's own pieces, all-gathered
    exactly (collective: announced first, so that a rank calling it alone raises instead of
    waiting for ever)."""
    fp = opt._flat
    opt._reducer.announce_gathered("zero_py.full_state_dict()")
    regions = {b: torch.empty_like(fp.bucket_region(b)) for b in range(fp.n_buckets)}
    with torch.no_grad():
        for work in [opt.executor.all_gather(regions[b], fp.bucket_piece(b)) for b in regions]:
            work.wait()
    if opt.executor.rank != rank:
        return None
    exact = {id(p): regions[fp.param_bucket[i]][fp.param_offset[i]:fp.param_offset[i]
                                                 + fp.param_numel[i]].view_as(p)
             for i, p in enumerate(fp.params)}
    return {k: exact.get(id(v), v).detach().to("cpu", copy=True)
            for k, v in model.state_dict(keep_vars=True).items()}
