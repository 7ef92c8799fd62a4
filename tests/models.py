"""Small models and data for the tests: random inputs, never all zeros."""

from __future__ import annotations

import importlib.metadata
import importlib.util
from typing import Optional

import torch
import torch.nn as nn
import torch.utils.checkpoint


class MLP(nn.Module):
    def __init__(self, d_in=16, d_hidden=32, d_out=8):
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_hidden)
        self.head = nn.Linear(d_hidden, d_out)

    def forward(self, x):
        return self.head(torch.nn.functional.gelu(self.fc2(torch.tanh(self.fc1(x)))))


def mlp_batch(gen: torch.Generator, batch=8, d_in=16, d_out=8):
    return torch.randn(batch, d_in, generator=gen), torch.randn(batch, d_out, generator=gen)


def _bf16_mse_loss_on_cpu() -> bool:
    try:
        one = torch.ones(1, dtype=torch.bfloat16)
        torch.nn.functional.mse_loss(one, one)
        return True
    except RuntimeError:  # torch 2.4: "mse_cpu" not implemented for 'BFloat16'
        return False


_BF16_MSE_LOSS = _bf16_mse_loss_on_cpu()


def mse_loss(out, y):
    """mse_loss; in fp32 for bf16 tensors where this torch has no bf16 mse_loss on the CPU
    (torch 2.4), in their own dtype elsewhere."""
    if not _BF16_MSE_LOSS and torch.bfloat16 in (out.dtype, y.dtype):
        out, y = out.float(), y.float()
    return torch.nn.functional.mse_loss(out, y)


def mlp_loss(model, batch):
    x, y = batch
    return mse_loss(model(x), y)


def max_rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to max |b| (the reference)."""
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def _adamw_rounds_as_zero_py(**mode) -> bool:
    """Whether torch.optim.AdamW(**mode) gives zero_py's fused kernel's bits on this CPU: three
    steps on random values (not the tests' data)."""
    from zero_py import kernels

    gen = torch.Generator().manual_seed(0)
    p0, g = torch.randn(4099, generator=gen), torch.randn(4099, generator=gen) * 1e-3
    p = nn.Parameter(p0.clone())
    try:
        opt = torch.optim.AdamW([p], lr=1e-2, weight_decay=0.1, **mode)
        master, m, v = p0.clone(), torch.zeros_like(p0), torch.zeros_like(p0)
        for step in (1, 2, 3):
            p.grad = g * step
            opt.step()
            kernels.optim_step_flat("adamw", master, g * step, m, v, step=step, lr=1e-2,
                                    weight_decay=0.1)
    except (RuntimeError, TypeError, ValueError):  # no fused AdamW on this torch's CPU build
        return False
    return torch.equal(p.detach(), master)


# torch's default (foreach) AdamW where it rounds as zero_py's kernel, else its fused one where
# that does (torch's AVX2 build: foreach is an ulp away in ~2% of the elements, fused equal)
REFERENCE_ADAMW_MODE = ({} if _adamw_rounds_as_zero_py(foreach=True) else
                        {"fused": True} if _adamw_rounds_as_zero_py(fused=True) else {})


def reference_adamw(params, **kw) -> torch.optim.AdamW:
    """torch.optim.AdamW as the reference beside zero_py's fused kernel, in the implementation
    of torch's that rounds as the kernel on this CPU (REFERENCE_ADAMW_MODE). Scenarios that
    amplify rounding (bf16 autocast's casts of the weights, a gradient at the level of rounding
    noise through Adam's normalisation, a GAN's game) turn an ulp into differences far above
    it within a few steps."""
    return torch.optim.AdamW(params, **{**REFERENCE_ADAMW_MODE, **kw})


def average_grads(module: nn.Module) -> None:
    """The reference's gradients averaged over the ranks by hand (summed, then divided), for a
    plain model beside zero_py's where DDP does not fit the idiom."""
    import torch.distributed as dist

    for p in module.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad)
            p.grad /= dist.get_world_size()


def tiny_gpt(vocab=32, block=16):
    from zero_py.examples.demo import TinyGPT

    return TinyGPT(vocab, n_layer=2, n_head=2, d_model=32, block_size=block)


