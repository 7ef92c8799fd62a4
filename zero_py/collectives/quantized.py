"""Fewer bytes on the wire (ZeRO++): quantized all-gather (qwZ), quantized reduce-scatter (qgZ)
and the bf16 reduction with an fp32 sum, over any executor with all_gather / all_to_all.

Only the wire is quantized; what a rank owns never is:

- quantized_all_gather: each rank quantizes its piece (int8, one fp32 scale per block), the
  packets are all-gathered as bytes and every peer's piece is dequantized into the output. The
  rank's own piece is copied exactly, so its fp32 master (or fp32 parameter piece) and the
  update that reads it stay exact: only the copies other ranks hold are approximations.
- quantized_reduce_scatter: qgZ's one hop. Each rank quantizes the chunk of its input that
  every peer owns (int8 or int4), one all-to-all hands each rank every peer's version of its
  own chunk, and the rank dequantizes and sums them in fp32, in rank order, its own chunk
  added unquantized. Each contribution is quantized once, whatever the world size, so the
  error of the sum is at most sum_r scale_r / 2 over the peers' blocks: with the gradients
  already divided by the world size (the reducer's averaging), that does not grow with N (a
  ring would quantize again at every hop).
- error feedback (quantized_reduce_scatter's residual, grad_error_feedback): each rank adds
  what rounding lost from its last contribution to its next, so a gradient below half a step
  is delayed, not dropped.
- stochastic rounding of the gradients (quantized_reduce_scatter's noise,
  quantized_grads_rounding="stochastic"; "nearest" is the default): each value rounds up with
  the probability of its fraction of a step, so that a contribution is the gradient on average.
  Rounded to nearest, every value below half its block's step is dropped at every step: at
  int4 (7 steps to the block's largest value) most of a block, a bias that slowed the demo's
  4-rank training by about 100 of 900 steps at one seed; stochastically, the variance grows
  instead (docs/scale-out.md has both measured). The noise is a function of (the optimizer's
  rounding seed: rank and step, the bucket, the pass, the peer), so runs and their resumption
  from a checkpoint repeat to the bit.
- layout_align_bytes: with a quantized wire the flat layout starts every parameter and every
  shard on a block boundary, so no block holds two parameters (one of them ~1, the other
  ~0.01, would be rounded on the first one's step).
- bf16_all_gather: the weights' wire in bf16 (quantized_weights="bf16"), the own piece exact:
  the baseline that int8 is measured against.
- widening_reduce_scatter: the input travels in its own dtype (bf16) and is summed in fp32
  (the output's dtype) in rank order; each value is rounded once, to bf16, before it is sent.
  An executor without a usable all_to_all (all_to_all_unavailable: a native NCCL executor on a
  library older than NCCL 2.7, or an executor object of the user's without one) reduces in the
  wire dtype instead and widens the result.

Both executors of zero_py have all_to_all: torch.distributed's (point-to-point messages on
gloo, all_to_all_single elsewhere) and the native NCCL one (an ncclSend and ncclRecv per rank
in one NCCL group, NCCL >= 2.7).

A packet of n values is (q bytes, padded to 4, then the fp32 scales): packet_bytes(n, ...).
QuantizedExecutor wraps an executor so that the reducer and the storages need not know:
its reduce_scatter and all_gather of fp32/bf16 tensors go through the forms above, every other
call (and every other dtype: object exchanges are bytes) goes to the executor it wraps, whose
messages are then what the wire carries.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

import torch

from zero_py.collectives.arguments import overlaps
from zero_py.collectives.work import Work
from zero_py.kernels.quantize import dequantize, quantize

_QUANTIZABLE = (torch.float32, torch.bfloat16)
_BITS = {"int8": 8, "int4": 4, "bf16": 16}  # 16: a cast to bf16, no scales


@dataclass(frozen=True)
class QuantSpec:
    """How one kind of buffer is quantized on the wire: bits (8 or 4), block (values a scale)."""
    bits: int  # 8, 4, or 16 (the values cast to bf16: the baseline the others are measured by)
    block: int


ROUNDINGS = ("stochastic", "nearest")
_M64 = (1 << 64) - 1


def check_rounding(rounding) -> bool:
    """quantized_grads_rounding checked; True for stochastic rounding."""
    if rounding not in ROUNDINGS:
        raise ValueError(f"quantized_grads_rounding must be 'stochastic' or 'nearest', got "
                         f"{rounding!r}")
    return rounding == "stochastic"


def spec(name: Optional[str], block: int, what: str,
         allowed=("int8", "int4")) -> Optional[QuantSpec]:
    """The QuantSpec of an option's value (None, "int8", "int4"), checked; `what` names the
    option in the error."""
    if name is None:
        return None
    if name not in allowed:
        raise ValueError(f"{what} must be None or one of {', '.join(map(repr, allowed))}, got "
                         f"{name!r}")
    bits = _BITS[name]
    check_block(block)
    if bits == 4 and block % 2:  # int4 packs two values a byte
        raise ValueError(f"quantize_block must be even with int4 (two values a byte), got "
                         f"{block}")
    return QuantSpec(bits, block)


def check_block(block) -> None:
    if isinstance(block, bool) or not isinstance(block, int) or not 1 <= block <= 2**24:
        raise ValueError(f"quantize_block must be an int in [1, 2**24], got {block!r}")


# the most a layout's alignment is raised for param-aligned blocks (quantize_block <= 16384)
MAX_BLOCK_ALIGN_BYTES = 1 << 16


def layout_align_bytes(align_bytes: int, block: int, quantized: bool) -> int:
    """The flat layout's alignment with a quantized wire: raised so that every parameter and
    every shard starts on a block boundary (block x 4 bytes: fp32's block, or two of bf16's),
    so that no block holds two parameters. A block that did would take its scale from the
    larger one: a LayerNorm gain (~1) beside its bias (~0.01) or a weight matrix (~0.02)
    gives those a step of 1/127 (int8), their copies on the peers 20% wrong. Unchanged without
    a quantized wire, when block x 4 is not a power of two or exceeds MAX_BLOCK_ALIGN_BYTES
    (then a block may straddle two parameters: docs/scale-out.md)."""
    want = 4 * block
    if not quantized or want & (want - 1) or want > MAX_BLOCK_ALIGN_BYTES:
        return align_bytes
    return max(align_bytes, want)


def packet_bytes(n: int, block: int, bits: int) -> int:
    """Bytes of the packet of n quantized values: q (padded to 4 bytes) then the scales."""
    q = n if bits == 8 else (n + 1) // 2
    return (q + 3) // 4 * 4 + 4 * ((n + block - 1) // block)


def _pack(x: torch.Tensor, packet: torch.Tensor, block: int, bits: int, noise=None) -> None:
    q, scales = _views(packet, x.numel(), block, bits)
    quantize(x, block, bits, q=q, scales=scales, noise=noise)


def _views(packet: torch.Tensor, n: int, block: int, bits: int):
    """(q, scales) inside a packet of n values."""
    nq = n if bits == 8 else (n + 1) // 2
    lo = (nq + 3) // 4 * 4
    q = packet[:nq] if bits == 4 else packet[:nq].view(torch.int8)
    return q, packet[lo:].view(torch.float32)


def _unpack(packet: torch.Tensor, n: int, block: int, bits: int, out: torch.Tensor,
            accumulate: bool = False) -> None:
    q, scales = _views(packet, n, block, bits)
    dequantize(q, scales, n, block, bits, out=out, accumulate=accumulate)


def quantized_all_gather(executor, output: torch.Tensor, input: torch.Tensor,
                         block: int, bits: int = 8) -> Work:
    """output = every rank's `input`, each peer's quantized on the wire, this rank's exact."""
    ws, me, n = executor.world_size, executor.rank, input.numel()
    if output.numel() != ws * n:
        raise ValueError(f"all-gather output has {output.numel()} elements, not {ws} x {n}")
    mine = output[me * n:(me + 1) * n]
    if ws == 1 or n == 0:
        if mine.data_ptr() != input.data_ptr():
            mine.copy_(input)
        return Work(None)
    p = packet_bytes(n, block, bits)
    send = torch.empty(p, dtype=torch.uint8, device=input.device)
    _pack(input, send, block, bits)
    recv = torch.empty(ws * p, dtype=torch.uint8, device=input.device)
    work = executor.all_gather(recv, send)

    def finish() -> None:
        if mine.data_ptr() != input.data_ptr():
            mine.copy_(input)
        for r in range(ws):
            if r != me:
                _unpack(recv[r * p:(r + 1) * p], n, block, bits, output[r * n:(r + 1) * n])
    return Work(work, finish, keep=(send, recv))


