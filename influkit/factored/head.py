"""A backward pass that starts below the model's output layer, on the output rows that carry a gradient.

A masked-LM's logits come out of one dense layer y_t = W a_t + b at every position, 30,522 classes wide, while its
loss labels about 15 % of the positions: the output-gradient u is zero on the rest. Autograd's backward of u through
that layer multiplies the whole (positions × classes) u by W regardless, and by the inputs a for a trained W — the
largest products of a small model's backward. Where the model's output *is* one registered dense layer's output
(:func:`find_head`), :func:`backward` does that layer's part on u's nonzero rows R only,

    ∂/∂a_t = Wᵀ u_t (t ∈ R, 0 elsewhere),   ∂/∂W = Σ_{t∈R} u_t a_tᵀ,   ∂/∂b = Σ_{t∈R} u_t,

and hands ∂/∂a to autograd for the rest of the graph (a weight tied to the input embeddings gets its other use
from there): the same gradients, the zero rows contributing nothing, at the labelled rows' share of the layer's
cost. The stationarity check's true-label backward uses it (:mod:`influkit.factored.fit`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..layers import Layer
from ..layers.dense import Dense


@dataclass(frozen=True)
class Head:
    """The output layer's call: its layer, the call's input a (with its graph) and the weight and bias it used."""

    layer: Layer
    inputs: torch.Tensor
    weight: torch.Tensor
    bias: torch.Tensor | None


class HeadRecorder:
    """Context manager: the (input, output) of each call of the candidate dense ``layers``, kept with their graph."""

    def __init__(self, layers: Sequence[Layer]):
        self.layers = [layer for layer in layers if isinstance(layer, Dense)]
        self.calls: list[tuple[Layer, torch.Tensor, torch.Tensor]] = []
        self._handles = []

    def __enter__(self) -> "HeadRecorder":
        for layer in self.layers:
            self._handles.append(layer.module.register_forward_hook(
                lambda module, args, output, layer=layer: self._record(layer, args, output)))
        return self

    def _record(self, layer: Layer, args, output) -> None:
        if args and torch.is_tensor(args[0]) and torch.is_tensor(output):
            self.calls.append((layer, args[0], output))

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def find_head(recorder: HeadRecorder, outputs: torch.Tensor, leaves: dict) -> Head | None:
    """The call whose output is the model's ``outputs`` itself, with the weight and bias it used (the trained ones
    from ``leaves``), or None: no such call, or its weight or bias computed by the graph rather than a leaf."""
    found = [(layer, inp) for layer, inp, out in recorder.calls if out is outputs]
    if len(found) != 1:
        return None
    layer, inp = found[0]
    module: nn.Module = layer.module
    weight = leaves[layer.weight] if layer.weight is not None else module.weight
    bias = leaves[layer.bias] if layer.bias is not None else getattr(module, "bias", None)
    if any(t is not None and t.grad_fn is not None for t in (weight, bias)):
        return None
    return Head(layer, inp, weight, bias)


def backward(outputs: torch.Tensor, u: torch.Tensor, targets: Sequence[torch.Tensor], head: Head,
             leaf_names: Sequence[str], leaves: dict) -> list[torch.Tensor | None]:
    """``torch.autograd.grad(outputs, [*targets, *leaves[leaf_names]], grad_outputs=u, allow_unused=True)`` with the
    head's part on u's nonzero rows only (module docstring); a target that is ``outputs`` itself gets u."""
    layer = head.layer
    rows = u.reshape(-1, u.shape[-1])
    keep = rows.ne(0).any(1).nonzero().squeeze(1)
    kept = rows[keep]
    flat = head.inputs.reshape(-1, head.inputs.shape[-1])
    matrix = layer.matrix(head.weight)  # (out, in)
    below = torch.zeros_like(flat)
    below[keep] = kept @ matrix.detach().to(kept.dtype)  # values: the backward below takes it from here
    inner = [t for t in targets if t is not outputs]
    wanted = [leaves[name] for name in leaf_names]
    grads = (torch.autograd.grad(head.inputs, inner + wanted, grad_outputs=below.reshape(head.inputs.shape),
                                 allow_unused=True)
             if (inner or wanted) and head.inputs.requires_grad else [None] * (len(inner) + len(wanted)))
    inner_grads, leaf_grads = list(grads[: len(inner)]), list(grads[len(inner):])
    own = {}
    if any(leaves[name] is head.weight for name in leaf_names):
        weight_grad = kept.T @ flat[keep].detach().to(kept.dtype)  # (out, in)
        own[id(head.weight)] = weight_grad.T if layer.inputs_first else weight_grad
    if head.bias is not None and any(leaves[name] is head.bias for name in leaf_names):
        own[id(head.bias)] = kept.sum(0)
    for i, leaf in enumerate(wanted):
        if id(leaf) in own:
            part = own[id(leaf)].reshape(leaf.shape).to(leaf.dtype)
            leaf_grads[i] = part if leaf_grads[i] is None else leaf_grads[i] + part
    inner_iter = iter(inner_grads)
    return [u if t is outputs else next(inner_iter) for t in targets] + leaf_grads
