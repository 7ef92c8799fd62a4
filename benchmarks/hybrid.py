"""Hybrid sharding beside full sharding and DDP: step time, model-state memory and bytes on the
wire per link class, side by side in one run.

    torchrun --nproc-per-node 4 benchmarks/hybrid.py [--rounds 8]

The demo's TinyGPT on 4 gloo ranks, AdamW, each rank its own batches. Configurations take
turns, round after round: DDP + torch.optim.AdamW; zero_py stages 2 and 3 sharded over all 4
ranks; the same as 2 replicas x 2 shards (device_mesh dims ("replicate", "shard")). Per
configuration, rank 0 prints the median step time, memory_report()'s model-state bytes (DDP:
its tensors, with the reducer's bucket copy of the gradients), and comm_stats()'s payload bytes
sent per rank in the last step by group (control messages apart), beside the ring formula:
shard group 2 Psi_p (S-1)/S for stage 2 (stage 3: see docs/scale-out.md, units kept gathered
move less), replicate group 2 (Psi_p/S) (R-1)/R, with Psi_p the padded layout's bytes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

import zero_py
from zero_py.examples.demo import Block, TinyGPT, get_batch, load_corpus
from zero_py.tools.env import cpu_model

CONFIGS = ["DDP + AdamW", "stage 2, 4 shards", "stage 2, 2 x 2 hybrid", "stage 3, 4 shards",
           "stage 3, 2 x 2 hybrid"]


def build(name, vocab, args, mesh):
    torch.manual_seed(0)
    model = TinyGPT(vocab, n_layer=args.n_layer, n_head=4, d_model=args.d_model,
                    block_size=args.block_size)
    if name.startswith("DDP"):
        return DistributedDataParallel(model), model, torch.optim.AdamW(model.parameters(),
                                                                         lr=1e-3)
    kw = {"device_mesh": mesh} if "hybrid" in name else {}
    stage = int(name.split()[1].rstrip(","))
    if stage == 3:
        kw["wrap_policy"] = {Block}
    model, opt = zero_py.initialize(model, torch.optim.AdamW, stage=stage, lr=1e-3, **kw)
    return model, model, opt


def step(forward, opt, tokens, args, gen):
    x, y = get_batch(tokens, args.batch_size, args.block_size, gen)
    forward(x, y)[1].backward()
    opt.step()
    opt.zero_grad()


def memory(name, model, opt) -> int:
    if not name.startswith("DDP"):
        rep = opt.memory_report()
        return rep["params"] + rep["grads"] + rep["optimizer_states"]
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    states = sum(v.numel() * v.element_size() for st in opt.state.values()
                 for v in st.values() if torch.is_tensor(v) and v.dim() > 0)
    return params + 2 * params + states  # param.grad and the reducer's bucket copy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3, help="steps per configuration per round")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 4:
        raise SystemExit("run on 4 ranks: torchrun --nproc-per-node 4 benchmarks/hybrid.py")
    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    tokens, _, vocab = load_corpus()
    runs = {}
    for name in CONFIGS:
        forward, model, opt = build(name, len(vocab), args, mesh)
        gen = torch.Generator().manual_seed(rank)
        step(forward, opt, tokens, args, gen)  # warm-up: states exist
        runs[name] = {"forward": forward, "model": model, "opt": opt, "gen": gen, "t": []}
    for r in range(args.rounds):
        for name in CONFIGS[r % len(CONFIGS):] + CONFIGS[:r % len(CONFIGS)]:
            run = runs[name]
            dist.barrier()
            t = time.perf_counter()
            for _ in range(args.steps):
                step(run["forward"], run["opt"], tokens, args, run["gen"])
            dist.barrier()
            run["t"].append((time.perf_counter() - t) / args.steps)
    rows = []
    for name in CONFIGS:
        run = runs[name]
        mem = memory(name, run["model"], run["opt"])
        traffic = {}
        formula = ""
        if not name.startswith("DDP"):
            stats = run["opt"].comm_stats()
            for label, kinds in stats.items():
                traffic[label] = sum(k["bytes_sent"] for kind, k in kinds.items()
                                     if kind != "control")
            fp = run["opt"]._flat
            padded = sum(fp.bucket_numel[b] * fp.bucket_dtype(b).itemsize
                         for b in range(fp.n_buckets))
            s = run["opt"].executor.world_size
            rep_size = world // s
            formula = f"shard 2Ψp(S-1)/S = {2 * padded * (s - 1) // s / 1e6:.2f} MB"
            if rep_size > 1:
                formula += (f"; replicate 2(Ψp/S)(R-1)/R = "
                            f"{2 * (padded // s) * (rep_size - 1) // rep_size / 1e6:.2f} MB")
        rows.append((name, statistics.median(run["t"]), mem, traffic, formula))
    if rank != 0:
        return
    print(f"# hybrid sharding, 4 ranks (gloo), TinyGPT {args.n_layer} layers x d{args.d_model}")
    print(f"CPU: {cpu_model()}; load average {os.getloadavg()[0]:.1f}; torch {torch.__version__}")
    print()
    print("| configuration | median s/step | vs DDP | model states MB/rank | payload MB sent per "
          "rank, last step, by group | ring formula (stage 2; stage 3 keeps units) |")
    print("|---|---:|---:|---:|---|---|")
    base = rows[0][1]
    for name, t, mem, traffic, formula in rows:
        by_group = ", ".join(f"{k} {v / 1e6:.2f}" for k, v in sorted(traffic.items())) or \
            "all-reduce 2Ψ(N-1)/N (not counted)"
        print(f"| {name} | {t:.3f} | {t / base:.2f}x | {mem / 1e6:.1f} | {by_group} | "
              f"{formula} |")


if __name__ == "__main__":
    main()