def bf16_all_gather(executor, output: torch.Tensor, input: torch.Tensor) -> Work:
    """output = every rank's fp32 `input`, each peer's rounded to bf16 on the wire (half the
    bytes), this rank's exact."""
    ws, me, n = executor.world_size, executor.rank, input.numel()
    mine = output[me * n:(me + 1) * n]
    if ws == 1 or n == 0:
        if mine.data_ptr() != input.data_ptr():
            mine.copy_(input)
        return Work(None)
    send = input.to(torch.bfloat16)
    recv = torch.empty(ws * n, dtype=torch.bfloat16, device=input.device)
    work = executor.all_gather(recv, send)

    def finish() -> None:
        if mine.data_ptr() != input.data_ptr():
            mine.copy_(input)
        for r in range(ws):
            if r != me:
                output[r * n:(r + 1) * n].copy_(recv[r * n:(r + 1) * n])
    return Work(work, finish, keep=(send, recv))


def residual_numel(world_size: int, n: int) -> int:
    """Elements of the error-feedback residual of a reduce-scatter whose output has n: one
    chunk per peer (this rank's own chunk is never quantized)."""
    return (world_size - 1) * n if world_size > 1 else 0


def quantized_reduce_scatter(executor, output: torch.Tensor, input: torch.Tensor,
                             block: int, bits: int = 8,
                             residual: Optional[torch.Tensor] = None,
                             noise: Optional[Tuple[int, int]] = None) -> Work:
    """output = this rank's chunk of the sum over ranks of `input`, the peers' chunks
    quantized once on the wire (one all-to-all), summed in fp32 in rank order.

    residual (fp32, residual_numel(ws, n), zeros at first): error feedback. What this rank
    sends a peer is then quantize(chunk + residual's slot of that peer), and the slot keeps
    what that rounding lost, to be sent with the next reduction of this bucket. The rounding
    error no longer vanishes in the sum: over steps it reaches the peer (a gradient below half
    a step is sent when it has added up to one) instead of being dropped every time. A block
    that overflows (scale NaN) leaves its slot at zero. `input` is never written.

    noise (seed, stream): stochastic rounding, the chunk for peer r with the noise of
    (seed, stream * 2**16 + r) (kernels.quantize); None rounds to nearest."""
    ws, me, n = executor.world_size, executor.rank, output.numel()
    if input.numel() != ws * n:
        raise ValueError(f"reduce-scatter input has {input.numel()} elements, not {ws} x {n}")
    own = input[me * n:(me + 1) * n]
    if ws == 1 or n == 0:
        output.copy_(own)
        return Work(None)
    if residual is not None and (residual.dtype != torch.float32
                                 or residual.numel() != residual_numel(ws, n)):
        raise ValueError(f"the error-feedback residual must be {residual_numel(ws, n)} float32, "
                         f"got {residual.dtype} x {residual.numel()}")
    p = packet_bytes(n, block, bits)
    send = torch.empty(ws * p, dtype=torch.uint8, device=input.device)
    sent = None if residual is None else torch.empty(n, dtype=torch.float32,
                                                     device=input.device)
    for r in range(ws):
        if r == me:  # this rank's own chunk never leaves it: its slot goes unsent
            continue
        packet = send[r * p:(r + 1) * p]
        peer_noise = None if noise is None else (noise[0], ((noise[1] << 16) + r) & _M64)
        if residual is None:
            _pack(input[r * n:(r + 1) * n], packet, block, bits, peer_noise)
            continue
        slot = residual[(r - (r > me)) * n:(r - (r > me) + 1) * n]
        slot.add_(input[r * n:(r + 1) * n])  # what should reach r: its chunk + what is owed
        _pack(slot, packet, block, bits, peer_noise)
        _unpack(packet, n, block, bits, sent)  # what will reach it
        # an overflowed block was sent as NaN (scale NaN): it owes nothing (the loss scaler
        # skips this step); no test of the scales, which would wait for a device
        slot.sub_(sent).nan_to_num_(0.0, 0.0, 0.0)
    recv = torch.empty(ws * p, dtype=torch.uint8, device=input.device)
    work = executor.all_to_all(recv, send)

    def finish() -> None:
        acc = output if output.dtype == torch.float32 and not overlaps(output, input) \
            else torch.empty(n, dtype=torch.float32, device=output.device)
        for r in range(ws):
            if r == me:
                if r == 0:
                    acc.copy_(own)
                else:
                    acc.add_(own)
            else:
                _unpack(recv[r * p:(r + 1) * p], n, block, bits, acc, accumulate=r > 0)
        if acc is not output:
            output.copy_(acc)
    return Work(work, finish, keep=(send, recv))


