"""Quantized and widened communication (zero_py/collectives/quantized.py; ZeRO++ qwZ / qgZ and
the bf16 wire with an fp32 sum): the collectives against full-precision torch.distributed
collectives plus the slow Python quantization reference (tests/test_quantize.py), the
two-step reduce-scatter's error bound at several world sizes, the options' checks, and
training parity against the unquantized run (the masters' update exact)."""

import os

import pytest
import torch
import torch.distributed as dist

import distributed
import zero_py
from models import gpt_batch, gpt_loss, tiny_gpt
from test_quantize import reference_dequantize, reference_quantize
from zero_py.collectives import TorchDistExecutor
from zero_py.collectives.quantized import (QuantizedExecutor, bf16_all_gather,
                                           layout_align_bytes, packet_bytes,
                                           quantized_all_gather,
                                           quantized_reduce_scatter, residual_numel, spec,
                                           widening_reduce_scatter)


def _ref_roundtrip(x: torch.Tensor, block: int, bits: int) -> torch.Tensor:
    q, s = reference_quantize(x, block, bits)
    return reference_dequantize(q, s, x.numel(), block, bits)


def _data(rank: int, n: int, seed: int, dtype=torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 100 + rank)
    return (torch.randn(n, generator=g) * torch.logspace(-2, 2, n)).to(dtype)


# -- the collectives against references ------------------------------------------------------


def _all_gather_body(rank, ws, n, block, dtype):
    ex = TorchDistExecutor()
    x = _data(rank, n, 1, dtype)
    out = torch.full((ws * n,), float("nan"), dtype=dtype)
    quantized_all_gather(ex, out, x, block, 8).wait()
    full = torch.empty(ws * n, dtype=dtype)
    dist.all_gather_into_tensor(full, x)  # the exact values, to build the reference from
    want = torch.cat([full[r * n:(r + 1) * n] if r == rank
                      else _ref_roundtrip(full[r * n:(r + 1) * n], block, 8).to(dtype)
                      for r in range(ws)])
    assert torch.equal(out, want), (out - want).abs().max()
    assert torch.equal(out[rank * n:(rank + 1) * n], x)  # own piece exact
    # in place: the input is this rank's chunk of the output (the storages' call)
    out2 = torch.zeros(ws * n, dtype=dtype)
    out2[rank * n:(rank + 1) * n] = x
    quantized_all_gather(ex, out2, out2[rank * n:(rank + 1) * n], block, 8).wait()
    assert torch.equal(out2, want)


def _all_gathers(rank, ws):
    for dtype in (torch.float32, torch.bfloat16):
        _all_gather_body(rank, ws, 1000, 64, dtype)
    _all_gather_body(rank, ws, 77, 256, torch.float32)  # one short block
    # the bf16 wire (the baseline): peers' pieces rounded to bf16 once, this rank's exact
    n = 500
    x = _data(rank, n, 4)
    out = torch.empty(ws * n)
    bf16_all_gather(TorchDistExecutor(), out, x).wait()
    full = torch.empty(ws * n)
    dist.all_gather_into_tensor(full, x)
    want = full.to(torch.bfloat16).float()
    want[rank * n:(rank + 1) * n] = x
    assert torch.equal(out, want)


@pytest.mark.parametrize("ws", [2, 3])
def test_quantized_all_gather_matches_reference(ws):
    distributed.run(_all_gathers, ws)


def _reduce_scatter_body(rank, ws, n, block, bits, dtype):
    ex = TorchDistExecutor()
    x = _data(rank, ws * n, 2, dtype)
    out = torch.full((n,), float("nan"))
    quantized_reduce_scatter(ex, out, x, block, bits).wait()
    everyone = [torch.empty(ws * n, dtype=dtype) for _ in range(ws)]
    dist.all_gather(everyone, x)
    want = torch.zeros(n)
    for r in range(ws):  # the reference sums in rank order too, own chunk exact
        chunk = everyone[r][rank * n:(rank + 1) * n]
        want = want + (chunk.float() if r == rank else _ref_roundtrip(chunk, block, bits))
    assert torch.equal(out, want), (out - want).abs().max()
    # a bf16 output is the fp32 sum rounded once
    outb = torch.empty(n, dtype=torch.bfloat16)
    quantized_reduce_scatter(ex, outb, x, block, bits).wait()
    assert torch.equal(outb, want.to(torch.bfloat16))


