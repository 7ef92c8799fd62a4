"""Ranks agree before they communicate: a fingerprint of what must match on every rank.

Every collective zero_py issues assumes that the ranks laid out the same parameters with the
same settings; when they did not (an extra layer on one rank, another dtype, other bucket
sizes, another wrap policy), the first collective that follows exchanges buffers of different
sizes and gloo aborts the process, or the ranks wait for collectives their peers never issue.
So ZeroOptimizer (stages 1-2) and zero_py.initialize (stage 3) first call check(): each rank
hashes an ordered list of (what, value) entries and the ranks all-gather the 32-byte digests,
one small collective. Only when the digests differ is there a second exchange (the entries
themselves, as JSON), after which every rank raises the same ValueError naming the first entry
that differs and its value on each rank. Nothing is laid out or sent before the check passes.

An entry's value is reduced to plain data (describe): numbers, strings, lists, dicts; dtypes,
devices and classes by name; tensors by shape and dtype (and their values when small); other
objects by their type, never by repr (which may hold a memory address that differs per rank).
"""

from __future__ import annotations

import hashlib
import json
import math
from typing import Any, List, Optional, Sequence, Tuple

import torch

from zero_py.collectives.objects import gather_json
from zero_py.collectives.stats import control
from zero_py.sharding.memory_order import MemoryOrder

DIGEST_BYTES = 32  # sha256
_SMALL_TENSOR = 16  # tensors of at most this many elements are described by their values

Entry = Tuple[str, Any]


def describe(value: Any) -> Any:
    """`value` as plain JSON data that is equal on two ranks exactly when the values agree."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)  # JSON has no nan/inf
    if isinstance(value, (torch.dtype, torch.device, torch.Size)):
        return str(value)
    if isinstance(value, torch.Tensor):
        out = {"tensor": list(value.shape), "dtype": str(value.dtype)}
        if not value.is_meta and value.numel() <= _SMALL_TENSOR:
            out["values"] = describe(value.detach().cpu().reshape(-1).tolist())
        return out
    if isinstance(value, dict):
        return {str(k): describe(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, (list, tuple)):
        return [describe(v) for v in value]
    if isinstance(value, (set, frozenset)):
        return sorted((describe(v) for v in value), key=json.dumps)
    if isinstance(value, type):
        return f"{value.__module__}.{value.__qualname__}"
    state = getattr(value, "state_dict", None)
    if callable(state) and type(value).__module__.startswith("zero_py"):
        return {"type": type(value).__qualname__, "state": describe(state())}
    name = getattr(value, "__qualname__", None)
    if callable(value) and name is not None:
        return f"{getattr(value, '__module__', '?')}.{name}"
    return {"type": f"{type(value).__module__}.{type(value).__qualname__}"}


def param_entry(index: int, name: Optional[str], p: torch.Tensor, **extra: Any) -> Entry:
    """One parameter's entry: its name (when known), shape, dtype and requires_grad, plus
    `extra` (its param group, its stage-3 unit)."""
    shape = getattr(p, "_zero_py_shape", None)  # a stage-3 parameter between uses is 1-D
    value = {"name": name, "shape": list(p.shape if shape is None else shape),
             "dtype": str(p.dtype), "requires_grad": bool(p.requires_grad)}
    order = getattr(p, "_zero_py_memory_order", None) or MemoryOrder.of(p)
    if not order.row_major:  # its flat range holds it in this order: the same on every rank
        value["dim_order"] = list(order.dim_order)
    value.update(extra)
    return f"parameter {index}", value


def _settings(param_groups: Sequence[dict]):
    """Each group's settings (every key but "params"), in order."""
    return [[(str(k), v) for k, v in g.items() if k != "params"] for g in param_groups]


def _plain(value: Any) -> str:
    if value is None or type(value) in (bool, int, float, str):
        return repr(value)  # exact, and the same text in every process
    if type(value) in (tuple, list):
        return "(" + ",".join(map(_plain, value)) + ")"
    return json.dumps(describe(value), sort_keys=True)


def hyperparameters(param_groups: Sequence[dict], loss_scaler: Optional[dict] = None,
                    kept_grads: Sequence[int] = ()) -> Tuple[int, Any]:
    """The param groups' settings (every key but "params"), and the loss scaler's state when
    there is one, as a 62-bit fingerprint that is equal on two ranks exactly when the settings
    agree, and a callable giving them in words (for the error). Each step compares the
    fingerprint in its count all-reduce (sharding/reducer.py; stage 1's count carries only
    the used mask besides): a scheduler stepped on a per-rank metric would otherwise train
    each rank's shard at its own learning rate, and a loss scale loaded on one rank only
    would reduce gradients scaled differently per rank, each shard unscaled by its own rank's
    scale. A few microseconds per group and step.

    kept_grads: the parameters (storage indices) whose zeroed gradient a
    zero_grad(set_to_none=False) kept for this step, which stages 2-3 update as torch.optim
    updates a zero param.grad. Ranks that zeroed alike keep the same ones; where one passed
    another set_to_none (or skipped zero_grad), its shard would take a step the others'
    shards do not (a hybrid replica drifted 10% in one SGD step with momentum; in a shard
    group the ranks that skipped the update skipped its all-gather too, and the others waited
    until the group's timeout)."""
    settings = _settings(param_groups)
    if loss_scaler is not None:
        settings.append([("loss scaler " + str(k), v) for k, v in sorted(loss_scaler.items())])
    text = ";".join(",".join(f"{k}={_plain(v)}" for k, v in g) for g in settings)
    if kept_grads:
        text += ";kept " + ",".join(map(str, kept_grads))
    fingerprint = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(),
                                 "little") >> 2

    def words() -> str:
        out = "; ".join(("" if g and g[0][0].startswith("loss scaler ") else f"group {i}: ")
                        + ", ".join(f"{k}={json.dumps(describe(v))}" for k, v in g)
                        for i, g in enumerate(settings))
        out = out if len(out) <= 600 else out[:600] + " ..."
        return out + (f"; zero_grad(set_to_none=False) kept the zeroed gradients of "
                      f"{len(kept_grads)} parameter{'s' if len(kept_grads) != 1 else ''} for "
                      "this step (call zero_grad() alike, with the same set_to_none, on every "
                      "rank)" if kept_grads else "; no zeroed gradient kept by "
                      "zero_grad(set_to_none=False)")
    return fingerprint, words


