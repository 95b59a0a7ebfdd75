"""M-Adam (Ren et al. 2020, Appendix C, Algorithm 2): Adam whose statistics advance only where the gradient is non-zero.

With mask M = 1[g ≠ 0], for the masked-in entries only:

    t ← t + 1 (a step count per entry),  m ← β₁m + (1−β₁)g,  v ← β₂v + (1−β₂)g²,
    λ ← λ − α · (m / (1−β₁ᵗ)) / (√(v / (1−β₂ᵗ)) + ε),

and every other entry keeps its value, moments and step count. Only the examples of the sampled unlabeled
batch get a hypergradient, so plain Adam would decay the moments of all the others with zeros; M-Adam does
not. When every entry has a non-zero gradient it is exactly torch's Adam. With ``nonnegative`` the updated
entries are clipped at 0 (per-example weights λ_u ≥ 0).
"""

from __future__ import annotations

import torch

from ..errors import InputError


class MaskedAdam(torch.optim.Optimizer):
    """Adam with per-entry step counts and moments that advance only for entries with a non-zero gradient.

    lr, betas, eps: as in ``torch.optim.Adam``; nonnegative: clip updated entries at 0 after each step.
    """

    def __init__(self, params, lr: float = 1e-2, betas=(0.9, 0.999), eps: float = 1e-8, nonnegative: bool = True):
        if lr <= 0:
            raise InputError(f"lr must be positive, got {lr}.")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise InputError(f"betas must lie in [0, 1), got {betas}.")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, nonnegative=nonnegative))

    @torch.no_grad()
    def step(self, closure=None):
        """Performs one masked Adam step; returns the closure's loss if a closure is given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                state = self.state[p]
                if not state:
                    state["step"] = torch.zeros_like(p)
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                mask = g != 0
                if not mask.any():
                    continue
                step, m, v = state["step"], state["exp_avg"], state["exp_avg_sq"]
                step[mask] += 1
                m[mask] = m[mask] * beta1 + (1 - beta1) * g[mask]
                v[mask] = v[mask] * beta2 + (1 - beta2) * g[mask] * g[mask]
                t = step[mask]
                bias1 = 1 - beta1**t
                bias2_sqrt = (1 - beta2**t).sqrt()
                denom = v[mask].sqrt() / bias2_sqrt + group["eps"]
                updated = p[mask] - (group["lr"] / bias1) * m[mask] / denom
                if group["nonnegative"]:
                    updated = updated.clamp_min(0.0)
                p[mask] = updated
        return loss