def _stochastic_reduce_scatter_body(rank, ws, n, block, bits, dtype):
    """With noise: the chunk rank r sends peer q is quantized with the noise of (r's seed,
    stream * 2**16 + q), against the reference's stochastic rounding."""
    ex = TorchDistExecutor()
    x = _data(rank, ws * n, 3, dtype)
    out = torch.full((n,), float("nan"))
    quantized_reduce_scatter(ex, out, x, block, bits, noise=(1000 + rank, 5)).wait()
    everyone = [torch.empty(ws * n, dtype=dtype) for _ in range(ws)]
    dist.all_gather(everyone, x)
    want = nearest = torch.zeros(n)
    for r in range(ws):
        chunk = everyone[r][rank * n:(rank + 1) * n]
        if r == rank:
            want, nearest = want + chunk.float(), nearest + chunk.float()
            continue
        q, sc = reference_quantize(chunk, block, bits, noise=(1000 + r, (5 << 16) + rank))
        want = want + reference_dequantize(q, sc, n, block, bits)
        nearest = nearest + _ref_roundtrip(chunk, block, bits)
    assert torch.equal(out, want), (out - want).abs().max()
    assert not torch.equal(out, nearest)


def _reduce_scatters(rank, ws):
    for bits in (8, 4):
        _reduce_scatter_body(rank, ws, 999, 32, bits, torch.float32)
        _reduce_scatter_body(rank, ws, 512, 64, bits, torch.bfloat16)
        _stochastic_reduce_scatter_body(rank, ws, 999, 32, bits, torch.float32)
        _stochastic_reduce_scatter_body(rank, ws, 512, 64, bits, torch.bfloat16)


@pytest.mark.parametrize("ws", [2, 3])
def test_quantized_reduce_scatter_matches_reference(ws):
    distributed.run(_reduce_scatters, ws)


def _feedback_body(rank, ws, n, block, bits):
    """Two reductions with a residual against the reference: what reaches each peer is the
    rounding of (chunk + what was owed to it), and the residual keeps what rounding lost."""
    ex = TorchDistExecutor()
    residual = torch.zeros(residual_numel(ws, n))
    owed = torch.zeros(ws, n)  # the reference's residual, one row per peer (own row unused)
    for call in range(2):
        x = _data(rank, ws * n, 10 + call)
        x_before = x.clone()
        out = torch.empty(n)
        quantized_reduce_scatter(ex, out, x, block, bits, residual).wait()
        assert torch.equal(x, x_before)  # the input is left alone
        sent = torch.zeros(ws, n)  # what this rank sent each peer (the reference)
        for r in range(ws):
            if r != rank:
                want = x[r * n:(r + 1) * n] + owed[r]
                sent[r] = _ref_roundtrip(want, block, bits)
                owed[r] = want - sent[r]
        assert torch.equal(residual, torch.cat([owed[r] for r in range(ws) if r != rank]))
        everyone_sent = torch.empty(ws * ws * n)
        dist.all_gather_into_tensor(everyone_sent, sent.reshape(-1))
        everyone_sent = everyone_sent.reshape(ws, ws, n)
        want = torch.zeros(n)
        for r in range(ws):  # rank order, own chunk exact
            want = want + (x[rank * n:(rank + 1) * n] if r == rank else everyone_sent[r, rank])
        assert torch.equal(out, want), (out - want).abs().max()


def _feedback_bounded(rank, ws, n, block, bits, steps):
    """The same gradient reduced `steps` times: without feedback a value below half a step is
    lost every time, so the summed outputs drift from the exact sums linearly in the steps;
    with it the drift is what is still owed, at most half a step, whatever the steps."""
    ex = TorchDistExecutor()
    g = torch.Generator().manual_seed(3 + rank)
    qmax = 127 if bits == 8 else 7
    # blocks of one 1.0 among values below half a step: those round to zero every time
    x = (torch.rand(ws * n, generator=g) * 2 - 1) * (0.45 / qmax)
    x[::block] = 1.0
    exact = x.double().clone()
    dist.all_reduce(exact)
    exact = exact[rank * n:(rank + 1) * n] * steps
    drift = {}
    for feedback in (False, True):
        residual = torch.zeros(residual_numel(ws, n)) if feedback else None
        total = torch.zeros(n, dtype=torch.float64)
        for _ in range(steps):
            out = torch.empty(n)
            quantized_reduce_scatter(ex, out, x, block, bits, residual).wait()
            total += out.double()
        drift[feedback] = float((total - exact).abs().max())
    half_steps = (ws - 1) * 1.0 / (2 * qmax)  # each peer owes at most half its step
    assert drift[True] <= half_steps * (1 + 1e-4), drift
    assert drift[False] > 2 * half_steps, drift  # the data makes the difference plain
    return drift