def _digest(items: List[list]) -> bytes:
    blob = json.dumps(items, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).digest()


def check(executor, entries: Sequence[Entry], what: str) -> None:
    """Raises ValueError on every rank unless every rank of the executor's group passed the
    same entries. Collective: one all-gather of DIGEST_BYTES per rank, plus one exchange of
    the entries when they differ. `what` names the call in the message (e.g.
    "zero_py.initialize")."""
    # hybrid sharding: every rank of every replica (a replica with another model is refused)
    executor = getattr(executor, "world", executor)
    if executor.world_size == 1:
        return
    items = [[key, describe(value)] for key, value in entries]
    mine = torch.frombuffer(bytearray(_digest(items)), dtype=torch.uint8).to(executor.device)
    everyone = torch.empty(executor.world_size * DIGEST_BYTES, dtype=torch.uint8,
                           device=executor.device)
    with control():
        work = executor.all_gather(everyone, mine)
    work.wait()
    rows = everyone.cpu().view(executor.world_size, DIGEST_BYTES)
    if bool((rows == rows[0]).all()):
        return
    raise ValueError(mismatch_message(gather_json(executor, items, dst=None), what))


def _show(value: Any) -> str:
    if value is _ABSENT:
        return "absent"
    if isinstance(value, dict) and "shape" in value and "dtype" in value:
        text = f"{value.get('name') or 'unnamed'} {tuple(value['shape'])} {value['dtype']}"
        if not value.get("requires_grad", True):
            text += " requires_grad=False"
        rest = {k: v for k, v in value.items()
                if k not in ("name", "shape", "dtype", "requires_grad")}
        return text + "".join(f" {k}={json.dumps(v)}" for k, v in rest.items())
    return json.dumps(value)


_ABSENT = object()


def mismatch_message(per_rank: List[List[list]], what: str) -> str:
    """The error for entries that differ: the first entry (in order) whose key or value is not
    the same on every rank, with each rank's value."""
    longest = max(len(items) for items in per_rank)
    for k in range(longest):
        here = [tuple(items[k]) if k < len(items) else None for items in per_rank]
        if all(h == here[0] for h in here):
            continue
        keys = sorted({h[0] for h in here if h is not None})
        if k == 0 and len(keys) > 1:  # different first entries: the ranks took other paths
            lines = [f"{what}: the ranks check different things ({', '.join(keys)}): some "
                     "asked for what the others did not (e.g. hybrid sharding on some ranks "
                     "only)"]
            lines += [f"  rank {r}: " + (f"{h[0]} = {_show(h[1])}" if h is not None else "-")
                      for r, h in enumerate(here)]
            lines.append("every rank must pass the same settings; nothing was changed or "
                         "communicated beyond this check")
            return "\n".join(lines)
        key = keys[0]
        values = [h[1] if h is not None and h[0] == key else _ABSENT for h in here]
        lines = [f"{what}: the ranks disagree on {key}:"]
        lines += [f"  rank {r}: {_show(v)}" for r, v in enumerate(values)]
        counts = [sum(1 for e in items if e[0].startswith("parameter ")) for items in per_rank]
        if len(set(counts)) > 1:
            lines.append("  (parameters per rank: "
                         + ", ".join(f"rank {r}: {n}" for r, n in enumerate(counts)) + ")")
        lines.append("every rank must build the same model and pass the same settings; nothing "
                     "was changed or communicated beyond this check")
        return "\n".join(lines)
    return f"{what}: the ranks' fingerprints differ but their entries agree (a hash collision?)"


# -- a call's arguments, inside the all-reduce the call makes anyway --------------------------

CALL_FINGERPRINT_BITS = 20  # a sum of squares stays exact in float64 up to 2**13 ranks


def call_fingerprint(text: str) -> Tuple[float, float]:
    """Two independent CALL_FINGERPRINT_BITS-bit fingerprints of a call's arguments `text`
    (e.g. clip_grad_norm_'s max_norm and norm_type), as floats for an all-reduce."""
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    mask = (1 << CALL_FINGERPRINT_BITS) - 1
    return (float(int.from_bytes(digest[:4], "little") & mask),
            float(int.from_bytes(digest[4:], "little") & mask))


def call_terms(text: str) -> List[float]:
    """What a rank adds to a SUM all-reduce so that every rank can tell whether all passed
    the same `text`: each fingerprint f and its square (see calls_agree)."""
    out = []
    for f in call_fingerprint(text):
        out += [f, f * f]
    return out


def calls_agree(sums: Sequence[float], world_size: int) -> bool:
    """Whether the all-reduced call_terms of `world_size` ranks come from one text: n * sum of
    squares == (sum)^2 exactly when every rank's fingerprint is the same (Cauchy-Schwarz), and
    the same verdict on every rank (they hold the same sums). Integers, exact."""
    for k in range(0, len(sums), 2):
        s1, s2 = int(sums[k]), int(sums[k + 1])
        if world_size * s2 != s1 * s1:
            return False
    return True
