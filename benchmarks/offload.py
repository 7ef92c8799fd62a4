"""Offload: the optimizer step with offload_optimizer None, "cpu" and "nvme", side by side.

    torchrun --nproc-per-node N benchmarks/offload.py steps [--params-m 64] [--dtype bf16]
             [--dir DIR] [--rounds 5]
    python benchmarks/offload.py rss --params-m 400 [--dir DIR] [--offload-params nvme]
             [--steps 4] [--checkpoint DIR]
    torchrun --nproc-per-node N benchmarks/offload.py params [--params-m 64] [--dir DIR]

`steps`: the modes None, "cpu", "cpu+overlap" (overlap_step=1.0: buckets updated on the host
during backward) and "nvme", on a stack of bias-free Linear(1024, 1024) layers (params-m of
them: about params-m million parameters), each rank its own random batch; every mode builds
its own copy of the same model and the modes take turns, round after round. Per mode: the
median time of
forward+backward and of optimizer.step(), the step's ratio to no offload, and memory_report()'s
per-rank bytes on the device, in host memory and on disk beside the resident memory the mode
added (VmRSS; on the CPU the "device" is host memory too, so the measured growth is compared
with device + host). For "nvme": the bytes the step read and wrote and its bandwidth, beside the
engine's raw bandwidth on the same file in the same run: the same records read and written with
no arithmetic (the ring's pattern) and large sequential direct reads and writes.

`rss`: one rank whose optimizer (fp32 masters and AdamW states: 12 bytes per parameter) lives on
NVMe, bf16 parameters: the resident memory after each step (and its peak within the step)
beside the optimizer's bytes on disk. `--offload-params nvme`: stage 3 built on the meta device,
the parameter shards on NVMe too. `--checkpoint DIR`: then a save_checkpoint and a
load_checkpoint, with the resident memory each adds at its peak.

`params`: stage 3 (each Linear a unit), three modes taking turns as in `steps`: everything in
memory; the optimizer on NVMe; the optimizer and the parameter shards on NVMe
(offload_params="nvme"). Per mode: the median fwd+bwd and step times, memory_report()'s host
and disk bytes, the parameter file's bytes moved per iteration (the gathers' reads and the
step's read and write) and the resident memory the mode added.

Every run prints the CPU model and the load average; record results in benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from typing import Optional

import torch
import torch.distributed as dist

import zero_py
import zero_py.offload
from zero_py.io.engine import DirectFile, IoEngine, aligned_empty
from zero_py.tools.env import cpu_model, proc_status_kib, reset_peak_rss

WIDTH = 1024
MODES = [None, "cpu", "cpu+overlap", "nvme"]


def make_model(layers: int, dtype: torch.dtype) -> torch.nn.Module:
    torch.manual_seed(0)
    # built in its dtype: no fp32 copy whose freed pages would stay in the resident set
    return torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH, bias=False, dtype=dtype)
                                 for _ in range(layers)])


def train_step(model, opt, gen, dtype) -> tuple:
    x = torch.randn(8, WIDTH, generator=gen).to(dtype)
    t0 = time.perf_counter()
    model(x).float().pow(2).mean().backward()
    t1 = time.perf_counter()
    opt.step()
    opt.zero_grad()
    return t1 - t0, time.perf_counter() - t1


def raw_bandwidth(store, rounds: int = 2) -> dict:
    """The engine on the offload file with no arithmetic: the ring's record pattern (read,
    write to the other slot) and large sequential direct writes and reads of as many bytes."""
    chunks = list(range(store.n_chunks))
    nbytes = 2 * len(chunks) * store.record_bytes
    ring = []
    for _ in range(rounds):
        t = time.perf_counter()
        store.stream(chunks, lambda k, buf: None)
        ring.append(nbytes / (time.perf_counter() - t))
    engine = IoEngine(n_threads=4)
    block = 8 << 20
    total = len(chunks) * store.record_bytes
    n = max(1, total // block)
    bufs = [aligned_empty(block) for _ in range(4)]
    for b in bufs:
        b.random_(0, 255)
    seq = []
    path = os.path.join(os.path.dirname(store.path) or ".", f"zp-raw-{os.getpid()}.bin")
    f = DirectFile(path, writable=True)
    try:
        os.posix_fallocate(f.fd, 0, n * block)
        for _ in range(rounds):
            t = time.perf_counter()
            for op in (engine.write, engine.read):
                inflight = []
                for i in range(n):  # 4 requests in flight, one per buffer
                    if len(inflight) == 4:
                        engine.wait(inflight.pop(0))
                    inflight.append(op(f, bufs[i % 4], i * block))
                for tk in inflight:
                    engine.wait(tk)
            seq.append(2 * n * block / (time.perf_counter() - t))
    finally:
        f.close()
        os.unlink(path)
        engine.close()
    return {"ring": max(ring), "sequential": max(seq), "deepspeed": deepspeed_aio(path, rounds)}


def deepspeed_aio(path: str, rounds: int) -> Optional[float]:
    """DeepSpeed's NVMe swapper engine (its aio op, built by DeepSpeed itself) writing then
    reading 512 MB in 8 MiB blocks, 32 deep, 4 threads, on the same drive; None where
    DeepSpeed or its aio op is missing (said on stderr)."""
    try:
        from deepspeed.ops.op_builder import AsyncIOBuilder
        aio = AsyncIOBuilder().load(verbose=False)
    except Exception as exc:  # not installed, or its op does not build here
        print(f"DeepSpeed aio: unavailable ({type(exc).__name__}: {exc})", file=sys.stderr)
        return None
    handle = aio.aio_handle(8 << 20, 32, False, True, 4)
    buf = torch.empty(512 << 20, dtype=torch.uint8).pin_memory() \
        if torch.cuda.is_available() else aligned_empty(512 << 20)
    buf.random_(0, 255)
    best = 0.0
    try:
        for _ in range(rounds):
            t = time.perf_counter()
            handle.sync_pwrite(buf, path)
            handle.sync_pread(buf, path)
            best = max(best, 2 * buf.numel() / (time.perf_counter() - t))
    finally:
        if os.path.exists(path):
            os.unlink(path)
    return best


def steps(args) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    base = make_model(args.params_m, dtype)
    runs = {}
    offload_dir = args.dir or tempfile.mkdtemp(prefix="zp-offload-")
    for mode in MODES:
        rss0 = proc_status_kib("VmRSS")
        model = copy.deepcopy(base)
        kw = {"offload_optimizer": mode}
        if mode == "cpu+overlap":  # the buckets updated during backward (overlap_step)
            kw = {"offload_optimizer": "cpu", "overlap_step": 1.0}
        if mode == "nvme":
            kw["offload_dir"] = offload_dir
        if dtype != torch.float32:
            kw["grad_reduce_dtype"] = torch.float32
        _, opt = zero_py.initialize(model, torch.optim.AdamW, stage=2, lr=1e-4, **kw)
        gen = torch.Generator().manual_seed(rank)
        train_step(model, opt, gen, dtype)  # warm-up: the states exist
        runs[mode] = {"model": model, "opt": opt, "gen": gen, "fb": [], "step": [],
                      "rss_kib": proc_status_kib("VmRSS") - rss0}
    for r in range(args.rounds):
        order = MODES[r % len(MODES):] + MODES[:r % len(MODES)]
        for mode in order:
            run = runs[mode]
            dist.barrier()
            for _ in range(args.steps):
                fb, st = train_step(run["model"], run["opt"], run["gen"], dtype)
                run["fb"].append(fb)
                run["step"].append(st)
    store = runs["nvme"]["opt"]._update.store
    raw = raw_bandwidth(store) if rank == 0 else None
    if rank != 0:
        return
    psi = args.params_m * WIDTH * WIDTH
    print(f"# offload step, {args.params_m}M parameters ({args.dtype}), {world} rank(s), "
          f"stage 2, AdamW")
    print(f"CPU: {cpu_model()}; load average {os.getloadavg()[0]:.1f}; "
          f"offload_dir {offload_dir} (direct I/O: {store.file.direct}); torch "
          f"{torch.__version__}; host kernel threads {zero_py.offload.host_threads()}")
    print()
    print("| mode | fwd+bwd (s) | step (s) | step / none | device MB | host MB | disk MB "
          "| RSS added MB |")
    print("|---|---|---|---|---|---|---|---|")
    none_step = statistics.median(runs[None]["step"])
    for mode in MODES:
        run = runs[mode]
        rep = run["opt"].memory_report()
        device = rep["params"] + rep["grads"] + rep["optimizer_states"]
        host = rep["host_optimizer_states"] + rep["host_grads"] + rep["host_params"]
        step = statistics.median(run["step"])
        print(f"| {mode or 'none'} | {statistics.median(run['fb']):.3f} | {step:.3f} | "
              f"{step / none_step:.2f}x | {device / 1e6:.1f} | {host / 1e6:.1f} | "
              f"{rep['nvme_optimizer_states'] / 1e6:.1f} | {run['rss_kib'] / 1024:.1f} |")
    fb_cpu, step_cpu = (statistics.median(runs["cpu"][k]) for k in ("fb", "step"))
    fb_ov, step_ov = (statistics.median(runs["cpu+overlap"][k]) for k in ("fb", "step"))
    early = runs["cpu+overlap"]["opt"]._early
    print()
    print(f"overlap_step=1.0: forward+backward+step {fb_ov + step_ov:.3f} s against "
          f"{fb_cpu + step_cpu:.3f} s without; the step alone {step_ov:.3f} s against "
          f"{step_cpu:.3f} s: {(step_cpu - step_ov) / step_cpu:.0%} of the offloaded step "
          f"moved into backward, {(fb_cpu + step_cpu - fb_ov - step_ov) / step_cpu:.0%} of it "
          f"hidden (the iteration's saving over the step); last step: "
          f"{early.kept_last_step} of {early.early_last_step} early buckets kept. On the CPU "
          "backward and the early updates share the cores: only a GPU can hide them.")
    step = statistics.median(runs["nvme"]["step"])
    moved = 2 * store.n_chunks * store.record_bytes
    print()
    print(f"NVMe step: {moved / 1e6:.0f} MB read+written per step ({psi / world / 1e6:.1f}M "
          f"elements x 12 B each way, records of {store.record_bytes >> 10} KiB, ring of "
          f"{len(store.ring)}): {moved / step / 1e9:.2f} GB/s; raw engine on the same file: "
          f"ring pattern {raw['ring'] / 1e9:.2f} GB/s ({moved / step / raw['ring']:.0%}), "
          f"sequential 8 MiB {raw['sequential'] / 1e9:.2f} GB/s "
          f"({moved / step / raw['sequential']:.0%})")
    if raw["deepspeed"]:
        print(f"DeepSpeed's aio op (its NVMe swapper's engine), 512 MB written then read in "
              f"8 MiB blocks on the same drive: {raw['deepspeed'] / 1e9:.2f} GB/s")


def rss(args) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    offload_dir = args.dir or tempfile.mkdtemp(prefix="zp-offload-")
    on_nvme = args.offload_params == "nvme"
    if on_nvme:  # stage 3, built on the meta device: the full model never exists in memory
        with torch.device("meta"):
            model = make_model(args.params_m, torch.bfloat16)
        model, opt = zero_py.initialize(model, torch.optim.AdamW, stage=3, lr=1e-4,
                                        wrap_policy={torch.nn.Linear},
                                        offload_optimizer="nvme", offload_params="nvme",
                                        offload_dir=offload_dir)
    else:
        model = make_model(args.params_m, torch.bfloat16)
        _, opt = zero_py.initialize(model, torch.optim.AdamW, stage=2, lr=1e-4,
                                    offload_optimizer="nvme", offload_dir=offload_dir)
    gen = torch.Generator().manual_seed(0)
    store = opt._update.store
    state = store.file_bytes // 2
    params_on_disk = opt._flat.nvme.file_bytes // 2 if on_nvme else 0
    where = ("stage 3, parameter shards on NVMe too (offload_params=\"nvme\")" if on_nvme
             else "stage 2, parameters in memory")
    print(f"# NVMe offload, resident memory: {args.params_m}M bf16 parameters, 1 rank, {where}")
    print(f"CPU: {cpu_model()}; load average {os.getloadavg()[0]:.1f}; offload_dir "
          f"{offload_dir}; optimizer on disk {state / 1e9:.2f} GB (x2 slots); parameters on "
          f"disk {params_on_disk / 1e9:.2f} GB (x2 slots); rings "
          f"{(store.host_bytes() + opt.memory_report()['host_params']) / 1e6:.0f} MB; "
          f"VmHWM after construction {proc_status_kib('VmHWM') / 1024:.0f} MB")
    print()
    print("On the CPU the parameters and gradients (the \"device\" side) are host memory too: "
          "the last columns take them out of VmRSS, leaving what the process holds beside "
          "them (the interpreter, torch, the rings).")
    print()
    print("| step | VmRSS MB | peak in the step MB | optimizer state / VmRSS | device-side MB | "
          "VmRSS - device-side MB | step (s) |")
    print("|---|---|---|---|---|---|---|")
    peaks = reset_peak_rss()
    for k in range(args.steps):
        _, st = train_step(model, opt, gen, torch.bfloat16)
        rss_b = proc_status_kib("VmRSS") * 1024
        rep = opt.memory_report()
        device = rep["params"] + rep["grads"] + rep["optimizer_states"]
        peak = f"{proc_status_kib('VmHWM') * 1024 / 1e6:.0f}" if peaks else "n/a"
        print(f"| {k + 1} | {rss_b / 1e6:.0f} | {peak} | {state / rss_b:.2f}x | "
              f"{device / 1e6:.0f} | {(rss_b - device) / 1e6:.0f} | {st:.2f} |")
        sys.stdout.flush()
        reset_peak_rss()
    if args.checkpoint:
        path = os.path.join(args.checkpoint, "rss_ckpt")
        print()
        print("| checkpoint call | s | VmRSS before MB | peak during MB | added MB |")
        print("|---|---|---|---|---|")
        for what, call in (("save_checkpoint", zero_py.save_checkpoint),
                           ("load_checkpoint", zero_py.load_checkpoint)):
            reset_peak_rss()
            before = proc_status_kib("VmRSS")
            t0 = time.perf_counter()
            call(path, model, opt)
            took = time.perf_counter() - t0
            peak = proc_status_kib("VmHWM")
            print(f"| {what} | {took:.2f} | {before / 1024:.0f} | {peak / 1024:.0f} | "
                  f"{(peak - before) / 1024:.0f} |")
            sys.stdout.flush()
        size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
        print(f"\ncheckpoint: {size / 1e9:.2f} GB in {path}")
        _, st = train_step(model, opt, gen, torch.bfloat16)
        print(f"a step after the load: {st:.2f} s, VmRSS "
              f"{proc_status_kib('VmRSS') / 1024:.0f} MB")


PARAM_MODES = [("memory", {}), ("opt nvme", {"offload_optimizer": "nvme"}),
               ("opt+params nvme", {"offload_optimizer": "nvme", "offload_params": "nvme"})]


def params(args) -> None:
    if "RANK" not in os.environ:  # a plain `python benchmarks/offload.py params`: one rank
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT="29534")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    offload_dir = args.dir or tempfile.mkdtemp(prefix="zp-offload-")
    runs = {}
    for name, kw in PARAM_MODES:
        rss0 = proc_status_kib("VmRSS")
        model = make_model(args.params_m, dtype)
        kw = dict(kw)
        if kw:
            kw["offload_dir"] = offload_dir
        if dtype != torch.float32:
            kw["grad_reduce_dtype"] = torch.float32
        model, opt = zero_py.initialize(model, torch.optim.AdamW, stage=3, lr=1e-4,
                                        wrap_policy={torch.nn.Linear}, **kw)
        gen = torch.Generator().manual_seed(rank)
        train_step(model, opt, gen, dtype)  # warm-up: the states exist
        runs[name] = {"model": model, "opt": opt, "gen": gen, "fb": [], "step": [],
                      "rss_kib": proc_status_kib("VmRSS") - rss0}
    names = [name for name, _ in PARAM_MODES]
    for r in range(args.rounds):
        for name in names[r % 3:] + names[:r % 3]:
            run = runs[name]
            dist.barrier()
            for _ in range(args.steps):
                fb, st = train_step(run["model"], run["opt"], run["gen"], dtype)
                run["fb"].append(fb)
                run["step"].append(st)
    if rank != 0:
        return
    files = runs["opt+params nvme"]["opt"]._flat.nvme
    print(f"# stage-3 parameters on NVMe: {args.params_m}M parameters ({args.dtype}), "
          f"{world} rank(s), each Linear({WIDTH}, {WIDTH}) a unit, AdamW")
    print(f"CPU: {cpu_model()}; load average {os.getloadavg()[0]:.1f}; offload_dir "
          f"{offload_dir} (direct I/O: {files.file.direct}); torch {torch.__version__}; "
          f"host kernel threads {zero_py.offload.host_threads()}")
    print()
    print("| mode | fwd+bwd (s) | step (s) | iteration / memory | host MB (offload) | disk MB "
          "| RSS added MB |")
    print("|---|---|---|---|---|---|---|")
    base = None
    for name in names:
        run = runs[name]
        rep = run["opt"].memory_report()
        host = rep["host_optimizer_states"] + rep["host_grads"] + rep["host_params"]
        disk = rep["nvme_optimizer_states"] + rep["nvme_params"]
        fb, st = statistics.median(run["fb"]), statistics.median(run["step"])
        base = base or fb + st
        print(f"| {name} | {fb:.3f} | {st:.3f} | {(fb + st) / base:.2f}x | {host / 1e6:.1f} | "
              f"{disk / 1e6:.1f} | {run['rss_kib'] / 1024:.1f} |")
    shard = sum(files.piece_bytes)
    print()
    print(f"parameter file: {shard / 1e6:.1f} MB of shards per rank, records of up to "
          f"{files.buffer_bytes >> 10} KiB, ring of {len(files.ring)} "
          f"({files.host_bytes() / 1e6:.1f} MB); an iteration reads them twice for the gathers "
          f"(forward, backward) and reads and writes them once in the step: "
          f"{4 * shard / 1e6:.0f} MB")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["steps", "rss", "params"])
    ap.add_argument("--params-m", type=int, default=64)
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--dir", default=None, help="offload_dir (default: a new temp directory)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--offload-params", choices=["none", "nvme"], default="none",
                    help="rss: stage 3 with the parameter shards on NVMe too")
    ap.add_argument("--checkpoint", default=None,
                    help="rss: then save and load a checkpoint in this directory, with the "
                         "resident memory each call adds")
    args = ap.parse_args()
    {"steps": steps, "rss": rss, "params": params}[args.what](args)


if __name__ == "__main__":
    main()