def _feedback_overflow(rank, ws, n, block):
    """An inf in a block is sent as NaN (the loss scaler's overflow) and owes nothing after;
    the other blocks keep their residual."""
    ex = TorchDistExecutor()
    residual = torch.zeros(residual_numel(ws, n))
    x = _data(rank, ws * n, 5)
    x[::n] = float("inf")  # the first value of every chunk: the first block of each
    out = torch.empty(n)
    quantized_reduce_scatter(ex, out, x, block, 8, residual).wait()
    assert torch.isnan(out[:block]).all() and torch.isfinite(out[block:]).all()
    for k in range(ws - 1):
        slot = residual[k * n:(k + 1) * n]
        assert torch.equal(slot[:block], torch.zeros(block))
        assert torch.isfinite(slot).all() and slot[block:].abs().max() > 0


def _feedbacks(rank, ws):
    for bits in (8, 4):
        _feedback_body(rank, ws, 999, 32, bits)
        _feedback_bounded(rank, ws, 512, 64, bits, 50)
    _feedback_overflow(rank, ws, 300, 64)


@pytest.mark.parametrize("ws", [2, 3])
def test_error_feedback_matches_reference_and_bounds_the_drift(ws):
    distributed.run(_feedbacks, ws)


def _error_body(rank, ws, n, block, bits, group):
    ex = TorchDistExecutor(group)
    g = torch.Generator().manual_seed(7 + rank)
    grad = torch.randn(ws * n, generator=g)  # each rank's full gradient
    grad_max = grad.abs().max().clone()
    dist.all_reduce(grad_max, dist.ReduceOp.MAX, group=group)
    averaged = grad / ws  # the reducer's averaging, before the sum
    out = torch.empty(n)
    quantized_reduce_scatter(ex, out, averaged, block, bits).wait()
    exact = averaged.double().clone()
    dist.all_reduce(exact, group=group)
    err = (out.double() - exact[rank * n:(rank + 1) * n]).abs().max()
    dist.all_reduce(err, dist.ReduceOp.MAX, group=group)
    return float(err), float(grad_max)


def _errors(rank, world):
    """(error, max |g|) per (world size, bits): groups of the first 2, 3 and 4 ranks."""
    out = {}
    for ws in (2, 3, 4):
        group = dist.new_group(list(range(ws)))  # every rank makes every group
        for bits in (8, 4):
            if rank < ws:
                out[ws, bits] = _error_body(rank, ws, 4096, 256, bits, group)
    return out


@pytest.mark.slow  # four processes
def test_two_step_reduce_scatter_error_does_not_grow_with_world_size():
    """Each contribution is quantized once, so the error of the mean is at most half a step of
    the largest gradient's blocks, (N - 1) / N * max|g| / (2 Q), at every N; a ring that
    requantized its partial sums at each hop would add one such term per hop."""
    results = distributed.run(_errors, 4)[0]
    for bits in (8, 4):
        qmax = 127 if bits == 8 else 7
        errs = {}
        for ws in (2, 3, 4):
            err, gmax = results[ws, bits]
            bound = (ws - 1) / ws * gmax / (2 * qmax) * (1 + 1e-5) + 1e-6
            assert err <= bound, (bits, ws, err, bound)
            errs[ws] = err / gmax
        assert errs[4] <= 1.5 * errs[2] + 1e-6, errs  # no growth with N (N x would be 2 x)


def _widening_body(rank, ws, n):
    ex = TorchDistExecutor()
    x = _data(rank, ws * n, 3, torch.bfloat16)
    out = torch.empty(n)
    widening_reduce_scatter(ex, out, x).wait()
    everyone = [torch.empty(ws * n, dtype=torch.bfloat16) for _ in range(ws)]
    dist.all_gather(everyone, x)
    want = torch.zeros(n)
    for r in range(ws):  # an fp32 sum of the bf16 values, in rank order
        want = want + everyone[r][rank * n:(rank + 1) * n].float()
    assert torch.equal(out, want)
    # and it is not the bf16 sum (which rounds at every add): the data makes them differ
    bf = everyone[0][rank * n:(rank + 1) * n].clone()
    for r in range(1, ws):
        bf = bf + everyone[r][rank * n:(rank + 1) * n]
    assert not torch.equal(bf.float(), want)


def _all_to_all_body(rank, ws):
    ex = TorchDistExecutor()
    x = torch.arange(ws * 5, dtype=torch.float32) + 100 * rank
    out = torch.empty_like(x)
    ex.all_to_all(out, x).wait()
    want = torch.empty_like(x)
    dist.all_to_all_single(want, x)
    assert torch.equal(out, want)


def _widening_and_all_to_all(rank, ws):
    _all_to_all_body(rank, ws)
    _widening_body(rank, ws, 777)


@pytest.mark.parametrize("ws", [2, 3])
def test_bf16_wire_fp32_sum_is_the_fp32_sum_of_bf16_values(ws):
    """Also checks the executor's all_to_all (the exchange it runs on) against torch's."""
    distributed.run(_widening_and_all_to_all, ws)


