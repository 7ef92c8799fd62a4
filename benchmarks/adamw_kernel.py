"""Memory bandwidth of zero_py's fused C AdamW against torch.optim.AdamW and plain copies.

Single process, run from anywhere once zero_py is installed:

    python benchmarks/adamw_kernel.py [--sizes 10,30,100] [--reps 15] [--json adamw.json]

For each size N (millions of fp32 elements) it times these candidates, taking turns repetition
after repetition; each timed call directly follows an untimed call of the same candidate, so that
none pays for the one before it (torch's OpenMP workers spin for a while after each parallel
region and slow down threads started right then, such as zero_py's):

    zero_py        zero_py.kernels.adamw_step_flat(p, g, m, v, ...)
    torch fused    torch.optim.AdamW(fused=True).step() on one parameter of numel N
    torch foreach  torch.optim.AdamW(foreach=True).step() on that parameter
    copy           dst.copy_(src)                             8 bytes/element (read + write)
    triad          torch.add(src, other, alpha=0.5, out=dst)  12 bytes/element (2 reads + write)

The three AdamWs update the same p with the same gradient g (the parameter is p, its .grad is
g); each keeps its own m and v. AdamW moves 28 bytes per element (reads p, g, m, v; writes p,
m, v). Each row reports the median time, bytes moved / median time in GB/s (1e9 bytes), and
that bandwidth as a percentage of the copy's. The copy and the triad write to memory they do
not read, which costs the CPU an extra read per written cache line that their 8 and 12 bytes
leave out; AdamW writes only what it has read, so it can exceed 100% of the copy.

torch runs on os.cpu_count() intra-op threads; zero_py picks its own count (ZP_NUM_THREADS,
else the CPUs it may run on). Before timing, the script checks one zero_py step against
torch.optim.AdamW on 1M elements and prints the largest difference.
"""

import argparse
import json
import os
import statistics
import time

import torch

from zero_py import kernels
from zero_py.tools.env import cpu_model

HYPER = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
BYTES_PER_ELEMENT = {"zero_py": 28, "torch fused": 28, "torch foreach": 28, "copy": 8, "triad": 12}


def zero_py_step(p, g, m, v, step):
    kernels.adamw_step_flat(p, g, m, v, step=step, lr=HYPER["lr"], beta1=HYPER["betas"][0],
                            beta2=HYPER["betas"][1], eps=HYPER["eps"],
                            weight_decay=HYPER["weight_decay"])


def check_against_torch(numel=2**20):
    """Largest |difference| of p, m, v after one zero_py step and one torch.optim.AdamW step."""
    gen = torch.Generator().manual_seed(1)
    p, g, m = (torch.randn(numel, generator=gen) for _ in range(3))
    v = torch.rand(numel, generator=gen)
    param = torch.nn.Parameter(p.clone())
    param.grad = g.clone()
    opt = torch.optim.AdamW([param], **HYPER)
    opt.state[param] = {"step": torch.tensor(4.0), "exp_avg": m.clone(),
                        "exp_avg_sq": v.clone()}
    opt.step()
    zero_py_step(p, g, m, v, step=5)
    state = opt.state[param]
    return max((a - b).abs().max().item() for a, b in
               ((p, param.detach()), (m, state["exp_avg"]), (v, state["exp_avg_sq"])))


def candidates(numel, gen):
    """name -> zero-argument function running one repetition, on tensors made here."""
    p, g, m = (torch.randn(numel, generator=gen) for _ in range(3))
    v = torch.rand(numel, generator=gen) + 0.1
    param = torch.nn.Parameter(p)  # shares p's storage: every AdamW updates the same tensor
    param.grad = g
    fused = torch.optim.AdamW([param], fused=True, **HYPER)
    foreach = torch.optim.AdamW([param], foreach=True, **HYPER)
    steps = [0]

    def zero_py_rep():
        steps[0] += 1
        zero_py_step(p, g, m, v, steps[0])

    src, other, dst = torch.randn(numel, generator=gen), torch.randn(numel, generator=gen), \
        torch.empty(numel)
    return {
        "zero_py": zero_py_rep,
        "torch fused": fused.step,
        "torch foreach": foreach.step,
        "copy": lambda: dst.copy_(src),
        "triad": lambda: torch.add(src, other, alpha=0.5, out=dst),
    }


def measure(numel, reps, warmup):
    """name -> seconds of each timed repetition. Candidates take turns; each timed call follows
    an untimed call of the same candidate."""
    runs = candidates(numel, torch.Generator().manual_seed(numel))
    for fn in runs.values():
        for _ in range(warmup):
            fn()
    times = {name: [] for name in runs}
    for _ in range(reps):
        for name, fn in runs.items():
            fn()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10,30,100",
                        help="comma-separated sizes in millions of fp32 elements")
    parser.add_argument("--reps", type=int, default=15, help="timed repetitions per candidate")
    parser.add_argument("--warmup", type=int, default=2, help="untimed repetitions first")
    parser.add_argument("--json", metavar="PATH", help="write the results here")
    args = parser.parse_args()

    torch.set_num_threads(os.cpu_count())
    sizes = [int(float(s) * 1e6) for s in args.sizes.split(",")]
    info = {"cpu": cpu_model(), "cpu_isa": kernels.cpu_isa(),
            "torch_threads": torch.get_num_threads(),
            "zero_py_threads": kernels.default_threads(), "torch": torch.__version__}
    print(f"CPU: {info['cpu']}, {os.cpu_count()} CPUs; zero_py ISA: {info['cpu_isa']}, "
          f"{info['zero_py_threads']} threads; torch {info['torch']}, "
          f"{info['torch_threads']} threads")
    print(f"zero_py vs torch.optim.AdamW after one step, max |diff| of p, m, v: "
          f"{check_against_torch():.2e}\n")

    rows = ["| N | candidate | median ms | GB/s | % of copy |", "|---:|---|---:|---:|---:|"]
    results = []
    for numel in sizes:
        times = measure(numel, args.reps, args.warmup)
        copy_gbps = 8 * numel / statistics.median(times["copy"]) / 1e9
        for name, samples in times.items():
            median = statistics.median(samples)
            gbps = BYTES_PER_ELEMENT[name] * numel / median / 1e9
            results.append({"numel": numel, "candidate": name, "median_s": median,
                            "bytes_per_element": BYTES_PER_ELEMENT[name], "gb_per_s": gbps,
                            "percent_of_copy": 100 * gbps / copy_gbps, "samples_s": samples})
            rows.append(f"| {numel / 1e6:g}M | {name} | {median * 1e3:.2f} | {gbps:.1f} "
                        f"| {100 * gbps / copy_gbps:.0f}% |")
    print("\n".join(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**info, "reps": args.reps, "warmup": args.warmup, "results": results},
                      f, indent=2)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
