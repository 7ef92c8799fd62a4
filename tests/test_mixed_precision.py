"""Mixed precision against DDP references, at 2 ranks (and 4 in make test-long): bf16
autocast, bf16 cast models with fp32 masters, fp16 autocast with dynamic loss scaling (DDP +
torch.amp.GradScaler as the reference) including a step that overflows on one rank only, and
global gradient clipping.

Tolerances (relative to the reference's largest magnitude). Under autocast both sides
compute the same low-precision forward, but from fp32 parameters that differ by an ulp here
and there (at 4 ranks the reduce-scatter sums gradients in another order than DDP's
all-reduce): an ulp moves a weight across a bf16 rounding boundary now and then, which changes
a gradient at bf16's resolution (2^-8), which Adam carries on. Parameters therefore agree to
RTOL_LOW_PRECISION, losses to RTOL_LOSS (measured at 4 ranks: ~3e-3 and ~6e-5; at 2 ranks the
update is bitwise torch's and the runs agree to ~1e-7). bf16 parameters: one different rounding
of a master moves a parameter by a bf16 ulp, RTOL_LOW_PRECISION again. Norms: 1e-5.
"""

import contextlib
import copy
import math

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

import distributed
import models
import zero_py

RTOL_LOW_PRECISION = 1e-2
RTOL_LOSS = 1e-3
# bf16/fp16 gradients summed over 4 ranks in another order (or, with grad_reduce_dtype=fp32,
# another precision) than DDP's ring all-reduce differ by low-precision roundings (2^-8) every
# step, and the trajectories drift apart (measured: 3e-2 to 4e-2; at 2 ranks the sums agree).
RTOL_BF16_SUM_4_RANKS = 1e-1
STEPS = 16
# (bad gradient element, norm_type, max_norm) of nonfinite_clipping
NONFINITE_CLIPPING = {"nan_grad_clipped": ("nan", 2.0, 1.0),
                      "nan_grad_clipped_inf_norm": ("nan", math.inf, 1.0),
                      "inf_grad_clipped": ("inf", 2.0, 1.0), "clipped_to_zero": (None, 2.0, 0.0)}


def _rel(a: nn.Module, b: nn.Module) -> float:
    return max(models.max_rel_diff(x.float(), y.float()) for x, y in zip(a.parameters(),
                                                                          b.parameters()))


def autocast_bf16(rank, stage):
    torch.manual_seed(0)
    ref = models.tiny_gpt()
    zm = copy.deepcopy(ref)
    ddp = DDP(ref)
    ref_opt = torch.optim.AdamW(ddp.parameters(), lr=3e-3)
    zopt = zero_py.ZeroOptimizer(zm.parameters(), stage=stage, lr=3e-3, bucket_bytes=8192)
    gen = torch.Generator().manual_seed(rank)
    loss_rel = 0.0
    for _ in range(STEPS):
        batch = models.gpt_batch(gen)
        losses = []
        for model, opt in ((ddp, ref_opt), (zm, zopt)):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = models.gpt_loss(model, batch)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        loss_rel = max(loss_rel, abs(losses[0] - losses[1]) / abs(losses[0]))
    return {"loss_rel": loss_rel, "rel": _rel(zm, ref)}


class MasterAdamW:
    """The reference for a cast model: DDP reduces bf16 gradients; torch.optim.AdamW updates
    fp32 master copies; the bf16 parameters are the masters rounded to nearest even. A master
    follows a write into its parameter: elementwise, where its rounding is not the parameter's
    value."""

    def __init__(self, params, **kw):
        self.params = list(params)
        self.masters = [p.detach().float().clone().requires_grad_(True) for p in self.params]
        self.opt = torch.optim.AdamW(self.masters, **kw)

    @torch.no_grad()
    def step(self):
        for p, m in zip(self.params, self.masters):
            m.copy_(torch.where(m.to(p.dtype) == p, m, p.float()))
            m.grad = None if p.grad is None else p.grad.float()
        self.opt.step()
        for p, m in zip(self.params, self.masters):
            p.copy_(m)

    def zero_grad(self):
        for p in self.params:
            p.grad = None


