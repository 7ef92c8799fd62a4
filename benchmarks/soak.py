"""Leak soak: resident memory, file descriptors, threads and shared-memory files over a long
run of one stage, sampled as it goes; fails when any of them keeps growing.

    torchrun --nproc-per-node 2 benchmarks/soak.py --stage 3 [--steps 1000] [--every 50]

Each rank trains the demo's GPT (zero_py.examples.demo.TinyGPT) for --steps steps, and on the
way does what a long job does: a no_grad evaluation forward every 25 steps, a checkpoint save
every 100 (every other one asynchronous, keep_last=2), a reload of the last one every 400 (the
first at step 175), gradient clipping every step. Everything the run does once for good (the
I/O engine's threads, the asynchronous saves' group) has happened by step 175. It samples
every --every steps: RSS (VmRSS), open file descriptors (/proc/self/fd), threads
(/proc/self/status), zero_py's files in /dev/shm (host-wide).

A leak is growth that does not stop: after the first quarter of the run (at least 250 steps:
allocators and caches warm up, the one-time resources exist), the last sample must not exceed
the one at the quarter by more than --rss-slack-mib (default 8) of RSS, and fds, threads and
/dev/shm files must not grow at all. Rank 0 prints the samples' summary per rank and exits 1
when any rank leaks. Prints the CPU.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import torch
import torch.distributed as dist

import zero_py
from zero_py.collectives.objects import gather_json
from zero_py.examples.demo import TinyGPT
from zero_py.tools.env import cpu_model, proc_status_kib


def sample(step: int) -> dict:
    shm = [n for n in os.listdir("/dev/shm") if "zero_py" in n or n.startswith("zp")] \
        if os.path.isdir("/dev/shm") else []
    return {"step": step, "rss_mib": proc_status_kib("VmRSS") / 1024,
            "fds": len(os.listdir("/proc/self/fd")), "threads": proc_status_kib("Threads"),
            "shm_files": len(shm)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", type=int, choices=(1, 2, 3), default=2)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--rss-slack-mib", type=float, default=8.0)
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = TinyGPT(64, n_layer=4, n_head=4, d_model=64, block_size=32)
    policy = {"wrap_policy": 20_000} if args.stage == 3 else {}
    model, opt = zero_py.initialize(model, torch.optim.AdamW, stage=args.stage, lr=1e-3,
                                    **policy)
    ckdir = tempfile.mkdtemp(prefix="zp_soak_") if rank == 0 else None
    ckdir = gather_json(opt.executor, ckdir, None)[0]
    gen = torch.Generator().manual_seed(rank)
    samples, pending, last_ck = [], None, None
    t0 = time.time()
    for step in range(1, args.steps + 1):
        idx = torch.randint(0, 64, (8, 33), generator=gen)
        _, loss = model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        if step % 25 == 0:
            with torch.no_grad():
                model(idx[:, :-1], idx[:, 1:])
        if step % 100 == 50:  # saves: synchronous and asynchronous in turn
            last_ck = os.path.join(ckdir, f"step_{step:06d}")
            if step % 200 == 150:
                pending = zero_py.save_checkpoint(last_ck, model, opt, keep_last=2,
                                                  async_save=True)
            else:
                zero_py.save_checkpoint(last_ck, model, opt, keep_last=2)
        if step % 400 == 175:  # and a reload of the last one
            zero_py.load_checkpoint(last_ck, model, opt)
        if step % args.every == 0:
            samples.append(sample(step))
    if pending is not None:
        pending.wait()
    seconds = time.time() - t0
    everyone = gather_json(opt.executor, samples, 0)
    leaked = False
    if rank == 0:
        print(f"# soak: stage {args.stage}, {world} ranks, {args.steps} steps in {seconds:.0f} s, "
              f"{cpu_model()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d')}")
        print("| rank | RSS MiB at 1/4 -> end | fds | threads | /dev/shm files | verdict |")
        print("|---:|---|---|---|---|---|")
        for r, ss in enumerate(everyone):
            q = next(x for x in ss if x["step"] >= max(250, args.steps // 4))
            end = ss[-1]
            grew = {k: end[k] - q[k] for k in ("rss_mib", "fds", "threads", "shm_files")}
            bad = (grew["rss_mib"] > args.rss_slack_mib or grew["fds"] > 0
                   or grew["threads"] > 0 or grew["shm_files"] > 0)
            leaked |= bad
            print(f"| {r} | {q['rss_mib']:.1f} -> {end['rss_mib']:.1f} "
                  f"({grew['rss_mib']:+.1f}) | {q['fds']} -> {end['fds']} | "
                  f"{q['threads']} -> {end['threads']} | {q['shm_files']} -> "
                  f"{end['shm_files']} | {'GROWS' if bad else 'flat'} |")
        shutil.rmtree(ckdir, ignore_errors=True)
    dist.destroy_process_group()
    return 1 if leaked else 0


if __name__ == "__main__":
    raise SystemExit(main())
