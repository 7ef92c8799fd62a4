"""What a bucket's reduction over a quantized gradient wire carries besides its values (a mixin
of zero_py/sharding/reducer.py; collectives/quantized.py): the error-feedback residual of the
peers' chunks, made at the bucket's first reduction and kept across steps (saved and loaded by
checkpoint/feedback.py), and the stochastic-rounding noise of the bucket in this pass."""

from __future__ import annotations

from typing import Dict, Tuple

import torch

from zero_py.collectives.quantized import residual_numel


class Residuals:
    """Needs the reducer's flat, executor, grads, error_feedback, noise_seed,
    passes_since_step and _residual."""

    def _noise(self, b: int) -> Tuple[int, int]:
        """The noise of bucket b's reduction in this pass: (seed, stream)."""
        seed = (self.noise_seed() * 0x9E3779B97F4A7C15 + 0x6A09E667) & 0xFFFFFFFFFFFFFFFF
        return seed, (b << 16) + min(self.passes_since_step, 0xFFFF)

    def _residual_of(self, b: int) -> torch.Tensor:
        r = self._residual.get(b)
        if r is None:
            n = residual_numel(self.executor.world_size, self.grads.piece(b).numel())
            r = self._residual[b] = torch.zeros(n, dtype=torch.float32, device=self.flat.device)
        return r

    def residuals(self) -> Dict[int, torch.Tensor]:
        """The error-feedback residuals made so far, by bucket (checkpoint/feedback.py)."""
        return dict(self._residual)

    def set_residuals(self, residuals: Dict[int, torch.Tensor]) -> None:
        """The residuals from now on (a load's; the buckets not given start at zero)."""
        for b, r in residuals.items():
            want = residual_numel(self.executor.world_size, self.grads.piece(b).numel())
            if r.dtype != torch.float32 or r.numel() != want:
                raise ValueError(f"the error-feedback residual of bucket {b} must be {want} "
                                 f"float32, got {r.dtype} x {r.numel()}")
        self._residual = dict(residuals)

    @property
    def residual_bytes(self) -> int:
        """Bytes of the error-feedback residuals once every bucket has been reduced."""
        if not self.error_feedback:
            return 0
        ws = self.executor.world_size
        return 4 * sum(residual_numel(ws, self.grads.piece(b).numel())
                       for b in range(self.flat.n_buckets))
