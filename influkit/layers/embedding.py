"""``nn.Embedding``: y_t = W[x_t], so the per-example gradient of M = W (vocabulary × dim) is Σ_t e_{x_t} g_tᵀ.

- contraction: ⟨∇W_i, S⟩ = Σ_t g_tᵀ S[x_t];
- per-example gradient rows: the (vocabulary × dim) matrix Σ_t e_{x_t} g_tᵀ, dense (worth it only for a vocabulary
  not much larger than the tokens per example, e.g. position embeddings);
- K-FAC: the input factor of one-hot inputs is diagonal, A = diag(token frequencies); G = Σ g gᵀ.

``padding_idx`` tokens carry no gradient and are left out. Ids shared by the whole batch (position ids of shape
(1, T)) are expanded to the batch when recorded, so that their output-gradients stay per example.
"""

from __future__ import annotations

import torch
from torch import nn

from .registry import Layer, register


@register(nn.Embedding)
class Embedding(Layer):
    kind = "embedding"
    kronecker = True
    inputs_first = True
    one_hot = True

    def unsupported(self):
        if self.module.max_norm is not None:
            return "max_norm embedding (its forward rescales the weights)"
        if self.module.scale_grad_by_freq:
            return "scale_grad_by_freq embedding (its gradient depends on the whole batch)"
        return None

    def record(self, inp, out, batch):
        if inp.shape[0] == 1 != batch:
            return inp.expand(batch, *inp.shape[1:]), out.expand(batch, *out.shape[1:])
        return inp, out

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.module.weight.shape)

    def factor_dims(self) -> tuple[int, int]:
        """(vocabulary: A's diagonal, dim: G's size)."""
        return self.shape

    def inputs(self, inp):
        """(B, T) token ids."""
        return inp.reshape(inp.shape[0], -1)

    def token_mask(self, ids: torch.Tensor) -> torch.Tensor:
        """(B, T) bool: the tokens that carry gradient (not ``padding_idx``)."""
        padding = self.module.padding_idx
        return torch.ones_like(ids, dtype=torch.bool) if padding is None else ids != padding

    def contract(self, ids, g, weight, bias):
        g = g * self.token_mask(ids).unsqueeze(-1).to(g.dtype)
        return (weight[ids] * g).sum((1, 2))

    def example_gradients(self, ids, g):
        g = g * self.token_mask(ids).unsqueeze(-1).to(g.dtype)
        rows = torch.zeros(ids.shape[0], *self.shape, dtype=g.dtype, device=g.device)
        rows.scatter_add_(1, ids.unsqueeze(-1).expand(-1, -1, g.shape[-1]), g)
        return [rows.reshape(ids.shape[0], -1)]

    def tied_example_norms(self, ids, g, decoder: Layer, a, u) -> torch.Tensor:
        """(B,) float64 ‖∇ℓ_i‖² over this embedding's weight W (vocabulary × dim), tied to ``decoder``'s — a dense
        layer y_s = W a_s + b with W stored (vocabulary, dim) —, and the decoder's own trained bias, from both
        layers' records: ids (B, T) and output-gradients g (B, T, dim) here, inputs a (B, S, dim) and
        output-gradients u (B, S, vocabulary) there. ∇_W ℓ_i = Σ_t e_{x_t} g_tᵀ + Σ_s u_s a_sᵀ, so

            ‖∇_W ℓ_i‖² = Σ_{t,t'} [x_t = x_t'] g_t·g_t' + Σ_{s,s'} (u_s·u_s')(a_s·a_s') + 2 Σ_{s,t} u_s[x_t] (a_s·g_t),

        the middle term with the bias's ‖Σ_s u_s‖² the decoder's own :meth:`example_norms`: T × T and S × T
        matrices, no vocabulary-sized row per example."""
        g = g * self.token_mask(ids).unsqueeze(-1).to(g.dtype)
        same = ids.unsqueeze(2) == ids.unsqueeze(1)
        embedded = (g @ g.transpose(1, 2)).to(torch.float64).mul_(same).sum((1, 2))
        picked = u.gather(2, ids.unsqueeze(1).expand(-1, u.shape[1], -1))  # (B, S, T): u_s[x_t]
        cross = (picked * (a @ g.transpose(1, 2)).to(picked.dtype)).sum((1, 2), dtype=torch.float64)
        return embedded + decoder.example_norms(a, u) + 2 * cross

    def contract_cost(self, tokens):
        """Per token: gather S[x_t], multiply by g_t and sum (3·dim)."""
        return 3 * tokens * self.shape[1]

    def gradient_cost(self, tokens):
        """Zero the vocabulary × dim rows, add the T tokens' g_t (2·T·dim)."""
        vocab, dim = self.shape
        return vocab * dim + 2 * tokens * dim

    def add_covariances(self, inputs, grads, ids, g) -> int:
        """Add token counts to ``inputs`` (vocabulary,) and Σ g gᵀ over the tokens that carry gradient to ``grads``."""
        keep = self.token_mask(ids)
        inputs.index_add_(0, ids[keep], torch.ones(int(keep.sum()), dtype=inputs.dtype, device=ids.device))
        g = (g * keep[None, :, :, None].to(g.dtype)).reshape(-1, g.shape[-1])
        grads += (g.T @ g).to(grads.dtype)
        return int(keep.sum())

    def example_squares(self, ids, g, left=None, right=None) -> torch.Tensor:
        """Σ_{j,i} ((∇_W ℓ_ij) R)², ∇_W ℓ_ij = Σ_t e_{x_it} g_ijtᵀ (rows touched by example i only); the row basis is
        the standard one (A is diagonal), so ``left`` is None."""
        vocab, dim = self.shape
        if right is not None:
            g = g @ right.to(g.dtype)
        keep = self.token_mask(ids)
        batch = ids.shape[0]
        keys = (torch.arange(batch, device=ids.device)[:, None] * vocab + ids)[keep]
        unique, inverse = torch.unique(keys, return_inverse=True)
        total = torch.zeros(vocab, dim, dtype=torch.float64, device=g.device)
        for j in range(g.shape[0]):
            summed = torch.zeros(unique.shape[0], dim, dtype=g.dtype, device=g.device)
            summed.index_add_(0, inverse, g[j][keep])
            total.index_add_(0, unique % vocab, (summed**2).to(torch.float64))
        return total
