"""Quantized communication on the demo's GPT: wire bytes per step and final loss for fp32, bf16,
int8 and int4 communication, at 2 and 4 ranks (gloo, CPU), against fp32 communication.

    python benchmarks/quantized_comm.py [--steps 300] [--ranks 2 4] [--plot benchmarks/plots]

runs one torchrun job per world size; each trains the demo's TinyGPT (zero_py/examples/demo.py:
its corpus, batches, LR schedule and AdamW) once per mode, from the same seed and the same
batches, with stage 2:

    fp32    everything fp32 on the wire
    bf16    gradients bf16 on the wire, summed in fp32 (grad_reduce_dtype + grad_accum_dtype);
            parameters all-gathered as bf16 (quantized_weights="bf16")
    int8    int8 weights (qwZ) and int8 gradients (qgZ), one fp32 scale per 256 values
    int4    int8 weights and int4 gradients
    (the gradients rounded to nearest, the library's default; "-sr": stochastically;
    "-ef": with grad_error_feedback; not run by default)
    fp32-reorder  a null: fp32 on the wire, but the reduce-scatter sums the ranks' chunks in
            reverse rank order (as another correct fp32 collective may: a ring or a tree).
            Its distance from fp32 is what 1-ulp differences alone grow into by the last
            step. At 2 ranks it is fp32 itself (a + b = b + a)
    fp32-ulp  a null at any world size: fp32, every initial weight moved by one ulp (toward
            +inf) before the first step
    fp32-noise4, fp32-noise8  nulls of the wire's size: fp32 on the wire, but every chunk a
            rank sends a peer in the reduce-scatter carries zero-mean noise, uniform over one
            int4 (int8) rounding step of its block (the block's largest value / 7 (127), per
            --quantize-block values, blocks aligned as the quantized modes align them), drawn
            afresh at every call. That is the error of rounding to nearest without its bias:
            how far noise of the quantized gradients' size alone moves the final loss

Wire bytes are what this rank sends, counted from the buffers handed to the executor (a
counting executor under zero_py's: a quantized collective hands it the int8/int4 packets with
their scales): an all-gather sends its input to every peer, a reduce-scatter or all-to-all
sends each peer its chunk. Counted over the steps after the first, per step; the small
all-reduces (pass counts, the used mask) are reported apart. The final loss is the mean
training loss of the last 20 steps on every rank, and the validation loss after training (the
same batches in every mode). Prints a table and the CPU model, writes the loss curves as a
PNG into --plot.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
import torch.distributed as dist

MODES = {
    "fp32": {},
    "bf16": {"grad_reduce_dtype": torch.bfloat16, "grad_accum_dtype": torch.float32,
             "quantized_weights": "bf16"},
    "int8": {"quantized_weights": "int8", "quantized_grads": "int8"},
    "int4": {"quantized_weights": "int8", "quantized_grads": "int4"},
    # the gradients rounded stochastically instead of to nearest (the default)
    "int8-sr": {"quantized_weights": "int8", "quantized_grads": "int8",
                "quantized_grads_rounding": "stochastic"},
    "int4-sr": {"quantized_weights": "int8", "quantized_grads": "int4",
                "quantized_grads_rounding": "stochastic"},
    # with error feedback: each rank carries its gradients' rounding error to the next step
    "int8-ef": {"quantized_weights": "int8", "quantized_grads": "int8",
                "grad_error_feedback": True},
    "int4-ef": {"quantized_weights": "int8", "quantized_grads": "int4",
                "grad_error_feedback": True},
    # one side alone, to see where the error enters (not run by default)
    "int8-weights": {"quantized_weights": "int8"},
    "int8-grads": {"quantized_grads": "int8"},
    "int4-grads": {"quantized_grads": "int4"},
    "fp32-reorder": {},  # CountingExecutor(reorder=True): the null, see the docstring
    "fp32-ulp": {},  # the initial weights one ulp up: the null at any world size
    # CountingExecutor(noise_bits=4 / 8): unbiased noise of the gradients' rounding step; the
    # layout aligned to the blocks as the quantized modes align it
    "fp32-noise4": {},
    "fp32-noise8": {},
}
NOISE_BITS = {"fp32-noise4": 4, "fp32-noise8": 8}
# the departures figure's order: the nulls, then each wire beside the null of its size
ORDER = ["fp32-ulp", "fp32-reorder", "bf16", "fp32-noise8", "int8-grads", "int8-weights", "int8",
         "int8-sr", "int8-ef", "fp32-noise4", "int4-grads", "int4", "int4-block64", "int4-sr",
         "int4-ef"]  # (int4-block64: results/quantized_comm_seeds.json's --quantize-block 64 runs)
DEFAULT_MODES = ["fp32", "bf16", "int8", "int4"]


class CountingExecutor:
    """An executor that counts the bytes this rank sends through `inner`."""

    def __init__(self, inner, reorder: bool = False, noise_bits: int = 0, block: int = 256,
                 seed: int = 0):
        self.inner = inner
        self.reorder = reorder  # fp32-reorder: reduce-scatter summed in reverse rank order
        self.noise_bits, self.block = noise_bits, block  # fp32-noise*: see the docstring
        self.gen = torch.Generator().manual_seed(seed)
        self.bytes = {"reduce-scatter": 0, "all-gather": 0, "all-to-all": 0, "other": 0}

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _peer_chunks(self, t):
        ws = self.inner.world_size
        return t.numel() * t.element_size() * (ws - 1) // ws

    def _noisy(self, input):
        """input with every peer's chunk moved by uniform noise of +-half a rounding step of
        its block (the block's largest value / (2**(bits-1) - 1))."""
        ws, me = self.inner.world_size, self.inner.rank
        n, levels = input.numel() // ws, 2 ** (self.noise_bits - 1) - 1
        x = input.to(torch.float32, copy=True)
        for r in range(ws):
            if r == me:  # a rank's own chunk is never on the wire
                continue
            chunk = x[r * n:(r + 1) * n]
            whole = n // self.block * self.block
            for part in (chunk[:whole].view(-1, self.block), chunk[whole:].view(1, -1)):
                if part.numel():
                    step = part.abs().amax(dim=1, keepdim=True) / levels
                    part.add_((torch.rand(part.shape, generator=self.gen) - 0.5) * step)
        return x

    def reduce_scatter(self, output, input):
        from zero_py.collectives.work import Work
        self.bytes["reduce-scatter"] += self._peer_chunks(input)
        if self.noise_bits:
            noisy = self._noisy(input)
            return Work(self.inner.reduce_scatter(output, noisy), None, keep=(noisy,))
        if not self.reorder:
            return self.inner.reduce_scatter(output, input)
        ws, n = self.inner.world_size, output.numel()
        recv = torch.empty_like(input)
        work = self.inner.all_to_all(recv, input)  # chunk r: rank r's copy of this rank's

        def finish():
            acc = recv[(ws - 1) * n:].to(torch.float32, copy=True)
            for r in reversed(range(ws - 1)):
                acc += recv[r * n:(r + 1) * n]
            output.copy_(acc)
        return Work(work, finish, keep=(recv,))

    def all_gather(self, output, input):
        self.bytes["all-gather"] += input.numel() * input.element_size() * (
            self.inner.world_size - 1)
        return self.inner.all_gather(output, input)

    def all_to_all(self, output, input):
        self.bytes["all-to-all"] += self._peer_chunks(input)
        return self.inner.all_to_all(output, input)

    def all_reduce(self, tensor, *args):
        self.bytes["other"] += 2 * self._peer_chunks(tensor)  # a ring's share
        return self.inner.all_reduce(tensor, *args)

    def all_reduce_max(self, tensor):
        self.bytes["other"] += 2 * self._peer_chunks(tensor)
        return self.inner.all_reduce_max(tensor)

    def broadcast(self, tensor, src=0):
        return self.inner.broadcast(tensor, src)

    def reset(self):
        for k in self.bytes:
            self.bytes[k] = 0


def train(mode: str, seed: int, args, train_tokens, val_tokens, vocab) -> dict:
    import zero_py
    from zero_py.collectives import TorchDistExecutor
    from zero_py.optim.arguments import DEFAULT_QUANTIZE_BLOCK
    from zero_py.examples.demo import TinyGPT, evaluate, get_batch, learning_rate

    rank = dist.get_rank()
    block_size = 64
    torch.manual_seed(seed)
    model = TinyGPT(len(vocab), block_size=block_size)
    block = args.quantize_block or DEFAULT_QUANTIZE_BLOCK
    counter = CountingExecutor(TorchDistExecutor(), reorder=mode == "fp32-reorder",
                               noise_bits=NOISE_BITS.get(mode, 0), block=block,
                               seed=seed * 1000 + rank)
    # the noise nulls: the layout's blocks aligned to the parameters as a quantized wire's are
    align = {"align_bytes": 4 * block} if mode in NOISE_BITS else {}
    model, opt = zero_py.initialize(model, torch.optim.AdamW, stage=2, executor=counter,
                                    bucket_bytes=args.bucket_kib * 1024, lr=args.lr,
                                    weight_decay=0.1, **MODES[mode], **align,
                                    **({"quantize_block": args.quantize_block}
                                       if args.quantize_block else {}))
    if mode == "fp32-ulp":
        with torch.no_grad():  # every rank alike: the replicas stay equal
            for p in model.parameters():
                p.copy_(torch.nextafter(p, torch.full_like(p, float("inf"))))
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    losses = []
    for step in range(1, args.steps + 1):
        if step == 2:
            counter.reset()  # construction's broadcasts and the first step's set-up
        for group in opt.param_groups:
            group["lr"] = learning_rate(step, args.steps, args.lr)
        _, loss = model(*get_batch(train_tokens, args.batch_size, block_size, gen))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    per_step = {k: v / max(1, args.steps - 1) for k, v in counter.bytes.items()}
    val = evaluate(model, val_tokens, args.batch_size, block_size, 20,
                   torch.Generator().manual_seed(12345))
    curve = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(curve)
    curve /= dist.get_world_size()
    return {"bytes": per_step, "losses": curve.tolist(), "val": val,
            "n_params": sum(p.numel() for p in model.parameters())}


def worker(args) -> None:
    from zero_py.examples.demo import load_corpus

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    train_tokens, val_tokens, vocab = load_corpus()
    out = {str(seed): {mode: train(mode, seed, args, train_tokens, val_tokens, vocab)
                       for mode in args.modes} for seed in args.seeds}
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


def _wire(r) -> float:
    b = r["bytes"]
    return b["reduce-scatter"] + b["all-gather"] + b["all-to-all"]


def _tail(r) -> float:
    return sum(r["losses"][-20:]) / len(r["losses"][-20:])


def _spread(xs) -> str:
    """mean, sample std and [min, max] of xs (percent)."""
    t = torch.tensor(xs, dtype=torch.float64)
    std = t.std().item() if len(xs) > 1 else float("nan")
    return f"{t.mean().item():+.2f}% ± {std:.2f} [{t.min().item():+.2f}, {t.max().item():+.2f}]"


def _modes(seeds) -> list:
    """Every mode run at any seed, in the order first run (merged --from-json files may hold
    different modes at different seeds)."""
    return list(dict.fromkeys(m for runs in seeds.values() for m in runs))


def _departures(seeds, mode, key=_tail) -> dict:
    """seed -> percent of `mode`'s final (key) loss against fp32 of the same seed, over the
    seeds that ran both."""
    return {s: 100 * (key(runs[mode]) / key(runs["fp32"]) - 1) for s, runs in seeds.items()
            if mode in runs and "fp32" in runs}


def report(results) -> None:
    """Per seed, then over seeds: each mode's final and validation loss against the fp32 run
    of the same seed (same initialization, same batches), and the fp32 run's own spread over
    seeds (a difference smaller than that is not a property of the mode)."""
    print("\nPer seed (final loss: mean train loss of the last 20 steps over ranks):\n")
    print("| ranks | seed | mode | final loss | vs fp32 | val loss | vs fp32 |")
    print("|---|---|---|---|---|---|---|")
    for ws, seeds in results.items():
        for seed, runs in seeds.items():
            base = runs.get("fp32")
            for mode, r in runs.items():
                b = base or r
                print(f"| {ws} | {seed} | {mode} | {_tail(r):.4f} | "
                      f"{100 * (_tail(r) / _tail(b) - 1):+.2f}% | {r['val']:.4f} | "
                      f"{100 * (r['val'] / b['val'] - 1):+.2f}% |")
    print("\nOver seeds (vs fp32 of the same seed: mean ± sample std [min, max]; the seeds "
          "within 0.5% and 1% of it):\n")
    print("| ranks | mode | seeds | wire MB/step/rank | x bf16 | all-reduce KB/step | final loss "
          "(mean) | final vs fp32 | within 0.5% | within 1% | val vs fp32 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for ws, seeds in results.items():
        modes = _modes(seeds)
        bf16 = next((_wire(runs["bf16"]) for runs in seeds.values() if "bf16" in runs), None)
        for mode in modes:
            rs = [runs[mode] for runs in seeds.values() if mode in runs]
            tails = [_tail(r) for r in rs]
            d_tail = list(_departures(seeds, mode).values())
            d_val = list(_departures(seeds, mode, lambda r: r["val"]).values())
            wire = _wire(rs[0])
            within = (f"{sum(abs(d) <= 0.5 for d in d_tail)}/{len(d_tail)} | "
                      f"{sum(abs(d) <= 1.0 for d in d_tail)}/{len(d_tail)}") if d_tail \
                else "| "
            print(f"| {ws} | {mode} | {len(rs)} | {wire / 1e6:.3f} | "
                  f"{wire / bf16 if bf16 else float('nan'):.3f} | "
                  f"{rs[0]['bytes']['other'] / 1e3:.1f} | {sum(tails) / len(tails):.4f} | "
                  f"{_spread(d_tail) if d_tail else ''} | {within} | "
                  f"{_spread(d_val) if d_val else ''} |")
        fp32 = [runs["fp32"] for runs in seeds.values() if "fp32" in runs]
        if len(fp32) > 1:
            tails = torch.tensor([_tail(r) for r in fp32], dtype=torch.float64)
            vals = torch.tensor([r["val"] for r in fp32], dtype=torch.float64)
            print(f"| {ws} | fp32 over seeds | {len(fp32)} | | | | {tails.mean().item():.4f} | "
                  f"std {100 * tails.std().item() / tails.mean().item():.2f}%, range "
                  f"{100 * (tails.max() - tails.min()).item() / tails.mean().item():.2f}% | | | "
                  f"std {100 * vals.std().item() / vals.mean().item():.2f}%, range "
                  f"{100 * (vals.max() - vals.min()).item() / vals.mean().item():.2f}% |")


def plot(results, directory: str) -> None:
    """Per world size: each mode's loss curve (mean over seeds, running mean of 10), and its
    difference from fp32 of the same seed (mean over seeds, the band from min to max); and,
    in a second figure, every seed's final loss against fp32 of that seed, mode by mode."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot")
        return
    os.makedirs(directory, exist_ok=True)
    k = 10  # a running mean: single batches are noisy

    def smooth(losses):
        t = torch.tensor(losses, dtype=torch.float64)  # (a run shorter than k: one mean)
        return torch.nn.functional.avg_pool1d(t[None, None], min(k, t.numel()), 1)[0, 0]

    fig, axes = plt.subplots(2, len(results), figsize=(6 * len(results), 7.5), squeeze=False)
    for col, (ws, seeds) in enumerate(results.items()):
        modes = _modes(seeds)
        top, bottom = axes[0][col], axes[1][col]
        for mode in modes:
            with_mode = [s for s in seeds if mode in seeds[s]]
            curves = torch.stack([smooth(seeds[s][mode]["losses"]) for s in with_mode])
            steps = list(range(k, curves.shape[1] + k))
            top.plot(steps, curves.mean(0).tolist(), label=f"{mode} ({len(with_mode)})")
            paired = [s for s in with_mode if "fp32" in seeds[s]]
            if paired:
                rel = 100 * (torch.stack([smooth(seeds[s][mode]["losses"]) for s in paired])
                             / torch.stack([smooth(seeds[s]["fp32"]["losses"])
                                            for s in paired]) - 1)
                line, = bottom.plot(steps, rel.mean(0).tolist(), label=mode)
                if len(paired) > 1:
                    bottom.fill_between(steps, rel.min(0).values.tolist(),
                                        rel.max(0).values.tolist(), alpha=0.15,
                                        color=line.get_color())
        top.set_title(f"TinyGPT, stage 2, {ws} ranks (gloo), {len(seeds)} seed(s)")
        top.set_xlabel("step")
        top.set_ylabel("train loss (mean over ranks and seeds,\nrunning mean of 10)")
        top.legend()
        bottom.axhline(0, color="black", linewidth=0.5)
        bottom.set_xlabel("step")
        bottom.set_ylabel("train loss vs fp32, same seed (%)\nmean over seeds, band min-max")
        bottom.set_ylim(-5, 5)
        bottom.legend()
    path = os.path.join(directory, "quantized_comm_loss.png")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"\nwrote {path}")

    fig, axes = plt.subplots(1, len(results), figsize=(6 * len(results), 4.5), squeeze=False)
    for col, (ws, seeds) in enumerate(results.items()):
        ax = axes[0][col]
        modes = sorted((m for m in _modes(seeds) if m != "fp32" and _departures(seeds, m)),
                       key=lambda m: (ORDER.index(m) if m in ORDER else len(ORDER)))
        for i, mode in enumerate(modes):
            d = list(_departures(seeds, mode).values())
            ax.scatter([i] * len(d), d, s=14, alpha=0.6)
            ax.plot([i - 0.3, i + 0.3], [sum(d) / len(d)] * 2, color="black", linewidth=1)
        ax.axhspan(-1, 1, color="0.9", zorder=0)
        ax.axhspan(-0.5, 0.5, color="0.8", zorder=0)
        ax.axhline(0, color="black", linewidth=0.5)
        ax.set_xticks(range(len(modes)),
                      [f"{m} ({len(_departures(seeds, m))})" for m in modes], rotation=30,
                      ha="right")
        ax.set_ylabel("final loss vs fp32, same seed (%)\none dot a seed, bar: the mean")
        ax.set_title(f"{ws} ranks (seeds per mode in brackets): bands at ±0.5% and ±1%")
    path = os.path.join(directory, "quantized_comm_departures.png")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--modes", nargs="+", default=DEFAULT_MODES, choices=list(MODES))
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--bucket-kib", type=int, default=256)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--quantize-block", type=int, default=0,
                        help="values per scale in the quantized modes (default: the library's)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0],
                        help="seeds (initialization and batches), each a run of every mode")
    parser.add_argument("--plot", default=os.path.join(os.path.dirname(__file__), "plots"))
    parser.add_argument("--json", help="write every run's numbers here")
    parser.add_argument("--from-json", nargs="+",
                        help="report and plot these --json files (merged) instead of running")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)

    from zero_py.tools.env import cpu_model

    results = {}
    if args.from_json:
        for path in args.from_json:  # later files add seeds and modes
            with open(path) as f:
                for ws, seeds in json.load(f).items():
                    for seed, runs in seeds.items():
                        results.setdefault(int(ws), {}).setdefault(seed, {}).update(runs)
        return report(results), plot(results, args.plot)
    print(f"CPU: {cpu_model()}; torch {torch.__version__}; {args.steps} steps, batch "
          f"{args.batch_size}x64 per rank, stage 2, gloo, seeds {args.seeds}")
    for ws in args.ranks:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "out.json")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   f"--nproc-per-node={ws}", os.path.abspath(__file__), "--worker", "--out", out,
                   "--steps", str(args.steps), "--batch-size", str(args.batch_size),
                   "--bucket-kib", str(args.bucket_kib), "--lr", str(args.lr),
                   "--quantize-block", str(args.quantize_block),
                   "--seeds", *map(str, args.seeds), "--modes", *args.modes]
            subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            with open(out) as f:
                results[ws] = json.load(f)
        if args.json:  # after each world size: a long run leaves what it finished
            with open(args.json, "w") as f:
                json.dump({str(k): v for k, v in results.items()}, f)
    report(results)
    plot(results, args.plot)


if __name__ == "__main__":
    main()
