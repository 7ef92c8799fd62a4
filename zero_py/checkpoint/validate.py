"""The manifest's layout checked against the rank files' headers, for every reader.

Checkpoint.open (reader.py) runs layout_problems() after it has checked the files' presence,
sizes and save identity, so load_checkpoint, consolidate and `inspect` refuse the same
manifests with the same messages. It checks what they read by: every parameter's shape,
dtype and pieces (lists of [rank, lo, hi] that cover [0, numel) in order, each element once,
none empty: a save lists only the ranks that hold elements), the tensors each piece places in
its rank's file (param/, master/ and state/<key>/ of the piece's length, the parameter's dtype
for its values, byte ranges inside the file's data), the tensors of the files that no piece
places there, the buffers, the tied-name aliases and the param groups' names. Each problem is
one line naming the file and the field.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Tuple, Union

from zero_py.checkpoint import plain
from zero_py.checkpoint.files import ST_DTYPES
from zero_py.sharding.memory_order import MemoryOrder

# (shape it must have (a piece: [element count]; -1: any), safetensors dtype it must have or
# None for any, the manifest field that places it)
_Expected = Tuple[Union[List[int], int], Optional[str], str]
_ST_NAME = {v: k for k, v in ST_DTYPES.items()}
_LAYOUT_PREFIXES = ("param/", "master/", "state/", "buffer/")
_INT64 = 2**63
# step counts: the update takes them as int64 and float64 (bias corrections, a step tensor),
# exact below 2**53; the stochastic-rounding seed (a base per rank + the steps) must stay in
# [0, 2**53] (a larger count loaded, and every step after it failed; a step count of 2**63 on
# the rank that owns the parameter alone failed that rank's step and hung the others)
_MAX_COUNT = 2**53
_MAX_ROUNDING_STEPS = 2**52


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_shape(v: Any) -> bool:
    """A list of sizes >= 0 whose running product stays in int64, as safetensors computes it
    (a shape like [2**62, 2**62, 0] holds no element but overflows every reader's int64)."""
    if not (isinstance(v, list) and all(_is_int(d) and d >= 0 for d in v)):
        return False
    n = 1
    for d in v:
        n *= d
        if n >= _INT64:
            return False
    return True


def _is_count(v: Any, limit: int = _MAX_COUNT) -> bool:
    return _is_int(v) and 0 <= v < limit


def _numel(shape: List[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _known_dtype(name: Any) -> bool:
    return isinstance(name, str) and name in plain.DTYPES


def layout_problems(manifest: dict, headers: Dict[str, Tuple[dict, int]],
                    sizes: Dict[str, int], path: str, manifest_name: str) -> List[str]:
    """Every disagreement of `manifest` (of checkpoint directory `path`) with itself and with
    the rank files' headers ({file: (header, data offset)}) and sizes; [] when none."""
    mpath = os.path.join(path, manifest_name)
    problems: List[str] = []
    world = manifest["world_size"]
    files = [f"rank{r:05d}.safetensors" for r in range(world)]
    expected: Dict[str, Dict[str, _Expected]] = {f: {} for f in files}

    unchecked = set()  # parameters whose entry is damaged: their tensors are not compared

    def bad(field: str, what: str) -> None:
        problems.append(f"{mpath}: {field} {what}")

    if not _is_count(manifest["step"]):
        bad("step", f"is {manifest['step']!r}, not a step count in [0, 2**53)")

    params = manifest["params"]
    for name, entry in params.items():
        field = f"params[{name!r}]"
        unchecked.add(name)
        if not isinstance(entry, dict):
            bad(field, f"is {entry!r}, not an object")
            continue
        shape, dtype = entry.get("shape"), entry.get("dtype")
        if not _is_shape(shape):
            bad(f"{field}.shape", f"is {shape!r}, not a list of sizes >= 0")
            continue
        if not _known_dtype(dtype):
            bad(f"{field}.dtype", f"is {dtype!r}, not one of {sorted(plain.DTYPES)}")
            continue
        for key in ("requires_grad", "trainable"):
            if not isinstance(entry.get(key), bool):
                bad(f"{field}.{key}", f"is {entry.get(key)!r}, not true or false")
        try:
            MemoryOrder.from_dim_order(shape, entry.get("dim_order"))
        except ValueError:
            bad(f"{field}.dim_order", f"is {entry.get('dim_order')!r}, not an order of the "
                f"dims 0..{len(shape) - 1}")
        numel = _numel(shape)
        tensors = [("param", _ST_NAME[plain.dtype_of(dtype)])]
        whole = True  # the fields that say which tensors the files hold are readable
        if entry.get("trainable") is True:
            step, master, state = entry.get("step"), entry.get("master"), entry.get("state")
            if not _is_count(step):
                bad(f"{field}.step", f"is {step!r}, not a step count in [0, 2**53)")
                whole = False
            if not isinstance(master, bool):
                bad(f"{field}.master", f"is {master!r}, not true or false")
                whole = False
            elif master:
                tensors.append(("master", None))
            if _is_count(step) and step > 0:
                if not isinstance(state, dict):
                    bad(f"{field}.state", f"is {state!r}: a parameter stepped {step} time(s) "
                        "has its optimizer state's record (keys, scalars, step_tensor)")
                    whole = False
                else:
                    keys = state.get("keys")
                    if not (isinstance(keys, list) and all(isinstance(k, str) and k
                                                           and "/" not in k for k in keys)):
                        bad(f"{field}.state.keys", f"is {keys!r}, not a list of state names")
                        whole = False
                    else:
                        tensors += [(f"state/{k}", None) for k in keys]
                    if not isinstance(state.get("scalars"), dict):
                        bad(f"{field}.state.scalars", f"is {state.get('scalars')!r}, not an "
                            "object")
                    st = state.get("step_tensor")
                    if st is not None and not _known_dtype(st):
                        bad(f"{field}.state.step_tensor", f"is {st!r}, not null or a dtype")
        elif "step" in entry and not _is_count(entry["step"]):  # a frozen one: none saved
            bad(f"{field}.step", f"is {entry['step']!r}, not a step count in [0, 2**53)")
        pieces = entry.get("pieces")
        if not isinstance(pieces, list):
            bad(f"{field}.pieces", f"is {pieces!r}, not a list of [rank, lo, hi]")
            continue
        at = 0
        for k, piece in enumerate(pieces):
            pf = f"{field}.pieces[{k}]"
            if not (isinstance(piece, list) and len(piece) == 3 and all(map(_is_int, piece))):
                bad(pf, f"is {piece!r}, not [rank, lo, hi]")
                at = None
                break
            r, lo, hi = piece
            if not 0 <= r < world:
                bad(pf, f"is {piece}: rank {r} has no file (the checkpoint has {world}, "
                    f"ranks 0 to {world - 1})")
            if lo != at:
                bad(pf, f"is {piece}: it starts at element {lo}, where the pieces before it "
                    f"end at {at} (the pieces cover [0, {numel}) in order, each element once)")
                at = None
                break
            if hi <= lo:
                bad(pf, f"is {piece}: it holds no element (a save lists only non-empty "
                    "pieces)")
                continue
            if hi > numel:
                bad(pf, f"is {piece}: it ends past the {numel} elements of shape {shape}")
                at = None
                break
            at = hi
            if 0 <= r < world:
                for kind, st_dtype in tensors:
                    expected[files[r]][f"{kind}/{name}"] = (hi - lo, st_dtype, pf)
        if at is not None and whole:
            unchecked.discard(name)
        if at is not None and at != numel:
            bad(f"{field}.pieces", f"cover elements [0, {at}) of the {numel} of shape {shape}: "
                "the rest is in no file")

    for name, entry in manifest["buffers"].items():
        field = f"buffers[{name!r}]"
        if not (isinstance(entry, dict) and _is_shape(entry.get("shape"))
                and _known_dtype(entry.get("dtype"))):
            bad(field, f"is {entry!r}, not {{'shape': [sizes], 'dtype': name}}")
        elif name in params:
            bad(field, "has the name of a parameter: a state_dict holds each name once")
        elif files:
            expected[files[0]][f"buffer/{name}"] = (  # a buffer keeps its shape (0-d too)
                list(entry["shape"]), _ST_NAME[plain.dtype_of(entry["dtype"])], field)

    aliases = manifest.get("aliases", {})
    if not isinstance(aliases, dict):
        bad("aliases", f"is {aliases!r}, not an object")
    else:
        for alias, target in aliases.items():
            if not (isinstance(target, str) and target in params):
                bad(f"aliases[{alias!r}]", f"is {target!r}, not a parameter of 'params'")
            elif alias in params or alias in manifest["buffers"]:
                # consolidate wrote both under one name: a file safetensors refuses to read
                bad(f"aliases[{alias!r}]", "is also the name of a parameter or buffer: a "
                    "state_dict holds each name once")

    opt = manifest["optimizer"]
    for key, kinds in (("class", str), ("fused", bool), ("param_groups", list)):
        if not isinstance(opt.get(key), kinds):
            bad(f"optimizer.{key}", f"is {opt.get(key)!r}, not of the type the format gives "
                "it")
    for key, limit in (("rounding_steps", _MAX_ROUNDING_STEPS), ("skipped_steps", _MAX_COUNT)):
        if not _is_count(opt.get(key), limit):
            bad(f"optimizer.{key}", f"is {opt.get(key)!r}, not a step count in [0, {limit})")
    for k, group in enumerate(opt.get("param_groups") or ()):
        names = group.get("params") if isinstance(group, dict) else None
        if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
            bad(f"optimizer.param_groups[{k}]", "is not an object whose 'params' is a list of "
                "parameter names")
            continue
        unknown = [n for n in names if n not in params]
        if unknown:
            bad(f"optimizer.param_groups[{k}].params", f"names {unknown[:3]}, which 'params' "
                "lacks")

    for fname in files:
        info = manifest["files"].get(fname)
        header, start = headers.get(fname, ({}, 0))
        fpath = os.path.join(path, fname)
        data = sizes.get(fname, 0) - start
        if isinstance(info, dict):
            fed = info.get("feedback")
            if fed is not None:
                buckets = fed.get("buckets") if isinstance(fed, dict) else None
                if not (isinstance(buckets, list) and all(map(_is_count, buckets))):
                    bad(f"files[{fname!r}].feedback", f"is {fed!r}, not {{'buckets': "
                        "[indices], 'digest': ...}")
                else:
                    for b in buckets:
                        expected[fname][f"feedback/{b}"] = (-1, "F32",
                                                            f"files[{fname!r}].feedback")
        ranges = []
        for key, entry in header.items():
            if key == "__metadata__":
                continue
            what = _tensor_problem(entry, data)
            if what is not None:
                problems.append(f"{fpath}: tensor {key} {what}")
                ranges = None
                continue
            if ranges is not None:
                ranges.append((*entry["data_offsets"], key))
            if key.startswith(_LAYOUT_PREFIXES) and key not in expected[fname] \
                    and _named(key) not in unchecked:
                problems.append(f"{fpath} holds tensor {key}, which no field of {mpath} "
                                "places in this file")
        if ranges is not None:
            problems += _range_problems(fpath, sorted(ranges), data)
        for key, (n, st_dtype, field) in expected[fname].items():
            entry = header.get(key)
            if entry is None:
                problems.append(f"{fpath} lacks tensor {key}, which {mpath}'s {field} places "
                                "there")
            elif _tensor_problem(entry, data) is None:
                shape = n if isinstance(n, list) else [n]
                if n != -1 and entry["shape"] != shape:
                    placed = f"shape {shape}" if isinstance(n, list) else f"{n} elements"
                    problems.append(f"{fpath}: tensor {key} has shape {entry['shape']}, where "
                                    f"{mpath}'s {field} places {placed}")
                elif st_dtype is not None and entry["dtype"] != st_dtype:
                    said = plain.dtype_name(ST_DTYPES[st_dtype])
                    problems.append(f"{fpath}: tensor {key} is {entry['dtype']}, where "
                                    f"{mpath}'s {field} says {said}")
    return problems


def _range_problems(fpath: str, ranges: List[Tuple[int, int, str]], data: int) -> List[str]:
    """The tensors' byte ranges (sorted) must tile the file's data, as safetensors requires:
    no two overlapping (a tensor read another's bytes), no bytes between or after them."""
    at, found = 0, []
    for begin, end, key in ranges:
        if begin != at:
            found.append(f"{fpath}: tensor {key} starts at data byte {begin}, where the tensors "
                         f"before it end at {at} (overlapping or with bytes between them)")
        at = max(at, end)
    if at != data:
        found.append(f"{fpath}: its tensors end at data byte {at} of its {data}")
    return found[:3]


def _named(key: str) -> str:
    """The parameter or buffer a layout tensor's name (param/<name>, state/<key>/<name>, ...)
    is of."""
    return key.split("/", 2 if key.startswith("state/") else 1)[-1]


def _tensor_problem(entry: Any, data_bytes: int) -> Optional[str]:
    """What is wrong with one tensor's header entry (in a file whose data has `data_bytes`
    bytes), or None."""
    if not isinstance(entry, dict):
        return f"has the header entry {entry!r}, not an object"
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in ST_DTYPES:
        return f"has dtype {dtype!r}, not one of {sorted(ST_DTYPES)}"
    if not _is_shape(shape):
        return f"has shape {shape!r}"
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_int, offsets))
            and 0 <= offsets[0] <= offsets[1] <= data_bytes):
        return f"has byte range {offsets!r}, not inside the file's {data_bytes} data bytes"
    if offsets[1] - offsets[0] != _numel(shape) * ST_DTYPES[dtype].itemsize:
        return (f"has {offsets[1] - offsets[0]} bytes, not the {_numel(shape)} elements of "
                f"{dtype} its shape {shape} gives")
    return None