def all_to_all_unavailable(executor) -> Optional[str]:
    """None when `executor` can run all_to_all (the qgZ exchange), else why not: it has no such
    method, or it says it cannot run one here (NcclExecutor.all_to_all_unavailable)."""
    if not callable(getattr(executor, "all_to_all", None)):
        return f"{type(executor).__name__} has no all_to_all"
    why = getattr(executor, "all_to_all_unavailable", None)
    return why if isinstance(why, str) else None


def _replicas(executor) -> int:
    """How many ranks hold each shard: a hybrid mesh's replicas (HybridExecutor), else 1."""
    return getattr(executor, "data_parallel_size", executor.world_size) // executor.world_size


def widening_reduce_scatter(executor, output: torch.Tensor, input: torch.Tensor) -> Work:
    """output (fp32) = this rank's chunk of the sum of `input` (bf16 or fp16 on the wire),
    summed in fp32 in rank order; without a usable all_to_all, reduced in the wire dtype and
    widened."""
    ws, me, n = executor.world_size, executor.rank, output.numel()
    # a hybrid mesh of one rank per shard group still all-reduces across its replicas
    if ws == 1 and _replicas(executor) == 1:
        output.copy_(input[me * n:(me + 1) * n])
        return Work(None)
    if all_to_all_unavailable(executor) is not None:
        tmp = torch.empty(n, dtype=input.dtype, device=input.device)
        work = executor.reduce_scatter(tmp, input)
        return Work(work, lambda: output.copy_(tmp), keep=(tmp,))
    recv = torch.empty_like(input)
    work = executor.all_to_all(recv, input)

    def finish() -> None:
        output.copy_(recv[:n])
        for r in range(1, ws):
            output.add_(recv[r * n:(r + 1) * n])
    return Work(work, finish, keep=(recv,))