def test_packet_bytes():
    assert packet_bytes(1000, 256, 8) == 1000 + 4 * 4
    assert packet_bytes(1001, 256, 4) == 504 + 4 * 4  # 501 bytes padded to 504
    assert packet_bytes(0, 256, 8) == 0


def test_options_are_checked(single_rank_group):
    p = [torch.nn.Parameter(torch.randn(10))]
    for kwargs, match in [({"quantized_weights": "int4"}, "quantized_weights must be"),
                          ({"quantized_weights": "fp8"}, "quantized_weights must be"),
                          ({"quantized_grads": "fp8"}, "quantized_grads must be"),
                          ({"quantized_grads": "int4", "quantize_block": 33}, "even"),
                          ({"quantized_weights": "int8", "quantize_block": 0}, "quantize_block"),
                          ({"grad_accum_dtype": torch.bfloat16}, "grad_accum_dtype"),
                          ({"grad_error_feedback": True}, "needs quantized_grads"),
                          # before: accepted, and nothing was rounded stochastically
                          ({"quantized_grads_rounding": "stochastic"}, "needs quantized_grads"),
                          ({"quantized_grads": "int8", "grad_error_feedback": 1},
                           "grad_error_feedback must be"),
                          ({"quantized_grads": "int4", "quantized_grads_rounding": "up"},
                           "quantized_grads_rounding must be"),
                          ({"quantize_block": 0}, "quantize_block must be")]:
        with pytest.raises(ValueError, match=match):
            zero_py.ZeroOptimizer(p, torch.optim.AdamW, lr=0.1, **kwargs)
    # float16 buffers travelled unquantized (the collectives take fp32 and bf16): refused
    half = [torch.nn.Parameter(torch.randn(10, dtype=torch.float16))]
    for kwargs, match in [({"quantized_weights": "int8"}, "float16 ones"),
                          ({"quantized_weights": "bf16"}, "float16 ones"),
                          ({"quantized_grads": "int8"}, "reduced in float16"),
                          ({"quantized_grads": "int4", "grad_reduce_dtype": torch.float16},
                           "reduced in float16")]:
        with pytest.raises(ValueError, match=match):
            zero_py.ZeroOptimizer(half, torch.optim.AdamW, lr=0.1, **kwargs)
        with pytest.raises(ValueError, match=match):
            zero_py.initialize(torch.nn.Linear(4, 4).half(), torch.optim.AdamW, stage=3,
                               lr=0.1, **kwargs)
    zero_py.ZeroOptimizer(half, torch.optim.AdamW, lr=0.1, quantized_grads="int8",
                          grad_reduce_dtype=torch.float32)  # fp32 gradients: quantized


def test_layout_align_bytes():
    assert layout_align_bytes(64, 256, True) == 1024
    assert layout_align_bytes(64, 256, False) == 64  # no quantized wire: the user's
    assert layout_align_bytes(4096, 256, True) == 4096  # already a multiple
    assert layout_align_bytes(64, 100, True) == 64  # 400 bytes: no power of two
    assert layout_align_bytes(64, 2**24, True) == 64  # beyond MAX_BLOCK_ALIGN_BYTES


def test_quantized_layout_aligns_parameters_and_shards_to_blocks(single_rank_group):
    """Every parameter and every rank's piece starts on a block boundary, so that no block
    holds values of two parameters (sizes chosen to straddle under the default alignment)."""
    for options, block in [({"quantized_weights": "int8"}, 256),
                           ({"quantized_grads": "int4", "quantize_block": 32}, 32)]:
        params = [torch.nn.Parameter(torch.randn(n)) for n in (100, 7, 300, 64)]
        opt = zero_py.ZeroOptimizer(params, torch.optim.AdamW, lr=0.1, **options)
        flat = opt._flat
        assert all(off % block == 0 for off in flat.param_offset)
        assert all(n % block == 0 for n in flat.bucket_shard_numel)


def _small_beside_large(rank, ws):
    """A LayerNorm-like gain (ones) and its bias (~0.01) side by side: each is quantized with
    its own scale, so a peer's copy of the bias is within half an int8 step of the bias's own
    largest value (a shared block would give it the gain's step, 1/254)."""
    torch.manual_seed(0)
    gain = torch.nn.Parameter(torch.ones(100))
    bias = torch.nn.Parameter(torch.randn(100) * 0.01)
    weight = torch.nn.Parameter(torch.randn(1000) * 0.02)
    opt = zero_py.ZeroOptimizer([weight, gain, bias], torch.optim.SGD, lr=0.0,
                                quantized_weights="int8", bucket_bytes=1 << 20)
    exact = bias.detach().clone()
    (weight.sum() + gain.sum() + bias.sum()).backward()
    opt.step()  # lr 0: the publish sends the unchanged values, quantized to the peers
    err = (bias.detach() - exact).abs().max()
    assert err <= exact.abs().max() / 254 * (1 + 1e-5), (err, exact.abs().max())


