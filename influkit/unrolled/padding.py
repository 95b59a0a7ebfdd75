"""The padding rows of a model's embeddings, fed to a step's gradient as inputs of their own.

An ``nn.Embedding(padding_idx=p)`` gives its row p no gradient from the positions that feed token p. Where that row
still moves during training — a masked-LM decoder tied to the word embeddings trains it, weight decay shrinks it —
and a batch feeds p at an attended position (``DataCollatorForLanguageModeling`` draws its random replacement
tokens from the whole vocabulary, [PAD] included), a step's gradient is not the gradient of any loss:

    g̃(θ) = ∂_θ L(θ, u) at u = θ_E[p],

the partial derivative with the fed rows u held fixed. Its derivative, which the reverse pass pulls the adjoint
through, is d g̃ / dθ = ∂²_θθ L + ∂²_θu L · ∂u/∂θ; autograd's double backward through the embedding holds u fixed
again and drops the second term. :class:`PaddingRows` gives the rows to the model as separate inputs (a forward hook
puts u at the positions that feed p: the same values, so replay stays bit-exact), the first-order gradient is taken
with respect to θ only, and the cotangent the reverse pass finds on u is added to row p of θ's (or the fixed shared
block's) adjoint. The test measure is a function of the final values through every position, padding included:
its gradient ∂f/∂θ_T adds the measure's derivative through the fed rows the same way.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial

import torch
from torch import nn


class PaddingRows:
    """The embeddings of a model that have a padding row, by their weight's parameter name."""

    def __init__(self, embeddings: dict[str, nn.Embedding]):
        self.embeddings = embeddings

    @classmethod
    def of(cls, model: nn.Module) -> "PaddingRows | None":
        """The model's ``nn.Embedding`` modules with a ``padding_idx`` (None if it has none)."""
        names = {id(p): n for n, p in model.named_parameters()}
        found = {names[id(m.weight)]: m for m in model.modules()
                 if isinstance(m, nn.Embedding) and m.padding_idx is not None and id(m.weight) in names}
        return cls(found) if found else None

    def values(self, params: dict) -> dict[str, torch.Tensor]:
        """{name: params[name][p]}: each padding row, as a function of ``params`` (θ or the fixed block)."""
        return {n: params[n][m.padding_idx] for n, m in self.embeddings.items() if n in params}

    @contextmanager
    def feeding(self, rows: dict[str, torch.Tensor] | None):
        """Within: each embedding gives ``rows[name]`` at the positions that feed its padding token (None: no
        change)."""
        if not rows:
            yield
            return
        handles = [self.embeddings[n].register_forward_hook(partial(_feed, row=row)) for n, row in rows.items()]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def add(self, adjoint: dict, cotangents: dict[str, torch.Tensor]) -> dict:
        """``adjoint`` (leading dimension q) with each row's cotangent (q, d) added to its padding row."""
        out = dict(adjoint)
        for n, c in cotangents.items():
            if n in out:
                index = torch.tensor([self.embeddings[n].padding_idx], device=c.device)
                out[n] = out[n].index_add(1, index, c.unsqueeze(1).to(out[n].dtype))
        return out


def _feed(module: nn.Embedding, args, output: torch.Tensor, *, row: torch.Tensor) -> torch.Tensor:
    return torch.where((args[0] == module.padding_idx).unsqueeze(-1), row, output)
