"""zero_py.profile(): labels zero_py's communication, copies and updates in a torch profiler trace.

    with zero_py.profile(model, trace="trace_rank{rank}.json"):
        for step in range(5):
            model(x).sum().backward(); optimizer.step(); optimizer.zero_grad()

Inside the block every collective zero_py starts, every wait on one, the copy of each gradient
into its bucket, each stage-3 unit's gather and free, the fused update of the rank's shard and
the all-gather of the updated parameters run inside torch.profiler.record_function ranges named
in LABELS ("zero_py.reduce_scatter", "zero_py.update", ...). In a Chrome/Perfetto trace
(chrome://tracing, ui.perfetto.dev) they sit on the same timeline as the model's own operators
(aten::mm, ...), so communication shows against compute. `trace=` also runs torch.profiler
(CPU, and CUDA when available) over the block and writes that trace on exit, "{rank}" in the
path replaced by the rank; without it the labels show in a profiler the caller runs.

How: the labels are installed on the given optimizers' objects (their executors, gradient
reducer, update, parameter storage, stage-3 engine) by wrapping those instances' methods for
the duration of the block, and removed on exit; the classes and other instances are untouched,
and values are unchanged (tests/test_profile.py compares the losses with an unprofiled run).
A method that an object does not have is skipped: `installed` on the handle lists the labels
that were placed. Build LR schedulers before the block: one built inside wraps the labelled
optimizer.step, and that wrapper goes when the label is removed.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed as dist
from torch.profiler import record_function

from zero_py.optim.compat import manager_of

__all__ = ["LABELS", "Profile", "profile"]

# label -> what it covers
LABELS: Dict[str, str] = {
    "zero_py.step": "optimizer.step(): waiting for the gradient shard, the update, the "
                    "parameters' all-gather",
    "zero_py.clip_grad_norm": "the global gradient norm (a read pass and one all-reduce)",
    "zero_py.update": "the optimizer math on this rank's fp32 shard (fused kernel or "
                      "torch.optim), with the cast back into the parameters",
    "zero_py.publish_params": "after the update: the all-gather of the updated parameters "
                              "(stage 3: the refresh of units held gathered)",
    "zero_py.copy_grad": "a gradient copied (and averaged) into its bucket buffer",
    "zero_py.wait_reduce_scatter": "waiting for gradient reductions in flight",
    "zero_py.wait_grads": "at the step: waiting for the last reductions of the gradient shard",
    "zero_py.gather_unit": "stage 3: starting a unit's all-gather",
    "zero_py.wait_unit": "stage 3: waiting for a unit's all-gather",
    "zero_py.free_unit": "stage 3: freeing a unit's full parameters",
    "zero_py.reduce_scatter": "a reduce-scatter started (gradients)",
    "zero_py.all_gather": "an all-gather started (parameters)",
    "zero_py.all_reduce": "an all-reduce started (norms, flags)",
    "zero_py.all_reduce_max": "a max all-reduce started (which parameters got gradients, the "
                              "stage-3 order)",
    "zero_py.broadcast": "a broadcast started",
    "zero_py.all_to_all": "an all-to-all started (quantized gradients, or bf16 gradients "
                          "summed in fp32)",
}

_EXECUTOR_METHODS = ("reduce_scatter", "all_gather", "all_reduce", "all_reduce_max", "broadcast",
                     "all_to_all")


class Profile:
    """What `with zero_py.profile(...) as p` gives: `installed` (the labels placed, sorted),
    `profiler` (the torch.profiler.profile run for `trace=`, else None) and `trace_path` (the
    file written on exit, else None)."""

    def __init__(self) -> None:
        self.installed: List[str] = []
        self.profiler: Optional[torch.profiler.profile] = None
        self.trace_path: Optional[str] = None


def _optimizers(targets) -> List[object]:
    out = []
    for t in targets:
        opt = manager_of(t) if isinstance(t, torch.nn.Module) else t
        if opt is None or not hasattr(opt, "_reducer"):
            raise TypeError(f"zero_py.profile takes models given to zero_py.initialize or "
                            f"ZeroOptimizers, got {type(t).__name__}")
        if all(opt is not o for o in out):
            out.append(opt)
    return out


def _seams(opt) -> List[Tuple[object, str, str]]:
    """(object, method name, label) for every place of `opt` that gets a label."""
    seams = [(opt, "step", "zero_py.step"), (opt, "clip_grad_norm_", "zero_py.clip_grad_norm")]
    update, storage, reducer = (getattr(opt, n, None) for n in ("_update", "_flat", "_reducer"))
    engine = getattr(opt, "_engine", None)
    seams += [(update, "step", "zero_py.update"),
              (storage, "publish", "zero_py.publish_params"),
              (reducer, "_copy_in", "zero_py.copy_grad"),
              (reducer, "_retire", "zero_py.wait_reduce_scatter"),
              (reducer, "finish", "zero_py.wait_grads"),
              (engine, "_gather", "zero_py.gather_unit"),
              (engine, "_wait", "zero_py.wait_unit"),
              (engine, "_free", "zero_py.free_unit")]
    executors = [opt.executor, getattr(reducer, "executor", None),
                 getattr(storage, "executor", None), getattr(engine, "executor", None),
                 getattr(getattr(storage, "frozen_storage", None), "executor", None)]
    seen = set()
    for ex in executors:
        if ex is not None and id(ex) not in seen:
            seen.add(id(ex))
            seams += [(ex, m, f"zero_py.{m}") for m in _EXECUTOR_METHODS]
    return [(o, m, label) for o, m, label in seams if o is not None]


def _label(obj, name: str, label: str, undo: List[Callable[[], None]]) -> bool:
    fn = getattr(obj, name, None)
    if not callable(fn) or getattr(fn, "_zero_py_label", None) is not None \
            or not hasattr(obj, "__dict__"):
        return False
    own = obj.__dict__.get(name, _MISSING)

    @functools.wraps(fn)
    def labelled(*args, **kwargs):
        with record_function(label):
            return fn(*args, **kwargs)

    labelled._zero_py_label = label
    setattr(obj, name, labelled)

    def restore() -> None:
        if own is _MISSING:
            obj.__dict__.pop(name, None)
        else:
            setattr(obj, name, own)

    undo.append(restore)
    return True


_MISSING = object()


def _trace_path(path: str) -> str:
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return path.replace("{rank}", str(rank))


@contextlib.contextmanager
def profile(*targets, trace: Optional[str] = None, **profiler_kwargs) -> Iterator[Profile]:
    """Labels what zero_py does for `targets` (models given to zero_py.initialize, or
    ZeroOptimizers) with torch.profiler.record_function ranges (LABELS) inside the block.

    `trace`: also profile the block with torch.profiler (CPU, plus CUDA when available;
    `profiler_kwargs` go to torch.profiler.profile) and write its Chrome/Perfetto trace there on
    exit ("{rank}" in the path becomes the rank). Returns a Profile handle."""
    opts = _optimizers(targets)
    if not opts:
        raise TypeError("zero_py.profile needs the model given to zero_py.initialize (or its "
                        "ZeroOptimizer): profile(model)")
    if profiler_kwargs and trace is None:
        raise ValueError(f"{sorted(profiler_kwargs)} configure the profiler that trace= runs; "
                         "pass trace= too")
    handle = Profile()
    undo: List[Callable[[], None]] = []
    try:
        for opt in opts:
            for obj, name, label in _seams(opt):
                if _label(obj, name, label, undo):
                    handle.installed.append(label)
        handle.installed = sorted(set(handle.installed))
        if trace is None:
            yield handle
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        profiler_kwargs.setdefault("activities", activities)
        handle.profiler = torch.profiler.profile(**profiler_kwargs)
        with handle.profiler:
            yield handle
        handle.trace_path = _trace_path(trace)
        handle.profiler.export_chrome_trace(handle.trace_path)
    finally:
        for restore in reversed(undo):
            restore()