def test_small_parameter_beside_a_large_one_keeps_its_own_scale():
    distributed.run(_small_beside_large, 2)


def test_quantized_grads_need_all_to_all():
    class NoAllToAll:
        world_size, rank = 2, 0
    with pytest.raises(ValueError, match="all_to_all"):
        QuantizedExecutor(NoAllToAll(), grads=spec("int8", 256, "quantized_grads"))


# -- training parity ----------------------------------------------------------------------------


def _train(rank, stage, steps, options, dtype=torch.float32):
    torch.manual_seed(0)
    model = tiny_gpt().to(dtype)
    model, opt = zero_py.initialize(model, torch.optim.AdamW, stage=stage, lr=3e-3,
                                    bucket_bytes=8192, **options)
    gen = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(steps):
        loss = gpt_loss(model, gpt_batch(gen))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses, _masters(opt), model, opt


def _masters(opt) -> torch.Tensor:
    """Every parameter's fp32 master, whole, in parameter order: independent of the layout
    (a quantized wire aligns parameters to blocks). fp32 parameters are their own masters: the
    pieces, gathered exactly."""
    flat = opt._flat
    full = {}
    for b in range(flat.n_buckets):
        if flat.bucket_dtype(b) == torch.float32 and not flat.params_sharded:
            piece = flat.bucket_piece(b).clone()
            full[b] = torch.empty(piece.numel() * flat.world_size)
            dist.all_gather_into_tensor(full[b], piece)
    return torch.cat([torch.empty(0)]
                     + [t.float().clone() for t in opt._masters.tensors.values()]
                     + [full[flat.param_bucket[i]][lo:lo + n]
                        for i, (lo, n) in enumerate(zip(flat.param_offset, flat.param_numel))
                        if flat.param_bucket[i] in full])


def _trainings(rank, ws, stage, steps, runs):
    return [_train(rank, stage, steps, options)[:2] for options in runs]


def test_quantized_weights_keep_the_masters_exact():
    """Stage 2: with the gradients exact, int8 weights change only what the other ranks'
    forwards see: after one step (gradients from equal parameters) the masters equal the
    unquantized run's bit for bit, and the rank's own piece of the parameters is its master."""
    for (_, m0), (_, m1) in distributed.run(_trainings, 2, 2, 1,
                                            [{}, {"quantized_weights": "int8"}]):
        assert torch.equal(m0, m1)


def _stage3_gather(rank, ws):
    _, _, model, opt = _train(rank, 3, 2, {"quantized_weights": "int8", "quantize_block": 64})
    flat = opt._flat
    for b in range(flat.n_buckets):
        piece = flat.shards.piece(b)
        n = piece.numel()
        exact = torch.empty(ws * n, dtype=piece.dtype)
        dist.all_gather_into_tensor(exact, piece)
        flat.gather(b).wait()
        got = flat.full_buffer(b).clone()
        flat.free(b)
        want = torch.cat([exact[r * n:(r + 1) * n] if r == rank
                          else _ref_roundtrip(exact[r * n:(r + 1) * n], 64, 8)
                          for r in range(ws)])
        assert torch.equal(got, want), b


def test_stage3_gathers_are_quantized_and_own_shard_exact():
    distributed.run(_stage3_gather, 2)


def _more_steps(seed: int):
    """more(model, opt): two steps on the batches of `seed` (the same for every call), then
    the masters; a run and its resumption from a checkpoint are compared by it."""
    gen = torch.Generator().manual_seed(seed)
    batches = [gpt_batch(gen) for _ in range(2)]

    def more(model, opt):
        for batch in batches:
            gpt_loss(model, batch).backward()
            opt.step()
            opt.zero_grad()
        return _masters(opt)
    return more


