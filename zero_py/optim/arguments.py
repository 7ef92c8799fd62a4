"""ZeroOptimizer's constructor arguments: their defaults, their checks (check_arguments, which
zero_py.initialize also runs before it shards a stage-3 model; check_param, each parameter's),
and the fingerprint the ranks agree on before anything is laid out or sent
(optim/agreement.py)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from zero_py.collectives import quantized
from zero_py.config import environment
from zero_py.offload import check_offload_optimizer
from zero_py.offload.early import check_overlap_step
from zero_py.optim import compat
from zero_py.optim.loss_scaler import LossScaler
from zero_py.optim.update import refuse_unhonoured_options

DEFAULT_BUCKET_BYTES = 25 * 2**20
DEFAULT_QUANTIZE_BLOCK = 256  # values per fp32 scale on a quantized wire (ZeRO++ uses 256-2048)
DEFAULT_ALIGN_BYTES = 64
PARAM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# torch.optim classes whose update of a parameter reads more than each element's own values:
# on a rank's 1-D slice of the flattened parameter they would compute something else (by name:
# Adafactor and Muon are recent)
_WHOLE_PARAMETER_OPTIMIZERS = {
    "Adafactor": "it factors the second moment of a matrix into row and column means and "
                 "scales its step by the parameter's RMS",
    "Muon": "it orthogonalizes each 2-D parameter as a whole",
    "LBFGS": "it takes dot products over all the parameters and re-evaluates a closure",
    "SparseAdam": "it takes sparse gradients",
}


def first_tensor(params: list) -> Optional[torch.Tensor]:
    """The first parameter of a params list as torch.optim takes it (tensors, (name, tensor)
    pairs, or param-group dicts of either), or None; a group's generator is not consumed."""
    for item in params:
        group = item.get("params", ()) if isinstance(item, dict) else [item]
        if not isinstance(group, (list, tuple, torch.Tensor)):
            continue
        for q in [group] if isinstance(group, torch.Tensor) else group:
            q = q[1] if isinstance(q, tuple) else q
            if isinstance(q, torch.Tensor):
                return q
    return None


def fingerprint(stage: int, executor, optimizer_class, options: Dict[str, Any],
                groups: Sequence[dict], params: Sequence[Tuple[str, Any]]) -> List[tuple]:
    """What every rank must agree on before it lays out or sends anything (agreement.check):
    the stage, the group, the optimizer and its options, then each parameter (`params`:
    agreement.param_entry), then the param groups' options. Settings come first, so a rank
    that took another stage is named as such rather than by its parameters."""
    ranks = ([executor.global_rank(r) for r in range(executor.world_size)]
             if hasattr(executor, "global_rank") else None)
    ranks = getattr(executor, "mesh_ranks", ranks)  # hybrid: every shard group, on every rank
    entries = [("stage", stage), ("world size", executor.world_size), ("group ranks", ranks),
               ("device type", torch.device(executor.device).type),
               ("executor", type(executor).__name__), ("optimizer class", optimizer_class)]
    entries += [(f"option {k}", v) for k, v in sorted(options.items())]
    entries += list(params)
    entries.append(("param groups", [{**{k: v for k, v in g.items() if k != "params"},
                                      "params": len(g["params"])} for g in groups]))
    return entries


def check_arguments(optimizer_class, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                    align_bytes: int = DEFAULT_ALIGN_BYTES,
                    grad_reduce_dtype: Optional[torch.dtype] = None,
                    grad_accum_dtype: Optional[torch.dtype] = None,
                    quantized_weights: Optional[str] = None,
                    quantized_grads: Optional[str] = None,
                    quantize_block: int = DEFAULT_QUANTIZE_BLOCK,
                    grad_error_feedback: bool = False,
                    quantized_grads_rounding: str = "nearest",
                    loss_scaler: Optional[LossScaler] = None, stochastic_rounding=False,
                    offload_optimizer: Optional[str] = None, offload_dir=None,
                    overlap_step: float = 0.0, **optimizer_kwargs) -> dict:
    """Checks the constructor's arguments (zero_py.initialize does it before it shards a
    stage-3 model) and returns optimizer_class's defaults with optimizer_kwargs applied."""
    environment.check()  # the ZP_* knobs, refused here rather than mid-forward
    if not (isinstance(optimizer_class, type)
            and issubclass(optimizer_class, torch.optim.Optimizer)):
        raise TypeError("optimizer_class must be a torch.optim.Optimizer subclass such as "
                        f"torch.optim.AdamW, got {optimizer_class!r}")
    for name, why in _WHOLE_PARAMETER_OPTIMIZERS.items():
        whole = getattr(torch.optim, name, None)
        if whole is not None and issubclass(optimizer_class, whole):
            raise ValueError(
                f"zero_py cannot run torch.optim.{name}: {why}, and each rank updates only "
                "its 1-D slice of the flattened parameters (ZeRO partitions elements, not "
                "parameters). Use an optimizer that updates each element from its own "
                "values: AdamW, Adam, SGD, Adagrad, zero_py.Lion, or a torch.optim class "
                "such as RMSprop, Adamax, NAdam or RAdam")
    if not isinstance(bucket_bytes, int) or bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
    if (not isinstance(align_bytes, int) or align_bytes < 4
            or align_bytes & (align_bytes - 1)):
        raise ValueError(f"align_bytes must be a power of two >= 4, got {align_bytes!r}")
    if grad_reduce_dtype not in (None, *PARAM_DTYPES):
        raise ValueError(f"grad_reduce_dtype must be None, torch.float32, torch.bfloat16 or "
                         f"torch.float16, got {grad_reduce_dtype!r}")
    if grad_accum_dtype not in (None, torch.float32):
        raise ValueError(f"grad_accum_dtype must be None or torch.float32 (sum the "
                         f"grad_reduce_dtype values in fp32), got {grad_accum_dtype!r}")
    quantized.check_options(quantized_weights, quantized_grads, quantize_block,
                            grad_error_feedback, quantized_grads_rounding)
    if loss_scaler is not None and not isinstance(loss_scaler, LossScaler):
        raise TypeError(f"loss_scaler must be a zero_py.LossScaler, got {loss_scaler!r}")
    check_offload_optimizer(offload_optimizer, offload_dir)
    check_overlap_step(overlap_step, offload_optimizer, stage=2)  # the stage: __init__
    # The optimizer class validates its own keyword arguments and supplies the defaults.
    probe = optimizer_class([torch.zeros(1, requires_grad=True)], **optimizer_kwargs)
    refuse_unhonoured_options([probe.defaults], "the optimizer's options")
    return dict(probe.defaults)


