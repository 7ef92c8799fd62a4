"""Raw bandwidth of zero_py's direct-I/O engine beside dd and buffered I/O, in one run.

    python benchmarks/io_engine.py [--gib 1] [--dir /tmp] [--rounds 3]

Writes and reads one file of --gib GiB in each mode, taking turns round after round, and prints
the median GB/s (1e9 bytes/s) of each:

    engine r x d     zero_py.io.IoEngine, requests of r MiB, d in flight, O_DIRECT (the file
                     system allowing), from one aligned buffer: no copy
    dd direct        dd bs=8M oflag=direct / iflag=direct (one request at a time)
    buffered         Python write + fsync / read through the page cache (evicted before)

Reads follow the writes of the same mode, with the file evicted from the page cache first.
Prints the CPU model. The file system and the device decide everything here; the machine's
other load moves single numbers, so compare within one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import time

from zero_py.tools.env import cpu_model
from zero_py.io import DirectFile, IoEngine, aligned_empty
from zero_py.io.engine import evict




def engine_io(engine, path, nbytes, req_mib, depth, write) -> float:
    buf = aligned_empty(req_mib << 20)
    if write:
        buf.random_(0, 255)
        if os.path.exists(path):
            os.unlink(path)
    t0 = time.perf_counter()
    with DirectFile(path, writable=write) as f:
        tickets = []
        for off in range(0, nbytes, len(buf)):
            if len(tickets) == depth:
                engine.wait(tickets.pop(0))
            tickets.append(engine.write(f, buf, off) if write else engine.read(f, buf, off))
        for t in tickets:
            engine.wait(t)
        if write:
            f.fsync()
    return time.perf_counter() - t0


def dd(path, nbytes, write) -> float:
    n = nbytes // (8 << 20)
    args = (["dd", "if=/dev/zero", f"of={path}", "bs=8M", f"count={n}", "oflag=direct",
             "conv=fsync"] if write else
            ["dd", f"if={path}", "of=/dev/null", "bs=8M", "iflag=direct"])
    if write and os.path.exists(path):
        os.unlink(path)
    t0 = time.perf_counter()
    subprocess.run(args, check=True, capture_output=True)
    return time.perf_counter() - t0


def buffered(path, nbytes, write) -> float:
    chunk = bytearray(os.urandom(8 << 20)) if write else bytearray(8 << 20)
    if write and os.path.exists(path):
        os.unlink(path)
    t0 = time.perf_counter()
    with open(path, "wb" if write else "rb", buffering=0) as f:
        if write:
            for _ in range(nbytes // len(chunk)):
                f.write(chunk)
            os.fsync(f.fileno())
        else:
            while f.readinto(chunk):
                pass
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    nbytes = int(args.gib * 2**30) // (8 << 20) * (8 << 20)
    path = os.path.join(args.dir, f"zp_io_bench_{os.getpid()}.bin")
    engine = IoEngine(n_threads=4, max_inflight=32)
    modes = {"engine 8 x 1": lambda w: engine_io(engine, path, nbytes, 8, 1, w),
             "engine 8 x 4": lambda w: engine_io(engine, path, nbytes, 8, 4, w),
             "engine 1 x 16": lambda w: engine_io(engine, path, nbytes, 1, 16, w),
             "dd direct": lambda w: dd(path, nbytes, w),
             "buffered": lambda w: buffered(path, nbytes, w)}
    times = {(m, w): [] for m in modes for w in (True, False)}
    try:
        for r in range(args.rounds):
            names = list(modes)
            for k in range(len(names)):
                m = names[(k + r) % len(names)]
                times[(m, True)].append(modes[m](True))
                evict(path)
                times[(m, False)].append(modes[m](False))
    finally:
        if os.path.exists(path):
            os.unlink(path)
    print(f"# direct-I/O engine, {cpu_model()}, {nbytes / 2**30:.2f} GiB file in {args.dir}, "
          f"median of {args.rounds} rounds, {time.strftime('%Y-%m-%d')}\n")
    print("| mode | write GB/s | read GB/s |")
    print("|---|---:|---:|")
    for m in modes:
        w = nbytes / statistics.median(times[(m, True)]) / 1e9
        rd = nbytes / statistics.median(times[(m, False)]) / 1e9
        print(f"| {m} | {w:.2f} | {rd:.2f} |")


if __name__ == "__main__":
    main()
