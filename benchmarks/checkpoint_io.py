"""Checkpoint save and load throughput: zero_py against the disk and torch.distributed.checkpoint.

    torchrun --nproc-per-node 2 benchmarks/checkpoint_io.py [--params-m 64] [--rounds 3]
             [--warmup 1] [--dir /tmp/zp_ckpt_bench]

One model (a stack of square fp32 Linear layers, --params-m million parameters) trained one
step with AdamW two ways: zero_py stage 2 and DDP + torch.optim.AdamW. Both checkpoints hold
the same bytes (parameters and two fp32 states: 12 bytes per parameter). Each round takes turns:

    disk       every rank writes a new file of its share of those bytes (write + fsync), reads
               it back (read() into one reused 64 MiB buffer); "(direct)": the same with
               O_DIRECT through zero_py's I/O engine (8 MiB requests, 4 in flight, reused
               buffers). All ranks at once, as a load reads: the disk is shared
    zero_py    zero_py.save_checkpoint / load_checkpoint (checksums verified on load)
    dcp        torch.distributed.checkpoint.save / load of DDP's model and optimizer state
               dicts (get_state_dict / set_state_dict; replicated tensors are written once)

Before every read the files are evicted from the page cache (posix_fadvise DONTNEED after
fsync), so loads read the disk. Throughput = checkpoint bytes / wall time of the call on the
slowest rank (a barrier before and after); "vs disk" is against the faster of the disk's two
ways (buffered or direct) of the same kind. The saves take turns going first, round by
round (this disk slows down during a burst of writes), and so do the loads, after a pause
(--settle) that lets the disk finish with the saves; a zero_py save that replaces a
checkpoint removes the old one on a thread, which is waited for, untimed, before the next
measurement; the loads run in the reverse order every other round, so that no load always
follows the same one. The first --warmup rounds (1) are run and not counted: this machine is a
VM whose memory costs several times more the first time the guest touches it (1.5 GB took 2.0 s
the first time and 0.3-0.4 s after, in a fresh process each time), so whichever measurement
first touched new memory paid for it (the first round's zero_py load read at 40-45% of the disk
twice, 69-104% in the rounds after). Rank 0 prints the medians, ranges and ratios, the CPU
model and the load average (the machine may be shared); then `python -m zero_py consolidate`
runs on the zero_py checkpoint and its peak RSS is printed beside the largest tensor.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.nn.parallel import DistributedDataParallel as DDP

import zero_py
from zero_py.tools.env import cpu_model
from zero_py.checkpoint.files import wait_for_removals
from zero_py.io import DirectFile, aligned_empty, default_engine
from zero_py.io.engine import evict as evict_file




def build(params_m: float, width: int = 2048) -> nn.Module:
    n_layers = max(1, round(params_m * 1e6 / (width * width + width)))
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(n_layers)])


def one_step(model, opt, seed: int) -> None:
    x = torch.randn(4, 2048, generator=torch.Generator().manual_seed(seed))
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()


def evict(paths) -> None:
    """Drops the files' pages from the page cache (they are fsynced: clean pages go)."""
    for root in paths:
        for dirpath, _, files in os.walk(root) if os.path.isdir(root) else [("", [], [root])]:
            for name in files:
                evict_file(os.path.join(dirpath, name))


def timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def disk_write(path: str, nbytes: int) -> None:
    buf = memoryview(torch.randint(0, 255, (min(nbytes, 64 * 2**20),),
                                   dtype=torch.uint8).numpy())
    with open(path, "wb", buffering=0) as f:
        left = nbytes
        while left:
            left -= f.write(buf[:min(left, len(buf))])
        os.fsync(f.fileno())


