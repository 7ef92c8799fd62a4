"""The rank payload of a save: the tensors one rank's file holds (parameter slices, fp32
masters, optimizer states, rank 0's buffers, `extra`, error-feedback residuals) and its record
for the manifest. Under offload_optimizer="nvme" the masters and states are Spans of the
offload file, and under offload_params="nvme" the parameter values are Spans of the parameter
files' records (offloaded.py), read as the file writer reaches them."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from zero_py.checkpoint import feedback, plain
from zero_py.checkpoint.holdings import Held, persistent_buffers
from zero_py.checkpoint.offloaded import PieceReaders, Span, SpanReader
from zero_py.optim.update import BUFFER


def _streamed_state(opt, s, reader: SpanReader) -> Optional[Dict[str, Any]]:
    """_slice_state's answer for an optimizer whose state is on NVMe, with Spans of the offload
    file in place of the master and state tensors (in the same order: the file is the same)."""
    if opt._step_count[s.param] == 0:
        return None
    update, flat = reader.update, opt._flat
    lo = flat.bucket_shard_offset[s.bucket] + s.piece_lo
    state: Dict[str, Any] = {}
    if opt._step_in_state():
        state["step"] = torch.tensor(float(opt._step_count[s.param]), dtype=torch.float32)
    for j, key in enumerate(update.keys):
        if key == BUFFER and s.param in update.no_momentum_yet:
            continue  # SGD stepped without momentum only: no buffer (as _slice_state)
        state[key] = reader.span(j + 1, lo, lo + s.numel)
    if opt._masters.dtype_of[s.bucket] is not None:
        state["master_param"] = reader.span(0, lo, lo + s.numel)
    return state


def _unstepped_master(opt, s, reader: Optional[SpanReader]):
    """The fp32 master of slice s of a parameter not stepped yet (a view, or a Span of the NVMe
    offload file), or None where its bucket has none (fp32: the parameter is its own). A save
    before the first step holds it too: the manifest says "master", and after a load of an
    fp32 checkpoint into a bf16 model it holds more than the parameter's bits."""
    if opt._masters.dtype_of[s.bucket] is None:
        return None
    if reader is not None:
        lo = opt._flat.bucket_shard_offset[s.bucket] + s.piece_lo
        return reader.span(0, lo, lo + s.numel)
    return opt._masters.piece(s.bucket)[s.piece_lo:s.piece_hi]


def _record_order(h: Held) -> tuple:
    """Where a parameter on NVMe sits in its file (trainable before frozen, then bucket and
    offset); the others after them. A rank file in this order reads each record of the
    parameter files once (the persistent unit's bucket holds parameters from every block), and
    the optimizer's records in shard-space order."""
    if h.on_file is None or h.on_file[1] is None:
        return (1,)
    s = h.on_file[1]
    return (0, h.index is None, s.bucket, s.piece_lo)


def rank_payload(model, opt, held: Dict[str, Held], extra, reader: Optional[SpanReader] = None,
                  records: Optional[PieceReaders] = None
                  ) -> Tuple[List[Tuple[str, Any]], Dict[str, Any]]:
    """This rank's tensors (file order) and its record for the manifest. With `reader` (the
    optimizer's state is on NVMe), its masters and states are Spans read as the file is
    written; so are the values of parameters on NVMe (Held.on_file), through `records`."""
    tensors: List[Tuple[str, Any]] = []
    pieces: Dict[str, List[int]] = {}
    states: Dict[str, Dict[str, Any]] = {}
    items = list(held.items())
    if any(h.on_file is not None for h in held.values()):
        items.sort(key=lambda item: _record_order(item[1]))
    for name, h in items:
        if h.hi == h.lo:
            continue
        pieces[name] = [h.lo, h.hi]
        tensors.append((f"param/{name}", h.values if h.on_file is None else records.span(h)))
        if h.slice is None:
            continue
        state = (opt._slice_state(h.slice, copy=False) if reader is None
                 else _streamed_state(opt, h.slice, reader))
        if state is None:  # not stepped yet: no state, but its fp32 master (the manifest
            master = _unstepped_master(opt, h.slice, reader)  # says it has one)
            if master is not None:
                tensors.append((f"master/{name}", master))
            continue
        keys, scalars = [], {}
        for key, value in state.items():
            if key == "master_param":
                tensors.append((f"master/{name}", value))
            elif (isinstance(value, (torch.Tensor, Span)) and len(value.shape) == 1
                  and value.numel() == h.hi - h.lo):
                keys.append(key)
                tensors.append((f"state/{key}/{name}", value))
            elif key != "step":
                scalars[key] = plain.encode(value, None, f"optimizer state {key!r} of {name}")
        step = state.get("step")
        states[name] = {"keys": keys, "scalars": scalars,
                        "step_tensor": None if not isinstance(step, torch.Tensor)
                        else plain.dtype_name(step.dtype)}
    if opt.executor.rank == 0:
        for name, buf in persistent_buffers(model).items():
            tensors.append((f"buffer/{name}", buf.detach()))
    extra_tensors: List[Tuple[str, torch.Tensor]] = []

    def sink(t: torch.Tensor) -> str:
        key = f"extra/{len(extra_tensors)}"
        extra_tensors.append((key, t.detach()))
        return key

    encoded = None if extra is None else plain.encode(extra, sink, "extra")
    tensors.extend(extra_tensors)
    residuals, fed = feedback.payload(opt)  # grad_error_feedback's residuals
    tensors.extend(residuals)
    record = {"pieces": pieces, "states": states, "extra": encoded, "feedback": fed}
    return tensors, record