def cast_bf16(rank, stage, reduce_dtype):
    torch.manual_seed(0)
    ref = models.MLP().to(torch.bfloat16)
    zm = copy.deepcopy(ref)
    ddp = DDP(ref)
    ref_opt = MasterAdamW(ddp.parameters(), lr=1e-2, weight_decay=0.1)
    zopt = zero_py.ZeroOptimizer(zm.parameters(), stage=stage, lr=1e-2, weight_decay=0.1,
                                 bucket_bytes=1024, grad_reduce_dtype=reduce_dtype)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        x, y = models.mlp_batch(gen)
        for model, opt in ((ddp, ref_opt), (zm, zopt)):
            nn.functional.mse_loss(model(x.bfloat16()).float(), y).backward()
            opt.step()
            opt.zero_grad()
    masters = [m.detach() for m in ref_opt.masters]
    z_masters = zopt.consolidate_state_dict(to=0)
    out = {"rel": _rel(zm, ref), "dtype_kept": all(p.dtype == torch.bfloat16
                                                   for p in zm.parameters())}
    if rank == 0:
        full = [z_masters["state"][k]["master_param"] for k in sorted(z_masters["state"])]
        out["master_rel"] = max(models.max_rel_diff(a, b) for a, b in zip(full, masters))
    return out


