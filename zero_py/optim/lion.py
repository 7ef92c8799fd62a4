"""Lion (Chen et al. 2023, arXiv 2302.06675) as a torch.optim.Optimizer.

torch.optim has no Lion, so zero_py provides one: pass zero_py.Lion to ZeroOptimizer and the
fused C kernel runs it; used on its own, this class is the plain PyTorch reference.
Update: c = beta1*m + (1-beta1)*g; p = p*(1 - lr*wd) - lr*sign(c); m = beta2*m + (1-beta2)*g.
"""

from __future__ import annotations

import torch


class Lion(torch.optim.Optimizer):
    """Lion (sign of an interpolated momentum; one state tensor, `exp_avg`): the update in
    the module docstring. Pass the class to ZeroOptimizer or zero_py.initialize, which run it
    in the fused kernels; on its own it is the plain PyTorch reference. lr is typically 3-10x
    smaller than AdamW's, weight_decay larger (it is multiplied by lr)."""

    def __init__(self, params, lr: float = 1e-4, betas=(0.9, 0.99), weight_decay: float = 0.0,
                 maximize: bool = False):
        if not lr >= 0.0:
            raise ValueError(f"Invalid learning rate: {lr}")
        if not (0.0 <= betas[0] < 1.0 and 0.0 <= betas[1] < 1.0):
            raise ValueError(f"Invalid betas: {betas}; each must be in [0, 1)")
        if not weight_decay >= 0.0:
            raise ValueError(f"Invalid weight_decay value: {weight_decay}")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay,
                                      maximize=maximize))

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = -p.grad if group["maximize"] else p.grad
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                m = state["exp_avg"]
                c = m.mul(beta1).add_(g, alpha=1.0 - beta1)
                p.mul_(1.0 - group["lr"] * group["weight_decay"])
                p.add_(torch.sign(c), alpha=-group["lr"])
                m.mul_(beta2).add_(g, alpha=1.0 - beta2)
        return loss
