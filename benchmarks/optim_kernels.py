"""Memory bandwidth of zero_py's fused C optimizers against torch.optim, DeepSpeed and copies.

Single process, run from anywhere once zero_py is installed (DeepSpeed is optional):

    python benchmarks/optim_kernels.py [--sizes 10,30] [--kinds adamw,adam,sgd,adagrad,lion]
                                       [--params fp32,bf16] [--reps 15] [--json optim.json]
                                       [--cache cold,warm] [--settle 4]
                                       [--variants 'ZP_CPU_ISA=avx2;ZP_CPU_PREFETCH=0']

Add 100 to --sizes for 100M parameters (about 7 GB of memory at the peak). Run it on an
otherwise idle machine: with few cores, one other busy process slows every candidate by a
varying factor. For each size N (millions of parameters), each parameter precision and each
optimizer it times these candidates on one flat parameter of N elements, in a new shuffled
order every repetition (a fixed seed), under one or both cache states (--cache):

    cold   each timed call follows a flush: one thread reads and writes back a buffer of twice
           the last-level cache (kernels.stream_bound on the calling thread, about 0.1 s), so
           the call meets its tensors in memory, as an optimizer step does after the forward
           and backward passes evicted them, and meets torch's OpenMP workers and zero_py's
           threads alike asleep. The default.
    warm   each timed call follows --settle untimed calls of the same candidate (default 4):
           tensors that fit in the last-level cache are read from it. Measured on a 2-vCPU
           Xeon guest that reports 480 MiB of L3, a call after any pause (a sleep, other work,
           another candidate) took up to 1.9x its steady time, recovering over about five
           calls, and torch's OpenMP workers spin for a while after each parallel region and
           slow down threads started then, such as zero_py's. One untimed call before each
           timed one, as this script did before, left zero_py, first in the order and so after
           torch foreach, at 0.90x torch fused on SGD while the same kernel placed after
           another candidate measured 1.17x.

The candidates:

    zero_py             zero_py.kernels.optim_step_flat(kind, master, grad, states..., param_out)
    torch fused         torch.optim.<X>(fused=True).step()   (AdamW, Adam, SGD, Adagrad)
    torch foreach       torch.optim.<X>(foreach=True).step()
    torch ops           Lion, which torch.optim lacks: four in-place torch ops (lion_torch)
    deepspeed           DeepSpeedCPUAdam (adamw_mode True / False), DeepSpeedCPUAdagrad,
                        DeepSpeedCPULion; none for SGD. Their C++ ops are built by DeepSpeed on
                        first use (about a minute each, cached under ~/.cache/torch_extensions)
    deepspeed bf16      bf16 parameters only: DeepSpeed's own bf16 path, which updates the bf16
                        parameter in place with fp32 states and keeps no fp32 master
    bound               zero_py's own streams moved once with no math (kernels.stream_bound,
                        in C with the kernels' threads, split, ISA and prefetch): read the
                        gradient, read and write back master and states, write the bf16
                        parameter. No step can be faster on this machine: "% of bound" is the
                        bound's median time over the row's (above 100%: noise, or a luckier
                        cache state)
    zero_py <VARS>      with --variants: zero_py with ZP_CPU_* set around each call, to compare
                        the kernels' paths in the same run
    copy                dst.copy_(src)                             8 bytes/element (read, write)
    triad               torch.add(src, other, alpha=0.5, out=dst)  12 bytes/element (2 reads, write)

Optimizers: AdamW and Adam (lr 1e-3, betas 0.9/0.999, eps 1e-8, weight decay 0.01, decoupled
for AdamW and added to the gradient for Adam), SGD (lr 1e-2, momentum 0.9, weight decay 0.01),
Adagrad (lr 1e-2, eps 1e-10, weight decay 0.01), Lion (lr 1e-4, betas 0.9/0.99, weight decay
0.01). Every candidate of one optimizer updates the same parameter with the same gradient and
keeps its own state.

Parameter precisions:
  fp32  the fp32 parameter is the master (param_out=None); the gradient is fp32.
  bf16  bf16 parameter and bf16 gradient, fp32 master and states. zero_py reads the bf16
        gradient and writes the bf16 parameter in its single pass. The torch and deepspeed
        baselines run their fp32 step on the master and its fp32 .grad, with the widening of
        the gradient (master.grad.copy_(grad_bf16)) before it and the cast of the parameter
        (param_bf16.copy_(master)) after it counted in.

Bytes per parameter of one update (B/param), with S fp32 states (2 for AdamW and Adam, 1 for
SGD's momentum buffer, Adagrad's sum and Lion's exp_avg):
  fp32  read param 4, grad 4, states 4S; write param 4, states 4S:           12 + 8S
  bf16  read grad 2, master 4, states 4S; write master 4, states 4S, param 2: 12 + 8S
so 28 for AdamW and Adam and 20 for SGD, Adagrad and Lion, in both precisions. DeepSpeed's bf16
path moves 6 + 8S (22, 14): read param 2, grad 2, states; write param 2, states. The bf16
baselines with casts do the same update as zero_py and are rated on the same 12 + 8S bytes, but
move 12 more per parameter (widening: read 2, write 4; cast: read 4, write 2).

Each row reports the median time, B/param * N / median time in GB/s (1e9 bytes), that
bandwidth as a percentage of the triad's (the median over all the triad's samples at that size,
taken between the optimizers' calls), and the speed-up: the median time of the reference (torch
fused; torch foreach where there is no fused, torch ops for Lion) over the row's. Writes to
memory not read first (copy, triad, the bf16 parameter) cost the CPU an extra read per written
cache line that these byte counts leave out, so an in-place update can exceed 100% of triad.

torch and DeepSpeed run on os.cpu_count() OpenMP threads; zero_py picks its own count
(ZP_NUM_THREADS, else the CPUs it may run on), and its bodies, prefetch, split and stores per
CPU vendor (printed first; ZP_CPU_ISA=avx512|avx2|scalar, ZP_CPU_PREFETCH=<bytes>[:l1],
ZP_CPU_SPLIT=blocks|static and ZP_CPU_STREAM=<bytes> force them, for zero_py and its bound
alike: csrc/kernels/cpu/tuning.h). DS_ACCELERATOR is set to cpu unless set. Before
timing, the script checks one step of zero_py and of DeepSpeed against torch on 1M elements, from
the same non-zero states, and prints the largest differences.
"""