def _stochastic_training(rank, ws, tmp):
    """Stochastic rounding of int4 gradients (quantized_grads_rounding="stochastic"): each
    reduction's noise is its own (rank, step, bucket, pass, peer); a run repeats to the bit,
    and so does its resumption from a checkpoint; rounding to nearest (the default) trains
    otherwise. Without the option, no noise reaches the kernels."""
    import zero_py.collectives.quantized as qmod

    seen = []
    real = qmod.quantize

    def spy(x, block, bits, q=None, scales=None, noise=None):
        if bits == 4:
            seen.append(noise)
        return real(x, block, bits, q=q, scales=scales, noise=noise)
    options = {"quantized_grads": "int4", "quantize_block": 64,
               "quantized_grads_rounding": "stochastic"}
    qmod.quantize = spy
    try:
        losses, masters, model, opt = _train(rank, 2, 2, options)
    finally:
        qmod.quantize = real
    out = {"noises": seen, "buckets": opt._flat.n_buckets}
    out["again"] = torch.equal(_train(rank, 2, 2, options)[1], masters)
    default = {k: v for k, v in options.items() if k != "quantized_grads_rounding"}
    seen_before = len(seen)
    qmod.quantize = spy
    try:
        out["nearest differs"] = not torch.equal(_train(rank, 2, 2, default)[1], masters)
    finally:
        qmod.quantize = real
    out["default noise"] = seen[seen_before:]
    del seen[seen_before:]
    # two steps, a checkpoint, two more; against the same four steps from the checkpoint
    more = _more_steps(7 + rank)
    zero_py.save_checkpoint(f"{tmp}/ck", model, opt)
    reference = more(model, opt)
    _, _, m2, o2 = _train(rank, 2, 0, options)
    zero_py.load_checkpoint(f"{tmp}/ck", m2, o2)
    out["resumed"] = torch.equal(more(m2, o2), reference)
    return out


def test_stochastic_gradient_rounding_repeats_and_resumes_exactly(tmp_path):
    runs = distributed.run(_stochastic_training, 2, str(tmp_path))
    for r in runs:
        noises = r["noises"]
        # one chunk a peer per bucket and step, every noise distinct (seeds and streams)
        assert len(noises) == 2 * r["buckets"] and None not in noises
        assert len(set(noises)) == len(noises)
        assert r["again"] and r["nearest differs"] and r["resumed"]
        assert r["default noise"] and set(r["default noise"]) == {None}
    assert not set(runs[0]["noises"]) & set(runs[1]["noises"])  # nor do the ranks share one


@pytest.mark.slow
def test_quantized_training_tracks_the_unquantized_run():
    runs = [{}, {"quantized_weights": "int8", "quantized_grads": "int8"},
            {"quantized_weights": "int8", "quantized_grads": "int4", "quantize_block": 64},
            {"grad_reduce_dtype": torch.bfloat16, "grad_accum_dtype": torch.float32},
            {"quantized_weights": "int8", "quantized_grads": "int4",
             "grad_error_feedback": True}]
    tols = [0.0, 0.01, 0.03, 0.005, 0.03]
    for rank_runs in distributed.run(_trainings, 2, 2, 8, runs):
        base = rank_runs[0][0][-1]
        for (losses, _), tol in zip(rank_runs[1:], tols[1:]):
            assert abs(losses[-1] - base) <= tol * abs(base), (base, losses)


def _feedback_resume(rank, ws, tmp):
    """grad_error_feedback's residuals travel in checkpoints: a run resumed at the same world
    size and layout continues as the uninterrupted run (its own residuals before the load are
    dropped); another stage's layout starts them at zero; consolidation ignores them. With
    int8 weights too: the load leaves the peers' pieces quantized, as the saved run's publish
    did (read exactly instead, the masters were 1.6e-4 off after two steps)."""
    from zero_py.checkpoint.consolidate import consolidate

    options = {"quantized_weights": "int8", "quantized_grads": "int4", "grad_error_feedback": True}
    more = _more_steps(11 + rank)
    _, _, model, opt = _train(rank, 2, 2, options)
    saved = {b: r.clone() for b, r in opt._reducer.residuals().items()}
    zero_py.save_checkpoint(f"{tmp}/ck", model, opt)
    reference = more(model, opt)
    _, _, m2, o2 = _train(rank, 2, 1, options)  # residuals of its own, to be dropped
    zero_py.load_checkpoint(f"{tmp}/ck", m2, o2)
    got = o2._reducer.residuals()
    out = {"restored": saved.keys() == got.keys() and len(saved) > 0
           and all(torch.equal(saved[b], got[b]) for b in saved)}
    out["resumed"] = torch.equal(more(m2, o2), reference)
    _, _, m3, o3 = _train(rank, 1, 1, options)
    zero_py.load_checkpoint(f"{tmp}/ck", m3, o3)
    out["other layout"] = o3._reducer.residuals()
    if rank == 0:
        consolidate(f"{tmp}/ck", f"{tmp}/full.safetensors")
    return out