class MixedDtypeMLP(nn.Module):
    """A bf16 layer, an fp16 layer and fp32 ones in one model: one flat buffer per dtype."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32).to(torch.bfloat16)
        self.fc2 = nn.Linear(32, 32).to(torch.float16)
        self.norm = nn.LayerNorm(32)
        self.head = nn.Linear(32, 8)

    def forward(self, x):
        h = torch.tanh(self.fc1(x.bfloat16()).float())
        h = self.fc2(h.half()).float()
        return self.head(self.norm(h))


def mixed_dtypes(rank, stage):
    torch.manual_seed(0)
    ref = MixedDtypeMLP()
    zm = copy.deepcopy(ref)
    ddp = DDP(ref)
    ref_opt = MasterAdamW(ddp.parameters(), lr=1e-2, weight_decay=0.1)
    zopt = zero_py.ZeroOptimizer(zm.parameters(), stage=stage, lr=1e-2, weight_decay=0.1,
                                 bucket_bytes=1024, grad_reduce_dtype=torch.float32)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        x, y = models.mlp_batch(gen)
        for model, opt in ((ddp, ref_opt), (zm, zopt)):
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    return {"rel": _rel(zm, ref), "n_buffers": len(zopt._flat.buffers),
            "dtypes_kept": [p.dtype for p in zm.parameters()] == [p.dtype
                                                                  for p in ref.parameters()]}


def fp16_loss_scaling(rank, stage, clip):
    """fp16 autocast + dynamic loss scaling; at step 5 rank 1's batch holds an inf, so every
    rank must skip that step and back off, as DDP + GradScaler does."""
    torch.manual_seed(0)
    ref = models.MLP()
    zm = copy.deepcopy(ref)
    ddp = DDP(ref)
    ref_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=3)
    zopt = zero_py.ZeroOptimizer(zm.parameters(), stage=stage, lr=1e-2, bucket_bytes=1024,
                                 loss_scaler=zero_py.LossScaler(init_scale=2.0**12,
                                                                growth_interval=3))
    gen = torch.Generator().manual_seed(rank)
    skipped, scales, norms = [], [], []
    for step in range(STEPS):
        x, y = models.mlp_batch(gen)
        if step == 5 and rank == 1:
            x[0, 0] = float("inf")
        with torch.autocast("cpu", dtype=torch.float16):
            ref_loss = nn.functional.mse_loss(ddp(x).float(), y)
        scaler.scale(ref_loss).backward()
        scaler.unscale_(ref_opt)
        ref_norm = torch.nn.utils.clip_grad_norm_(ddp.parameters(), clip) if clip else None
        scale_before = scaler.get_scale()
        scaler.step(ref_opt)
        scaler.update()
        ref_skipped = scaler.get_scale() < scale_before
        ref_opt.zero_grad()

        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.mse_loss(zm(x).float(), y)
        zopt.scale_loss(loss).backward()
        norm = zopt.clip_grad_norm_(clip) if clip else None
        zopt.step()
        zopt.zero_grad()
        skipped.append((ref_skipped, zopt.last_step_skipped))
        scales.append((scaler.get_scale(), zopt.loss_scale))
        if clip and not ref_skipped:
            norms.append(abs(float(norm) - float(ref_norm)) / float(ref_norm))
    return {"rel": _rel(zm, ref), "skipped": skipped, "scales": scales,
            "norm_rel": max(norms) if norms else 0.0}


def clipping(rank, stage, norm_type):
    torch.manual_seed(0)
    ref = models.MLP()
    zm = copy.deepcopy(ref)
    ddp = DDP(ref)
    ref_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    zopt = zero_py.ZeroOptimizer(zm.parameters(), stage=stage, lr=1e-2, bucket_bytes=1024)
    gen = torch.Generator().manual_seed(rank)
    norm_rel, clipped = 0.0, 0
    for _ in range(STEPS):
        b = models.mlp_batch(gen)
        models.mlp_loss(ddp, b).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ddp.parameters(), 0.1, norm_type=norm_type)
        # a second clip (or a loop logging the norm after clipping) sees the clipped gradients
        ref_again = torch.nn.utils.clip_grad_norm_(ddp.parameters(), 0.05, norm_type=norm_type)
        ref_opt.step()
        ref_opt.zero_grad()
        models.mlp_loss(zm, b).backward()
        norm = zopt.clip_grad_norm_(0.1, norm_type=norm_type)
        again = zopt.clip_grad_norm_(0.05, norm_type=norm_type)
        zopt.step()
        zopt.zero_grad()
        norm_rel = max(norm_rel, abs(float(norm) - float(ref_norm)) / float(ref_norm),
                       abs(float(again) - float(ref_again)) / float(ref_again))
        clipped += float(ref_norm) > 0.1
    return {"rel": _rel(zm, ref), "norm_rel": norm_rel, "clipped": clipped}


def _clipped_mlp(stage, find_unused=False):
    """The MLP under DDP + AdamW(weight_decay=0.1) and its copy under zero_py at `stage`:
    (ref, ddp, ref_opt, zero_py's model, zero_py's optimizer)."""
    torch.manual_seed(0)
    ref = models.MLP()
    zm = copy.deepcopy(ref)
    ddp = DDP(ref, find_unused_parameters=find_unused)
    ref_opt = torch.optim.AdamW(ddp.parameters(), lr=1e-2, weight_decay=0.1)
    if stage == 3:
        zm, zopt = zero_py.initialize(zm, torch.optim.AdamW, stage=3, wrap_policy={nn.Linear},
                                      lr=1e-2, weight_decay=0.1)
    else:
        zopt = zero_py.ZeroOptimizer(zm.parameters(), stage=stage, lr=1e-2, weight_decay=0.1,
                                     bucket_bytes=1024)
    return ref, ddp, ref_opt, zm, zopt


def clip_while_unfreezing(rank, stage):
    """A fine-tuning loop that freezes a layer for some steps (requires_grad_(False) after the
    optimizer was built) and clips the parameters that train now, [p for p in
    model.parameters() if p.requires_grad], against DDP(find_unused_parameters=True) + AdamW:
    zero_py refused that call as clipping some of its parameters only. Then a layer frozen
    between backward and the clip (its gradient there, left out of torch's norm): refused on
    every rank, since zero_py clips the whole gradient shard."""
    ref, ddp, ref_opt, zm, zopt = _clipped_mlp(stage, find_unused=True)
    gen = torch.Generator().manual_seed(rank)
    norm_rel = 0.0
    for step in range(6):
        x, y = models.mlp_batch(gen)
        norms = []
        for model, module, opt in ((ddp, ref, ref_opt), (zm, zm, zopt)):
            module.fc1.requires_grad_(not 2 <= step < 5)
            nn.functional.mse_loss(model(x), y).backward()
            trainable = [p for p in module.parameters() if p.requires_grad]
            norms.append(float(torch.nn.utils.clip_grad_norm_(trainable, 0.05)))
            opt.step()
            opt.zero_grad()
        norm_rel = max(norm_rel, abs(norms[1] - norms[0]) / norms[0])
    ctx = zero_py.gathered(zm) if stage == 3 else contextlib.nullcontext()
    with ctx:
        rel = _rel(zm, ref)
    nn.functional.mse_loss(zm(x), y).backward()
    zm.fc2.requires_grad_(False)
    try:
        torch.nn.utils.clip_grad_norm_([p for p in zm.parameters() if p.requires_grad], 0.05)
        refused = None
    except RuntimeError as exc:
        refused = str(exc)
    zm.fc2.requires_grad_(True)
    zopt.zero_grad()
    return {"rel": rel, "norm_rel": norm_rel, "refused": refused}


class QuantizedBase(nn.Module):
    """A quantized base model's layer: frozen int8 and float8 weights (with a frozen fp32
    scale) and trainable low-rank adapters beside them; a float8 and a bool buffer."""

    def __init__(self, rank):
        super().__init__()
        gen = torch.Generator().manual_seed(rank)  # the frozen values differ between ranks
        self.q8 = nn.Parameter(torch.randint(-127, 128, (16, 16), generator=gen,
                                             dtype=torch.int8), requires_grad=False)
        self.f8 = nn.Parameter(torch.randn(16, 16, generator=gen).to(torch.float8_e4m3fn),
                               requires_grad=False)
        self.scale = nn.Parameter(torch.rand(16, 1, generator=gen) / 64, requires_grad=False)
        self.register_buffer("shift", torch.randn(16, generator=gen).to(torch.float8_e4m3fn))
        self.register_buffer("mask", torch.rand(16, generator=gen) > 0.3)
        torch.manual_seed(0)
        self.a = nn.Parameter(torch.randn(4, 16) * 0.1)
        self.b = nn.Parameter(torch.randn(16, 4) * 0.1)
        self.head = nn.Linear(16, 8)

    def forward(self, x):
        w = (self.q8.float() + self.f8.float()) * self.scale
        h = torch.tanh(x @ w.t() + (x @ self.a.t()) @ self.b.t() + self.shift.float())
        return self.head(h * self.mask)


def quantized_base(rank, stage):
    """Stages 1-2 keep frozen parameters whole, in any dtype, and start them (and the buffers)
    from rank 0's values: a float8 one was broadcast in its own dtype, which gloo refuses
    ("Invalid scalar type", reported as a peer's failure), so the model could not be built."""
    ref = QuantizedBase(0)  # rank 0's values: every rank's after initialize, as under DDP
    ref_opt = MasterAdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    zm, zopt = zero_py.initialize(QuantizedBase(rank), torch.optim.AdamW, stage=stage,
                                  lr=1e-2, bucket_bytes=1024)
    state = {k: v.clone() for k, v in zm.state_dict().items()}
    same = all(torch.equal(state[k].view(torch.uint8), v.view(torch.uint8))
               for k, v in ref.state_dict().items())
    gen = torch.Generator().manual_seed(rank)
    for _ in range(4):
        x, y = models.mlp_batch(gen)
        for model, opt in ((ref, ref_opt), (zm, zopt)):
            nn.functional.mse_loss(model(x), y).backward()
            if opt is ref_opt:  # DDP's average, by hand
                for p in opt.params:
                    p.grad.div_(2)
                    torch.distributed.all_reduce(p.grad)
            opt.step()
            opt.zero_grad()
    return {"rank0_values": same, "rel": _rel(zm, ref)}


def nonfinite_clipping(rank, stage, bad, norm_type, max_norm):
    """clip_grad_norm_ (torch's, as a DDP script calls it) in fp32 without a loss scaler, where
    rank 1's gradient holds one inf or NaN element at step 1 (`bad`; None: none). torch scales
    every gradient by clamp(max_norm / (total + 1e-6), max=1) whatever the total: an inf total
    zeroes the finite gradients, a NaN one makes every gradient, so every parameter, NaN, on
    every rank; max_norm=0 zeroes them all. zero_py used to skip the clipping of a non-finite
    total (the finite gradients were applied unclipped, 1.4e-2 off; a NaN stayed in one
    element), return NaN for an inf total, drop a NaN peer's total under norm_type=inf (a
    finite norm, nothing clipped), and take a coefficient of 0 for "no clipping"."""
    ref, ddp, ref_opt, zm, zopt = _clipped_mlp(stage)
    gen = torch.Generator().manual_seed(rank)
    norms = []
    for step in range(2 if bad else 4):
        x, y = models.mlp_batch(gen)
        for model, module, opt in ((ddp, ref, ref_opt), (zm, zm, zopt)):
            hook = None
            if bad and step == 1 and rank == 1:
                def poison(g):
                    g = g.clone()
                    g.view(-1)[3] = float(bad)
                    return g
                hook = module.fc2.weight.register_hook(poison)
            nn.functional.mse_loss(model(x), y).backward()
            if hook is not None:
                hook.remove()
            norms.append(float(torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm,
                                                              norm_type=norm_type)))
            opt.step()
            opt.zero_grad()
    ctx = zero_py.gathered(zm) if stage == 3 else contextlib.nullcontext()
    with ctx:
        got = [p.detach().clone() for p in zm.parameters()]
    want = [p.detach() for p in ref.parameters()]
    finite = [a.isfinite() & b.isfinite() for a, b in zip(got, want)]
    return {"norms": norms[0::2], "z_norms": norms[1::2],
            "nan": [int(b.isnan().sum()) for b in want],
            "same_nan": all(torch.equal(a.isnan(), b.isnan()) for a, b in zip(got, want)),
            "rel": max(models.max_rel_diff(a[f], b[f]) if f.any() else 0.0
                       for a, b, f in zip(got, want, finite))}


