"""Forms of all-gather and reduce-scatter on gloo (CPU), side by side.

    torchrun --nproc-per-node 4 benchmarks/gloo_collectives.py [--sizes-mb 0.8 3.2 12.8]

For each size (bytes of the full fp32 buffer) the forms take turns, round after round, each
timed over a few calls between barriers; rank 0 prints the median ms per call:

    all-gather     flat      dist.all_gather_into_tensor(out, piece)
                   list      dist.all_gather(list(out.chunk(n)), piece)
                   bcast     one async broadcast per rank from its chunk of out
                   zero_py   TorchDistExecutor.all_gather: point-to-point messages
    reduce-scatter list      dist.reduce_scatter(piece, list(full.chunk(n)))
                   flat      dist.reduce_scatter_tensor(piece, full)
                   allreduce dist.all_reduce(full) + copy of this rank's chunk
                   zero_py   TorchDistExecutor.reduce_scatter: point-to-point messages
    reference      allreduce the same all-reduce alone (what DDP runs)

zero_py.executor picks its gloo forms from these numbers. Each rank uses one intra-op thread.
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from zero_py.collectives import TorchDistExecutor
from zero_py.tools.env import cpu_model

# torch 2.13 renamed the flat collectives (*_single) and deprecated the old names
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def forms(numel, rank, world):
    piece = torch.randn(numel // world)
    out = torch.empty(numel)
    outs = list(out.chunk(world))
    full = torch.randn(numel)
    fulls = list(full.chunk(world))

    def ag_bcast():
        outs[rank].copy_(piece)
        works = [dist.broadcast(c, src=k, async_op=True) for k, c in enumerate(outs)]
        for w in works:
            w.wait()

    executor = TorchDistExecutor()

    def rs_allreduce():
        dist.all_reduce(full)
        piece.copy_(fulls[rank])

    return {
        "all-gather flat": lambda: _all_gather_flat(out, piece),
        "all-gather list": lambda: dist.all_gather(outs, piece),
        "all-gather bcast": ag_bcast,
        "all-gather zero_py": lambda: executor.all_gather(out, piece).wait(),
        "reduce-scatter list": lambda: dist.reduce_scatter(piece, fulls),
        "reduce-scatter flat": lambda: _reduce_scatter_flat(piece, full),
        "reduce-scatter allreduce": rs_allreduce,
        "reduce-scatter zero_py": lambda: executor.reduce_scatter(piece, full).wait(),
        "all-reduce (reference)": lambda: dist.all_reduce(full),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[0.8, 3.2, 12.8])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--calls", type=int, default=5, help="calls per timed sample")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = []
    for mb in args.sizes_mb:
        numel = int(mb * 1e6 / 4) // world * world
        fns = forms(numel, rank, world)
        samples = {name: [] for name in fns}
        names = list(fns)
        for r in range(args.rounds):
            for name in names[r % len(names):] + names[:r % len(names)]:
                fns[name]()  # warm
                dist.barrier()
                start = time.perf_counter()
                for _ in range(args.calls):
                    fns[name]()
                dist.barrier()
                samples[name].append((time.perf_counter() - start) / args.calls)
        for name in names:
            rows.append((mb, name, statistics.median(samples[name]) * 1e3))
    if rank == 0:
        print(f"gloo, {world} ranks, torch {torch.__version__}, 1 thread per rank, "
              f"{args.rounds} rounds x {args.calls} calls, median ms per call; "
              f"CPU: {cpu_model()}\n")
        print("| MB (full buffer) | form | median ms |")
        print("|---:|---|---:|")
        for mb, name, ms in rows:
            print(f"| {mb:g} | {name} | {ms:.2f} |")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