import argparse
import gc
import glob
import json
import os
import platform
import random
import statistics
import time

import torch

from zero_py import kernels

os.environ.setdefault("DS_ACCELERATOR", "cpu")
try:
    import deepspeed
    from deepspeed.ops.adagrad import DeepSpeedCPUAdagrad
    from deepspeed.ops.adam import DeepSpeedCPUAdam
    from deepspeed.ops.lion import DeepSpeedCPULion
    DEEPSPEED_MISSING = None
except ImportError as e:
    DEEPSPEED_MISSING = f"{type(e).__name__}: {e}"

KINDS = ("adamw", "adam", "sgd", "adagrad", "lion")
ZP_KIND = {"adamw": kernels.OPT_ADAMW, "adam": kernels.OPT_ADAM, "sgd": kernels.OPT_SGD,
           "adagrad": kernels.OPT_ADAGRAD, "lion": kernels.OPT_LION}
# zero_py's fields: beta1 is SGD's momentum and Adagrad's lr_decay, beta2 SGD's dampening.
ADAM_HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2)
HYPER = {"adamw": ADAM_HYPER, "adam": ADAM_HYPER,
         "sgd": dict(lr=1e-2, beta1=0.9, beta2=0.0, eps=0.0, weight_decay=1e-2),
         "adagrad": dict(lr=1e-2, beta1=0.0, beta2=0.0, eps=1e-10, weight_decay=1e-2),
         "lion": dict(lr=1e-4, beta1=0.9, beta2=0.99, eps=0.0, weight_decay=1e-2)}
# State tensors in the order of zero_py's state0, state1, under torch's and DeepSpeed's names.
TORCH_STATE = {"adamw": ("exp_avg", "exp_avg_sq"), "adam": ("exp_avg", "exp_avg_sq"),
               "sgd": ("momentum_buffer",), "adagrad": ("sum",), "lion": ("exp_avg",)}
DEEPSPEED_STATE = {"adamw": ("exp_avg", "exp_avg_sq"), "adam": ("exp_avg", "exp_avg_sq"),
                   "adagrad": ("exp_avg_sq",), "lion": ("exp_avg",)}
PARAM_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16}


def cpu_model():
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown"


def update_bytes(kind, deepspeed_bf16=False):
    """Bytes per parameter of one update (see the module docstring)."""
    states = len(TORCH_STATE[kind])
    return (6 if deepspeed_bf16 else 12) + 8 * states


