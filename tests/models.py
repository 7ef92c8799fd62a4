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
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))