def disk_write_direct(path: str, nbytes: int) -> None:
    """The same bytes with O_DIRECT through zero_py's I/O engine, 8 MiB requests, 4 in flight,
    no copy: the best this disk does for a sequential write."""
    if os.path.exists(path):
        os.unlink(path)
    engine = default_engine()
    buf = aligned_empty(8 << 20)
    buf.random_(0, 255)
    with DirectFile(path, writable=True) as f:
        tickets = []
        for off in range(0, -(-nbytes // len(buf)) * len(buf), len(buf)):
            if len(tickets) == 4:
                engine.wait(tickets.pop(0))
            tickets.append(engine.write(f, buf, off))
        for t in tickets:
            engine.wait(t)
        f.fsync()


def disk_read_direct(path: str) -> None:
    """The file with O_DIRECT through zero_py's I/O engine, 8 MiB requests, 4 in flight, into
    4 reused buffers (the last request may end short of the buffer: the file's tail)."""
    engine = default_engine()
    size = os.path.getsize(path)
    bufs = [aligned_empty(8 << 20) for _ in range(4)]
    with DirectFile(path) as f:
        tickets = []
        for k, off in enumerate(range(0, size, 8 << 20)):
            if len(tickets) == 4:
                engine.wait(tickets.pop(0))
            n = -(-min(8 << 20, size - off) // 4096) * 4096
            tickets.append(engine.read(f, bufs[k % 4][:n], off))
        for t in tickets:
            try:
                engine.wait(t)
            except IndexError:  # the file's last block: shorter than the aligned request
                pass


def disk_read(path: str) -> None:
    buf = bytearray(64 * 2**20)
    with open(path, "rb", buffering=0) as f:
        while f.readinto(buf):
            pass


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--params-m", type=float, default=64.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/zp_ckpt_bench")
    ap.add_argument("--settle", type=float, default=2.0,
                    help="seconds between the last save and the first load of a round")
    ap.add_argument("--warmup", type=int, default=1,
                    help="rounds run first and not counted (see the module docstring)")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    root = args.dir
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
    dist.barrier()

    torch.manual_seed(0)
    zmodel = build(args.params_m)
    zmodel, zopt = zero_py.initialize(zmodel, torch.optim.AdamW, stage=2, lr=1e-4)
    one_step(zmodel, zopt, rank)
    torch.manual_seed(0)
    ddp = DDP(build(args.params_m))
    dopt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    one_step(ddp, dopt, rank)
    n_params = sum(p.numel() for p in zmodel.parameters())

    zpath, dpath = os.path.join(root, "zero_py"), os.path.join(root, "dcp")
    raw = os.path.join(root, f"raw{rank}.bin")
    times = {k: [] for k in ("disk save", "disk save (direct)", "zero_py save", "dcp save",
                             "disk load", "disk load (direct)",
                             "zero_py load", "zero_py load (no verify)", "dcp load")}
    ck_bytes = None
    load_avg = [os.getloadavg()]  # the machine is shared: said beside the numbers
    for r in range(args.warmup + args.rounds):
        counted = r >= args.warmup
        if rank == 0:
            shutil.rmtree(dpath, ignore_errors=True)
        dist.barrier()
        if os.path.exists(raw):
            os.unlink(raw)
        share = (ck_bytes or 12 * n_params) // world  # the first round: the state's size

        def dcp_save():
            msd, osd = get_state_dict(ddp, dopt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=dpath)

        saves = [("disk save", lambda n=share: disk_write(raw, n)),
                 ("disk save (direct)", lambda n=share: disk_write_direct(raw, n)),
                 ("dcp save", dcp_save),
                 ("zero_py save", lambda: zero_py.save_checkpoint(zpath, zmodel, zopt))]
        for k in range(len(saves)):  # each goes first in one round of three: a disk slows
            name, fn = saves[(k + r) % len(saves)]  # down during a burst of writes
            t = timed(fn)
            if counted:
                times[name].append(t)
            wait_for_removals()  # zero_py removes a replaced checkpoint on a thread: untimed
        ck_bytes = dir_bytes(zpath)

        def dcp_load():
            msd, osd = get_state_dict(ddp, dopt)
            state = {"model": msd, "optim": osd}
            dcp.load(state, checkpoint_id=dpath)
            set_state_dict(ddp, dopt, model_state_dict=state["model"],
                           optim_state_dict=state["optim"])

        loads = [("disk load", [raw], lambda: disk_read(raw)),
                 ("disk load (direct)", [raw], lambda: disk_read_direct(raw)),
                 ("zero_py load", [zpath], lambda: zero_py.load_checkpoint(zpath, zmodel, zopt)),
                 ("zero_py load (no verify)", [zpath],
                  lambda: zero_py.load_checkpoint(zpath, zmodel, zopt, verify=False)),
                 ("dcp load", [dpath], dcp_load)]
        # the disk is still busy for a while after a burst of writes (the first read after the
        # saves was up to 6x slower than the same read later): let it settle, then the loads
        # take turns going first, round by round, like the saves. Every other round runs them
        # in the reverse order, so a load does not always follow the same one: a load that
        # comes right after another zero_py load gets the memory that load just freed, which
        # this machine gives faster than memory it has not used for a while
        os.sync()
        time.sleep(args.settle)
        order = loads if r % 2 == 0 else loads[::-1]
        for k in range(len(order)):
            name, files, fn = order[(k + r) % len(order)]
            evict(files)
            t = timed(fn)
            if counted:
                times[name].append(t)
    dcp_bytes = dir_bytes(dpath) if rank == 0 else 0
    load_avg.append(os.getloadavg())
    if rank == 0:
        gb = ck_bytes / 1e9
        print(f"# checkpoint I/O, {world} ranks, {cpu_model()} ({os.cpu_count()} logical "
              f"cores), torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M')}")
        print(f"# {n_params / 1e6:.1f}M fp32 parameters + AdamW: zero_py checkpoint "
              f"{ck_bytes / 1e6:.1f} MB, DCP checkpoint {dcp_bytes / 1e6:.1f} MB; "
              f"median and range of {args.rounds} rounds after {args.warmup} not counted, "
              "page cache evicted before loads; "
              "load average (1/5/15 min) "
              + " at the start, ".join("/".join(f"{x:.2f}" for x in a) for a in load_avg)
              + " at the end\n")
        print("| what | median s | range s | GB/s | vs disk | zero_py / dcp |")
        print("|---|---:|---:|---:|---:|---:|")
        med = {k: statistics.median(v) for k, v in times.items()}
        # against the faster of the disk's two ways (buffered or direct) of the same bytes
        best = {kind: min(med[f"disk {kind}"], med[f"disk {kind} (direct)"])
                for kind in ("save", "load")}
        for k, t in med.items():
            kind = "save" if "save" in k else "load"
            vs_disk = best[kind] / t
            vs_dcp = (f"{med[f'dcp {kind}'] / t:.2f}x faster" if k.startswith("zero_py")
                      else "")
            spread = f"{min(times[k]):.3f}-{max(times[k]):.3f}"
            print(f"| {k} | {t:.3f} | {spread} | {gb / t:.2f} | {100 * vs_disk:.0f}% | "
                  f"{vs_dcp} |")
        for name in ("zero_py load", "zero_py load (no verify)"):
            ratios = [min(d, e) / z for d, e, z in zip(times["disk load"],
                                                        times["disk load (direct)"],
                                                        times[name])]
            print(f"\n{name} against the disk read of the same round: "
                  + ", ".join(f"{100 * x:.0f}%" for x in ratios))
        largest = max(p.numel() * p.element_size() for p in zmodel.parameters())
        out = os.path.join(root, "full.safetensors")
        res = subprocess.run([sys.executable, "-m", "zero_py", "consolidate", zpath, out],
                             capture_output=True, text=True)
        print(f"\nconsolidate: {res.stdout.strip() or res.stderr.strip()}")
        print(f"largest tensor {largest / 2**20:.1f} MiB")
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
