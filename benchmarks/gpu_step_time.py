"""GPU training step time and peak memory of a GPT-2-small-shaped model on one GPU (world size 1,
a one-rank NCCL group): DDP + torch's fused AdamW, zero_py stages 1, 2 and 3, FSDP2, and
ZeRO-Offload (stage 2 with the optimizer step on the host, with and without overlap_step).

    python benchmarks/gpu_step_time.py [--batch-size 8] [--out build/gpu-check/gpu_step_time.md]

The model is built from plain torch modules: GPT-2 small's shape (12 pre-LN blocks of
zero_py.examples.demo.Block, d_model 768, 12 heads, vocab 50257, 1024 positions, input and
output embeddings tied: 124M parameters), attention by F.scaled_dot_product_attention.
Precision: bf16 autocast over fp32 parameters, fp32 gradients and fp32 AdamW states in every
configuration (so none keeps more or fewer bytes per parameter than another by recipe):

    DDP + AdamW(fused)       DistributedDataParallel, torch.optim.AdamW(fused=True)
    zero_py stage 1, 2, 3    zero_py.initialize(model, torch.optim.AdamW, stage=s) (stage 3 with
                             wrap_policy={Block}); executor "auto": zero_py's NCCL executor
    FSDP2 + AdamW(fused)     torch.distributed.fsdp.fully_shard on every Block and on the
                             model, torch.optim.AdamW(fused=True)
    z2-cpu, z2-cpu-ov        stage 2 with offload_optimizer="cpu" (fp32 masters and AdamW
                             states in pinned host memory, the fused CPU kernel), without and
                             with overlap_step=1.0 (buckets updated on the host during backward)

    z2-cpu-sync              z2-cpu with torch.cuda.synchronize() between backward and step():
                             the host step and its copies exposed whole
    ds2, ds2-cpu             DeepSpeed (pyproject's `peers` extra) at ZeRO stage 2: torch's
                             AdamW on the GPU, and ZeRO-Offload (DeepSpeedCPUAdam, which
                             DeepSpeed builds at first use); only with --only, since DeepSpeed
                             may be missing (its failure is reported, like FSDP2's)

With z2 and z2-cpu-sync in the run, the share of the host step hidden behind backward is
printed under the table for z2-cpu and z2-cpu-ov: 1 - (T[mode] - T[z2]) / (T[z2-cpu-sync] -
T[z2]) (issue 13's goal: >= 70%). The host step starts on each bucket as its gradient reaches
the host, while the GPU is still in backward (the CPU runs ahead of it), and each bucket goes
back as soon as it is updated; what cannot hide is the last buckets' update and copy. It needs
a backward at least as long as the host step: raise --batch-size.

A step is forward, backward, optimizer.step() and zero_grad(set_to_none=True). Every
configuration starts from the same weights (same seed) and sees the same batches (random
tokens, one pool on the GPU).

Memory, first: each configuration alone on the GPU (everything of the one before freed: del,
gc.collect(), torch.cuda.empty_cache()), the peak of torch.cuda.max_memory_allocated() (reset
before it is built) over its construction and its warm-up steps, less what was allocated
before; and what it still holds after them (resident: parameters, gradients if kept,
optimizer states). zero_py's NCCL communicators allocate outside torch's allocator and are not
counted.

Time, then (--mode round-robin, the default): every configuration built again and alive at
once, warmed up, then --rounds rounds in which the configurations take turns (the starting one
rotates), each running --steps-per-round steps between two torch.cuda.synchronize(); a sample
is that time over the steps. The table gives the median and quartiles of the samples and the
ratios to DDP. --mode sequential times each configuration alone, right after its memory
measurement, for when all of them do not fit at once.

A configuration that fails (while built or at any step) is reported in the table and freed; the
others go on. Exit status: 0; 1 when DDP or a zero_py configuration failed (a peer's failure is
reported only); 2 without a usable GPU (the reason is printed), as benchmarks/gpu_adamw.py.
--cpu-smoke runs the same code on the CPU (gloo, a tiny model, no memory figures) to check the
script on a machine without a GPU; its times mean nothing.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import zero_py  # noqa: E402
from zero_py.examples.demo import Block  # noqa: E402
from zero_py.kernels import cuda  # noqa: E402

CONFIGS = {  # key: table name
    "ddp": "DDP + AdamW(fused)",
    "z1": "zero_py stage 1",
    "z2": "zero_py stage 2",
    "z3": "zero_py stage 3",
    "fsdp2": "FSDP2 + AdamW(fused)",
    "z2-cpu": "zero_py stage 2, offload_optimizer=\"cpu\"",
    "z2-cpu-ov": "zero_py stage 2, offload_optimizer=\"cpu\", overlap_step=1.0",
    "z2-cpu-sync": "zero_py stage 2, offload_optimizer=\"cpu\", step after a synchronize",
    "ds2": "DeepSpeed ZeRO-2 + torch AdamW",
    "ds2-cpu": "DeepSpeed ZeRO-2, offload_optimizer cpu (ZeRO-Offload, DeepSpeedCPUAdam)",
}
PEERS = {"fsdp2", "ds2", "ds2-cpu"}  # a failure is reported, not fatal
OFFLOAD = {"z2-cpu": {"offload_optimizer": "cpu"},  # ZeRO-Offload: the step on the host
           "z2-cpu-ov": {"offload_optimizer": "cpu", "overlap_step": 1.0},
           "z2-cpu-sync": {"offload_optimizer": "cpu"}}
SYNC_BEFORE_STEP = {"z2-cpu-sync"}  # nothing of the host step can overlap backward
REFERENCE = "ddp"
DEFAULT_OUT = os.path.join("build", "gpu-check", "gpu_step_time.md")
SMOKE_SHAPE = dict(n_layer=2, d_model=64, n_head=2, vocab=512, seq_len=64, batch_size=2)


class GPT(nn.Module):
    """GPT-2's shape from plain modules: token and position embeddings, pre-LN blocks, a final
    LayerNorm and an output projection tied to the token embedding; returns the mean
    cross-entropy of next-token prediction."""

    def __init__(self, vocab, n_layer, n_head, d_model, seq_len):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head, 0.0) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)
        self.lm_head.weight = self.tok_emb.weight
        self.apply(self._init)

    @staticmethod
    def _init(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx, targets):
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


class Config:
    """One configuration: its model, what forward is called on, its optimizer, its place in
    the batch pool, its samples."""

    def __init__(self, key, args, device):
        self.key, self.name, self.device = key, CONFIGS[key], device
        torch.manual_seed(args.seed)
        with torch.device(device):
            model = GPT(args.vocab, args.n_layer, args.n_head, args.d_model, args.seq_len)
        self.model, self.forward = model, model
        hyper = dict(lr=args.lr, weight_decay=0.1)
        if key == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            self.forward = DistributedDataParallel(
                model, device_ids=[device.index] if device.type == "cuda" else None)
            self.optimizer = torch.optim.AdamW(model.parameters(), fused=True, **hyper)
        elif key.startswith("z"):
            stage = int(key[1])
            extra = {"wrap_policy": {Block}} if stage == 3 else {}
            extra.update(OFFLOAD.get(key, {}))
            self.model, self.optimizer = zero_py.initialize(model, torch.optim.AdamW,
                                                            stage=stage, **extra, **hyper)
            self.forward = self.model
        elif key.startswith("ds"):
            self.model = self.forward = _deepspeed(model, key, args, device)
            self.optimizer = self.model.optimizer
        elif key == "fsdp2":
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh(device.type, (dist.get_world_size(),))
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
            self.optimizer = torch.optim.AdamW(model.parameters(), fused=True, **hyper)
        else:
            raise ValueError(f"unknown configuration {key!r}")
        self.next_batch = 0
        self.samples = []
        self.steps = 0
        self.last_loss = None

    def step(self, pool):
        x, y = pool[self.next_batch % len(pool)]
        self.next_batch += 1
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            loss = self.forward(x, y)
        if self.key.startswith("ds"):  # DeepSpeed's engine: its backward, its step
            self.model.backward(loss)
            self.model.step()
        else:
            loss.backward()
            if self.key in SYNC_BEFORE_STEP:
                _sync(self.device)
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
        self.last_loss = loss.detach()
        self.steps += 1

    def release(self):
        self.model = self.forward = self.optimizer = self.last_loss = None


def _deepspeed(model, key, args, device):
    """DeepSpeed's engine over `model` at ZeRO stage 2 on the existing one-rank group: torch's
    AdamW on the device (ds2), or ZeRO-Offload (ds2-cpu: DeepSpeedCPUAdam on pinned host
    memory, which DeepSpeed builds at first use). fp32 parameters under the same bf16
    autocast as the other configurations; the same hyperparameters."""
    import deepspeed  # optional: pyproject's `peers` extra

    for k, v in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"),
                 ("LOCAL_WORLD_SIZE", "1")):
        os.environ.setdefault(k, v)
    zero = {"stage": 2, "overlap_comm": True, "contiguous_gradients": True}
    hyper = {"lr": args.lr, "weight_decay": 0.1, "betas": [0.9, 0.999], "eps": 1e-8}
    if key == "ds2-cpu":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": device.type == "cuda"}
    else:
        hyper["torch_adam"] = True  # torch's AdamW: no op of DeepSpeed's to build
    config = {"train_micro_batch_size_per_gpu": args.batch_size,
              "gradient_accumulation_steps": 1,
              "optimizer": {"type": "AdamW", "params": hyper},
              "zero_optimization": zero, "steps_per_print": 1 << 30}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=config)
    return engine


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def _failure(exc: BaseException) -> str:
    """One line for the table: the exception, and where in this script it came from."""
    tb = traceback.extract_tb(exc.__traceback__)
    here = [f for f in tb if f.filename == os.path.abspath(__file__)]
    where = f" (line {here[-1].lineno})" if here else ""
    text = f"{type(exc).__name__}: {exc}".splitlines()[0] if str(exc) else type(exc).__name__
    return (text[:300] + "...") if len(text) > 300 else text + where


def _timed(cfg, pool, steps):
    _sync(cfg.device)
    start = time.perf_counter()
    for _ in range(steps):
        cfg.step(pool)
    _sync(cfg.device)
    return (time.perf_counter() - start) / steps


def _git_commit() -> str:
    try:
        def git(*a):
            return subprocess.run(["git", "-C", REPO, *a], capture_output=True, text=True,
                                  timeout=30, check=True).stdout.strip()
        commit = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
        return commit + (" (with uncommitted changes)" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown (no git repository here)"


def _environment(device) -> list:
    lines = []
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as exc:  # torch without NCCL
            nccl = f"unavailable ({type(exc).__name__})"
        from zero_py.collectives import nccl as zp_nccl

        why = zp_nccl.unavailable_reason()
        lines.append(f"GPU: {p.name}, {p.total_memory / 2**30:.1f} GiB, "
                     f"{p.multi_processor_count} SMs")
        lines.append(f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL {nccl}; "
                     f"zero_py's NCCL executor: {'usable' if why is None else why}")
    else:
        lines.append(f"CPU smoke run (gloo): times and memory mean nothing; "
                     f"torch {torch.__version__}")
    lines.append(f"date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}; "
                 f"git commit: {_git_commit()}")
    return lines


def _pool(args, device):
    gen = torch.Generator(device=device).manual_seed(args.seed + 1)
    out = []
    for _ in range(args.batches):
        idx = torch.randint(0, args.vocab, (args.batch_size, args.seq_len + 1), generator=gen,
                            device=device)
        out.append((idx[:, :-1].contiguous(), idx[:, 1:].contiguous()))
    return out


def _memory_pass(keys, args, device, pool, failed, mem, report):
    """Each configuration alone: built, warmed up, its peak and resident memory; in sequential
    mode also timed. Freed before the next."""
    for key in keys:
        _free(device)
        on_cuda = device.type == "cuda"
        if on_cuda:
            torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device) if on_cuda else 0
        cfg = None
        try:
            cfg = Config(key, args, device)
            for _ in range(args.warmup):
                cfg.step(pool)
            _sync(device)
            if on_cuda:
                mem[key] = (torch.cuda.max_memory_allocated(device) - base,
                            torch.cuda.memory_allocated(device) - base)
            if args.mode == "sequential":
                for _ in range(args.rounds):
                    cfg.samples.append(_timed(cfg, pool, args.steps_per_round))
                report[key] = (cfg.samples, float(cfg.last_loss), cfg.steps)
            print(f"  {CONFIGS[key]}: built and warmed up"
                  + (f", peak {mem[key][0] / 2**20:.0f} MiB" if key in mem else ""), flush=True)
        except Exception as exc:
            failed[key] = _failure(exc)
            print(f"  {CONFIGS[key]}: FAILED: {failed[key]}", flush=True)
            traceback.print_exc()
        finally:
            if cfg is not None:
                cfg.release()
            del cfg
            _free(device)


def _round_robin(keys, args, device, pool, failed, report):
    """All configurations alive at once, taking turns."""
    alive = {}
    for key in keys:
        try:
            cfg = Config(key, args, device)
            for _ in range(args.warmup):
                cfg.step(pool)
            alive[key] = cfg
        except Exception as exc:
            failed[key] = _failure(exc)
            print(f"  {CONFIGS[key]}: FAILED when built for timing: {failed[key]}", flush=True)
            traceback.print_exc()
        finally:
            cfg = None
            _free(device)
    order = list(alive)
    for r in range(args.rounds):
        turn = order[r % len(order):] + order[:r % len(order)] if order else []
        for key in turn:
            cfg = alive.get(key)
            if cfg is None:
                continue
            try:
                cfg.samples.append(_timed(cfg, pool, args.steps_per_round))
            except Exception as exc:
                failed[key] = _failure(exc)
                print(f"  {CONFIGS[key]}: FAILED at round {r}: {failed[key]}", flush=True)
                traceback.print_exc()
                alive.pop(key).release()
                _free(device)
            cfg = None
    for key, cfg in alive.items():
        report[key] = (cfg.samples, float(cfg.last_loss), cfg.steps)
        cfg.release()
    alive.clear()
    _free(device)


def _table(keys, failed, mem, report) -> list:
    ref = report.get(REFERENCE)
    ref_ms = statistics.median(ref[0]) * 1e3 if ref and ref[0] else None
    ref_peak = mem.get(REFERENCE, (None,))[0]
    rows = ["| configuration | median ms/step | p25 | p75 | time vs DDP | peak MiB | "
            "peak vs DDP | resident MiB | loss at last step (steps) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for key in keys:
        name = CONFIGS[key]
        if key in failed:
            rows.append(f"| {name} | failed: {failed[key].replace('|', '/')} "
                        "| | | | | | | |")
            continue
        samples, loss, steps = report[key]
        med = statistics.median(samples) * 1e3
        q1, q3 = ((statistics.quantiles(samples, n=4)[0] * 1e3,
                   statistics.quantiles(samples, n=4)[2] * 1e3) if len(samples) > 1
                  else (med, med))
        ratio = f"{med / ref_ms:.3f}" if ref_ms else "n/a"
        if key in mem:
            peak, resident = mem[key]
            peak_s, resident_s = f"{peak / 2**20:.0f}", f"{resident / 2**20:.0f}"
            peak_ratio = f"{peak / ref_peak:.3f}" if ref_peak else "n/a"
        else:
            peak_s = resident_s = peak_ratio = "n/a"
        rows.append(f"| {name} | {med:.2f} | {q1:.2f} | {q3:.2f} | {ratio} | {peak_s} | "
                    f"{peak_ratio} | {resident_s} | {loss:.4f} ({steps}) |")
    return rows


def _hidden(report) -> list:
    """The share of the host step hidden behind backward, from the medians: the step after a
    synchronize (z2-cpu-sync) exposes all of it, the GPU's own step (z2) none."""
    if not all(k in report and report[k][0] for k in ("z2", "z2-cpu-sync")):
        return []
    med = {k: statistics.median(v[0]) * 1e3 for k, v in report.items() if v[0]}
    exposed = med["z2-cpu-sync"] - med["z2"]
    lines = ["", f"the host step with its copies, all of it exposed, adds {exposed:.2f} ms to a "
             f"step ({med['z2-cpu-sync']:.2f} against {med['z2']:.2f} ms on the GPU)"]
    if exposed <= 0:
        return lines + ["(nothing measurable: no hidden share to report)"]
    for key in ("z2-cpu", "z2-cpu-ov"):
        if key in med:
            left = med[key] - med["z2"]
            lines.append(f"- {CONFIGS[key]}: adds {left:.2f} ms, **{1 - left / exposed:.0%} of "
                         "the host step hidden** behind backward (goal >= 70%)")
    return lines


