"""Small models and data for the tests: random inputs, never all zeros."""

from __future__ import annotations

import torch
import torch.nn as nn


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


def mlp_loss(model, batch):
    x, y = batch
    return torch.nn.functional.mse_loss(model(x), y)


def max_rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| relative to max |b| (the reference)."""
    a, b = a.detach(), b.detach()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def tiny_gpt(vocab=32, block=16):
    from zero_py.demo import TinyGPT

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
