"""``nn.LayerNorm`` and ``nn.RMSNorm``: y = â ⊙ w + b elementwise, â the normalized input, so
⟨∇w_i, s⟩ = Σ_t (g_t ⊙ â_t)ᵀ s and ⟨∇b_i, s⟩ = Σ_t g_tᵀ s: the per-example gradient rows Σ_t g_t ⊙ â_t and Σ_t g_t
cost what one contraction costs, so with two directions or more (and tokens) they are formed once. Elementwise parameters have no Kronecker factors
(factored curvature gives them diagonal blocks)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .registry import Layer, register


class Norm(Layer):
    """A normalization with an elementwise affine map over ``normalized_shape``; tokens: the leading dimensions."""

    def normalized(self, inp: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def inputs(self, inp):
        """(B, T, D) normalized inputs â, D = prod(normalized_shape)."""
        return self.normalized(inp).reshape(inp.shape[0], -1, self.module.weight.numel())

    def grads(self, grad):
        return grad.reshape(grad.shape[0], -1, self.module.weight.numel())

    def contract(self, a, g, weight, bias):
        out = torch.zeros(a.shape[0], dtype=g.dtype, device=g.device)
        if weight is not None:
            out += ((g * a).sum(1) * weight.reshape(-1)).sum(1)
        if bias is not None:
            out += g.sum(1) @ bias.reshape(-1)
        return out

    def example_gradients(self, a, g):
        return ([(g * a).sum(1)] if self.weight is not None else []) + ([g.sum(1)] if self.bias is not None else [])

    def contract_cost(self, tokens):
        """Per token: g ⊙ â and its sum (3·D) for the weight, g summed (D) for the bias; plus the dot products."""
        dim = self.module.weight.numel()
        return (tokens * 3 * dim + dim if self.weight is not None else 0) + (tokens * dim + dim if self.bias is not None else 0)

    def gradient_cost(self, tokens):
        dim = self.module.weight.numel()
        return tokens * dim * ((3 if self.weight is not None else 0) + (1 if self.bias is not None else 0))


@register(nn.LayerNorm)
class LayerNorm(Norm):
    kind = "layernorm"

    def normalized(self, inp):
        return F.layer_norm(inp, self.module.normalized_shape, None, None, self.module.eps)


@register(nn.RMSNorm)
class RMSNorm(Norm):
    kind = "rmsnorm"

    def normalized(self, inp):
        return F.rms_norm(inp, self.module.normalized_shape, None, self.module.eps)