def _init_group(device):
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise SystemExit("gpu_step_time runs at world size 1; start it without torchrun")
        return None
    if int(os.environ.get("WORLD_SIZE", "1")) != 1:
        raise SystemExit("gpu_step_time runs at world size 1; start it without torchrun")
    tmp = tempfile.TemporaryDirectory(prefix="zp_step_time_")
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.FileStore(os.path.join(tmp.name, "store"), 1),
                            rank=0, world_size=1)
    return tmp


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("--batch-size", type=int, default=8, help="sequences per step (default 8)")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--n-layer", type=int, default=12)
    ap.add_argument("--n-head", type=int, default=12)
    ap.add_argument("--d-model", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--warmup", type=int, default=3, help="steps per configuration")
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--steps-per-round", type=int, default=3)
    ap.add_argument("--batches", type=int, default=4, help="batches in the pool (cycled)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", default=",".join(k for k in CONFIGS if not k.startswith("ds")),
                    help=f"configurations, comma-separated, of {','.join(CONFIGS)} "
                         f"({REFERENCE} is always run: the reference; default: all but "
                         "DeepSpeed's)")
    ap.add_argument("--mode", choices=["round-robin", "sequential"], default="round-robin")
    ap.add_argument("--out", default=None,
                    help=f"markdown table written here (default {DEFAULT_OUT}; with "
                         "--cpu-smoke, nowhere unless given)")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="run on the CPU with a tiny model, to check the script without a GPU")
    args = ap.parse_args()
    keys = [k.strip() for k in args.only.split(",") if k.strip()]
    bad = [k for k in keys if k not in CONFIGS]
    if bad:
        ap.error(f"--only: unknown {bad}; choose from {list(CONFIGS)}")
    keys = [k for k in CONFIGS if k in keys or k == REFERENCE]
    if args.rounds < 1 or args.steps_per_round < 1 or args.warmup < 0 or args.batches < 1:
        ap.error("--rounds, --steps-per-round and --batches must be >= 1, --warmup >= 0")

    if args.cpu_smoke:
        for k, v in SMOKE_SHAPE.items():
            if getattr(args, k) == ap.get_default(k):
                setattr(args, k, v)
        device = torch.device("cpu")
        out = args.out
    else:
        why = cuda.unavailable_reason()
        if why is not None:
            print(f"gpu_step_time: no GPU run: {why} (use --cpu-smoke to check the script "
                  "without a GPU)")
            return 2
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        out = args.out or DEFAULT_OUT

    tmp = _init_group(device)
    try:
        head = _environment(device)
        with torch.device("meta"):
            shape = GPT(args.vocab, args.n_layer, args.n_head, args.d_model, args.seq_len)
        n_params = sum(p.numel() for p in shape.parameters())  # the tied weight once
        head.append(f"model: GPT-2-small shape from plain torch modules (n_layer {args.n_layer}, "
                    f"d_model {args.d_model}, n_head {args.n_head}, vocab {args.vocab}, tied "
                    f"embeddings), {n_params / 1e6:.1f}M parameters; batch {args.batch_size} x "
                    f"{args.seq_len} tokens; bf16 autocast over fp32 parameters, gradients and "
                    "AdamW states in every configuration; world size 1 "
                    f"({dist.get_backend()} group)")
        head.append(f"timing ({args.mode}): {args.warmup} warm-up steps per configuration, "
                    f"then {args.rounds} rounds x {args.steps_per_round} steps"
                    + (", configurations in turn with the first rotating, all alive at once"
                       if args.mode == "round-robin" else ", each configuration alone")
                    + "; torch.cuda.synchronize() around each timed run")
        head.append("memory: each configuration alone on the GPU, peak "
                    "torch.cuda.max_memory_allocated() over construction and warm-up (reset "
                    "in between); resident: allocated after the warm-up")
        for line in head:
            print(line, flush=True)
        pool = _pool(args, device)
        failed, mem, report = {}, {}, {}
        print("memory pass:", flush=True)
        _memory_pass(keys, args, device, pool, failed, mem, report)
        if args.mode == "round-robin":
            print("timing pass:", flush=True)
            _round_robin([k for k in keys if k not in failed], args, device, pool, failed,
                         report)
        text = "\n".join(["# zero_py GPU step time", ""] + [f"- {h}" for h in head] + [""]
                         + _table(keys, failed, mem, report) + _hidden(report)) + "\n"
        print()
        print(text)
        if out:
            os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
            with open(out, "w") as f:
                f.write(text)
            print(f"wrote {out}")
        hard = [k for k in failed if k not in PEERS]
        return 1 if hard else 0
    finally:
        dist.destroy_process_group()
        if tmp is not None:
            tmp.cleanup()


if __name__ == "__main__":
    sys.exit(main())