def resume_bf16(rank, stage):
    """Save and reload a bf16 model's optimizer (fp32 masters included): exact continuation."""
    def build():
        torch.manual_seed(0)
        m = models.MLP().to(torch.bfloat16)
        return m, zero_py.ZeroOptimizer(m.parameters(), stage=stage, lr=1e-2, bucket_bytes=1024,
                                        stochastic_rounding=True)

    gen = torch.Generator().manual_seed(rank)
    batches = [models.mlp_batch(gen) for _ in range(8)]

    def run(model, opt, bs):
        for x, y in bs:
            nn.functional.mse_loss(model(x.bfloat16()).float(), y).backward()
            opt.step()
            opt.zero_grad()

    m1, o1 = build()
    run(m1, o1, batches)
    m2, o2 = build()
    run(m2, o2, batches[:4])
    saved = copy.deepcopy((m2.state_dict(), o2.state_dict()))
    # the full dict too (consolidate_state_dict, on every rank): it used to leave out where
    # the rounding stream stood, and the resumed run rounded as from step 0 (a bf16 ulp off)
    full = [o2.consolidate_state_dict(to=0)]
    torch.distributed.broadcast_object_list(full, 0)
    out = {}
    # optimizer_first: torch.distributed.checkpoint's set_state_dict order; the model's load
    # of the stochastically rounded values keeps the loaded masters (either neighbour of a
    # master is its rounding)
    for kind, opt_sd in (("shard", saved[1]), ("full", full[0]), ("optimizer_first", saved[1])):
        m3, o3 = build()
        if kind == "optimizer_first":
            o3.load_state_dict(opt_sd)
            m3.load_state_dict(saved[0])
        else:
            m3.load_state_dict(saved[0])
            o3.load_state_dict(opt_sd)
        run(m3, o3, batches[4:])
        out[kind] = all(torch.equal(a, b) for a, b in zip(m1.parameters(), m3.parameters()))
    return out


class MaxNormEmbedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(20, 8, max_norm=1.0)
        self.head = nn.Linear(8, 4)

    def forward(self, idx):
        return self.head(self.emb(idx)).float()


def max_norm_embedding_bf16(rank, stage):
    """nn.Embedding(max_norm=...) in a bf16 model renormalizes looked-up rows of the bf16
    parameter in place during its forward; the fp32 master follows that write at the step (a
    write into a parameter is what the step updates, as under DDP + torch.optim), as the
    reference's hand-kept masters do. Before, the master never saw it, and the step wrote the
    renormalized rows back to their old norms. Every rank looks up the same rows (different
    targets): rows renormalized on one rank only would leave DDP's replicas apart."""
    torch.manual_seed(0)
    ref = MaxNormEmbedding()
    with torch.no_grad():
        ref.emb.weight.mul_(3.0)  # most rows above max_norm
    ref = ref.bfloat16()
    zm = copy.deepcopy(ref)
    ddp = DDP(ref)
    ref_opt = MasterAdamW(ddp.parameters(), lr=1e-2)
    zopt = zero_py.ZeroOptimizer(zm.parameters(), stage=stage, lr=1e-2, bucket_bytes=256)
    rows, gen = torch.Generator().manual_seed(7), torch.Generator().manual_seed(rank)
    looked_up = torch.zeros(20, dtype=torch.bool)
    for _ in range(6):
        idx, y = torch.randint(0, 20, (8,), generator=rows), torch.randn(8, 4, generator=gen)
        looked_up[idx] = True
        for model, opt in ((ddp, ref_opt), (zm, zopt)):
            nn.functional.mse_loss(model(idx), y).backward()
            opt.step()
            opt.zero_grad()
    norms = zm.emb.weight.float().norm(dim=1)
    return {"rel": _rel(zm, ref),
            "rows_above_max_norm": int((norms > 1.01).sum()),
            # renormalized, then updated once by lr 1e-2 at most: near max_norm, not ~3x
            "looked_up_rows_far_above": int((norms[looked_up] > 1.2).sum())}


