"""Training step time of TinyGPT under DDP, torch's ZeroRedundancyOptimizer and zero_py.

Launch one process per rank with torchrun (gloo, CPU), from the repository root:

    torchrun --nproc-per-node 2 benchmarks/step_time.py [--json step_time.json]

Every configuration trains its own copy of the same model (same initial weights, same batches
on a given rank: the demo's byte-level corpus of the standard library):

    (a) DDP + torch.optim.AdamW
    (b) DDP + torch.distributed.optim.ZeroRedundancyOptimizer(AdamW)
    (c) zero_py.ZeroOptimizer(AdamW, stage=1), model not wrapped
    (d) zero_py.ZeroOptimizer(AdamW, stage=2), model not wrapped
    (e) zero_py.initialize(model, AdamW, stage=3, wrap_policy={Block})
    (f) PyTorch FSDP2: fully_shard on every Block and on the model, torch.optim.AdamW (skipped,
        with the reason printed, where this torch cannot run it on gloo/CPU)

A step is forward, backward, optimizer.step() and zero_grad(). After warm-up the configurations
take turns, round after round (the starting configuration rotates), each running a few steps
between two barriers; a sample is that time divided by the steps. Rank 0 prints the median,
quartiles and ratio to (a) as a markdown table, and the largest difference between each
configuration's parameters and (a)'s at the end. They saw the same batches, so that difference
is rounding, which training amplifies (AdamW divides by sqrt(v) + eps, so gradients near eps
magnify it); torch's own fused and for-loop AdamW drift apart as fast. Each rank uses one
intra-op thread (torch.set_num_threads(1)).
"""

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

import zero_py
from zero_py.tools.env import cpu_model
from zero_py.examples.demo import Block, TinyGPT, get_batch, load_corpus

CONFIGS = ["DDP + AdamW", "DDP + ZeroRedundancyOptimizer", "zero_py stage 1", "zero_py stage 2",
           "zero_py stage 3", "FSDP2 (fully_shard)"]


class Run:
    """One configuration: the model, what forward is called on, its optimizer and batches."""

    def __init__(self, name, vocab_size, args, rank):
        torch.manual_seed(args.seed)
        self.model = TinyGPT(vocab_size, n_layer=args.n_layer, n_head=args.n_head,
                             d_model=args.d_model, block_size=args.block_size)
        self.forward = self.model
        hyper = dict(lr=1e-3, weight_decay=0.1)
        if name == "DDP + AdamW":
            self.forward = DistributedDataParallel(self.model)
            self.optimizer = torch.optim.AdamW(self.model.parameters(), **hyper)
        elif name == "DDP + ZeroRedundancyOptimizer":
            self.forward = DistributedDataParallel(self.model)
            self.optimizer = ZeroRedundancyOptimizer(
                self.model.parameters(), optimizer_class=torch.optim.AdamW, **hyper)
        elif name == "zero_py stage 3":
            self.model, self.optimizer = zero_py.initialize(
                self.model, torch.optim.AdamW, stage=3, wrap_policy={Block}, **hyper)
            self.forward = self.model
        elif name.startswith("FSDP2"):
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cpu", (dist.get_world_size(),))
            for block in self.model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(self.model, mesh=mesh)
            self.optimizer = torch.optim.AdamW(self.model.parameters(), **hyper)
        else:
            self.optimizer = zero_py.ZeroOptimizer(
                self.model.parameters(), torch.optim.AdamW, stage=int(name[-1]), **hyper)
        self.name = name
        self.generator = torch.Generator().manual_seed(args.seed * 1000 + rank)
        self.samples = []

    def step(self, tokens, args):
        x, y = get_batch(tokens, args.batch_size, args.block_size, self.generator)
        _, loss = self.forward(x, y)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def timed(run, tokens, args):
    """Seconds per step over args.steps_per_round steps, between barriers."""
    dist.barrier()
    start = time.perf_counter()
    for _ in range(args.steps_per_round):
        run.step(tokens, args)
    dist.barrier()
    return (time.perf_counter() - start) / args.steps_per_round


def full_params(run):
    """The configuration's full parameters (gathered for stage 3, unsharded for FSDP2)."""
    if run.name == "zero_py stage 3":
        with zero_py.gathered(run.model):
            return [p.detach().clone() for p in run.model.parameters()]
    return [p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
            for p in run.model.parameters()]


@torch.no_grad()
def max_param_diff(run, reference):
    """Largest absolute difference between the two models' parameters on any rank."""
    diff = max((p - q).abs().max() for p, q in zip(full_params(run), full_params(reference)))
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    return diff.item()


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def model_state_bytes(run, tokens, args):
    """Bytes of model states this rank holds after a backward and a step: zero_py's own
    accounting (shards, gathered peak, gradient shard and bucket buffers, states, masters);
    for the others the tensors themselves: parameters (local shards for FSDP2), gradients at
    the end of backward (plus DDP's bucket copy of them), optimizer states."""
    x, y = get_batch(tokens, args.batch_size, args.block_size, run.generator)
    _, loss = run.forward(x, y)
    loss.backward()
    if run.name.startswith("zero_py"):
        run.optimizer.step()
        rep = run.optimizer.memory_report()
        run.optimizer.zero_grad()
        return rep["params"] + rep["grads"] + rep["optimizer_states"]
    params = sum(_local(p).numel() * p.element_size() for p in run.model.parameters())
    grads = sum(_local(p.grad).numel() * p.element_size() for p in run.model.parameters()
                if p.grad is not None)
    if run.name.startswith("DDP"):
        grads *= 2  # the reducer's buckets hold a second copy (gradient_as_bucket_view=False)
    run.optimizer.step()
    run.optimizer.zero_grad()
    opt = getattr(run.optimizer, "optim", run.optimizer)  # ZeroRedundancyOptimizer's local one
    states = sum(_local(v).numel() * v.element_size() for st in opt.state.values()
                 for v in st.values() if torch.is_tensor(v) and v.dim() > 0)
    return params + grads + states


