"""`python -m zero_py plot`: per-rank memory against world size for each stage, and where a step's
time goes, as PNGs (matplotlib).

    python -m zero_py plot                          # measure 1, 2 and 4 ranks, then draw
    python -m zero_py plot --json build/demo/demo.json --out build/demo

Two figures:

- memory.png: the model-state bytes per rank (parameters, gradients, optimizer states; stage 3's
  gathered units counted in its parameters) against the world size, for each stage and for DDP.
  Lines are zero_py.estimate_memory for the demo's TinyGPT at every world size from 1 to
  --max-world; markers are measured: ZeroOptimizer.memory_report() after short runs.
- step_time.png: forward, backward and optimizer.step() time per step (mean over the measured
  steps, rank 0), stacked, for each measured world size and stage (and DDP).

Measurements ("records") come from short runs this command starts itself (`torchrun
--nproc-per-node W -m zero_py.tools.plot --worker`, one launch per world size, gloo on the
CPU) unless --no-measure, and from JSON files the demo writes (`--json`;
`python -m zero_py.examples.demo --json PATH`). A record is one rank of one run:
{"world", "stage" (1-3, or "ddp"), "rank", "model_states", "ddp_model_states" (bytes),
"times": {"forward", "backward", "step"} (seconds per step), "model": TinyGPT's arguments,
"bucket_bytes"}. `zero_py.tools.bench` prints the same measurements as a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional, Sequence

MIB = 2.0 ** 20
STAGE_COLORS = {1: "tab:blue", 2: "tab:orange", 3: "tab:green", "ddp": "tab:gray"}
DEFAULT_MODEL = {"n_layer": 2, "n_head": 4, "d_model": 128, "block_size": 64}
DEFAULT_BUCKET_BYTES = 256 * 1024  # the demo's


# -- measuring (one rank of a torchrun launch) ---------------------------------------------------

def time_steps(model, optimizer, batches, device_sync=lambda: None) -> Dict[str, float]:
    """Mean seconds per step of forward, backward and optimizer.step() + zero_grad() over
    `batches` ((x, y) pairs), for a model returning (logits, loss)."""
    import torch.distributed as dist

    spent = {"forward": 0.0, "backward": 0.0, "step": 0.0}
    for x, y in batches:
        dist.barrier()  # every rank starts together: the time is this rank's, not its wait
        t0 = time.perf_counter()
        _, loss = model(x, y)
        device_sync()
        t1 = time.perf_counter()
        loss.backward()
        device_sync()
        t2 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad()
        device_sync()
        t3 = time.perf_counter()
        spent["forward"] += t1 - t0
        spent["backward"] += t2 - t1
        spent["step"] += t3 - t2
    return {k: v / max(1, len(batches)) for k, v in spent.items()}


def measure_rank(stages: Sequence, steps: int, model_args: Optional[dict] = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, batch_size: int = 8,
                 seed: int = 0) -> List[dict]:
    """On every rank of the current process group: each of `stages` (1, 2, 3 or "ddp") trains
    the demo's TinyGPT for one warm-up step and `steps` timed ones; returns this rank's
    records (see the module docstring)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import zero_py
    from zero_py.examples.demo import Block, TinyGPT, get_batch, load_corpus

    model_args = {**DEFAULT_MODEL, **(model_args or {})}
    rank, world = dist.get_rank(), dist.get_world_size()
    train, _, vocab = load_corpus(max_bytes=2 ** 20)
    model_args["vocab_size"] = len(vocab)
    records = []
    for stage in stages:
        torch.manual_seed(seed)
        model = TinyGPT(**model_args)
        gen = torch.Generator().manual_seed(seed * 1000 + rank)
        batches = [get_batch(train, batch_size, model_args["block_size"], gen)
                   for _ in range(steps + 1)]
        if stage == "ddp":
            model = DDP(model)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        else:
            kwargs = {"wrap_policy": {Block}} if stage == 3 else {}
            model, opt = zero_py.initialize(model, torch.optim.AdamW, stage=stage, lr=1e-3,
                                            bucket_bytes=bucket_bytes, **kwargs)
        time_steps(model, opt, batches[:1])  # warm-up: states allocated, orders recorded
        times = time_steps(model, opt, batches[1:])
        record = {"world": world, "stage": stage, "rank": rank, "times": times,
                  "model": model_args, "bucket_bytes": bucket_bytes}
        if stage != "ddp":
            rep = opt.memory_report()
            record["model_states"] = rep["params"] + rep["grads"] + rep["optimizer_states"]
            record["ddp_model_states"] = (rep["ddp_params"] + rep["ddp_grads"]
                                          + rep["ddp_optimizer_states"])
        records.append(record)
        del model, opt
    return records