def load_after_construction_bf16(rank, stage):
    """Weights loaded into a bf16 model after its ZeroOptimizer was built (a DDP script's
    order: model, optimizer, then model.load_state_dict of a checkpoint or of pretrained
    weights): the masters follow the write, as the optimizer built over the loaded model has
    them. Before, the first step wrote the parameters back from the masters of the weights at
    construction, silently (188% off after one step)."""
    torch.manual_seed(0)
    pretrained = models.MLP().to(torch.bfloat16)
    torch.manual_seed(1)
    zm = models.MLP().to(torch.bfloat16)
    zopt = zero_py.ZeroOptimizer(zm.parameters(), stage=stage, lr=1e-2, bucket_bytes=1024)
    zm.load_state_dict(pretrained.state_dict())
    ref = copy.deepcopy(pretrained)
    ref_opt = zero_py.ZeroOptimizer(ref.parameters(), stage=stage, lr=1e-2, bucket_bytes=1024)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(2):
        x, y = (t.to(torch.bfloat16) for t in models.mlp_batch(gen))
        for model, opt in ((ref, ref_opt), (zm, zopt)):
            models.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
    return _rel(zm, ref)


def _cases(rank, world_size):
    r = {}
    for stage in (1, 2):
        r["autocast_bf16", stage] = autocast_bf16(rank, stage)
        r["cast_bf16", stage] = cast_bf16(rank, stage, None)
        r["cast_bf16_fp32_reduce", stage] = cast_bf16(rank, stage, torch.float32)
        r["mixed_dtypes", stage] = mixed_dtypes(rank, stage)
        r["fp16_scaling", stage] = fp16_loss_scaling(rank, stage, None)
        r["fp16_scaling_clip", stage] = fp16_loss_scaling(rank, stage, 1.0)
        r["clip_l2", stage] = clipping(rank, stage, 2.0)
        r["clip_inf", stage] = clipping(rank, stage, float("inf"))
        r["resume_bf16", stage] = resume_bf16(rank, stage)
        r["max_norm_bf16", stage] = max_norm_embedding_bf16(rank, stage)
        r["load_after_construction", stage] = load_after_construction_bf16(rank, stage)
    if world_size == 2:
        for stage in (1, 2):
            r["quantized_base", stage] = quantized_base(rank, stage)
        for stage in (1, 2, 3):
            r["clip_while_unfreezing", stage] = clip_while_unfreezing(rank, stage)
            for key, args in NONFINITE_CLIPPING.items():
                r[key, stage] = nonfinite_clipping(rank, stage, *args)
    return r