class QuantizedExecutor:
    """`inner` with its reduce_scatter and all_gather of fp32/bf16 tensors on a smaller wire:
    weights (QuantSpec or None) for all-gathers, grads (QuantSpec or None) for reduce-scatters;
    a reduce-scatter into a wider output than its input (bf16 in, fp32 out) sums in fp32.
    Everything else is `inner`'s."""

    def __init__(self, inner, weights: Optional[QuantSpec] = None,
                 grads: Optional[QuantSpec] = None, error_feedback: bool = False,
                 stochastic_grads: bool = False):
        # a hybrid mesh of one rank per shard group (pure replication) included: the
        # exchange would have nothing to do there, and the replicas' all-reduce be skipped
        why = (all_to_all_unavailable(inner)
               if grads is not None and inner.world_size * _replicas(inner) > 1 else None)
        if why is not None:
            raise ValueError(
                f"quantized_grads needs an executor with all_to_all (the qgZ exchange), and "
                f"here it has none: {why}. zero_py's executors ('torch', and 'nccl' on NCCL "
                "2.7 or newer) have one")
        self.inner = inner
        self.weights = weights
        self.grads = grads
        # the caller keeps a residual per reduced buffer and passes it (GradReducer)
        self.error_feedback = bool(error_feedback) and grads is not None and inner.world_size > 1
        # the caller passes the noise of each reduction (GradReducer: its seed and stream)
        self.stochastic_grads = (bool(stochastic_grads) and grads is not None
                                 and inner.world_size > 1)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def all_gather(self, output: torch.Tensor, input: torch.Tensor) -> Work:
        w = self.weights
        if w is None or input.dtype not in _QUANTIZABLE or output.dtype != input.dtype:
            return self.inner.all_gather(output, input)
        if w.bits == 16:
            if input.dtype != torch.float32:  # bf16 already
                return self.inner.all_gather(output, input)
            return bf16_all_gather(self.inner, output, input)
        return quantized_all_gather(self.inner, output, input, w.block, w.bits)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor,
                       residual: Optional[torch.Tensor] = None,
                       noise: Optional[Tuple[int, int]] = None) -> Work:
        """residual: the error feedback of this buffer (quantized_reduce_scatter), kept by the
        caller across calls; noise: its stochastic rounding's (seed, stream); each used only
        when the gradients are quantized with it."""
        g = self.grads
        if g is not None and input.dtype in _QUANTIZABLE and output.dtype in _QUANTIZABLE:
            return quantized_reduce_scatter(self.inner, output, input, g.block, g.bits,
                                            residual if self.error_feedback else None,
                                            noise if self.stochastic_grads else None)
        if output.dtype != input.dtype:
            return widening_reduce_scatter(self.inner, output, input)
        return self.inner.reduce_scatter(output, input)

    @property
    def reduce_scatter_keeps_input(self) -> bool:
        return self.grads is not None or getattr(self.inner, "reduce_scatter_keeps_input", False)


