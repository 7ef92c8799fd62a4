"""Per-rank memory of zero_py's model states, estimated before training:
`zero_py.estimate_memory(model_or_param_count, world_size, stage, dtype)` and
`python -m zero_py estimate`.

The estimate follows the library's own accounting (ZeroOptimizer.memory_report()) term by
term, from the sizes alone:

- params: stages 1-2 every rank holds the whole model in flat buffers; stage 3 its shard (1/N)
  plus the parameters kept whole (persistence_threshold).
- grads: the rank's gradient shard (1/N, in the reduction dtype), the bucket buffers the
  reductions use (stages 1-2: up to three buckets at once, the one being filled and two
  reductions in flight; stage 3: the root unit's, one unit being filled and one in flight),
  the reduce-scatter receive buffers on gloo ((N - 2) / N of a bucket per reduction in flight),
  and in stage 1 the full param.grad that autograd leaves.
- optimizer_states: the fp32 states of the rank's shard (AdamW 8 B per element, SGD with
  momentum, Adagrad and Lion 4 B, SGD without momentum 0) and, for bf16/fp16 parameters, the
  fp32 master of the shard (4 B).
- working_set (stage 3): gathered units (by default the root, the unit in use and one
  prefetched: root + the two largest other units, bounded by prefetch_bytes) and, on one host,
  this rank's share of the shared-memory gather ring (2 x its chunk of the largest unit).
- buffers: the model's buffers (BatchNorm statistics, ...), whole on every rank.
- host, nvme (offload, docs/offload.md): under offload="cpu" the optimizer states and fp32
  masters (of every bucket, fp32 ones too), a copy of the gradient shard and the staging of
  updated bf16/fp16 values are host memory, not device memory; under offload="nvme" the host
  holds the ring (4 records of at most 8 MiB) and the disk both slots of every record (master
  and states, padded to whole chunks); offload_params="cpu" moves stage 3's shards to the host;
  offload_params="nvme" moves them to the parameter file (a record per bucket, two slots) and
  the host holds its ring (3 records of the largest piece per storage).

Activations, autograd's own temporaries and the allocator's slack are not model states and
are not counted. What the estimate is checked against: tests/test_estimate.py (the library's
memory_report() and resident memory measured on gloo ranks).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Dict, List, Optional, Sequence, Union

import torch
import torch.nn as nn

from zero_py.optim.arguments import DEFAULT_ALIGN_BYTES, DEFAULT_BUCKET_BYTES
from zero_py.sharding.reducer import MAX_BUCKETS_IN_FLIGHT

__all__ = ["MemoryEstimate", "estimate_memory", "state_bytes_per_element", "format_table"]

_STATE_BYTES = {"adamw": 8, "adam": 8, "adagrad": 4, "lion": 4, "sgd": 0}
_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
           "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}
# a model given as a bare parameter count: stage 3's units are assumed to be this fraction of
# it (the largest unit), unless largest_unit is given
DEFAULT_UNIT_FRACTION = 1 / 16


@dataclasses.dataclass
class MemoryEstimate:
    """Bytes one rank holds for model states (see the module docstring for each term)."""

    stage: int
    world_size: int
    param_count: int
    dtype: torch.dtype
    params: int
    grads: int
    optimizer_states: int
    working_set: int
    buffers: int
    # what DDP + torch.optim would hold per rank with the same precision recipe, by term:
    # params, grads (param.grad and the reducer's bucket copy), optimizer_states, buffers
    ddp_terms: Dict[str, int]
    host: int = 0  # offload: bytes in host memory (not in total, which is the device's)
    nvme: int = 0  # offload="nvme": bytes of the offload file
    shard_numel: int = 0  # the rank's shard of the trainable parameters, in elements
    shard_params: int = 0  # stage 3: bytes of the rank's parameter shards

    @property
    def ddp(self) -> int:
        return sum(self.ddp_terms.values())

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer_states + self.working_set + self.buffers

    def as_dict(self) -> Dict[str, int]:
        return {"params": self.params, "grads": self.grads,
                "optimizer_states": self.optimizer_states, "working_set": self.working_set,
                "buffers": self.buffers, "total": self.total, "ddp": self.ddp,
                "host": self.host, "nvme": self.nvme}


def state_bytes_per_element(optimizer: Union[str, type] = "adamw",
                            **optimizer_kwargs) -> int:
    """fp32 optimizer-state bytes per parameter element: AdamW/Adam 8 (12 with amsgrad),
    Adagrad and Lion 4, SGD 4 with momentum and 0 without."""
    name = optimizer if isinstance(optimizer, str) else getattr(optimizer, "__name__", "")
    key = name.lower()
    if key not in _STATE_BYTES:
        raise ValueError(f"no state size known for optimizer {name!r}: give one of AdamW, "
                         "Adam, SGD, Adagrad, Lion, or state_bytes= (fp32 bytes per element)")
    if key in ("adam", "adamw") and optimizer_kwargs.get("amsgrad"):
        return 12
    if key == "sgd":
        return 4 if optimizer_kwargs.get("momentum", 0) else 0
    return _STATE_BYTES[key]


def _dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype}")
        return dtype
    if isinstance(dtype, str) and dtype.lower() in _DTYPES:
        return _DTYPES[dtype.lower()]
    raise ValueError(f"dtype must be a torch dtype or one of {sorted(_DTYPES)}, got {dtype!r}")


@dataclasses.dataclass
class _Sizes:
    """What the estimate needs to know of a model, in elements."""

    trainable: List[int]          # trainable parameter sizes, in model order
    frozen: int = 0               # frozen parameter elements
    buffer_bytes: int = 0
    units: Optional[List[int]] = None  # stage 3: trainable + frozen elements per unit (0: root)
    kept: int = 0  # stage 3: elements of the parameters below persistence_threshold


def _model_sizes(model: nn.Module, wrap_policy, need_units: bool,
                 persistence_threshold: int) -> _Sizes:
    seen, trainable, frozen = set(), [], 0
    for p in model.parameters():
        if id(p) in seen or p.numel() == 0:
            continue
        seen.add(id(p))
        if p.requires_grad:
            trainable.append(p.numel())
        else:
            frozen += p.numel()
    buffer_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    units = None
    kept = 0
    if need_units:
        from zero_py.sharding.units import assign_units

        unit_list, unit_of = assign_units(model, wrap_policy)
        units = [0] * len(unit_list)
        for p in {id(p): p for p in model.parameters()}.values():
            if p.numel() < persistence_threshold:
                kept += p.numel()  # the persistent pseudo-unit, whole on every rank
            else:
                units[unit_of[id(p)]] += p.numel()
    return _Sizes(trainable, frozen, buffer_bytes, units, kept)


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def _buckets(sizes: Sequence[int], bucket_numel: int) -> List[int]:
    """Bucket sizes in elements: parameters packed in order up to bucket_numel (a larger
    parameter makes a bucket of its own), as the layout planner does."""
    out, cur = [], 0
    for n in sizes:
        if cur and cur + n > bucket_numel:
            out.append(cur)
            cur = 0
        cur += n
    if cur:
        out.append(cur)
    return out


def estimate_memory(model_or_param_count: Union[nn.Module, int, float], world_size: int,
                    stage: int, dtype=torch.float32, *, optimizer: Union[str, type] = "adamw",
                    optimizer_kwargs: Optional[dict] = None, state_bytes: Optional[int] = None,
                    grad_reduce_dtype=None, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                    wrap_policy=None, largest_unit: Optional[int] = None,
                    root_unit: int = 0, persistence_threshold: int = 0,
                    prefetch_bytes: Optional[int] = None, gloo: bool = True,
                    shared_memory: bool = True, offload=None,
                    offload_params=None, overlap_step: float = 0.0) -> MemoryEstimate:
    """Estimated per-rank bytes of model states under zero_py (see the module docstring).

    model_or_param_count: an nn.Module (on any device, the meta device included: only sizes
        are read) or a parameter count (e.g. 7e9).
    world_size, stage (1-3), dtype: the parameters' dtype (torch dtype or "fp32"/"bf16"/
        "fp16"); non-fp32 parameters get fp32 masters.
    optimizer: "adamw", "adam", "sgd", "adagrad", "lion" or the class, with optimizer_kwargs
        (momentum, amsgrad); or state_bytes: fp32 state bytes per element for any other.
    grad_reduce_dtype, bucket_bytes, persistence_threshold, prefetch_bytes: as for
        zero_py.initialize. wrap_policy: stage 3's units for a model (as initialize cuts them).
        For a parameter count, largest_unit / root_unit give the largest unit's and the root
        unit's parameter counts (default: 1/16 of the model, and 0).
    gloo: the reduce-scatter's receive buffers (gloo only); shared_memory: stage 3's gathers go
        through /dev/shm (all ranks on one host, the default).
    offload: None, "cpu" or "nvme" (offload_optimizer=); offload_params: None, "cpu" or "nvme"
        (stage 3; "nvme" with offload="nvme"): the offloaded bytes go to `host` and `nvme`
        instead of the device's terms. overlap_step (with offload="cpu"): its backup of masters
        and states for that share of the shard, in `host`."""
    if overlap_step and offload != "cpu":
        raise ValueError("overlap_step applies to offload='cpu' (offload_optimizer='cpu')")
    if offload not in (None, "none", "cpu", "nvme"):
        raise ValueError(f"offload must be None, 'cpu' or 'nvme' (offload_optimizer=), got "
                         f"{offload!r}")
    if offload_params not in (None, "none", "cpu", "nvme"):
        raise ValueError(f"offload_params must be None, 'cpu' or 'nvme', got "
                         f"{offload_params!r}")
    if offload_params in ("cpu", "nvme") and stage != 3:
        raise ValueError("offload_params applies to stage 3 only")
    if offload_params == "nvme" and offload != "nvme":
        raise ValueError("offload_params='nvme' needs offload='nvme' (offload_optimizer), as "
                         "zero_py.initialize does")
    if stage not in (1, 2, 3):
        raise ValueError(f"stage must be 1, 2 or 3, got {stage!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be an int >= 1, got {world_size!r}")
    dtype = _dtype(dtype)
    reduce_dtype = _dtype(grad_reduce_dtype) if grad_reduce_dtype is not None else dtype
    if state_bytes is None:
        state_bytes = state_bytes_per_element(optimizer, **(optimizer_kwargs or {}))
    if isinstance(model_or_param_count, nn.Module):
        sizes = _model_sizes(model_or_param_count, wrap_policy, stage == 3,
                             persistence_threshold)
    else:
        count = model_or_param_count
        if isinstance(count, bool) or not isinstance(count, (int, float)) or count < 1 \
                or count != int(count):
            raise ValueError(f"model_or_param_count must be an nn.Module or a whole number of "
                             f"parameters >= 1, got {count!r}")
        count = int(count)
        unit = int(largest_unit) if largest_unit else max(1, int(count * DEFAULT_UNIT_FRACTION))
        n_units = max(1, math.ceil((count - root_unit) / unit))
        rest = count - root_unit - unit * (n_units - 1)
        # parameters much smaller than a bucket, as in a transformer: buckets fill up to
        # bucket_bytes
        chunk = max(1, min(unit, bucket_bytes // dtype.itemsize))
        trainable = [chunk] * (count // chunk) + ([count % chunk] if count % chunk else [])
        sizes = _Sizes(trainable, units=[root_unit] + [unit] * (n_units - 1) + [rest])
    est = _estimate(sizes, world_size, stage, dtype, reduce_dtype, state_bytes,
                    bucket_bytes, prefetch_bytes, gloo, shared_memory)
    est = _offloaded(est, offload, offload_params == "cpu", dtype, reduce_dtype, state_bytes,
                     float(overlap_step))
    return _params_on_nvme(est, sizes, dtype) if offload_params == "nvme" else est


def _offloaded(est: MemoryEstimate, offload, params_on_host: bool, dtype: torch.dtype,
               reduce_dtype: torch.dtype, state_bytes: int,
               overlap_step: float = 0.0) -> MemoryEstimate:
    """`est` with the offloaded terms moved off the device (see the module docstring)."""
    if offload in (None, "none") and not params_on_host:
        return est
    shard = est.shard_numel
    host = nvme = 0
    states = est.optimizer_states
    if offload == "cpu":
        host = shard * (state_bytes + 4) + shard * reduce_dtype.itemsize
        host += 0 if dtype == torch.float32 else shard * dtype.itemsize
        host += int(overlap_step * shard) * (state_bytes + 4)  # offload/early.py's backup
        states = 0
    elif offload == "nvme":
        from zero_py.offload.nvme import DEFAULT_RING, record_geometry

        _, n_chunks, record = record_geometry(shard, state_bytes // 4)
        host = DEFAULT_RING * record
        nvme = 2 * n_chunks * record
        states = 0
    params = est.params
    if params_on_host:
        shards = est.shard_params
        params -= shards
        host += shards
    return dataclasses.replace(est, params=int(params), optimizer_states=int(states),
                               host=int(host), nvme=int(nvme))


def _params_on_nvme(est: MemoryEstimate, sizes: "_Sizes", dtype: torch.dtype) -> MemoryEstimate:
    """offload_params="nvme": the shards leave the device's params for the parameter file
    (a record per bucket, its piece rounded up to the direct-I/O alignment, two slots each);
    the host holds the ring (ZP_OFFLOAD_PARAM_RING records of the largest piece), one for the
    trainable parameters and one for the frozen ones when there are any."""
    from zero_py.offload.param_store import DEFAULT_PARAM_RING, param_record_bytes

    n, b = est.world_size, dtype.itemsize
    pad = n * max(1, DEFAULT_ALIGN_BYTES // b)
    units = sizes.units or [0, est.param_count]
    pieces = [_round_up(u, pad) // n * b for u in units if u]
    if sizes.kept:
        pieces.append(_round_up(sizes.kept, pad) // n * b)
    records = [param_record_bytes(x) for x in pieces]
    rings = 2 if sizes.frozen else 1
    host = rings * DEFAULT_PARAM_RING * max(records, default=0)
    return dataclasses.replace(est, params=int(est.params - est.shard_params),
                               host=int(est.host + host), nvme=int(est.nvme + 2 * sum(records)))


def _estimate(sizes: _Sizes, n: int, stage: int, dtype: torch.dtype,
              reduce_dtype: torch.dtype, state_bytes: int, bucket_bytes: int,
              prefetch_bytes: Optional[int], gloo: bool, shared_memory: bool) -> MemoryEstimate:
    b, rb = dtype.itemsize, reduce_dtype.itemsize
    master = 0 if dtype == torch.float32 else 4
    psi = sum(sizes.trainable)
    # every bucket is padded so that it splits into n aligned pieces
    pad = n * max(1, DEFAULT_ALIGN_BYTES // b)
    ddp = {"params": (psi + sizes.frozen) * b, "grads": 2 * psi * b,
           "optimizer_states": psi * (state_bytes + master), "buffers": sizes.buffer_bytes}
    if stage in (1, 2):
        buckets = [_round_up(x, pad) for x in _buckets(sizes.trainable,
                                                       max(1, bucket_bytes // b))]
        flat = sum(buckets)
        shard = flat // n
        params = flat * b + sizes.frozen * b
        # a reduction over one rank is done at once: its buffer is reused by the next bucket
        live = sorted(buckets, reverse=True)[:1 if n == 1 else MAX_BUCKETS_IN_FLIGHT + 1]
        in_flight = sorted(buckets, reverse=True)[:MAX_BUCKETS_IN_FLIGHT]
        grads = shard * rb + sum(live) * rb
        if gloo and n > 2:
            grads += sum(x * (n - 2) // n for x in in_flight) * rb
        if stage == 1:
            grads += psi * b
        states = shard * (state_bytes + master)
        working = 0
    else:
        units = sizes.units or [0, psi + sizes.frozen]
        unit_pad = [_round_up(u, pad) if u else 0 for u in units]
        kept_pad = _round_up(sizes.kept, pad) if sizes.kept else 0
        # the persistent pseudo-unit is sharded like the others and also held whole
        shard_numel = (sum(unit_pad) + kept_pad) // n
        params = shard_numel * b + kept_pad * b
        root, others = unit_pad[0], sorted(unit_pad[1:], reverse=True)
        largest = others[0] if others else 0
        budget = prefetch_bytes if prefetch_bytes is not None else (root + 2 * largest) * b
        gathered = min(root * b + sum(others[:2]) * b, max(budget, root * b + largest * b))
        gathered += kept_pad * b  # the persistent unit, gathered once (counted once more)
        transport = 2 * _round_up(largest * b // n, 64) if shared_memory and n > 1 else 0
        working = gathered + transport
        trainable_shard = shard_numel * psi // max(1, psi + sizes.frozen)
        live = [max(largest, kept_pad)] if n == 1 else [root, kept_pad] + others[:2]
        grads = trainable_shard * rb + sum(live) * rb
        if gloo and n > 2:  # a reduction in flight and the next one's receive buffers
            grads += 2 * (largest * (n - 2) // n) * rb
        if not psi:  # nothing trainable (a reference or teacher model): nothing is reduced
            grads = 0
        states = trainable_shard * (state_bytes + master)
    return MemoryEstimate(stage, n, psi + sizes.frozen, dtype, int(params), int(grads),
                          int(states), int(working), int(sizes.buffer_bytes), ddp,
                          shard_numel=int(shard if stage in (1, 2) else trainable_shard),
                          shard_params=int(shard_numel * b) if stage == 3 else 0)


# -- the table ---------------------------------------------------------------------------------

def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def format_table(estimates: Sequence[MemoryEstimate]) -> str:
    """The estimates side by side: one column per stage (and DDP), one row per term."""
    rows = [("params", "params"), ("grads", "grads"), ("optimizer states", "optimizer_states"),
            ("stage-3 working set", "working_set"), ("buffers", "buffers"), ("total", "total")]
    offloaded = [(label, key) for label, key in (("host (offload)", "host"),
                                                 ("NVMe (offload)", "nvme"))
                 if any(getattr(e, key) for e in estimates)]
    heads = [f"stage {e.stage}" for e in estimates] + ["DDP"]
    ddp = {**estimates[0].ddp_terms, "working_set": 0, "total": estimates[0].ddp}
    table = [[label] + [_human(e.as_dict()[key]) for e in estimates] + [_human(ddp[key])]
             for label, key in rows]
    table.append(["of DDP's total"] + [f"{100 * e.total / e.ddp:.1f}%" for e in estimates]
                 + ["100%"])
    table += [[label] + [_human(getattr(e, key)) for e in estimates] + ["-"]
              for label, key in offloaded]
    widths = [max(len(r[i]) for r in table + [[""] + heads]) for i in range(len(heads) + 1)]
    lines = ["  ".join([" " * widths[0]] + [h.rjust(w) for h, w in zip(heads, widths[1:])])]
    for r in table:
        lines.append("  ".join([r[0].ljust(widths[0])]
                               + [c.rjust(w) for c, w in zip(r[1:], widths[1:])]))
    return "\n".join(lines)


# -- python -m zero_py estimate -----------------------------------------------------------------

def model_from_hf_config(path: str) -> nn.Module:
    """A Hugging Face model built from its config.json (a file or the folder holding it) on the
    meta device: its sizes without its memory. Causal LMs get their LM head (tied or not)."""
    import json
    import os

    try:
        import transformers
    except ImportError:
        raise RuntimeError("--config needs the transformers package (pip install transformers); "
                           "or give --params") from None
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    with open(path) as f:
        data = json.load(f)
    model_type = data.pop("model_type", None)
    if model_type is None:
        raise ValueError(f"{path} has no model_type: is it a Hugging Face config.json?")
    cfg = transformers.AutoConfig.for_model(model_type, **data)
    with torch.device("meta"):
        try:
            return transformers.AutoModelForCausalLM.from_config(cfg)
        except ValueError:  # not a causal LM: the bare model
            return transformers.AutoModel.from_config(cfg)


def hf_block_policy(model: nn.Module):
    """Stage 3's units for a Hugging Face model: its blocks (the classes _no_split_modules
    names, e.g. LlamaDecoderLayer), or None (zero_py's default policy)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    classes = {type(m) for m in model.modules() if type(m).__name__ in names}
    return classes or None


def _count(text: str) -> float:
    """A parameter count: 7e9, 7000000000, 7B, 1.3b, 350M, 125k."""
    scale = {"k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}.get(text[-1:].lower())
    try:
        return float(text[:-1]) * scale if scale else float(text)
    except ValueError:
        import argparse

        raise argparse.ArgumentTypeError(
            f"not a parameter count: {text!r} (e.g. 7e9 or 7B)") from None


def _parse_stages(text: str) -> List[int]:
    try:
        stages = sorted({int(s) for s in text.split(",")})
    except ValueError:
        raise ValueError(f"--stage takes 1, 2, 3 or a list like 1,2,3; got {text!r}") from None
    if not stages or any(s not in (1, 2, 3) for s in stages):
        raise ValueError(f"--stage takes 1, 2, 3 or a list like 1,2,3; got {text!r}")
    return stages


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "estimate", help="per-rank memory of model states under each ZeRO stage",
        description="Estimates what one rank holds for model states (params, grads, optimizer "
                    "states, stage 3's working set, buffers) under zero_py, stages side by "
                    "side, beside DDP. Give the model as --params or --config.")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", type=_count, help="parameter count, e.g. 7e9 or 7B")
    what.add_argument("--config", help="a Hugging Face config.json (or its folder): the model "
                                       "is built on the meta device and its parameters counted")
    p.add_argument("--world", type=int, required=True, help="data-parallel ranks")
    p.add_argument("--stage", default="1,2,3",
                   help="stages to show: 1, 2, 3 or a list (default 1,2,3)")
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"],
                   help="parameter dtype (bf16/fp16 add fp32 masters; default fp32)")
    p.add_argument("--optimizer", default="adamw",
                   choices=["adamw", "adam", "sgd", "sgd-momentum", "adagrad", "lion"])
    p.add_argument("--bucket-bytes", type=int, default=DEFAULT_BUCKET_BYTES,
                   help="gradient bucket size of stages 1-2 (default 25 MiB)")
    p.add_argument("--unit-params", type=_count,
                   help="stage 3, with --params: the largest unit's parameter count (default: "
                        "1/16 of the model)")
    p.add_argument("--root-params", type=_count, default=0,
                   help="stage 3, with --params: parameters of the root unit, always gathered "
                        "(e.g. untied embeddings)")
    p.add_argument("--backend", default="gloo", choices=["gloo", "nccl"],
                   help="gloo adds the reduce-scatter's receive buffers and, on one host, the "
                        "shared-memory gathers; default gloo")
    p.add_argument("--offload", default="none", choices=["none", "cpu", "nvme"],
                   help="offload_optimizer: the optimizer's bytes in host memory or on NVMe")
    p.add_argument("--offload-params", default="none", choices=["none", "cpu", "nvme"],
                   help="offload_params (stage 3): the parameter shards in host memory, or on "
                   "NVMe (with --offload nvme)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=_main)


def _main(args) -> int:
    import json
    import sys

    try:
        stages = _parse_stages(args.stage)
        if args.world < 1:
            raise ValueError(f"--world must be >= 1, got {args.world}")
        kw = dict(dtype=args.dtype, optimizer="sgd" if args.optimizer == "sgd-momentum"
                  else args.optimizer,
                  optimizer_kwargs={"momentum": 0.9} if args.optimizer == "sgd-momentum" else {},
                  bucket_bytes=args.bucket_bytes, gloo=args.backend == "gloo",
                  shared_memory=args.backend == "gloo")
        if args.config:
            model = model_from_hf_config(args.config)
            what = f"{type(model).__name__} from {args.config}"
            kw["wrap_policy"] = hf_block_policy(model)
            subject = model
        else:
            subject = args.params
            what = f"{args.params:.4g} parameters"
            if args.unit_params:
                kw["largest_unit"] = int(args.unit_params)
            kw["root_unit"] = int(args.root_params)
        estimates = [estimate_memory(subject, args.world, s, offload=args.offload,
                                     offload_params=args.offload_params if s == 3 else None,
                                     **kw) for s in stages]
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"zero_py estimate: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"model": what, "world_size": args.world, "dtype": args.dtype,
                          "param_count": estimates[0].param_count,
                          "stages": {str(e.stage): e.as_dict() for e in estimates}}, indent=2))
        return 0
    print(f"{what}: {estimates[0].param_count:,} parameters, {args.dtype}, {args.optimizer}, "
          f"{args.world} rank(s), {args.backend}; bytes per rank:")
    print(format_table(estimates))
    if any(e.stage == 3 for e in estimates) and not args.config and not args.unit_params:
        print("stage 3's working set assumes units of 1/16 of the model: give --unit-params "
              "(e.g. one transformer block) for yours")
    return 0