def gpt_batch(gen: torch.Generator, batch=4, vocab=32, block=16):
    idx = torch.randint(0, vocab, (batch, block + 1), generator=gen)
    return idx[:, :-1], idx[:, 1:]


def gpt_loss(model, batch):
    return model(*batch)[1]


MODELS = {"mlp": (MLP, mlp_batch, mlp_loss), "gpt": (tiny_gpt, gpt_batch, gpt_loss)}


class Branchy(nn.Module):
    """A model with a frozen layer, a branch some ranks skip, and a layer nobody uses."""

    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(16, 16)
        self.frozen.requires_grad_(False)
        self.trunk = nn.Linear(16, 32)
        self.branch = nn.Linear(32, 32)
        self.never = nn.Linear(32, 32)
        self.head = nn.Linear(32, 8)

    def forward(self, x, use_branch=True):
        h = torch.tanh(self.trunk(self.frozen(x)))
        if use_branch:
            h = h + torch.tanh(self.branch(h))
        return self.head(h)


class TiedGPT(nn.Module):
    """A GPT for stage 3: the output projection is the input embedding (tied), pre-LN blocks
    (zero_py.examples.demo.Block) that can run under activation checkpointing ("reentrant" or
    "non_reentrant"), one block that can run twice per forward (`repeat`), blocks a step can
    skip, and GPT-2's init pass over model.apply when init="apply"."""

    def __init__(self, vocab=32, n_layer=3, d_model=32, n_head=2, block=16, checkpoint="none",
                 repeat=None, init="apply"):
        super().__init__()
        from zero_py.examples.demo import Block

        self.tok_emb = nn.Embedding(vocab, d_model)
        self.pos_emb = nn.Embedding(block, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_head, 0.0) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)
        self.lm_head.weight = self.tok_emb.weight
        self.checkpoint = checkpoint
        self.repeat = repeat
        if init == "apply":
            self.apply(self.init_weights)

    @staticmethod
    def init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.05)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.uniform_(module.bias, -0.1, 0.1)

    def _block(self, block, x):
        if self.checkpoint == "none":
            return block(x)
        return torch.utils.checkpoint.checkpoint(
            block, x, use_reentrant=self.checkpoint == "reentrant")

    def forward(self, idx, targets=None, skip=()):
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1], device=idx.device))
        for k, block in enumerate(self.blocks):
            if k in skip:
                continue
            x = self._block(block, x)
            if k == self.repeat:
                x = self._block(block, x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 targets.reshape(-1))


def hf_missing() -> Optional[str]:
    """Why the Hugging Face model tests cannot run here, or None. They follow transformers 5
    (its meta-device construction, which draws no initial values, and its modules'
    attributes), which runs models only on torch >= 2.6: torch 2.4-2.5 get transformers 4."""
    if importlib.util.find_spec("transformers") is None:
        return "transformers is not installed (make deps installs it)"
    version = importlib.metadata.version("transformers")
    if int(version.split(".")[0]) < 5:
        return (f"transformers {version}: these tests follow transformers 5 (its meta-device "
                "construction and its modules' attributes)")
    if tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 6):
        return (f"transformers {version} runs models only on torch >= 2.6, not "
                f"{torch.__version__}")
    return None


def tiny_t5_config(vocab: int, width: int):
    """A two-layer T5 (encoder-decoder; its shared embedding tied to the encoder's, the
    decoder's and the head), no dropout."""
    import transformers

    return transformers.T5Config(
        vocab_size=vocab, d_model=width, d_kv=width // 4, d_ff=2 * width, num_layers=2,
        num_decoder_layers=2, num_heads=4, dropout_rate=0.0, decoder_start_token_id=0,
        pad_token_id=0, eos_token_id=1)


def tiny_hf_configs(vocab: int, width: int) -> dict:
    """Two-layer GPT-2 (tied embeddings, no dropout) and Llama (untied, grouped-query
    attention) configs of `width`, for tests that build Hugging Face models from scratch."""
    import transformers

    return {
        "gpt2": transformers.GPT2Config(
            n_layer=2, n_embd=width, n_head=2, vocab_size=vocab, n_positions=32,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
            tie_word_embeddings=True),
        "llama": transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=width, intermediate_size=2 * width,
            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            max_position_embeddings=32, bos_token_id=0, eos_token_id=0,
            tie_word_embeddings=False),
    }
