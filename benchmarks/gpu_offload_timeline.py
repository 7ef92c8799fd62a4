"""Where an offloaded step's time goes on one GPU: a timeline of one step of ZeRO-Offload (stage
2, offload_optimizer="cpu"), with and without overlap_step, in host wall-clock milliseconds
from the start of backward.

    python benchmarks/gpu_offload_timeline.py [--batch-size 32] [--steps 2] [--cpu-smoke]

Events: backward returns on the host; the GPU finishes backward (an event waited for by a
side thread); the reducer hands each bucket to the host side (reduced); an early update's
wait for its gradient copy, its backup and its kernel (overlap_step); step()'s reducer finish,
settle and host step (each bucket's kernel); step() returns. Model: benchmarks/gpu_step_time.py's
GPT-2 small. For issue 13's "share of the host step hidden behind backward": what runs after
the GPU's backward is what is exposed.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

import gpu_step_time as gst  # noqa: E402

import zero_py  # noqa: E402
from zero_py.offload import early, host  # noqa: E402
from zero_py.optim.update import FusedUpdate  # noqa: E402
from zero_py.sharding import reducer  # noqa: E402

LOG: list = []
T0 = [0.0]


def mark(what: str) -> None:
    LOG.append(((time.perf_counter() - T0[0]) * 1e3, threading.current_thread().name, what))


def wrap(cls, name, label):
    orig = getattr(cls, name)

    def inner(self, *a, **k):
        b = a[0] if a and isinstance(a[0], int) else ""
        mark(f"{label}{b} start")
        try:
            return orig(self, *a, **k)
        finally:
            mark(f"{label}{b} end")
    setattr(cls, name, inner)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--cpu-smoke", action="store_true")
    args = ap.parse_args()
    shape = dict(vocab=50257, n_layer=12, n_head=12, d_model=768, seq_len=1024)
    if args.cpu_smoke:
        shape.update(vocab=512, n_layer=2, n_head=2, d_model=64, seq_len=64)
        args.batch_size = 2
    device = torch.device("cpu") if args.cpu_smoke else torch.device("cuda", 0)
    tmp = gst._init_group(device)
    wrap(early.EarlyStep, "reduced", "reduced b")
    wrap(early.EarlyStep, "_run", "early b")
    wrap(early.EarlyStep, "settle", "settle")
    wrap(host.HostShard, "grads_ready", "grads_ready b")
    wrap(host.HostShard, "step", "host.step")
    wrap(reducer.GradReducer, "finish", "finish")
    wrap(reducer.GradReducer, "_launch", "launch b")
    wrap(FusedUpdate, "step", "kernel")
    for overlap in (0.0, 1.0):
        torch.manual_seed(0)
        with torch.device(device):
            model = gst.GPT(shape["vocab"], shape["n_layer"], shape["n_head"], shape["d_model"],
                            shape["seq_len"])
        model, opt = zero_py.initialize(model, torch.optim.AdamW, stage=2, lr=1e-4,
                                        offload_optimizer="cpu", overlap_step=overlap)
        idx = torch.randint(0, shape["vocab"], (args.batch_size, shape["seq_len"] + 1),
                            device=device)
        x, y = idx[:, :-1].contiguous(), idx[:, 1:].contiguous()
        for s in range(3 + args.steps):
            gst._sync(device)
            LOG.clear()
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = model(x, y)
            gst._sync(device)
            T0[0] = time.perf_counter()
            loss.backward()
            mark("backward returned")
            if device.type == "cuda":
                ev = torch.cuda.Event()
                ev.record()
                th = threading.Thread(target=lambda e=ev: (e.synchronize(),
                                                           mark("GPU backward done")),
                                      name="gpu-watch")
                th.start()
            opt.step()
            mark("step returned")
            gst._sync(device)
            mark("synchronized")
            opt.zero_grad(set_to_none=True)
            if device.type == "cuda":
                th.join()
            if s >= 3:
                print(f"\n## overlap_step={overlap}, step {s}: buckets {opt._flat.n_buckets}, "
                      f"host threads {opt._host.threads}, torch threads "
                      f"{torch.get_num_threads()}")
                for t, who, what in sorted(LOG):
                    print(f"{t:9.2f} ms  {who[:22]:22s} {what}")
        del model, opt
    # without this, the run did not exit on the H100 (NCCL's process group left to atexit)
    torch.distributed.destroy_process_group()
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