def _worker_main(argv: Optional[List[str]] = None) -> None:
    """`torchrun ... -m zero_py.tools.plot --worker --out FILE ...`: rank 0 writes every rank's
    records to FILE."""
    import torch
    import torch.distributed as dist

    from zero_py.collectives import TorchDistExecutor, gather_object

    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("--out", required=True)
    p.add_argument("--stages", default="1,2,3")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--model", default="{}", help="TinyGPT's arguments, as JSON")
    p.add_argument("--batch-size", type=int, default=8)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    stages = [s if s == "ddp" else int(s) for s in args.stages.split(",")]
    mine = measure_rank(stages, args.steps, json.loads(args.model), batch_size=args.batch_size)
    every = gather_object(TorchDistExecutor(), mine, dst=0)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump([r for rank_records in every for r in rank_records], f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def measure(worlds: Sequence[int], stages: Sequence = (1, 2, 3), steps: int = 3,
            model_args: Optional[dict] = None, batch_size: int = 8,
            timeout: float = 600) -> List[dict]:
    """Records from one torchrun launch per world size (gloo, CPU)."""
    records = []
    with tempfile.TemporaryDirectory(prefix="zero_py_plot_") as tmp:
        for world in worlds:
            out = os.path.join(tmp, f"world{world}.json")
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc-per-node", str(world), "-m", "zero_py.tools.plot", "--worker",
                   "--out", out, "--stages", ",".join(map(str, stages)), "--steps", str(steps),
                   "--model", json.dumps(model_args or {}), "--batch-size", str(batch_size)]
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
            if proc.returncode != 0:
                raise RuntimeError(f"measuring {world} rank(s) failed (exit {proc.returncode}):"
                                   f"\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
            with open(out) as f:
                records += json.load(f)
    return records


# -- drawing --------------------------------------------------------------------------------------

def _stage_key(stage):
    return (1, 0) if stage == "ddp" else (0, stage)


def estimated_curves(model_args: dict, bucket_bytes: int, worlds: Sequence[int]
                     ) -> Dict[object, List[float]]:
    """{stage: [model-state bytes per rank at each world size]} from zero_py.estimate_memory
    for TinyGPT(**model_args) (built on the meta device), plus "ddp"."""
    import torch

    from zero_py.examples.demo import Block, TinyGPT
    from zero_py.tools.estimate import estimate_memory

    with torch.device("meta"):
        model = TinyGPT(**model_args)
    out: Dict[object, List[float]] = {1: [], 2: [], 3: [], "ddp": []}
    for w in worlds:
        for stage in (1, 2, 3):
            est = estimate_memory(model, w, stage, bucket_bytes=bucket_bytes,
                                  wrap_policy={Block} if stage == 3 else None)
            out[stage].append(est.total - est.buffers)
            if stage == 1:
                out["ddp"].append(est.ddp - est.ddp_terms.get("buffers", 0))
    return out


def draw(records: Sequence[dict], out_dir: str, max_world: int = 8) -> List[str]:
    """Writes memory.png and step_time.png into out_dir; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not records:
        raise ValueError("nothing to plot: no measured records")
    os.makedirs(out_dir, exist_ok=True)
    model_args = records[0]["model"]
    bucket_bytes = records[0].get("bucket_bytes", DEFAULT_BUCKET_BYTES)
    worlds = list(range(1, max(max_world, max(r["world"] for r in records)) + 1))
    curves = estimated_curves(model_args, bucket_bytes, worlds)
    paths = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for stage, values in curves.items():
        label = "DDP (estimated)" if stage == "ddp" else f"stage {stage} (estimated)"
        ax.plot(worlds, [v / MIB for v in values], "-", color=STAGE_COLORS[stage], label=label,
                alpha=0.8)
    for stage in (1, 2, 3):
        pts = [(r["world"], r["model_states"] / MIB) for r in records
               if r["stage"] == stage and "model_states" in r]
        if pts:
            ax.plot(*zip(*pts), "o", color=STAGE_COLORS[stage], label=f"stage {stage} (measured)")
    ddp_pts = {(r["world"], r["ddp_model_states"] / MIB) for r in records
               if "ddp_model_states" in r}
    if ddp_pts:
        ax.plot(*zip(*sorted(ddp_pts)), "s", color=STAGE_COLORS["ddp"], mfc="none",
                label="DDP (memory_report's twin)")
    ax.set_xlabel("world size (ranks)")
    ax.set_ylabel("model states per rank (MiB)")
    ax.set_title(f"TinyGPT ({_describe(model_args)}): per-rank memory, fp32 AdamW")
    ax.set_xticks(worlds)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "memory.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    rank0 = sorted((r for r in records if r["rank"] == 0),
                   key=lambda r: (r["world"], _stage_key(r["stage"])))
    fig, ax = plt.subplots(figsize=(max(6, 0.8 * len(rank0) + 2), 4.5))
    labels = [f"{'DDP' if r['stage'] == 'ddp' else 'stage ' + str(r['stage'])}\n"
              f"{r['world']} rank{'s' if r['world'] > 1 else ''}"
              f"{' (demo)' if r.get('source') == 'demo' else ''}" for r in rank0]
    bottom = [0.0] * len(rank0)
    for part, color in (("forward", "tab:blue"), ("backward", "tab:orange"),
                        ("step", "tab:green")):
        ms = [1e3 * r["times"][part] for r in rank0]
        ax.bar(range(len(rank0)), ms, bottom=bottom, color=color,
               label=part if part != "step" else "optimizer.step()")
        bottom = [b + m for b, m in zip(bottom, ms)]
    ax.set_xticks(range(len(rank0)))
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel("ms per step (rank 0, mean)")
    ax.set_title("Where a step's time goes (gloo, CPU)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(os.path.join(out_dir, "step_time.png"))
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)
    return paths


def _describe(model_args: dict) -> str:
    return (f"{model_args['n_layer']} layers, d_model {model_args['d_model']}, vocab "
            f"{model_args.get('vocab_size', '?')}")


# -- command line ----------------------------------------------------------------------------------

def _worlds(text: str) -> List[int]:
    try:
        worlds = [int(w) for w in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a comma-separated list of ints: {text!r}") from None
    if not worlds or min(worlds) < 1:
        raise argparse.ArgumentTypeError(f"world sizes must be >= 1: {text!r}")
    return worlds


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "plot", help="PNGs: per-rank memory against world size per stage (estimated and "
        "measured), and a step-time breakdown",
        description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="append", default=[], metavar="FILE",
                   help="records to draw (the demo's --json output); may repeat")
    p.add_argument("--no-measure", action="store_true",
                   help="draw only the --json records, measure nothing")
    p.add_argument("--worlds", type=_worlds, default=[1, 2, 4],
                   help="world sizes to measure (default 1,2,4)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per run (default 3)")
    p.add_argument("--max-world", type=int, default=8,
                   help="estimated lines run from 1 to this many ranks (default 8)")
    p.add_argument("--out", default=".", help="directory for the PNGs (default: here)")
    p.set_defaults(func=_main)


def _main(args) -> int:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("python -m zero_py plot needs matplotlib: python3 -m pip install matplotlib "
              "(or pip install 'zero_py[plot]')", file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)  # before minutes of measuring, not after
    records: List[dict] = []
    for path in args.json:
        with open(path) as f:
            records += json.load(f)
    if not args.no_measure:
        print(f"measuring stages 1-3 and DDP at {', '.join(map(str, args.worlds))} rank(s), "
              f"{args.steps} steps each ...", flush=True)
        records += measure(args.worlds, (1, 2, 3, "ddp"), args.steps)
    if not records:
        print("nothing to plot: give --json files or drop --no-measure", file=sys.stderr)
        return 2
    for path in draw(records, args.out, args.max_world):
        print(f"wrote {os.path.abspath(path)}")
    return 0


if __name__ == "__main__":
    if "--worker" in sys.argv[1:]:
        _worker_main()
    else:
        from zero_py.__main__ import main

        sys.exit(main(["plot", *sys.argv[1:]]))