def _feedback_regrouped(rank, ws, add_at=None, steps=3):
    """grad_error_feedback with blocks[1] frozen, and unfrozen by add_param_group before step
    `add_at` (None: never): the other parameters' values after `steps` steps, and the
    residuals just before the add and just after, keyed by the parameters of their bucket."""
    torch.manual_seed(0)
    model = tiny_gpt()
    model.blocks[1].requires_grad_(False)
    opt = zero_py.ZeroOptimizer([p for p in model.parameters() if p.requires_grad],
                                torch.optim.AdamW, lr=3e-3, bucket_bytes=8192,
                                quantized_grads="int4", grad_error_feedback=True)
    gen = torch.Generator().manual_seed(100 + rank)

    def residuals():
        flat = opt._flat
        return {tuple(id(flat.params[i]) for i in flat.bucket_params[b]): r.clone()
                for b, r in opt._reducer.residuals().items()}
    out = {}
    for t in range(steps):
        if t == add_at:
            out["before"] = residuals()
            model.blocks[1].requires_grad_(True)
            opt.add_param_group({"params": list(model.blocks[1].parameters()), "lr": 1e-3})
            out["after"] = residuals()
        gpt_loss(model, gpt_batch(gen)).backward()
        opt.step()
        opt.zero_grad()
    out["values"] = {n: p.detach().clone() for n, p in model.named_parameters()
                     if not n.startswith("blocks.1.")}
    return out


def _exact_reads(rank, ws, stage):
    """int8 weights: what zero_py.gathered() shows and model.state_dict() exports (stage 3,
    its gathers collective: ZP_SHM=0, as across hosts, on CUDA or with offload_params='nvme';
    the LayerNorms persistent, always gathered), and zero_py.full_state_dict() (stage 2),
    against torch.distributed's own all-gather of the shards; each rank's own pieces across an
    edit-free
    zero_py.gathered(modifier_rank=0); and the training after these reads, against the run
    without them."""
    options = {"quantized_weights": "int8"}
    if stage == 3:
        options["persistence_threshold"] = 64
    os.environ["ZP_SHM"] = "0"
    try:
        _, _, model, opt = _train(rank, stage, 2, options)
        _, _, ref_model, ref_opt = _train(rank, stage, 2, options)
    finally:
        del os.environ["ZP_SHM"]
    flat = opt._flat
    pieces = {b: (flat.shards.piece(b) if stage == 3 else flat.bucket_piece(b)).clone()
              for b in range(flat.n_buckets)}
    exact = {}
    for b, piece in pieces.items():
        exact[b] = torch.empty(ws * piece.numel(), dtype=piece.dtype)
        dist.all_gather_into_tensor(exact[b], piece)
    out = {}
    if stage == 2:  # the parameters hold their peers' pieces as int8 copies
        index = {id(p): i for i, p in enumerate(flat.params)}
        sd = zero_py.full_state_dict(model)
        if sd is not None:
            out["full_state_dict"] = all(torch.equal(sd[n], exact[flat.param_bucket[index[id(p)]]][
                flat.param_offset[index[id(p)]]:flat.param_offset[index[id(p)]]
                + p.numel()].view_as(p)) for n, p in model.named_parameters())
    if stage == 3:
        with zero_py.gathered(model):
            out["gathered"] = all(torch.equal(flat.full_buffer(b), exact[b]) for b in exact)
            want = {n: p.detach().clone() for n, p in model.named_parameters()}
        sd = model.state_dict()
        out["state_dict"] = all(torch.equal(sd[n], want[n]) for n in want)
    with zero_py.gathered(model, modifier_rank=0):
        pass
    out["own pieces kept"] = [b for b in pieces if not torch.equal(
        flat.shards.piece(b) if stage == 3 else flat.bucket_piece(b), pieces[b])]
    more = _more_steps(31 + rank)
    more(model, opt)
    more(ref_model, ref_opt)
    out["training goes on"] = all(torch.equal(p, q) for p, q in zip(
        model.parameters(), ref_model.parameters()))
    if stage == 2:  # collective now: one rank alone raises, on every rank, never hangs
        try:
            if rank == 0:
                zero_py.full_state_dict(model)
            opt.step()
            out["alone refused"] = "no error"
        except RuntimeError as exc:
            out["alone refused"] = "call it on every rank" in str(exc)
    return out


def _stage3_resume(rank, ws, tmp):
    """Stage 3, int8 weights, the LayerNorms persistent (always gathered) and blocks[1] frozen:
    two steps, a checkpoint, two more; against a fresh run loaded from the checkpoint."""
    def build(seed):
        torch.manual_seed(seed)
        model = tiny_gpt()
        model.blocks[1].requires_grad_(False)
        with torch.no_grad():  # LayerNorms of ones and zeros would quantize exactly
            for p in model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        return zero_py.initialize(model, torch.optim.AdamW, stage=3, lr=3e-3,
                                  quantized_weights="int8", persistence_threshold=64)
    gen = torch.Generator().manual_seed(100 + rank)
    model, opt = build(0)
    for _ in range(2):
        gpt_loss(model, gpt_batch(gen)).backward()
        opt.step()
        opt.zero_grad()
    zero_py.save_checkpoint(f"{tmp}/stage3", model, opt)
    more = _more_steps(41 + rank)
    more(model, opt)
    resumed, resumed_opt = build(1)
    zero_py.load_checkpoint(f"{tmp}/stage3", resumed, resumed_opt)
    more(resumed, resumed_opt)
    return [float((p - q).abs().max()) for p, q in zip(resumed.parameters(),
                                                        model.parameters()) if p.numel()]


