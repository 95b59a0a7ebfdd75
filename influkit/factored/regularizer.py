"""The Hessian of a stage objective's data-free part R (+ the proximal term) as the diagonal a factored curvature adds."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..params import ParamSpace, point
from ..stage import Stage


def regularizer_diagonal(stage: Stage, names: Sequence[str], extra=None, at=None, seed: int = 0) -> torch.Tensor | None:
    """(p,) float64 diag(∇²(R + extra)) by one Rademacher probe v ⊙ (∇²(R + extra)) v, or None without R and extra.

    Exact for separable R (L2, the proximal term); an unbiased estimate otherwise.
    """
    if stage.regularizer is None and extra is None:
        return None
    space = ParamSpace(point(stage.state(), names, at))
    leaves = {n: t.detach().clone().requires_grad_(True) for n, t in point(stage.state(), names, at).items()}
    with torch.enable_grad():
        value = 0.0
        reg = stage.regularization(leaves)
        if reg is not None:
            value = value + reg
        if extra is not None:
            value = value + extra(leaves)
        if not torch.is_tensor(value) or not value.requires_grad:
            return torch.zeros(space.dim, dtype=torch.float64, device=space.device)
        grads = torch.autograd.grad(value, list(leaves.values()), create_graph=True, allow_unused=True)
        gen = torch.Generator(device="cpu").manual_seed(seed + 7919)
        probes = [(torch.randint(0, 2, t.shape, generator=gen) * 2 - 1).to(t.dtype).to(t.device) for t in leaves.values()]
        dot = sum((g * v).sum() for g, v in zip(grads, probes) if g is not None and g.requires_grad)
        if not torch.is_tensor(dot):
            return torch.zeros(space.dim, dtype=torch.float64, device=space.device)
        hv = torch.autograd.grad(dot, list(leaves.values()), allow_unused=True)
    parts = [(torch.zeros_like(v) if h is None else h * v).reshape(-1) for h, v in zip(hv, probes)]
    return torch.cat(parts).to(torch.float64)