def zero_py_step(kind, master, grad, states, param_out, step):
    h = HYPER[kind]
    kernels.optim_step_flat(
        ZP_KIND[kind], master, grad, states[0], states[1] if len(states) > 1 else None, None,
        param_out, step=step, lr=h["lr"], beta1=h["beta1"], beta2=h["beta2"], eps=h["eps"],
        weight_decay=h["weight_decay"], grad_scale=1.0, maximize=False, amsgrad=False,
        nesterov=False, stochastic_rounding=False, seed=0, n_threads=None)


def torch_optimizer(kind, param, **mode):
    """torch.optim's optimizer of this kind on one parameter; mode: fused= or foreach=."""
    h = HYPER[kind]
    if kind in ("adamw", "adam"):
        cls = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
        return cls([param], lr=h["lr"], betas=(h["beta1"], h["beta2"]), eps=h["eps"],
                   weight_decay=h["weight_decay"], **mode)
    if kind == "sgd":
        return torch.optim.SGD([param], lr=h["lr"], momentum=h["beta1"], dampening=h["beta2"],
                               weight_decay=h["weight_decay"], **mode)
    return torch.optim.Adagrad([param], lr=h["lr"], lr_decay=h["beta1"], eps=h["eps"],
                               weight_decay=h["weight_decay"], **mode)


def lion_torch(param, grad, exp_avg, buf):
    """One Lion step in torch ops: the baseline for Lion, which torch.optim lacks."""
    h = HYPER["lion"]
    param.mul_(1.0 - h["lr"] * h["weight_decay"])
    torch.lerp(exp_avg, grad, 1.0 - h["beta1"], out=buf)
    param.add_(buf.sign_(), alpha=-h["lr"])
    exp_avg.lerp_(grad, 1.0 - h["beta2"])


def deepspeed_optimizer(kind, param):
    """DeepSpeed's CPU optimizer of this kind on one parameter (it has none for SGD)."""
    h = HYPER[kind]
    if kind in ("adamw", "adam"):
        return DeepSpeedCPUAdam([param], lr=h["lr"], betas=(h["beta1"], h["beta2"]), eps=h["eps"],
                                weight_decay=h["weight_decay"], adamw_mode=kind == "adamw")
    if kind == "adagrad":
        return DeepSpeedCPUAdagrad([param], lr=h["lr"], eps=h["eps"],
                                   weight_decay=h["weight_decay"])
    return DeepSpeedCPULion([param], lr=h["lr"], betas=(h["beta1"], h["beta2"]),
                            weight_decay=h["weight_decay"])


def has_deepspeed(kind):
    return DEEPSPEED_MISSING is None and kind != "sgd"


def random_states(kind, numel, gen):
    """Non-zero states for the correctness check; second moments and sums positive."""
    if kind == "adagrad":
        return [torch.rand(numel, generator=gen)]
    states = [torch.randn(numel, generator=gen)]
    if len(TORCH_STATE[kind]) == 2:
        states.append(torch.rand(numel, generator=gen))
    return states


def max_diff(pairs):
    return max((a.float() - b.float()).abs().max().item() for a, b in pairs)


def check_against_torch(kind, params, numel=2**20):
    """name -> largest |difference| after one step (step 5) from the same state as the torch
    reference: of master and states, and for bf16 also of the bf16 parameter."""
    gen = torch.Generator().manual_seed(1)
    master = torch.randn(numel, generator=gen)
    grad = torch.randn(numel, generator=gen).to(PARAM_DTYPE[params])
    if params == "bf16":
        master = master.bfloat16().float()  # DeepSpeed's bf16 path starts from the bf16 param
    states = random_states(kind, numel, gen)

    ref = torch.nn.Parameter(master.clone())
    ref.grad = grad.float()
    ref_states = [s.clone() for s in states]
    if kind == "lion":
        lion_torch(ref.detach(), ref.grad, ref_states[0], torch.empty(numel))
    else:
        opt = torch_optimizer(kind, ref)
        opt.state[ref] = dict(zip(TORCH_STATE[kind], ref_states))
        if kind != "sgd":
            opt.state[ref]["step"] = torch.tensor(4.0)
        opt.step()

    diffs = {}
    zp_master, zp_states = master.clone(), [s.clone() for s in states]
    zp_param = torch.empty(numel, dtype=torch.bfloat16) if params == "bf16" else None
    zero_py_step(kind, zp_master, grad, zp_states, zp_param, step=5)
    diffs["zero_py"] = max_diff([(zp_master, ref.detach())] + list(zip(zp_states, ref_states)))
    if zp_param is not None:
        diffs["zero_py bf16 param"] = max_diff([(zp_param, ref.detach().bfloat16())])
    if has_deepspeed(kind):
        for name, dtype in (("deepspeed", torch.float32),) + (
                (("deepspeed bf16", torch.bfloat16),) if params == "bf16" else ()):
            p = torch.nn.Parameter(master.to(dtype, copy=True))
            p.grad = grad.to(dtype, copy=True)
            ds_states = [s.clone() for s in states]
            opt = deepspeed_optimizer(kind, p)
            opt.state[p] = dict(zip(DEEPSPEED_STATE[kind], ds_states), step=4)
            opt.step()
            expected = ref.detach().to(dtype)
            diffs[name] = max_diff([(p.detach(), expected)] + list(zip(ds_states, ref_states)))
    return diffs