def check_kind_options(optimizer_class, kind: Optional[str], dtypes, stochastic_rounding: bool,
                       offload_optimizer: Optional[str], overlap_step, stage: int) -> float:
    """The options that need a fused optimizer (`kind`: fused_kind's answer) or bf16
    parameters (`dtypes`: the parameters' dtypes); returns overlap_step as a share. Stage 3's
    initialize runs them before it shards the model, so that a refusal leaves it untouched."""
    if kind is None and stochastic_rounding:
        raise ValueError("stochastic_rounding needs a fused optimizer (AdamW, Adam, SGD, "
                         f"Adagrad or zero_py.Lion), not {optimizer_class.__name__}")
    if stochastic_rounding and torch.bfloat16 not in dtypes:
        # it would change nothing: fp16 parameters round to nearest even
        raise ValueError("stochastic_rounding rounds bf16 parameters from their fp32 "
                         "masters, and this optimizer has none (its parameters are "
                         f"{sorted(str(d) for d in dtypes)}): cast the model to "
                         "torch.bfloat16, or drop stochastic_rounding")
    if kind is None and offload_optimizer == "nvme":
        raise ValueError("offload_optimizer='nvme' streams the fused optimizers (AdamW, "
                         "Adam, SGD, Adagrad, zero_py.Lion), not "
                         f"{optimizer_class.__name__}; use offload_optimizer='cpu'")
    overlap_step = check_overlap_step(overlap_step, offload_optimizer, stage)
    if overlap_step and kind is None:
        raise ValueError("overlap_step runs the fused kernels (AdamW, Adam, SGD, Adagrad, "
                         f"zero_py.Lion) during backward, not {optimizer_class.__name__}")
    return overlap_step


def check_no_shared_storage(params: Sequence[torch.Tensor], name_of) -> None:
    """Refuses two distinct parameters whose elements overlap in memory (one a view of the
    other, or both views of one tensor): zero_py gives each parameter a place of its own in
    its flat buffers (stage 3: its shards), which would silently make them independent,
    where torch.optim under DDP updates the shared elements through both. The same
    Parameter object given twice (tied weights) is one parameter and fine. `name_of(p)`
    names a parameter in the message."""
    spans: Dict[Tuple[torch.device, int], List[Tuple[int, int, torch.Tensor]]] = {}
    seen = set()
    for p in params:
        if id(p) in seen or p.is_meta or p.numel() == 0:
            continue
        seen.add(id(p))
        if _overlaps_itself(p):
            raise ValueError(
                f"parameter {name_of(p)} overlaps itself in memory (an expanded tensor, or "
                "strides that revisit elements); torch.optim's in-place update refuses it, "
                "and zero_py would give each of its elements a place of its own, so they "
                "would silently train apart. Make the Parameter of its distinct values "
                "(e.g. nn.Parameter(t[:1].clone())) and expand it in the forward")
        key, lo, hi = _span(p)
        spans.setdefault(key, []).append((lo, hi, p))
    for found in spans.values():
        found.sort(key=lambda span: span[0])
        for (_, a_hi, a), (b_lo, _, b) in zip(found, found[1:]):
            if b_lo < a_hi:
                raise ValueError(
                    f"parameters {name_of(a)} and {name_of(b)} share memory (one is a view of "
                    "the other, or both of one tensor); zero_py gives each parameter a place "
                    "of its own in its flat buffers, so they would silently train apart. Tie "
                    "them as one Parameter (module.b = module.a), or make the second a "
                    "function of the first in the forward (a view taken there, e.g. "
                    "self.a[:16]), instead of a Parameter of its own")


