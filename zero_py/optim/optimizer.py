"""ZeroOptimizer: a torch.optim.Optimizer that shards optimizer states (stage 1) and gradients
(stage 2) across the ranks of a process group, in fp32 or mixed precision.

Reading order: the storage (sharding/storage.py: FlatParams for stages 1-2, built here;
ShardedParams for stage 3, handed in by zero_py.initialize) lays the parameters out;
GradReducer (sharding/reducer.py) brings each rank the averaged gradient of its shard; this
class checks it (overflow, global norm), has the update (update.py: the fused kernels, or any
torch.optim class) run on the fp32 master shard, and has the storage publish the new values.

This file holds the class, its construction and its torch.optim surface; its mixins hold the
rest: the update path it builds over the storage (update_path.py), the training step
(training.py), state dicts (persistence.py), gradient statistics (grad_stats.py) and memory
accounting (accounting.py). The constructor's argument and parameter checks: arguments.py.
"""

from __future__ import annotations

import functools
from typing import Any, Dict, List, Optional, Sequence, Tuple, Type

import torch
import torch.distributed as dist

from zero_py.collectives import make_executor, make_hybrid_executor
from zero_py.collectives import stats as comm_stats
from zero_py.offload import HostShard, check_offload_optimizer
from zero_py.offload.early import EarlyStep
from zero_py.collectives import quantized
from zero_py.optim import agreement, compat, regroup
from zero_py.optim.accounting import MemoryAccounting
from zero_py.optim.arguments import (DEFAULT_ALIGN_BYTES, DEFAULT_BUCKET_BYTES,
                                     DEFAULT_QUANTIZE_BLOCK, check_arguments,
                                     check_kind_options, check_no_shared_storage, check_param,
                                     fingerprint, first_tensor)
from zero_py.optim.grad_stats import GradStatistics
from zero_py.optim.loss_scaler import LossScaler
from zero_py.optim.persistence import StateDicts
from zero_py.optim.streamed import StreamedUpdate
from zero_py.optim.training import TrainingStep
from zero_py.optim.update import fused_kind, refuse_unhonoured_options, warn_ignored_group_options
from zero_py.optim.update_path import UpdatePath
from zero_py.sharding.reducer import GradReducer
from zero_py.sharding.storage import FlatParams

__all__ = ["ZeroOptimizer"]


