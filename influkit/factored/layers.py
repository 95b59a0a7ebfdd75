"""Which trained parameters get Kronecker factors: the registered layers (:mod:`influkit.layers`) with a Kronecker
structure whose weight is trained and owned by one module.

A layer's parameters form one block matrix M whose per-example gradient is a sum of outer products over the layer's
tokens t (positions, patches, time steps, and every call of the module in one forward), e.g. M = [W | b] with
∇_M ℓ = Σ_t g_t ā_tᵀ for ``nn.Linear`` and ``nn.Conv1d``/``nn.Conv2d`` (ā = [a; 1], a the unfolded patch of a
convolution), M = W with ∇_M ℓ = Σ_t e_{x_t} g_tᵀ for ``nn.Embedding`` (one-hot inputs: a diagonal input factor).

Every other trained parameter (elementwise ones such as LayerNorm's, unregistered modules, layers the hooks
cannot follow, weights shared between modules, modules never called through their ``forward`` or not
batch-first) gets a diagonal block; :func:`plan_layers` says why for each.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from ..layers import Layer, plan


def plan_layers(model: nn.Module, names: Sequence[str]) -> tuple[list[Layer], dict[str, str]]:
    """(Kronecker-factored layers, {parameter name: why it gets a diagonal block}) for the trained ``names``."""
    layers, reasons = plan(model, names)
    owners: dict[int, list[str]] = {}
    for pname, param in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(param), []).append(pname)
    factored = []
    for layer in layers:
        if not layer.kronecker:
            reasons |= {n: f"{type(layer.module).__name__} has no Kronecker factors" for n in layer.params}
            continue
        if layer.weight is None:
            reasons[layer.bias] = "bias trained without its layer's weight"
            continue
        aliases = owners[id(layer.module.weight)]
        if len(aliases) > 1:
            reasons[layer.weight] = f"weight shared by several modules ({', '.join(aliases)})"
            if layer.bias is not None:
                reasons[layer.bias] = "bias trained without its layer's weight (shared by several modules)"
            continue
        if layer.bias is not None and len(owners[id(layer.module.bias)]) > 1:
            reasons[layer.bias] = f"bias shared by several modules ({', '.join(owners[id(layer.module.bias)])})"
            layer = layer.without({layer.bias})
        factored.append(layer)
    return factored, reasons
