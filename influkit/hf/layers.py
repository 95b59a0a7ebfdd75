"""The transformers layer types influkit knows, registered with :mod:`influkit.layers` when :mod:`influkit.hf` is
imported: GPT-2's ``Conv1D``, y = a W + b with W stored (in, out)."""

from __future__ import annotations

from transformers.pytorch_utils import Conv1D

from ..layers import Linear, register


@register(Conv1D)
class TransposedLinear(Linear):
    """transformers' ``Conv1D``: a linear layer whose weight is stored transposed, (in, out). Its Kronecker block
    is M = [W; bᵀ] (in+1 × out): the same factors A = Σ ā āᵀ and G = Σ g gᵀ as ``nn.Linear``, on the other sides."""

    kind = "conv1d-transposed"
    inputs_first = True

    def matrix(self, w):
        return w.T