# 4 ranks (sums in another order than DDP's, the tolerances above) in make test-long: make
# test's 10-minute budget on a 2-vCPU host
@pytest.fixture(scope="module", params=[2, pytest.param(4, marks=pytest.mark.slow)])
def results(request):
    return {request.param: distributed.run(_cases, request.param)}


def _at_two_ranks(results):
    """The ranks' results of a scenario checked at 2 ranks only (the 4-rank run skips it)."""
    if 2 not in results:
        pytest.skip("checked at 2 ranks only")
    return results[2]


def _each(results, key):
    for ws, ranks in results.items():
        for rank, r in enumerate(ranks):
            for stage in (1, 2):
                yield f"stage {stage} rank {rank}/{ws}", r[key, stage]


def test_bf16_autocast_matches_ddp(results):
    for where, r in _each(results, "autocast_bf16"):
        assert r["loss_rel"] <= RTOL_LOSS and r["rel"] <= RTOL_LOW_PRECISION, f"{where}: {r}"


@pytest.mark.parametrize("key", ["cast_bf16", "cast_bf16_fp32_reduce"])
def test_bf16_model_with_fp32_masters_matches_ddp(results, key):
    for where, r in _each(results, key):
        tol = RTOL_BF16_SUM_4_RANKS if key == "cast_bf16" and where.endswith("/4") \
            else RTOL_LOW_PRECISION
        assert r["dtype_kept"], where
        assert r["rel"] <= tol, f"{where}: {r}"
        if "master_rel" in r:
            assert r["master_rel"] <= tol, f"{where}: {r}"


def test_parameters_of_several_dtypes(results):
    for where, r in _each(results, "mixed_dtypes"):
        tol = RTOL_BF16_SUM_4_RANKS if where.endswith("/4") else RTOL_LOW_PRECISION
        assert r["n_buffers"] == 3 and r["dtypes_kept"], f"{where}: {r}"
        assert r["rel"] <= tol, f"{where}: {r}"


@pytest.mark.parametrize("key", ["fp16_scaling", "fp16_scaling_clip"])
def test_fp16_loss_scaling_matches_grad_scaler(results, key):
    for where, r in _each(results, key):
        assert [a for a, _ in r["skipped"]] == [b for _, b in r["skipped"]], f"{where}: {r}"
        assert r["skipped"][5] == (True, True), f"{where}: the injected overflow was not skipped"
        assert [a for a, _ in r["scales"]] == [b for _, b in r["scales"]], f"{where}: {r}"
        assert r["rel"] <= RTOL_LOW_PRECISION, f"{where}: {r['rel']:.2e}"
        assert r["norm_rel"] <= 1e-5, f"{where}: {r['norm_rel']:.2e}"


@pytest.mark.parametrize("key", ["clip_l2", "clip_inf"])
def test_global_clipping_matches_torch_under_ddp(results, key):
    for where, r in _each(results, key):
        assert r["clipped"] > 0, f"{where}: the test wants clipping to happen"
        assert r["norm_rel"] <= 1e-5, f"{where}: {r['norm_rel']:.2e}"
        assert r["rel"] <= 1e-5, f"{where}: {r['rel']:.2e}"


def test_bf16_state_dict_resumes_exactly(results):
    """With stochastic rounding, from a shard state_dict() and from consolidate_state_dict():
    the rounding stream goes on as in the run that never stopped."""
    for where, r in _each(results, "resume_bf16"):
        assert r == {"shard": True, "full": True, "optimizer_first": True}, where