def with_env(env, fn):
    """fn with the environment variables `env` set around each call (the C kernels read
    ZP_CPU_* at every call), restored after it."""
    def rep():
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            fn()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    return rep


def candidates(kind, params, numel, gen, variants=()):
    """name -> (bytes per parameter, zero-argument function running one repetition).
    variants: environments ({ZP_CPU_...: value}) for extra zero_py candidates."""
    nbytes = update_bytes(kind)
    master = torch.randn(numel, generator=gen)
    grad = torch.randn(numel, generator=gen).to(PARAM_DTYPE[params])
    param = torch.nn.Parameter(master)  # shares master's storage: every candidate updates it
    if params == "fp32":
        param.grad, param_out = grad, None

        def with_casts(step):
            return step
    else:
        param.grad, param_out = torch.empty(numel), torch.empty(numel, dtype=torch.bfloat16)

        def with_casts(step):
            def rep():
                param.grad.copy_(grad)
                step()
                param_out.copy_(master)
            return rep

    zp_states = [torch.zeros(numel) for _ in TORCH_STATE[kind]]
    steps = [0]

    def zero_py_rep():
        steps[0] += 1
        zero_py_step(kind, master, grad, zp_states, param_out, steps[0])

    runs = {"zero_py": (nbytes, zero_py_rep),
            "bound": (nbytes, bound_rep(grad, [master] + zp_states, param_out))}
    for env in variants:
        runs["zero_py " + ",".join(f"{k}={v}" for k, v in env.items())] = (
            nbytes, with_env(env, zero_py_rep))
    if kind == "lion":
        exp_avg, buf = torch.zeros(numel), torch.empty(numel)
        runs["torch ops"] = (nbytes, with_casts(lambda: lion_torch(master, param.grad, exp_avg,
                                                                   buf)))
    else:
        runs["torch fused"] = (nbytes, with_casts(torch_optimizer(kind, param, fused=True).step))
        runs["torch foreach"] = (nbytes,
                                 with_casts(torch_optimizer(kind, param, foreach=True).step))
    if has_deepspeed(kind):
        runs["deepspeed"] = (nbytes, with_casts(deepspeed_optimizer(kind, param).step))
        if params == "bf16":
            param_bf16 = torch.nn.Parameter(param_out)  # shares param_out's storage
            param_bf16.grad = grad
            runs["deepspeed bf16"] = (update_bytes(kind, deepspeed_bf16=True),
                                      deepspeed_optimizer(kind, param_bf16).step)
    return runs


def bound_rep(grad, updated, written):
    """The in-place bound of one update: zero_py's own streams moved once with no math
    (kernels.stream_bound: the kernels' threads, split, ISA and prefetch), unchanged but the
    write-only parameter, which zero_py's next call writes again."""
    streams = [(grad, "read")] + [(t, "update") for t in updated]
    if written is not None:
        streams.append((written, "write"))
    return lambda: kernels.stream_bound(streams)


def bandwidth_candidates(numel, gen):
    """copy and triad: name -> (bytes per element, function)."""
    src, other, dst = torch.randn(numel, generator=gen), torch.randn(numel, generator=gen), \
        torch.empty(numel)
    return {"copy": (8, lambda: dst.copy_(src)),
            "triad": (12, lambda: torch.add(src, other, alpha=0.5, out=dst))}


def last_level_cache_bytes():
    """The largest cache Linux reports for CPU 0 (in a VM: the host's, shared with other
    guests); 32 MiB where it reports none."""
    sizes = []
    for index in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            with open(index) as f:
                text = f.read().strip()
        except OSError:
            continue
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text[:-1] if text[-1:] in "KMG" else text
        if digits.isdigit():
            sizes.append(int(digits) * unit)
    return max(sizes, default=32 << 20)