def _scenarios(rank, ws, tmp):
    return {"resume": _feedback_resume(rank, ws, tmp),
            "stage 3 resume": _stage3_resume(rank, ws, tmp),
            "regrouped": _feedback_regrouped(rank, ws, add_at=2),
            "unchanged": _feedback_regrouped(rank, ws),
            "exact reads": {stage: _exact_reads(rank, ws, stage) for stage in (2, 3)}}


@pytest.fixture(scope="module")
def feedback_runs(tmp_path_factory):
    return distributed.run(_scenarios, 2, str(tmp_path_factory.mktemp("feedback")))


def test_error_feedback_residuals_resume_from_checkpoints(feedback_runs):
    for r in feedback_runs:
        r = r["resume"]
        assert r["restored"] and r["resumed"]
        assert r["other layout"] == {}


def test_error_feedback_residuals_survive_add_param_group(feedback_runs):
    """add_param_group rebuilds the layout (the new group's buckets come first, the others
    keep theirs under new indices): each kept bucket keeps what rounding lost. The first step
    after it reduces the old parameters' gradients, computed before any new parameter moved,
    from the same residuals as the run that never added the group, so it updates them to the
    same bits. Before, the rebuilt reducer started without residuals: every bucket's were
    dropped, and after that step those parameters were up to 11% off (of a tensor's largest
    value: Adam makes much of a small change in a near-zero gradient)."""
    for r in feedback_runs:
        before, after = r["regrouped"]["before"], r["regrouped"]["after"]
        assert before and before.keys() == after.keys()
        assert all(torch.equal(before[k], after[k]) for k in before)
        assert any(float(v.abs().max()) > 0 for v in before.values())
        got, want = r["regrouped"]["values"], r["unchanged"]["values"]
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want), \
            max(float((got[k] - want[k]).abs().max()) for k in want)


def _feedback_memory(rank, ws):
    _, _, _, plain = _train(rank, 2, 1, {"quantized_grads": "int4"})
    _, _, _, fed = _train(rank, 2, 1, {"quantized_grads": "int4", "grad_error_feedback": True})
    flat = fed._flat
    # one fp32 residual per peer chunk of every bucket: (N - 1) / N of the gradient buckets
    want = 4 * sum((ws - 1) * fed._reducer.grads.piece(b).numel()
                   for b in range(flat.n_buckets))
    assert want > 0
    assert fed._reducer.residual_bytes == want
    assert sum(r.numel() * 4 for r in fed._reducer._residual.values()) == want
    assert fed.memory_report()["grads"] - plain.memory_report()["grads"] == want


def test_error_feedback_memory_is_reported():
    distributed.run(_feedback_memory, 2)


def _bf16_model(rank, ws):
    losses, _, _, _ = _train(rank, 2, 3, {"grad_accum_dtype": torch.float32,
                                          "quantized_grads": "int8"}, torch.bfloat16)
    return losses


def test_bf16_model_with_fp32_sum_and_int8_grads_trains():
    for losses in distributed.run(_bf16_model, 2):
        assert all(torch.isfinite(torch.tensor(losses)))


def test_state_dicts_and_gathered_blocks_read_int8_weights_exactly(feedback_runs):
    """quantized_weights quantizes the gathers of training only. zero_py.gathered() and the
    stage-3 state dicts read the peers' shards exactly, also where the gathers are collective
    (before: through the int8 wire, an exported model 0.39% off, of a block's largest value);
    and zero_py.gathered(modifier_rank=0) leaves every rank's own pieces as they were (before:
    rank 0's int8 copies of its peers' pieces became theirs, at stages 2 and 3, even with
    nothing edited in the block). The persistent parameters, gathered between steps, are
    read exactly too, and training then goes on from the copies a publish leaves, as the run
    that never read them does, to the bit."""
    wrong = [(rank, stage, what) for rank, r in enumerate(feedback_runs)
             for stage, got in r["exact reads"].items() for what, ok in got.items()
             if ok is not True and ok != []]
    assert wrong == [], wrong


def test_stage3_persistent_and_frozen_parameters_resume_exactly(feedback_runs):
    """The load refreshes the persistent parameters as the saved run holds them: the trained
    ones through the int8 wire (a step's publish), the frozen ones exact (construction's
    broadcast; no step publishes them). Before, the frozen ones came back quantized and the
    resumed run was 4e-3 off the uninterrupted one after two steps (its largest difference)."""
    for r in feedback_runs:
        assert max(r["stage 3 resume"]) == 0.0, r["stage 3 resume"]