class ZeroOptimizer(TrainingStep, UpdatePath, StateDicts, GradStatistics, MemoryAccounting,
                    torch.optim.Optimizer):
    """Drop-in replacement for a torch.optim optimizer under data parallelism (ZeRO 1-2).

    Use it instead of DDP + torch.optim: build the model on every rank, then
    ``opt = ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=...)`` and train with the
    usual ``loss.backward(); opt.step(); opt.zero_grad()``. Gradients are averaged over the
    ranks as DDP does; rank 0's initial parameters are broadcast at construction.

    Args:
        params: parameters or param-group dicts, as for any torch.optim optimizer.
        optimizer_class: the torch.optim class to run on this rank's shard. AdamW runs in the
            fused C kernel; any other class runs unchanged on views of the shard (so it must
            update each element from its own values: Adafactor, Muon, LBFGS and SparseAdam
            are refused).
        stage: 1 shards optimizer states; 2 also shards gradients, reduced bucket by bucket
            during backward (param.grad is then None after backward).
        process_group: the data-parallel group (default: the world); with replicate_group,
            the shard group of hybrid sharding.
        replicate_group, device_mesh, hybrid: hybrid sharding (shard inside a group, replicate
            across groups; see zero_py/collectives/hybrid.py and docs/scale-out.md): this
            rank's replicate group beside process_group=; or a 2-D DeviceMesh with dims
            ("replicate", "shard"); or hybrid="node", one shard group per node from torchrun's
            environment. Gradients are averaged over every rank, as DDP over the world does.
        bucket_bytes: gradient bucket size; a bucket is one reduce-scatter.
        align_bytes: alignment of every parameter and shard in the flat buffers.
        grad_reduce_dtype: dtype gradients are reduced in (default: the parameters' own);
            torch.float32 gives bf16/fp16 models an fp32 sum.
        grad_accum_dtype: None (the sum in grad_reduce_dtype) or torch.float32: gradients
            travel in grad_reduce_dtype (e.g. bf16: half fp32's bytes) and are summed in fp32
            into an fp32 gradient shard (each value rounded once, to the wire dtype). On
            executors without all-to-all (NCCL older than 2.7, hybrid sharding) the sum is
            the executor's reduce-scatter, in the wire dtype, widened after.
        quantized_weights: None, "bf16" or "int8": the parameter all-gathers (stages 1-2's
            publish after step(), stage 3's gathers) carry fp32 parameters as bf16, or int8
            values with one fp32 scale per quantize_block values (ZeRO++ qwZ). A rank's own
            piece is never quantized.
        quantized_grads: None, "int8" or "int4": the gradient reduce-scatter quantizes each
            rank's contribution once, exchanges them in one all-to-all and sums in fp32
            (ZeRO++ qgZ; needs an executor with all_to_all: the torch.distributed one, or the
            native NCCL one on NCCL 2.7 or newer; refused under hybrid sharding).
        quantize_block: values per scale (default 256; even for int4). Only the wire is
            quantized: the fp32 masters and their update are exact (collectives/quantized.py).
        grad_error_feedback: with quantized_grads, each rank keeps what rounding its
            contributions lost (an fp32 residual of the peers' chunks of every bucket:
            (N - 1) / N of the gradients, counted in memory_report's grads) and adds it to its
            next contribution, so that no gradient is dropped for being below half a step.
        quantized_grads_rounding: "nearest" (default: values below half a step of their
            block are sent as zero, every step) or "stochastic" (each value rounds up with the
            probability of its fraction of a step, so a contribution is the gradient on
            average, with more variance; the noise follows the rank, step, bucket and pass, so
            runs repeat). Measured trade-offs: docs/scale-out.md.
        loss_scaler: a zero_py.LossScaler for fp16 training: scale the loss with
            scale_loss(loss); a step whose gradients overflow on any rank is skipped on all.
        stochastic_rounding: round bf16 parameters stochastically from their fp32 masters
            (fused optimizers only) instead of to nearest even.
        executor: who runs the collectives: "auto" (zero_py's native NCCL executor for CUDA
            parameters in an NCCL group, the torch.distributed executor otherwise), "nccl",
            "torch", or an executor object (see zero_py/collectives/).
        offload_optimizer: "cpu" keeps this rank's fp32 masters and optimizer states in host
            memory and runs the step there, bucket by bucket, with the fused CPU kernels
            (ZeRO-Offload; parameters and gradients stay on the device; docs/offload.md).
            "nvme" keeps them in a file under `offload_dir` and streams them through a small
            ring of host buffers at each step (ZeRO-Infinity; fused optimizers only).
        offload_dir: the directory (on a fast local drive) for offload_optimizer="nvme".
        overlap_step: with offload_optimizer="cpu" (stages 2-3, fused optimizers), the share
            of this rank's shard, in [0, 1] (True: all of it), that may be updated during
            backward, as soon as each bucket's gradient is on the host, before the total norm
            and the overflow check are known; a step that turns out clipped, skipped or
            otherwise different puts those buckets back and updates them as usual, so results
            are the same to the bit. Costs (1 + states) fp32 values of host memory per element
            of that share (offload/early.py). Off (0) by default.
        **optimizer_kwargs: hyperparameters for optimizer_class (lr, betas, weight_decay, ...).

    Parameters may be float32, bfloat16 or float16 (several dtypes in one model are fine);
    non-fp32 parameters get an fp32 master copy of this rank's shard. AdamW, Adam, SGD,
    Adagrad and zero_py.Lion run in the fused C kernels. Parameters with requires_grad=False at
    construction are kept as they are (never updated). Parameters live on the CPU or on one
    CUDA device per rank; CUDA shards are updated by the CUDA kernel family (zero_py.kernels.cuda).

    The ranks check that they agree before anything is laid out or sent (optim/agreement.py):
    a model or a setting that differs between ranks is a ValueError on every rank that names
    the first parameter or setting that differs. A parameter belongs to one ZeroOptimizer.

    torch idioms (optim/compat.py): `state` is a read-only view of this rank's slices of the
    state (state[p]["exp_avg"] is the rank's 1-D slice of p's flattened state; owned_range(p)
    says which elements); the state-dict hooks of torch.optim run; add_param_group works
    between steps under stages 1-2. torch.nn.utils.clip_grad_norm_ and torch.amp.GradScaler
    are refused with a pointer to clip_grad_norm_ and loss_scaler=, their equivalents here.
    """

    # torch.amp.GradScaler then hands step() its scale instead of reading param.grad, which holds
    # no reduced gradient here: step() refuses it with a pointer to zero_py.LossScaler
    _step_supports_amp_scaling = True

    def __init__(self, params, optimizer_class: Type[torch.optim.Optimizer] = torch.optim.AdamW,
                 *, stage: int = 2, process_group: Optional[dist.ProcessGroup] = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 align_bytes: int = DEFAULT_ALIGN_BYTES,
                 grad_reduce_dtype: Optional[torch.dtype] = None,
                 grad_accum_dtype: Optional[torch.dtype] = None,
                 quantized_weights: Optional[str] = None, quantized_grads: Optional[str] = None,
                 quantize_block: int = DEFAULT_QUANTIZE_BLOCK, grad_error_feedback: bool = False,
                 quantized_grads_rounding: str = "nearest",
                 loss_scaler: Optional[LossScaler] = None, stochastic_rounding: bool = False,
                 executor="auto", replicate_group: Optional[dist.ProcessGroup] = None,
                 device_mesh=None, hybrid: Optional[str] = None,
                 offload_optimizer: Optional[str] = None, offload_dir=None,
                 overlap_step: float = 0.0, storage=None,
                 _param_names: Optional[Dict[int, str]] = None,
                 _agreement: Sequence[Tuple[str, Any]] = (), **optimizer_kwargs):
        self._names = dict(_param_names or {})  # id(param) -> name, for messages
        self._state_view = compat.StateView(self)
        params = list(params) if not isinstance(params, torch.Tensor) else [params]
        # A refusal here is local; it is raised after the ranks' agreement, which carries it,
        # so that a rank refused alone makes every rank raise instead of leaving them waiting.
        problem: Optional[Exception] = None
        try:
            if stage not in (1, 2) and storage is None:
                raise ValueError(f"ZeroOptimizer takes stage 1 or 2, got {stage!r}; for stage 3 "
                                 "use model, optimizer = zero_py.initialize(model, ..., stage=3)")
            probe = self.check_arguments(optimizer_class, bucket_bytes=bucket_bytes,
                                         align_bytes=align_bytes,
                                         grad_reduce_dtype=grad_reduce_dtype,
                                         grad_accum_dtype=grad_accum_dtype,
                                         quantized_weights=quantized_weights,
                                         quantized_grads=quantized_grads,
                                         quantize_block=quantize_block,
                                         grad_error_feedback=grad_error_feedback,
                                         quantized_grads_rounding=quantized_grads_rounding,
                                         loss_scaler=loss_scaler,
                                         offload_optimizer=offload_optimizer,
                                         offload_dir=offload_dir, overlap_step=overlap_step,
                                         **optimizer_kwargs)
            # what optimizer_class takes besides its hyperparameters (its defaults): the inner
            # optimizer over the shards is built with them too
            self._class_kwargs = {k: v for k, v in optimizer_kwargs.items() if k not in probe}
            self._constructing = True
            super().__init__(params, probe)  # add_param_group checks ownership
            self._constructing = False
            given = [p for g in self.param_groups for p in g["params"]]
            dtypes = {p.dtype for p in given}
            quantized.check_dtypes(quantized_weights, quantized_grads, grad_reduce_dtype, dtypes)
            check_no_shared_storage(given, self._name)
            refuse_unhonoured_options(self.param_groups)
            kind = fused_kind(optimizer_class, self.param_groups)
            warn_ignored_group_options(optimizer_class, self.defaults, self.param_groups)
            overlap_step = check_kind_options(optimizer_class, kind, dtypes, stochastic_rounding,
                                              offload_optimizer, overlap_step, stage)
        except (TypeError, ValueError) as exc:
            problem = exc
        self.optimizer_class = optimizer_class
        self.stage = stage
        first = (next((p for g in self.param_groups for p in g["params"]), None)
                 if problem is None else first_tensor(params))
        device = first.device if first is not None else torch.device("cpu")
        try:
            self.executor = (make_hybrid_executor(process_group, replicate_group, device_mesh,
                                                  hybrid, device, executor)
                             or make_executor(process_group, device, executor))
        except (RuntimeError, TypeError, ValueError):
            if problem is not None:
                raise problem from None
            raise
        if storage is None:  # stage 3: zero_py.initialize checked before sharding
            entries = [("arguments", f"refused: {problem}" if problem else "accepted")]
            if problem is None:
                options = {"bucket_bytes": bucket_bytes, "align_bytes": align_bytes,
                           "grad_reduce_dtype": grad_reduce_dtype, "loss_scaler": loss_scaler,
                           "grad_accum_dtype": grad_accum_dtype,
                           "quantized_weights": quantized_weights,
                           "quantized_grads": quantized_grads, "quantize_block": quantize_block,
                           "grad_error_feedback": bool(grad_error_feedback),
                           "quantized_grads_rounding": quantized_grads_rounding,
                           "stochastic_rounding": bool(stochastic_rounding),
                           "offload_optimizer": offload_optimizer,
                           "overlap_step": overlap_step, **optimizer_kwargs}
                group_of = {id(p): k for k, g in enumerate(self.param_groups)
                            for p in g["params"]}
                all_params = [p for g in self.param_groups for p in g["params"]]
                entries += fingerprint(
                    stage, self.executor, optimizer_class, options, self.param_groups,
                    [agreement.param_entry(i, self._names.get(id(p)), p, group=group_of[id(p)])
                     for i, p in enumerate(all_params)]) + list(_agreement)
            agreement.check(self.executor, entries, "zero_py.ZeroOptimizer")
        if problem is not None:
            raise problem
        self._all_params: List[torch.Tensor] = [p for g in self.param_groups for p in g["params"]]
        owned = None if storage is None else {id(p) for p in storage.params}

        managed, groups_of, self._managed_index = [], [], []
        index = 0
        for gi, group in enumerate(self.param_groups):
            for p in group["params"]:
                if (p.requires_grad and p.numel() > 0) if owned is None else id(p) in owned:
                    self._check_param(p, index, self._names.get(id(p)),
                                      slices_ok=owned is not None)
                    managed.append(p)
                    groups_of.append(gi)
                    self._managed_index.append(index)
                index += 1
        if not managed and storage is None:
            raise ValueError("ZeroOptimizer got no trainable parameter: every parameter has "
                             "requires_grad=False or no elements. A model used only for "
                             "inference (a frozen reference or teacher) needs no optimizer: "
                             "keep it a plain model on every rank, or shard it with "
                             "zero_py.initialize(model, stage=3)")
        if len({p.device for p in managed}) > 1:
            raise ValueError("the parameters are on several devices "
                             f"({sorted(str(d) for d in {p.device for p in managed})}); zero_py "
                             "shards one device per rank: move the model to one device")
        self.loss_scaler = loss_scaler
        self.stochastic_rounding = bool(stochastic_rounding)
        self.last_step_skipped = False
        self.skipped_steps = 0
        self._clip_coef: Optional[float] = None  # from clip_grad_norm_, for the next step
        self._nonfinite: Optional[bool] = None   # overflow check done for the next step
        self._grad_reduce_dtype = grad_reduce_dtype
        self._grad_accum_dtype = grad_accum_dtype
        # the reducer's and the stages 1-2 publish's executor: the wire may be quantized or
        # widened (collectives/quantized.py); everything else uses self.executor
        self._wire, align_bytes = quantized.wire(
            self.executor, align_bytes, quantized_weights, quantized_grads, quantize_block,
            widening=grad_accum_dtype is not None, error_feedback=grad_error_feedback,
            rounding=quantized_grads_rounding)
        self._bucket_bytes, self._align_bytes = bucket_bytes, align_bytes
        self._kind = kind
        self.uses_fused_kernel = kind is not None
        self.offload_optimizer = check_offload_optimizer(offload_optimizer, offload_dir)
        self._offload_dir = offload_dir
        self._host: Optional[HostShard] = None
        self._overlap_step = float(overlap_step) if problem is None else 0.0
        self._early: Optional[EarlyStep] = None
        self._hook_handles: list = []
        if storage is None:
            storage = FlatParams(managed, groups_of, self.executor.world_size,
                                 self.executor.rank, align_bytes, bucket_bytes)
            storage.broadcast(self.executor, src=0)  # every rank starts from rank 0's values
        elif [id(p) for p in storage.params] != [id(p) for p in managed]:
            raise ValueError("the storage handed to ZeroOptimizer holds other parameters than "
                             "its trainable ones, or in another order")
        if not storage.shards_frozen:
            self._broadcast_frozen(managed)
        self._release = compat.release_on_collect(self, self._hook_handles)
        try:
            self._build(storage, [0] * len(managed))
            if not isinstance(self._update, StreamedUpdate):  # its file was written from them
                self.sync_master_from_params()
        except BaseException:
            # a failed construction (the NVMe file refused on a rank) takes its gradient hooks
            # back: left on the parameters, they fed a dead reducer, and a later optimizer over
            # the model failed in its first backward
            self._release()
            raise
        self._sr_seed = self._rounding_seed_base()
        compat.claim(self, managed)
        compat.install_clip_guards()
        compat.install_module_zero_grad()
        self._comm = comm_stats.StepWindow(self._comm_executors)  # comm_stats()

    @staticmethod
    @functools.wraps(check_arguments)
    def check_arguments(optimizer_class, **kwargs) -> dict:
        # the constructor's checks, without building anything (zero_py.initialize runs them
        # before it shards a stage-3 model): optim/arguments.py, which cannot name this class
        if isinstance(optimizer_class, type) and issubclass(optimizer_class, ZeroOptimizer):
            raise TypeError("optimizer_class must be a plain torch.optim class, not "
                            "ZeroOptimizer")
        return check_arguments(optimizer_class, **kwargs)

    # a parameter's checks (zero_py.initialize and add_param_group run them too)
    _check_param = staticmethod(check_param)

    def _broadcast_frozen(self, managed: List[torch.Tensor]) -> None:
        """Frozen parameters stay outside the flat buffers but start equal on every rank."""
        ids = {id(p) for p in managed}
        with torch.no_grad():
            for p in self._all_params:
                if id(p) not in ids and p.numel() > 0:
                    buf = p.detach().contiguous().clone()
                    # as bytes: frozen parameters may be of any dtype (int8 or float8 weights
                    # of a quantized base model), which gloo does not all take (float8: an
                    # "Invalid scalar type" that read as a peer's failure)
                    self.executor.broadcast(buf.view(-1).view(torch.uint8), 0).wait()
                    p.copy_(buf)

    def _name(self, p: torch.Tensor) -> str:
        name = self._names.get(id(p))
        if name is not None:
            return repr(name)
        index = next((i for i, q in enumerate(getattr(self, "_all_params", ())) if q is p), None)
        return f"of shape {tuple(p.shape)}" + (f" (index {index})" if index is not None else "")

    # -- construction ---------------------------------------------------------------------------

    @property
    def reducer(self) -> GradReducer:
        """The gradient path (stage 3's engine opens and closes its passes)."""
        return self._reducer

    @property
    def state(self) -> compat.StateView:
        """Read-only: parameter -> this rank's state of it. Per-element tensors (exp_avg, ...)
        are the rank's 1-D slice of the flattened parameter's state, views of the live state
        (owned_range(p) says which elements; empty where the rank holds none of p); "step";
        "master_param" (the fp32 slice) for bf16/fp16 parameters. The full tensors:
        consolidate_state_dict()."""
        return self._state_view

    @state.setter
    def state(self, value) -> None:
        if not getattr(self, "_constructing", False):
            raise AttributeError("ZeroOptimizer.state is a read-only view of this rank's shard; "
                                 "load state with load_state_dict()")
        # torch.optim.Optimizer.__init__ assigns its own dict: the view replaces it

    def __getstate__(self):
        # copy.deepcopy and pickle both come here. torch.optim's own __getstate__ keeps only
        # defaults, state and param_groups: the copy had no shard, buffers, reducer or group
        # and failed at its first step() with "no attribute '_flat'" (pickle: a raw weakref
        # error).
        raise TypeError(
            "a ZeroOptimizer cannot be copied or pickled (copy.deepcopy, pickle, "
            "torch.save(optimizer)): it holds this rank's shard, flat buffers that the "
            "model's parameters view, and its process group. Save its state with "
            "optimizer.state_dict() (this rank's shard), consolidate_state_dict(to=0) (the "
            "full torch.optim dict) or zero_py.save_checkpoint; for a second optimizer, build "
            "a new ZeroOptimizer over the copy's parameters and load_state_dict() into it.")

    def join_hook(self, **kwargs):
        # torch.distributed.algorithms.Join (uneven inputs) asks each joinable for this hook;
        # a joined rank would have to shadow every collective of its peers' steps (reductions,
        # gathers, counts, the clipping norm and the overflow check as the script calls them)
        raise NotImplementedError(
            "zero_py does not support torch.distributed.algorithms.Join (uneven inputs): give "
            "every rank the same number of batches per epoch, e.g. DistributedSampler("
            "drop_last=True), or stop every rank at the first rank's end (all-reduce a flag "
            "each step); a rank whose peers stopped waits in its next collective until the "
            "process group's timeout, then raises")

    def owned_range(self, p: torch.Tensor) -> Optional[Tuple[int, int]]:
        """The elements [lo, hi) of flattened parameter p whose state this rank keeps (what
        state[p] holds), or None where it keeps none."""
        k = self._managed_of.get(self._param_index.get(id(p), -1))
        s = self._flat.slice_of_param.get(k) if k is not None else None
        return (s.param_lo, s.param_hi) if s is not None else None

    def _param_state(self, i: int, read: bool = True) -> dict:
        """state[p] of parameter i (index into all parameters): views, or {}. read: the values
        are read (not only whether there are any), so an early update of overlap_step that
        holds the coming step's guess is put back first, as for a state dict."""
        k = self._managed_of.get(i)
        s = self._flat.slice_of_param.get(k) if k is not None else None
        if s is None:
            return {}
        if read:
            self.discard_early_updates([s.bucket])
        state = self._slice_state(s, copy=False)
        return self._as_torch_keeps(s, state) if state else {}

    def add_param_group(self, param_group: dict) -> None:
        """Adds a param group, as torch.optim does (e.g. layers a fine-tuning script unfreezes).
        Under stages 1-2 the flat layout is rebuilt with the new group's buckets after the
        others: every parameter already here keeps its slice, state and fp32 master, and the
        new parameters start from rank 0's values. Collective (every rank calls it with the
        same group), between step() and the next backward. Stage 3 lays parameters out at
        initialize: there, pass the layers to unfreeze in a group of their own from the start
        (e.g. with lr=0, raised later)."""
        if getattr(self, "_constructing", True):
            params = param_group.get("params") if isinstance(param_group, dict) else None
            params = [params] if isinstance(params, torch.Tensor) else list(params or ())
            compat.check_unowned([q[1] if isinstance(q, tuple) else q for q in params],
                                 self._name)
            if isinstance(param_group, dict) and "params" in param_group:
                # the list just made, not the group's own iterable: a generator (e.g.
                # {"params": layer.parameters()}) is spent by now, and torch.optim would take
                # it as an empty group, leaving those parameters untrained without a word
                param_group = {**param_group, "params": params}
            super().add_param_group(param_group)
            for name, q in zip(param_group.get("param_names", ()), param_group["params"]):
                self._names.setdefault(id(q), name)
            return
        regroup.add_param_group(self, param_group)
