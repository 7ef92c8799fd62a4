"""`python -m zero_py bench`: step time and per-rank memory of DDP and zero_py's stages, as a table.

    python -m zero_py bench                       # 2 ranks, DDP and stages 1-3, TinyGPT
    python -m zero_py bench --nproc 4 --stages 3,ddp --steps 10 --d-model 256
    python -m zero_py bench --full                # benchmarks/step_time.py (a source checkout)

The built-in run launches `torchrun --nproc-per-node N` (gloo, CPU) on the demo's TinyGPT
(zero_py/tools/plot.py measures it: one warm-up step, then --steps timed steps between
barriers, each configuration from the same weights and batches) and prints, from rank 0, the
mean forward, backward and optimizer-step time per step, their sum and its ratio to DDP's, and
the model-state bytes per rank from memory_report() beside DDP's. `--full` runs the repository's
benchmarks/step_time.py instead (DDP, torch's ZeroRedundancyOptimizer, stages 1-3 and FSDP2,
medians of interleaved rounds) and prints its table; `--json` keeps the records.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import List, Sequence

MIB = 2.0 ** 20


def _stages(text: str) -> List[object]:
    out = []
    for s in text.split(","):
        s = s.strip().lower()
        if s == "ddp":
            out.append("ddp")
        elif s in ("1", "2", "3"):
            out.append(int(s))
        else:
            raise argparse.ArgumentTypeError(f"stages are 1, 2, 3 or ddp, comma-separated; "
                                             f"got {s!r}")
    return out


def format_table(records: Sequence[dict]) -> str:
    """Rank 0's records as a markdown table: times per step and model states per rank."""
    rank0 = [r for r in records if r["rank"] == 0]
    ddp = next((r for r in rank0 if r["stage"] == "ddp"), None)
    ddp_total = sum(ddp["times"].values()) if ddp else None
    rows = ["| configuration | ranks | forward ms | backward ms | step ms | total ms | vs DDP "
            "| model states / rank MiB | DDP's MiB |", "|---|---:" + "|---:" * 7 + "|"]
    for r in sorted(rank0, key=lambda r: (1, 0) if r["stage"] == "ddp" else (0, r["stage"])):
        t = r["times"]
        total = sum(t.values())
        name = "DDP + torch.optim.AdamW" if r["stage"] == "ddp" else f"zero_py stage {r['stage']}"
        ratio = f"{total / ddp_total:.2f}x" if ddp_total else "-"
        mem = f"{r['model_states'] / MIB:.2f}" if "model_states" in r else "-"
        ddp_mem = f"{r['ddp_model_states'] / MIB:.2f}" if "ddp_model_states" in r else "-"
        rows.append(f"| {name} | {r['world']} | {1e3 * t['forward']:.2f} | "
                    f"{1e3 * t['backward']:.2f} | {1e3 * t['step']:.2f} | {1e3 * total:.2f} | "
                    f"{ratio} | {mem} | {ddp_mem} |")
    return "\n".join(rows)


def _script() -> str:
    """benchmarks/step_time.py of the source checkout this package runs from, if any."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return os.path.join(root, "benchmarks", "step_time.py")


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "bench", help="step time (forward, backward, step) and per-rank memory of DDP and "
        "stages 1-3 under torchrun, as a table", description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    p.add_argument("--stages", type=_stages, default=[1, 2, 3, "ddp"],
                   help="configurations: 1, 2, 3, ddp (default all)")
    p.add_argument("--steps", type=int, default=5, help="timed steps each (default 5)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--json", metavar="FILE", help="also write the records here")
    p.add_argument("--full", action="store_true",
                   help="run benchmarks/step_time.py (a source checkout) instead")
    p.set_defaults(func=_main)


def _main(args) -> int:
    if args.nproc < 1 or args.steps < 1:
        print("--nproc and --steps must be >= 1", file=sys.stderr)
        return 2
    if args.full:
        script = _script()
        if not os.path.exists(script):
            print(f"--full needs benchmarks/step_time.py of a source checkout; {script} does "
                  "not exist (the built-in run needs nothing: drop --full)", file=sys.stderr)
            return 2
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(args.nproc), script]
        if args.json:
            cmd += ["--json", args.json]
        return subprocess.call(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"})
    from zero_py.tools.plot import measure

    model = {"n_layer": args.n_layer, "d_model": args.d_model}
    print(f"TinyGPT ({args.n_layer} layers, d_model {args.d_model}), {args.nproc} rank(s), "
          f"gloo, {args.steps} timed steps after one warm-up, batch {args.batch_size} per "
          "rank; rank 0's mean per step:", flush=True)
    records = measure([args.nproc], args.stages, args.steps, model, args.batch_size)
    print(format_table(records))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
        print(f"wrote {args.json}")
    return 0