def table(runs, param_diffs, peak):
    base = statistics.median(runs[CONFIGS[0]].samples)
    base_mem = peak[CONFIGS[0]]
    rows = ["| configuration | median ms/step | p25 | p75 | vs DDP + AdamW "
            "| max abs param diff vs (a) | model states MiB/rank | vs DDP |",
            "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name in runs:
        q1, _, q3 = statistics.quantiles(runs[name].samples, n=4)
        med = statistics.median(runs[name].samples)
        rows.append(f"| {name} | {med * 1e3:.1f} | {q1 * 1e3:.1f} | {q3 * 1e3:.1f} "
                    f"| {med / base:.3f} | {param_diffs[name]:.2e} "
                    f"| {peak[name] / 2**20:.2f} | {peak[name] / base_mem:.2f} |")
    return "\n".join(rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n-layer", type=int, default=4)
    parser.add_argument("--n-head", type=int, default=6)
    parser.add_argument("--d-model", type=int, default=384)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per rank per step")
    parser.add_argument("--warmup", type=int, default=5, help="steps per configuration")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--steps-per-round", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", metavar="LETTERS", default="abcdef",
                        help="configurations to run, by letter (a is always run: the reference)")
    parser.add_argument("--json", metavar="PATH", help="write the results here (rank 0)")
    args = parser.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    train, _, vocab = load_corpus()
    runs = {}
    bad = set(args.only) - set("abcdef")
    if bad:
        parser.error(f"--only takes letters a-f, got {''.join(sorted(bad))}")
    chosen = [name for k, name in enumerate(CONFIGS) if k == 0 or "abcdef"[k] in args.only]
    for name in chosen:
        try:
            runs[name] = Run(name, len(vocab), args, rank)
        except Exception as exc:  # FSDP2 where this torch cannot run it on gloo/CPU
            if not name.startswith("FSDP2"):
                raise
            if rank == 0:
                print(f"skipping {name}: {type(exc).__name__}: {exc}")
    configs = list(runs)
    n_params = sum(p.numel() for p in runs[CONFIGS[0]].model.parameters())
    if rank == 0:
        print(f"TinyGPT n_layer={args.n_layer} d_model={args.d_model} n_head={args.n_head}: "
              f"{n_params / 1e6:.2f}M parameters; {world} ranks x {args.batch_size}x"
              f"{args.block_size} tokens per step; torch {torch.__version__}, 1 thread per rank; "
              f"zero_py C kernels: {zero_py.kernels.cpu_isa()}; CPU: {cpu_model()}")

    for run in runs.values():
        for _ in range(args.warmup):
            run.step(train, args)
    for r in range(args.rounds):
        for name in configs[r % len(configs):] + configs[:r % len(configs)]:
            runs[name].samples.append(timed(runs[name], train, args))

    param_diffs = {name: max_param_diff(run, runs[CONFIGS[0]]) for name, run in runs.items()}
    memory = {name: model_state_bytes(run, train, args) for name, run in runs.items()}
    peak = {}
    for name, b in memory.items():
        t = torch.tensor([b], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        peak[name] = int(t.item())

    if rank == 0:
        print(f"\n{args.rounds} rounds x {args.steps_per_round} steps per configuration, "
              f"after {args.warmup} warm-up steps:\n")
        print(table(runs, param_diffs, peak))
        if args.json:
            base = statistics.median(runs[CONFIGS[0]].samples)
            result = {
                "world_size": world, "torch": torch.__version__, "threads_per_rank": 1,
                "model": {"n_layer": args.n_layer, "n_head": args.n_head,
                          "d_model": args.d_model, "block_size": args.block_size,
                          "vocab_size": len(vocab), "parameters": n_params},
                "batch_size_per_rank": args.batch_size, "warmup_steps": args.warmup,
                "rounds": args.rounds, "steps_per_round": args.steps_per_round,
                "configurations": {
                    name: {"median_s": statistics.median(run.samples),
                           "ratio_to_ddp": statistics.median(run.samples) / base,
                           "samples_s": run.samples,
                           "max_abs_param_diff_vs_ddp": param_diffs[name],
                           "model_state_bytes_max_rank": peak[name]}
                    for name, run in runs.items()},
            }
            with open(args.json, "w") as f:
                json.dump(result, f, indent=2)
            print(f"\nwrote {args.json}")
    dist.barrier()  # every rank done with its collectives before any tears down
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