def check_options(weights: Optional[str], grads: Optional[str], block: int, error_feedback,
                  rounding) -> None:
    """The ZeroOptimizer options of the wire (quantized_weights, quantized_grads,
    quantize_block, grad_error_feedback, quantized_grads_rounding), checked: a bad value is
    refused even where it would go unused (quantize_block without a quantized wire)."""
    check_block(block)
    spec(weights, block, "quantized_weights", ("bf16", "int8"))
    spec(grads, block, "quantized_grads")
    if not isinstance(error_feedback, bool):
        raise ValueError(f"grad_error_feedback must be True or False, got {error_feedback!r}")
    if error_feedback and grads is None:
        raise ValueError("grad_error_feedback=True needs quantized_grads ('int8' or 'int4'): "
                         "it carries the gradients' quantization error to the next step")
    if check_rounding(rounding) and grads is None:  # it would round nothing, silently
        raise ValueError("quantized_grads_rounding='stochastic' needs quantized_grads ('int8' "
                         "or 'int4'): it rounds the quantized gradients; for bf16 parameters "
                         "rounded from their masters use stochastic_rounding=True")


def check_dtypes(weights: Optional[str], grads: Optional[str], grad_reduce_dtype,
                 param_dtypes) -> None:
    """The wire options against the parameters' dtypes: the quantized collectives take fp32 and
    bf16 buffers, and pass any other dtype through unchanged, so float16 parameters (or float16
    gradients) would travel unquantized, the option silently doing nothing."""
    def names(dtypes) -> str:
        return ", ".join(sorted(str(d).replace("torch.", "") for d in dtypes))
    odd = {d for d in param_dtypes if d not in _QUANTIZABLE}
    if weights is not None and odd:
        raise ValueError(f"quantized_weights={weights!r} quantizes float32 and bfloat16 "
                         f"parameters, and this model has {names(odd)} ones, whose all-gathers "
                         "would travel unquantized: cast the model to bfloat16 (or float32), or "
                         "drop quantized_weights")
    wire_dtypes = {grad_reduce_dtype} if grad_reduce_dtype is not None else set(param_dtypes)
    odd = {d for d in wire_dtypes if d not in _QUANTIZABLE}
    if grads is not None and odd:
        raise ValueError(f"quantized_grads={grads!r} quantizes float32 and bfloat16 gradients, "
                         f"and these would be reduced in {names(odd)}, unquantized: pass "
                         "grad_reduce_dtype=torch.float32 (or torch.bfloat16), or drop "
                         "quantized_grads")


def wire(executor, align_bytes: int, weights: Optional[str], grads: Optional[str], block: int,
         widening: bool, error_feedback: bool, rounding: str):
    """(the executor the reducer and the publish use, the flat layout's alignment) for the
    checked options (check_options): `executor` itself without a quantized or widened wire,
    and the alignment raised so that no quantization block straddles two parameters."""
    wrapped = wrap(executor, spec(weights, block, "quantized_weights", ("bf16", "int8")),
                   spec(grads, block, "quantized_grads"), widening=widening,
                   error_feedback=error_feedback, stochastic_grads=check_rounding(rounding))
    return wrapped, layout_align_bytes(align_bytes, block,
                                       weights == "int8" or grads is not None)


def exact(executor):
    """`executor` without a quantized wire: its collectives carry the values as they are
    (a state dict, zero_py.gathered(); the training gathers keep the wire's)."""
    return executor.inner if isinstance(executor, QuantizedExecutor) else executor


def weights_quantized(executor) -> bool:
    """Whether `executor`'s all-gathers quantize (quantized_weights)."""
    return isinstance(executor, QuantizedExecutor) and executor.weights is not None


def wrap(executor, weights: Optional[QuantSpec] = None, grads: Optional[QuantSpec] = None,
         widening: bool = False, error_feedback: bool = False, stochastic_grads: bool = False):
    """`executor` itself when nothing is quantized or widened, else a QuantizedExecutor."""
    if weights is None and grads is None and not widening:
        return executor
    return QuantizedExecutor(executor, weights, grads, error_feedback, stochastic_grads)