def check_no_aliased_buffers(params: Sequence[torch.Tensor], buffers, name_of) -> None:
    """Refuses a buffer ((name, tensor) in `buffers`) whose elements overlap one of `params`,
    the parameters zero_py moves into storage of its own (stages 1-2: the trained ones; stage
    3: all): the buffer would keep the values it had, where under torch.optim it sees every
    update of the parameter. `name_of(p)` names a parameter in the message."""
    spans: Dict[Tuple[torch.device, int], List[Tuple[int, int, torch.Tensor]]] = {}
    for p in params:
        if not p.is_meta and p.numel() > 0:
            key, lo, hi = _span(p)
            spans.setdefault(key, []).append((lo, hi, p))
    for name, b in buffers:
        if b is None or b.is_meta or b.numel() == 0:
            continue
        key, b_lo, b_hi = _span(b)
        for lo, hi, p in spans.get(key, ()):
            if b_lo < hi and lo < b_hi:
                raise ValueError(
                    f"buffer {name!r} shares memory with parameter {name_of(p)} (one is a "
                    "view of the other); zero_py moves the parameter into storage of its "
                    "own, so the buffer would silently keep the values it had, where under "
                    "torch.optim it follows every update. Compute it from the parameter in "
                    "the forward (e.g. a property returning self.weight[:k]), or register a "
                    "copy (t.clone()) if it is meant to stay as it is")


def _span(t: torch.Tensor) -> Tuple[Tuple[torch.device, int], int, int]:
    """(device, storage) and the byte range [lo, hi) of it that tensor t can touch."""
    size = t.element_size()
    lo = t.storage_offset() * size
    hi = lo + size * (1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride())))
    return (t.device, t.untyped_storage().data_ptr()), lo, hi


def _overlaps_itself(p: torch.Tensor) -> bool:
    """Whether two elements of p are one element of its storage (an expand()ed tensor has a
    stride 0). Strides that nest, each at least the span of the smaller ones, cannot overlap
    (every contiguous, transposed, channels_last or sliced tensor); only other strides
    (as_strided) are checked element by element."""
    span = 1
    for stride, n in sorted((abs(st), n) for n, st in zip(p.shape, p.stride()) if n > 1):
        if stride == 0:
            return True
        if stride < span:
            break
        span = stride * n
    else:
        return False
    offsets = torch.zeros((), dtype=torch.int64)
    for n, stride in zip(p.shape, p.stride()):
        offsets = offsets.unsqueeze(-1) + torch.arange(n, dtype=torch.int64) * stride
    return offsets.unique().numel() < p.numel()


def check_param(p: torch.Tensor, i: int, name: Optional[str] = None,
                slices_ok: bool = False) -> None:
    """Refuses a parameter zero_py cannot train (meta, a left stage-3 slice, another device or
    dtype). `name`: the parameter's name, where known, for the message (else its index i).
    `slices_ok`: p may be a stage-3 shard slice (stage 3's own construction)."""
    what = f"parameter {name!r} (index {i})" if name else f"parameter {i}"
    if p.is_meta:  # it has no values, and cannot be moved: .to() of a meta tensor raises
        raise ValueError(f"{what} is on the meta device (no values yet): build the model "
                         "with zero_py.initialize(model, stage=3), which materializes it "
                         "module by module, or give it values first (model.to_empty("
                         "device=...) and initialize them) for stages 1-2")
    if not slices_ok and compat.left_sharded(p):
        # its ranks' slices differ in size: laid out again, the first broadcast aborted
        # the process inside gloo
        raise ValueError(
            f"{what} is a stage-3 shard slice (shape {tuple(p.shape)}, full shape "
            f"{tuple(p._zero_py_shape)}) that no optimizer manages: a zero_py.initialize"
            "(stage=3) of this model failed after sharding its parameters. Build the model "
            "again (or load its weights into a new one) before zero_py.initialize")
    if p.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{what} is on {p.device}: zero_py trains CPU and CUDA "
                         "parameters; move the model to one of them")
    if p.dtype not in PARAM_DTYPES:
        # (a frozen one under stage 3 is refused before, by initialize, with its remedy)
        if p.is_complex():  # a cast to a real dtype would drop the imaginary part
            raise ValueError(f"{what} has dtype {p.dtype}: zero_py trains float32, "
                             "bfloat16 and float16 parameters, not complex ones; keep it "
                             "as a real parameter of shape (..., 2) and take "
                             "torch.view_as_complex of it in the forward")
        raise ValueError(f"{what} has dtype {p.dtype}: zero_py trains float32, "
                         "bfloat16 and float16 parameters; cast the model to one of "
                         "them")