def cache_flush():
    """A function that evicts the caches from the calling thread alone: one pass reading and
    storing back a buffer of twice the last-level cache (at least 64 MiB), in C, so that neither
    torch's OpenMP workers nor zero_py's threads run or spin during it."""
    buf = torch.ones(max(2 * last_level_cache_bytes(), 64 << 20) // 4)
    return lambda: kernels.stream_bound([(buf, "update")], n_threads=1)


def measure(runs, reps, warmup, cache, settle=4, flush=None, seed=0):
    """name -> seconds of each timed repetition. Every repetition times each candidate once,
    in a new shuffled order; cache "cold": `flush()` before each timed call, "warm": `settle`
    untimed calls of the same candidate before it."""
    for fn in runs.values():
        for _ in range(warmup):
            fn()
    order = random.Random(seed)
    times = {name: [] for name in runs}
    for _ in range(reps):
        names = list(runs)
        order.shuffle(names)
        for name in names:
            fn = runs[name]
            if cache == "cold":
                flush()
            else:
                for _ in range(settle):
                    fn()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def reference_name(names):
    return next(n for n in ("torch fused", "torch foreach", "torch ops") if n in names)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10,30",
                        help="comma-separated sizes in millions of parameters")
    parser.add_argument("--kinds", default=",".join(KINDS), help="comma-separated optimizers")
    parser.add_argument("--params", default="fp32,bf16",
                        help="comma-separated parameter precisions: fp32, bf16")
    parser.add_argument("--reps", type=int, default=15, help="timed repetitions per candidate")
    parser.add_argument("--warmup", type=int, default=2, help="untimed repetitions first")
    parser.add_argument("--cache", default="cold",
                        help="comma-separated cache states to time in: cold (caches flushed "
                             "before each timed call), warm (--settle untimed calls before it)")
    parser.add_argument("--settle", type=int, default=4,
                        help="warm: untimed calls of the same candidate before each timed one")
    parser.add_argument("--variants", default="",
                        help="extra zero_py candidates, ';'-separated, each a ','-separated "
                             "list of ZP_CPU_*=value (e.g. 'ZP_CPU_ISA=avx2;ZP_CPU_PREFETCH=0'"
                             "): which path is fastest on this CPU, in the same run")
    parser.add_argument("--json", metavar="PATH", help="write the results here")
    args = parser.parse_args()
    kinds, precisions = args.kinds.split(","), args.params.split(",")
    for k in kinds:
        if k not in KINDS:
            parser.error(f"unknown optimizer {k!r}; choose from {', '.join(KINDS)}")
    for p in precisions:
        if p not in PARAM_DTYPE:
            parser.error(f"unknown parameter precision {p!r}; choose from fp32, bf16")
    caches = args.cache.split(",")
    for c in caches:
        if c not in ("cold", "warm"):
            parser.error(f"unknown cache state {c!r}; choose from cold, warm")
    if args.settle < 1:
        parser.error("--settle must be at least 1")

    variants = []
    for spec in filter(None, args.variants.split(";")):
        env = dict(item.split("=", 1) for item in spec.split(","))
        if not all(k.startswith("ZP_CPU_") for k in env):
            parser.error(f"--variants: {spec!r} sets something other than ZP_CPU_*")
        variants.append(env)

    torch.set_num_threads(os.cpu_count())
    sizes = [int(float(s) * 1e6) for s in args.sizes.split(",")]
    tuning = kernels.cpu_tuning()
    info = {"cpu": cpu_model(), "cpu_isa": tuning["isa"], "cpu_vendor": tuning["vendor"],
            "prefetch_bytes": tuning["prefetch_bytes"], "prefetch_into": tuning["prefetch_into"],
            "split": tuning["split"],
            "last_level_cache_bytes": last_level_cache_bytes(),
            "torch_threads": torch.get_num_threads(),
            "zero_py_threads": kernels.default_threads(), "torch": torch.__version__,
            "deepspeed": DEEPSPEED_MISSING or deepspeed.__version__}
    print(f"CPU: {info['cpu']} ({info['cpu_vendor']}), {os.cpu_count()} CPUs; zero_py ISA: "
          f"{info['cpu_isa']}, prefetch {info['prefetch_bytes']} B into "
          f"{info['prefetch_into'].upper()}, split {info['split']}, "
          f"{info['zero_py_threads']} threads; torch {info['torch']}, "
          f"{info['torch_threads']} threads; last-level cache "
          f"{info['last_level_cache_bytes'] / 2**20:.0f} MiB")
    print(f"DeepSpeed: {info['deepspeed']}" if DEEPSPEED_MISSING is None else
          f"DeepSpeed: not measured ({DEEPSPEED_MISSING})")

    print("\nOne step against torch (step 5, same non-zero states), max |diff| of master and "
          "states (bf16 param: of the bf16 parameter):\n")
    check_rows = ["| optimizer | params | candidate | max abs diff |", "|---|---|---|---:|"]
    checks = []
    for params in precisions:
        for kind in kinds:
            for name, diff in check_against_torch(kind, params).items():
                checks.append({"kind": kind, "params": params, "candidate": name,
                               "max_abs_diff": diff})
                check_rows.append(f"| {kind} | {params} | {name} | {diff:.2e} |")
    print("\n".join(check_rows) + "\n")

    rows = ["| N | cache | params | optimizer | candidate | B/param | median ms | GB/s "
            "| % of triad | % of bound | speed-up |",
            "|---:|---|---|---|---|---:|---:|---:|---:|---:|---:|"]
    summary = ["| N | cache | params | optimizer | zero_py vs reference | zero_py % of bound |",
               "|---:|---|---|---|---:|---:|"]
    results = []
    flush = cache_flush() if "cold" in caches else None
    for numel in sizes:
        gen = torch.Generator().manual_seed(numel)
        bandwidth = bandwidth_candidates(numel, gen)
        groups = []
        for params in precisions:
            for kind in kinds:
                runs = {**candidates(kind, params, numel, gen, variants), **bandwidth}
                fns = {name: fn for name, (_, fn) in runs.items()}
                for cache in caches:
                    times = measure(fns, args.reps, args.warmup, cache, args.settle, flush)
                    groups.append((cache, params, kind, {name: (runs[name][0], times[name])
                                                         for name in runs}))
                del runs, fns  # frees this group's tensors before the next is made
                gc.collect()
        for cache in caches:
            cache_groups = [g for g in groups if g[0] == cache]
            pooled = {name: [t for *_, g in cache_groups for t in g[name][1]]
                      for name in bandwidth}
            triad_gbps = 12 * numel / statistics.median(pooled["triad"]) / 1e9
            size_rows = [("", "", name, bandwidth[name][0], pooled[name], None, None)
                         for name in pooled]
            for _, params, kind, group in cache_groups:
                ref = statistics.median(group[reference_name(group)][1])
                bound = statistics.median(group["bound"][1])
                size_rows += [(params, kind, name, nbytes, samples, ref, bound)
                              for name, (nbytes, samples) in group.items()
                              if name not in bandwidth]
                zp = statistics.median(group["zero_py"][1])
                summary.append(f"| {numel / 1e6:g}M | {cache} | {params} | {kind} "
                               f"| {ref / zp:.2f}x ({reference_name(group)}) "
                               f"| {100 * bound / zp:.0f}% |")
            for params, kind, name, nbytes, samples, ref, bound in size_rows:
                median = statistics.median(samples)
                gbps = nbytes * numel / median / 1e9
                speedup = None if ref is None else ref / median
                of_bound = None if bound is None else 100 * bound / median
                results.append({"numel": numel, "cache": cache, "params": params, "kind": kind,
                                "candidate": name, "bytes_per_param": nbytes,
                                "median_s": median, "gb_per_s": gbps,
                                "percent_of_triad": 100 * gbps / triad_gbps,
                                "percent_of_bound": of_bound, "speedup": speedup,
                                "samples_s": samples})
                rows.append(f"| {numel / 1e6:g}M | {cache} | {params} | {kind} | {name} "
                            f"| {nbytes} | {median * 1e3:.2f} | {gbps:.1f} "
                            f"| {100 * gbps / triad_gbps:.0f}% "
                            f"| {'' if of_bound is None else f'{of_bound:.0f}%'} "
                            f"| {'' if speedup is None else f'{speedup:.2f}x'} |")
    print("\n".join(rows))
    print("\nzero_py against the reference (torch fused, where torch has it) and against the "
          "bound, same run:\n")
    print("\n".join(summary))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**info, "reps": args.reps, "warmup": args.warmup,
                       "cache": caches, "settle": args.settle, "checks": checks,
                       "results": results}, f, indent=2)
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
