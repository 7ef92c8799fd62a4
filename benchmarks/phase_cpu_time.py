"""CPU time of forward, backward and step+zero_grad: a plain model, zero_py stage 2, stage 3.

    torchrun --nproc-per-node 1 benchmarks/phase_cpu_time.py [--iters 25] [--n-layer 24]

The same TinyGPT (d_model 64, 4 heads by default: many small units, so zero_py's Python
dominates what it adds) and the same batch, the three taking turns every iteration; rank 0
prints each phase's median over the iterations after 3 warm-up ones, in ms of the process's
CPU time (time.process_time: all its threads). Unlike wall time, CPU time barely moves when
other jobs share the cores, so zero_py's overhead (stage 2 or 3 minus the plain model, which
is neither wrapped nor reduced) can be compared between two checkouts on a busy machine. At
more than one rank the plain model is still not reduced, and the CPU time includes the
collectives' threads.
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist

import zero_py
from zero_py.examples.demo import Block, TinyGPT, get_batch, load_corpus


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--iters", type=int, default=25)
    parser.add_argument("--n-layer", type=int, default=24)
    parser.add_argument("--d-model", type=int, default=64)
    parser.add_argument("--n-head", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    train, _, vocab = load_corpus()

    def model():
        torch.manual_seed(0)
        return TinyGPT(len(vocab), n_layer=args.n_layer, n_head=args.n_head,
                       d_model=args.d_model, block_size=64)

    plain = model()
    z2 = model()
    z3, z3opt = zero_py.initialize(model(), torch.optim.AdamW, stage=3, wrap_policy={Block},
                                   lr=1e-3)
    runs = {"plain": (plain, torch.optim.AdamW(plain.parameters(), lr=1e-3)),
            "stage 2": (z2, zero_py.ZeroOptimizer(z2.parameters(), torch.optim.AdamW, stage=2,
                                                  lr=1e-3)),
            "stage 3": (z3, z3opt)}
    x, y = get_batch(train, 4, 64, torch.Generator().manual_seed(dist.get_rank()))
    times = {name: {"forward": [], "backward": [], "step": []} for name in runs}
    for it in range(args.iters):
        for name, (m, opt) in runs.items():
            t0 = time.process_time()
            _, loss = m(x, y)
            t1 = time.process_time()
            loss.backward()
            t2 = time.process_time()
            opt.step()
            opt.zero_grad(set_to_none=True)
            t3 = time.process_time()
            if it >= 3:
                for phase, t in zip(times[name], (t1 - t0, t2 - t1, t3 - t2)):
                    times[name][phase].append(t)
    if dist.get_rank() == 0:
        print("| model | forward ms | backward ms | step ms |\n|---|---:|---:|---:|")
        for name, phases in times.items():
            print(f"| {name} | " + " | ".join(f"{statistics.median(v) * 1e3:.1f}"
                                              for v in phases.values()) + " |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
