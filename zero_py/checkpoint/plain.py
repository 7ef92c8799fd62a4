"""Plain data as JSON, for checkpoints that never unpickle: the user's `extra` state and the
optimizer's hyperparameters.

encode(value, sink) turns a tree of None, bool, int, float, str, bytes, list, tuple, dict and
torch.Tensor into JSON-serializable data; decode(data, source) turns it back. JSON lacks some
of these, so they are tagged objects with one key that starts with "__":

    {"__tuple__": [...]}                          a tuple
    {"__float__": "nan" | "inf" | "-inf"}         a float JSON cannot spell
    {"__bytes__": "<base64>"}                     bytes
    {"__items__": [[key, value], ...]}            a dict whose keys are not all str
    {"__dict__": {...}}                           a str-keyed dict that has a key starting
                                                  with "__" (so it cannot be read as a tag)
    {"__scalar__": value, "dtype": "float32"}     a tensor of one element and no dimensions
    {"__tensor__": "<name>"}                      any other tensor: stored under <name> by
                                                  sink(tensor) -> name, read by source(name)
    {"__numpy__": value, "dtype": "int64"}        a numpy scalar (np.int64, np.float32,
                                                  np.bool_, ...), given back as one
    {"__ndarray__": "<name>", "dtype": "<u4",     a numpy array (np.random.get_state()'s key):
     "shape": [624]}                              its bytes as a uint8 tensor through sink

Anything else (a function, a module, an arbitrary object) is refused with its path in the
value, so nothing is silently dropped.
"""

from __future__ import annotations

import base64
import math
from typing import Any, Callable, Optional

import torch

DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool)}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_of(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; zero_py checkpoints hold "
                         f"{sorted(DTYPES)}") from None


def encode(value: Any, sink: Optional[Callable[[torch.Tensor], str]] = None,
           path: str = "extra") -> Any:
    """JSON-serializable form of `value` (see the module docstring); tensors with elements
    go to `sink` (refused when it is None)."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if type(value).__module__ == "numpy":  # before int and float: np.float64 is a float
        return _encode_numpy(value, sink, path)
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else {"__float__": repr(value)}
    if isinstance(value, bytes):
        return {"__bytes__": base64.b64encode(value).decode()}
    if isinstance(value, torch.Tensor):
        # refused here, before anything is written: the file writer takes only these dtypes
        # and bytes that exist
        if value.dtype not in DTYPES.values():
            raise TypeError(f"{path} is a tensor of dtype {value.dtype}, which zero_py "
                            f"checkpoints do not store; convert it to one of {sorted(DTYPES)}")
        if value.is_meta:
            raise TypeError(f"{path} is a tensor on the meta device, which holds no values")
        if value.dim() == 0:
            return {"__scalar__": encode(value.item(), None, path),
                    "dtype": dtype_name(value.dtype)}
        if sink is None:
            raise TypeError(f"{path} is a tensor with dimensions; only scalars are stored here")
        return {"__tensor__": sink(value)}
    if isinstance(value, (list, tuple)):
        items = [encode(v, sink, f"{path}[{i}]") for i, v in enumerate(value)]
        return {"__tuple__": items} if isinstance(value, tuple) else items
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value):
            out = {k: encode(v, sink, f"{path}[{k!r}]") for k, v in value.items()}
            return {"__dict__": out} if any(k.startswith("__") for k in value) else out
        items = []
        for k, v in value.items():
            if not isinstance(k, (str, int, float, bool, type(None), tuple)):
                raise TypeError(f"{path} has a key of type {type(k).__name__} ({k!r}); "
                                "checkpoint state takes str, int, float, bool or tuple keys")
            items.append([encode(k, None, f"{path} key"), encode(v, sink, f"{path}[{k!r}]")])
        return {"__items__": items}
    raise TypeError(f"{path} is a {type(value).__module__}.{type(value).__qualname__}, which is "
                    "not plain data; zero_py checkpoints store None, bool, int, float, str, "
                    "bytes, list, tuple, dict, tensors and numpy scalars and arrays (no "
                    "pickle): convert it, e.g. with its state_dict()")


def _encode_numpy(value: Any, sink: Optional[Callable[[torch.Tensor], str]], path: str) -> Any:
    import numpy as np

    if isinstance(value, (np.bool_, np.integer, np.floating)):
        return {"__numpy__": encode(value.item(), None, path), "dtype": value.dtype.name}
    if isinstance(value, np.ndarray) and value.dtype.kind in "biufcmMSU":
        if sink is None:
            raise TypeError(f"{path} is a numpy array; only scalars are stored here")
        raw = np.ascontiguousarray(value).reshape(-1).view(np.uint8)
        return {"__ndarray__": sink(torch.from_numpy(raw.copy())), "dtype": value.dtype.str,
                "shape": list(value.shape)}
    raise TypeError(f"{path} is a {type(value).__module__}.{type(value).__qualname__}"
                    + (f" of dtype {value.dtype}" if isinstance(value, np.ndarray) else "")
                    + ", which zero_py checkpoints do not store (numpy scalars and arrays of "
                    "numbers, dates and fixed-size strings they do): convert it, e.g. with "
                    ".tolist()")


def _decode_numpy(data: dict, source: Optional[Callable[[str], torch.Tensor]]) -> Any:
    import numpy as np

    # only the kinds encode() writes: np.void(10**12) of a crafted "V8" would allocate 1 TB, an
    # object or structured dtype is no plain data
    if "__numpy__" in data:
        dtype = _numpy_dtype(data["dtype"], "biuf")
        return dtype.type(decode(data["__numpy__"]))
    if source is None:
        raise ValueError("a numpy array where none is expected")
    dtype = _numpy_dtype(data["dtype"], "biufcmMSU")
    raw = source(data["__ndarray__"]).numpy().tobytes()
    return np.frombuffer(raw, dtype=dtype).reshape(data["shape"]).copy()


def _numpy_dtype(name: Any, kinds: str):
    import numpy as np

    dtype = np.dtype(name) if isinstance(name, str) else None
    if dtype is None or dtype.kind not in kinds or dtype.fields is not None:
        raise ValueError(f"numpy dtype {name!r} is not one zero_py checkpoints store")
    return dtype


def decode(data: Any, source: Optional[Callable[[str], torch.Tensor]] = None) -> Any:
    """The value `encode` was given, from its JSON-serializable form."""
    if isinstance(data, list):
        return [decode(v, source) for v in data]
    if not isinstance(data, dict):
        return data
    if len(data) == 1 or "__scalar__" in data:
        tag = next(iter(data))
        if tag == "__tuple__":
            return tuple(decode(v, source) for v in data[tag])
        if tag == "__float__":
            return float(data[tag])
        if tag == "__bytes__":
            return base64.b64decode(data[tag])
        if tag == "__items__":
            return {_key(decode(k)): decode(v, source) for k, v in data[tag]}
        if tag == "__dict__":
            return {k: decode(v, source) for k, v in data[tag].items()}
        if tag == "__tensor__":
            if source is None:
                raise ValueError("a tensor reference where none is expected")
            return source(data[tag])
        if "__scalar__" in data:
            return torch.tensor(decode(data["__scalar__"]), dtype=dtype_of(data["dtype"]))
    if set(data) in ({"__numpy__", "dtype"}, {"__ndarray__", "dtype", "shape"}):
        return _decode_numpy(data, source)
    return {k: decode(v, source) for k, v in data.items()}


def _key(k: Any) -> Any:
    return tuple(k) if isinstance(k, list) else k
