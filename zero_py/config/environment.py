"""The ZP_* environment variables a run reads (the knobs the docs name), checked.

Each knob is read where it is used (the shared-memory all-gather, the NVMe rings, the C core's
thread pool), but a value that is not one the knob takes used to be a bare `int()`/`float()`
error in the middle of the first forward (`could not convert string to float: 'abc'`), a
negative timeout that made the first all-gather fail at once, or a value the C core ignored
without a word (`ZP_NUM_THREADS=four`, `ZP_SHM=no`, which left shared memory on). `problems()`
lists every knob set to a value it does not take; ZeroOptimizer and zero_py.initialize raise
them, as their other refusals, on every rank before anything is laid out (a rank whose
environment alone is wrong makes every rank raise). `read()` is what the users of a knob call.
"""

from __future__ import annotations

import math
import os
from typing import Callable, List, Optional, Tuple, Union

Number = Union[int, float]


def _int(low: int, high: Optional[int] = None) -> Tuple[Callable[[str], Optional[int]], str]:
    def parse(text: str) -> Optional[int]:
        try:
            v = int(text.strip())
        except ValueError:
            return None
        return v if v >= low and (high is None or v <= high) else None
    return parse, (f"an integer from {low} to {high}" if high is not None
                   else f"an integer >= {low}")


def _seconds(text: str) -> Optional[float]:
    try:
        v = float(text.strip())
    except ValueError:
        return None
    return v if math.isfinite(v) and v > 0 else None


def _switch(text: str) -> Optional[int]:
    return {"0": 0, "1": 1}.get(text.strip())


# name: (parse, what it takes, what it does) -- parse returns None for a value not taken
KNOBS = {
    "ZP_SHM": (_switch, "0 or 1", "0 turns the shared-memory all-gather off"),
    "ZP_SHM_TIMEOUT_S": (_seconds, "a number of seconds > 0",
                         "how long a shared-memory wait lasts (unset: the process group's "
                         "timeout)"),
    "ZP_NUM_THREADS": (*_int(1, 256), "the kernel threads of a step"),
    "ZP_POOL_SPIN_US": (*_int(0, 1000000), "how long the pool's workers spin after a job"),
    "ZP_OFFLOAD_RING": (*_int(2), "host buffers of the NVMe optimizer ring"),
    "ZP_OFFLOAD_PARAM_RING": (*_int(2), "host buffers of the NVMe parameter ring"),
    "ZP_OFFLOAD_CHUNK_BYTES": (*_int(1), "the target bytes of one NVMe optimizer record"),
}


def _problem(name: str, text: str) -> str:
    _, takes, does = KNOBS[name]
    return f"{name}={text!r} is not {takes} ({name}: {does}): set it to such a value, or unset it"


def problems() -> List[str]:
    """Every ZP_* knob of this process's environment set to a value it does not take (an
    empty value counts as unset)."""
    out = []
    for name, (parse, _, _) in KNOBS.items():
        text = os.environ.get(name, "")
        if text != "" and parse(text) is None:
            out.append(_problem(name, text))
    return out


def check() -> None:
    """Raises ValueError naming every knob set to a value it does not take."""
    found = problems()
    if found:
        raise ValueError("; ".join(found))


def read(name: str, default: Number) -> Number:
    """The value of knob `name`, or `default` when it is unset or empty; ValueError naming the
    knob for a value it does not take."""
    text = os.environ.get(name, "")
    if text == "":
        return default
    value = KNOBS[name][0](text)
    if value is None:
        raise ValueError(_problem(name, text))
    return value
