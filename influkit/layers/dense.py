"""Layers that are one matrix product per token, y_t = W a_t + b, and ``nn.Linear``.

With ā = [a; 1] when the bias is trained (a homogeneous coordinate), the per-example gradient of the block matrix
M = [W | b] (out × in+1) is Σ_t g_t ā_tᵀ, so

- contraction: ⟨∇W_i, S⟩ = Σ_t g_tᵀ S a_t and ⟨∇b_i, s⟩ = Σ_t g_tᵀ s, the cheaper side multiplied first;
- per-example gradient rows: ∇W_i = Σ_t g_t a_tᵀ, ∇b_i = Σ_t g_t (one product, then one per direction block);
- K-FAC (Martens & Grosse 2015): A = Σ ā āᵀ over tokens, G = Σ g gᵀ; a weight stored (in, out) (``inputs_first``,
  GPT-2's ``Conv1D``) takes M = [W; bᵀ] (in+1 × out), the same factors on the other sides.
"""

from __future__ import annotations

import torch
from torch import nn

from .registry import Layer, register

EXAMPLE_CHUNK_BYTES = 64 * 2**20  # per-example gradients of one layer formed at once by example_squares


def bilinear(a: torch.Tensor, g: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """(B,) Σ_t g_tᵀ S a_t for a (B, T, in), g (B, T, out), S (out, in): the cheaper side multiplied first."""
    if s.shape[0] <= s.shape[1]:
        return (a @ s.T).mul_(g).sum((1, 2))
    return (g @ s).mul_(a).sum((1, 2))


class Dense(Layer):
    """A layer y_t = W a_t + b per token; subclasses say how the weight is stored (:meth:`matrix`) and what a
    token is (:meth:`inputs`, :meth:`grads`)."""

    kronecker = True

    def matrix(self, w: torch.Tensor) -> torch.Tensor:
        """The (out, in) matrix W of a tensor shaped like the weight."""
        return w

    @property
    def features(self) -> tuple[int, int]:
        """(out, in) of W."""
        return tuple(self.matrix(self.module.weight).shape)

    @property
    def shape(self) -> tuple[int, int]:
        out, width = self.features
        width += self.bias is not None
        return (width, out) if self.inputs_first else (out, width)

    def factor_dims(self) -> tuple[int, int]:
        """(size of the input factor A, size of the output-gradient factor G)."""
        out, width = self.features
        return width + (self.bias is not None), out

    def inputs(self, inp: torch.Tensor) -> torch.Tensor:
        return inp.reshape(inp.shape[0], -1, inp.shape[-1])

    def contract(self, a, g, weight, bias):
        out = torch.zeros(a.shape[0], dtype=g.dtype, device=g.device)
        if weight is not None:
            out += bilinear(a, g, self.matrix(weight))
        if bias is not None:
            out += g.sum(1) @ bias
        return out

    def example_gradients(self, a, g):
        rows = []
        if self.weight is not None:  # Σ_t g_t a_tᵀ (B, out, in), or its transpose for a weight stored (in, out)
            grad = a.transpose(1, 2) @ g if self.inputs_first else g.transpose(1, 2) @ a
            rows.append(grad.reshape(g.shape[0], -1))
        if self.bias is not None:
            rows.append(g.sum(1))
        return rows

    def example_norms(self, a, g):
        """(B,) float64 ‖Σ_t g_t ā_tᵀ‖²_F = Σ_{t,t'} (ā_t·ā_t')(g_t·g_t') from the two T × T Gram matrices when that is
        cheaper than forming the rows (T·(in + out) < in·out: short sequences of wide layers), else the rows'."""
        tokens, width, out = a.shape[1], a.shape[2], g.shape[2]
        if tokens * (width + out) >= width * out:
            return super().example_norms(a, g)
        inputs = a @ a.transpose(1, 2) if self.weight is not None else a.new_zeros(a.shape[0], tokens, tokens)
        if self.bias is not None:
            inputs = inputs + 1  # ā = [a; 1]: ā_t·ā_t' = a_t·a_t' + 1
        return (inputs * (g @ g.transpose(1, 2))).sum((1, 2), dtype=torch.float64)

    def contract_cost(self, tokens):
        """Per token: S a_t (r·c flops, r + c elements) for the weight, g_t summed for the bias."""
        out, width = self.features
        return tokens * ((out * width + out + width if self.weight is not None else 0) + (out if self.bias is not None else 0))

    def gradient_cost(self, tokens):
        """Σ_t g_t a_tᵀ: T·r·c flops, T·(r + c) read, r·c written; the bias T·r."""
        out, width = self.features
        weight = tokens * (out * width + out + width) + out * width if self.weight is not None else 0
        return weight + (tokens * out if self.bias is not None else 0)

    def add_covariances(self, inputs: torch.Tensor, grads: torch.Tensor, a: torch.Tensor, g: torch.Tensor) -> int:
        """Add one batch's Σ ā āᵀ to ``inputs`` (blockwise for the homogeneous coordinate, never forming ā) and
        Σ g gᵀ to ``grads`` (g: (k, B, T, out), every pseudo-gradient column); returns the batch's token count."""
        flat = a.reshape(-1, a.shape[-1])
        width = flat.shape[1]
        inputs[:width, :width] += (flat.T @ flat).to(inputs.dtype)
        if self.bias is not None:
            total = flat.sum(0).to(inputs.dtype)
            inputs[:width, width] += total
            inputs[width, :width] += total
            inputs[width, width] += flat.shape[0]
        flat_g = g.reshape(-1, g.shape[-1])
        grads += (flat_g.T @ flat_g).to(grads.dtype)
        return flat.shape[0]

    def _with_bias(self, a: torch.Tensor, basis: torch.Tensor | None) -> torch.Tensor:
        """ā Q for ā = [a, 1] (a trained bias) or a, without forming ā when Q is given (ā Q = a Q[:-1] + Q[-1])."""
        if basis is not None:
            basis = basis.to(a.dtype)
            return a @ basis[:-1] + basis[-1] if self.bias is not None else a @ basis
        if self.bias is None:
            return a
        return torch.cat([a, torch.ones(*a.shape[:-1], 1, dtype=a.dtype, device=a.device)], dim=-1)

    def example_squares(self, a, g, left=None, right=None) -> torch.Tensor:
        """Σ_{j,i} (Lᵀ ∇_M ℓ_ij R)² elementwise over pseudo-gradient columns j and examples i: (rows, cols) float64.

        a: (B, T, in), g: (k, B, T, out); L, R: eigenbases of the factors on M's rows and columns (None: the
        standard basis), so with them this is EK-FAC's eigenvalue correction and without them the diagonal of the
        (sampled) Gauss-Newton block. Products in the model's dtype, per batch."""
        g_basis, a_basis = (right, left) if self.inputs_first else (left, right)
        a = self._with_bias(a, a_basis)
        if g_basis is not None:
            g = g @ g_basis.to(g.dtype)
        k, batch, tokens, rows = g.shape
        if tokens == 1:  # ∇_M ℓ_ij = g aᵀ: the squares factor, Σ_i (Σ_j g_ij²) (a_i²)ᵀ is one product
            total = ((g[:, :, 0] ** 2).sum(0).T @ (a[:, 0] ** 2)).to(torch.float64)
        else:
            total = torch.zeros(rows, a.shape[2], dtype=torch.float64, device=a.device)
            chunk = max(1, EXAMPLE_CHUNK_BYTES // (a.element_size() * k * rows * a.shape[2]))
            for s in range(0, batch, chunk):
                grads = torch.einsum("kbto,bti->kboi", g[:, s : s + chunk], a[s : s + chunk])
                total += (grads**2).sum((0, 1)).to(torch.float64)
        return total.T if self.inputs_first else total


@register(nn.Linear)
class Linear(Dense):
    """``nn.Linear``: y = W a + b, W stored (out, in)."""

    kind = "linear"