def test_embedding_max_norm_in_a_bf16_model_matches_ddp_with_masters(results):
    for where, r in _each(results, "max_norm_bf16"):
        assert r["rows_above_max_norm"] > 0, where  # rows never looked up keep their norm
        assert r["looked_up_rows_far_above"] == 0, (where, r)  # the masters followed
        # bitwise at 2 ranks; at 4, bf16 gradients summed in another order (measured 3e-3)
        tol = 0.0 if where.endswith("/2") else RTOL_LOW_PRECISION
        assert r["rel"] <= tol, (where, r)


def test_weights_loaded_after_the_optimizer_reach_the_masters(results):
    for where, rel in _each(results, "load_after_construction"):
        assert rel == 0.0, (where, rel)


class _Bf16AndFp16(nn.Module):
    """A bf16 and an fp16 parameter whose gradients do not depend on each other."""

    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.randn(256).bfloat16())
        self.b = nn.Parameter(torch.randn(256).half())

    def forward(self, x):
        return (x * self.a.float()).pow(2).mean() + (x + self.b.float()).pow(2).mean()


def test_fp16_masters_follow_a_write_of_either_neighbour_under_stochastic_rounding(
        single_rank_group):
    """stochastic_rounding rounds bf16 parameters only: an fp16 parameter written to the
    neighbour of its master other than the nearest (p.copy_ after a step) is a write its
    master follows, as without stochastic_rounding (it was taken for a rounding of the master
    and dropped: 94 of 256 elements 1 ulp off)."""
    finals = []
    for stochastic in (False, True):
        torch.manual_seed(0)
        model = _Bf16AndFp16()
        opt = zero_py.ZeroOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-2, stage=2,
                                    stochastic_rounding=stochastic)
        for step in range(2):
            model(torch.randn(256)).backward()
            opt.step()
            opt.zero_grad()
            if step == 0:
                with torch.no_grad():
                    model.b.copy_(torch.nextafter(model.b, torch.full_like(model.b, math.inf)))
        finals.append(model.b.detach().clone())
    assert torch.equal(finals[0], finals[1]), (finals[0] != finals[1]).sum()


@pytest.mark.parametrize("key", list(NONFINITE_CLIPPING))
def test_clipping_a_nonfinite_or_zero_norm_does_what_torch_does_under_ddp(results, key):
    bad = NONFINITE_CLIPPING[key][0]
    for rank, r in enumerate(_at_two_ranks(results)):
        for stage in (1, 2, 3):
            where, c = f"stage {stage} rank {rank}/2", r[key, stage]
            for want, got in zip(c["norms"], c["z_norms"]):  # inf, NaN and finite alike
                assert (math.isnan(want) and math.isnan(got)) or got == pytest.approx(want,
                                                                                       rel=1e-5), \
                    f"{where}: total norms {c['z_norms']}, torch's {c['norms']}"
            assert c["same_nan"], f"{where}: NaN parameters differ from DDP's {c['nan']}"
            # torch's NaN coefficient reaches every parameter
            assert (sum(c["nan"]) > 1000) == (bad == "nan"), f"{where}: {c['nan']}"
            assert c["rel"] <= 1e-5, f"{where}: finite parameters differ by {c['rel']:.2e}"


def test_frozen_parameters_and_buffers_of_any_dtype_start_from_rank_0(results):
    for rank, r in enumerate(_at_two_ranks(results)):
        for stage in (1, 2):
            c = r["quantized_base", stage]
            assert c["rank0_values"], f"stage {stage} rank {rank}/2: not rank 0's values"
            assert c["rel"] <= 1e-5, f"stage {stage} rank {rank}/2: {c['rel']:.2e}"


def test_clipping_the_trainable_parameters_while_a_layer_is_frozen_matches_ddp(results):
    for rank, r in enumerate(_at_two_ranks(results)):
        for stage in (1, 2, 3):
            where, c = f"stage {stage} rank {rank}/2", r["clip_while_unfreezing", stage]
            assert c["norm_rel"] <= 1e-5 and c["rel"] <= 1e-5, f"{where}: {c}"
            named = "'fc2.weight'" if stage == 3 else "of shape (32, 32) (index 2)"
            assert f"{named}, which has requires_grad=False but holds a gradient" in (
                c["refused"] or ""), f"{where}: {c['refused']}"
