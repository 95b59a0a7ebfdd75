"""What a factored fit's data pass measures of the objective's gradient for the stationarity check.

:class:`ObjectiveGradient` is the result (‖∇L‖ and the RMS per-example loss-gradient norm over every example the fit
averages over); ``GradientSums`` the running sums the statistics pass adds each batch to, from the hooked layers'
inputs and true-label output-gradients and the diagonal-block parameters' per-example rows
(:mod:`influkit.stationarity` reads it as ``curvature.gradient``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..layers import Layer


@dataclass(frozen=True)
class ObjectiveGradient:
    """What a factored fit's data pass measured of the objective's gradient at the fitted point, with the true labels
    (:func:`fit_curvature` with ``gradient=True``): ``norm`` ‖∇L‖ = ‖(1/n) Σ_i ∇ℓ_i + ∇(R + extra)‖ and ``typical``
    g = ((1/n) Σ_i ‖∇ℓ_i‖²)^½ over the n = ``examples`` examples the fit averages over (every one, no sample), and
    ``seconds``, what forming them added to the pass: from each hooked layer's recorded inputs a and output-gradients
    g, the batch's gradient (one product over all its tokens) and the per-example squared norms
    (:meth:`influkit.layers.Layer.example_norms`: for a dense layer Σ_{t,t'} (ā_t·ā_t')(g_t·g_t'), no per-example
    rows), the diagonal-block parameters' per-example gradients (hooked too where one registered layer owns them
    alone — a LayerNorm, a bias without its weight —, else by per-example backward passes), and, when the
    pseudo-gradients are not the true-label ones (``fisher`` "sampled" or "exact"), one more backward of the true-label
    output-gradients through the pass's graph (no forward). A decoder weight tied to the word embeddings gets its
    per-example norms from both layers' hooks (:meth:`add_tied`). A diagonal-block parameter whose per-example
    gradient no hook gives (a module outside the layer registry) adds its batch
    gradient Σ_i ∇ℓ_i to ``norm`` from that same backward (the empirical Fisher's fit forms its rows anyway: then
    exact), and is named in ``unmeasured``: ``typical`` is then (1/n) Σ_i ‖∇ℓ_i‖² over the other parameters only,
    and the check completes it from a sample's rows (:mod:`influkit.stationarity`)."""

    norm: float
    typical: float
    examples: int
    seconds: float
    unmeasured: tuple[str, ...] = ()  # parameters in ``norm`` whose per-example squared norms ``typical`` leaves out


class GradientSums:
    """Running sums of the true-label per-example loss gradients: Σ_i ∇ℓ_i per parameter (float64), Σ_i ‖∇ℓ_i‖²."""

    def __init__(self):
        self.total: dict[str, torch.Tensor] = {}
        self.squares = 0.0
        self.seconds = 0.0
        self.unmeasured: set[str] = set()  # parameters summed without their per-example squared norms

    def add(self, names, rows) -> None:
        """Add one batch: ``rows`` (B, numel) per parameter of ``names``, the examples' gradients of it."""
        for name, part in zip(names, rows):
            self._sum(name, part.sum(0, dtype=torch.float64))
            self.squares += float(part.pow(2).sum(dtype=torch.float64))

    def add_tied(self, embedding: Layer, ids: torch.Tensor, g: torch.Tensor, decoder: Layer, a: torch.Tensor,
                 u: torch.Tensor) -> None:
        """Add one batch's Σ_i ‖∇ℓ_i‖² over a weight shared by an embedding and a decoder and the decoder's bias
        (:meth:`influkit.layers.Embedding.tied_example_norms`); their batch gradient comes from :meth:`add_summed`."""
        self.squares += float(embedding.tied_example_norms(ids, g, decoder, a, u).sum())

    def add_summed(self, gradients: dict, normed=()) -> None:
        """Add one batch's gradient Σ_i ∇ℓ_i of each parameter, without the per-example squared norms (``normed``:
        those whose squares :meth:`add_tied` adds)."""
        for name, summed in gradients.items():
            if name in self.total:
                self.total[name].add_(summed.reshape(-1))  # into the float64 sum in place: no float64 copy per batch
            else:
                self.total[name] = summed.reshape(-1).to(torch.float64)
            if name not in normed:
                self.unmeasured.add(name)

    def add_layer(self, layer: Layer, a: torch.Tensor, g: torch.Tensor) -> None:
        """Add one batch of a hooked layer from its inputs a and true-label output-gradients g: the batch's gradient
        Σ_i ∇ℓ_i is the per-example gradient of all its tokens as one example (one product, no per-example rows),
        Σ_i ‖∇ℓ_i‖² is :meth:`~influkit.layers.Layer.example_norms`'."""
        merged = layer.example_gradients(a.reshape(1, -1, *a.shape[2:]), g.reshape(1, -1, *g.shape[2:]))
        for name, part in zip(layer.params, merged):
            self._sum(name, part[0].to(torch.float64))
        self.squares += float(layer.example_norms(a, g).sum())

    def _sum(self, name: str, summed: torch.Tensor) -> None:
        self.total[name] = self.total[name] + summed if name in self.total else summed
