"""Closed forms for a final linear layer: per-example gradients and the explicit Hessian, from cached features.

For logits h_i = W a_i + b, with a_i the layer's input (the features) and δ_i = ∂ℓ_i/∂h_i, the gradient of
example i's loss is ∇_W ℓ_i = δ_i a_iᵀ and ∇_b ℓ_i = δ_i. Because the batch loss Σ_i ℓ_i is a sum,
its gradient with respect to the logits is exactly the stack of the δ_i: one backward pass gives them all
(Ren et al. 2020, §3.1). Rows are flattened in parameter order (weight row-major, then bias), the layout of
:class:`influkit.params.ParamSpace` over ``[head.weight, head.bias]``. Other layers: use
:func:`influkit.gradients.per_example_grads` (vmap).

Because h is linear in (W, b), the Hessian of Σ_i c_i ℓ_i over (W, b) is exactly Σ_i c_i J_iᵀ G_i J_i with
G_i = ∂²ℓ_i/∂h² (C×C) and J_i = I_C ⊗ [a_i; 1]ᵀ, i.e. Σ_i c_i G_i ⊗ ã_i ã_iᵀ with ã_i = [a_i; 1]: no
Hessian-vector products through the network are needed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..errors import InputError


def final_linear(model: nn.Module, name: str) -> nn.Linear:
    """Returns the ``nn.Linear`` submodule called ``name`` (a module prefix such as ``"2"`` or ``"fc"``)."""
    try:
        head = model.get_submodule(name.rstrip("."))
    except AttributeError as exc:
        raise InputError(f"{name!r} is not a submodule of {type(model).__name__}.") from exc
    if not isinstance(head, nn.Linear):
        raise InputError(f"{name!r} is a {type(head).__name__}; the closed form needs an nn.Linear final layer.")
    return head


def head_features(model: nn.Module, head: nn.Linear, inputs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (features a, outputs) of ``model`` on ``inputs``, with a the input of ``head``; no autograd graph.

    Raises :class:`InputError` unless ``head``'s output is the model's output (the closed form needs the loss
    to be a function of the head's logits only).
    """
    seen: dict[str, torch.Tensor] = {}

    def hook(module, args, output):
        seen["features"], seen["outputs"] = args[0], output

    handle = head.register_forward_hook(hook)
    try:
        with torch.no_grad():
            outputs = model(inputs)
    finally:
        handle.remove()
    if "outputs" not in seen or seen["outputs"] is not outputs:
        raise InputError(
            "the chosen layer is not the model's final layer (its output is not the model output); "
            "pass the name of the last nn.Linear, or use the vmap path (cache_features=False)."
        )
    return seen["features"], outputs


def output_gradients(loss: Callable, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Returns δ (B, C) with δ_i = ∂ℓ_i/∂outputs_i, from one backward pass of Σ_i loss(outputs, targets)_i."""
    logits = outputs.detach().requires_grad_(True)
    with torch.enable_grad():
        (delta,) = torch.autograd.grad(loss(logits, targets).sum(), logits)
    return delta


def linear_per_example_grads(features: torch.Tensor, deltas: torch.Tensor, bias: bool = True) -> torch.Tensor:
    """Returns (N, C·d [+ C]): row i is [vec(δ_i a_iᵀ), δ_i], the gradient of ℓ_i over (W, b) of a linear layer."""
    if features.shape[0] != deltas.shape[0]:
        raise InputError(f"{features.shape[0]} feature rows but {deltas.shape[0]} output-gradient rows.")
    weight = (deltas.unsqueeze(2) * features.unsqueeze(1)).reshape(features.shape[0], -1)
    return torch.cat([weight, deltas], dim=1) if bias else weight


def linear_grad_dot(
    features: torch.Tensor, deltas: torch.Tensor, weight_dir: torch.Tensor, bias_dir: torch.Tensor | None = None
) -> torch.Tensor:
    """Returns (N,) = ⟨∇_{(W,b)} ℓ_i, (S_W, s_b)⟩ = δ_iᵀ (S_W a_i + s_b) without forming the per-example gradients."""
    projected = features @ weight_dir.T
    if bias_dir is not None:
        projected = projected + bias_dir
    return (deltas * projected).sum(dim=1)


def logit_hessians(loss: Callable, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Returns G (B, C, C) with G_i = ∂²ℓ_i/∂h_i², the Hessian of each example's loss in its logits."""

    def single(h: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return loss(h.unsqueeze(0), t.unsqueeze(0)).squeeze(0)

    return torch.func.vmap(torch.func.hessian(single))(outputs.detach(), targets)


def linear_hessian(features: torch.Tensor, hessians: torch.Tensor, coef: torch.Tensor, bias: bool = True) -> torch.Tensor:
    """Returns the (p, p) Hessian Σ_i coef_i G_i ⊗ ã_i ã_iᵀ of Σ_i coef_i ℓ_i over (W, b), in [vec(W), b] order.

    features: a (N, d); hessians: G (N, C, C) from :func:`logit_hessians`; coef: (N,) example weights.
    """
    n, d = features.shape
    c = hessians.shape[1]
    tilde = torch.cat([features, torch.ones(n, 1, dtype=features.dtype, device=features.device)], 1) if bias else features
    k = tilde.shape[1]
    weighted = hessians * coef.reshape(n, 1, 1)
    full = torch.einsum("nij,nk,nl->ikjl", weighted, tilde, tilde).reshape(c * k, c * k)
    if not bias:
        return full
    index = torch.arange(c * k, device=features.device).reshape(c, k)
    order = torch.cat([index[:, :d].reshape(-1), index[:, d]])
    return full[order][:, order]


def last_layer_grads(
    model: nn.Module, head: str, loss: Callable, inputs: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    """Returns (N, p) per-example gradients of ``loss(model(inputs), targets)`` over the final linear layer ``head``.

    One forward pass (features and logits, no graph through the body) and one backward pass to the logits.
    """
    layer = final_linear(model, head)
    features, outputs = head_features(model, layer, inputs)
    deltas = output_gradients(loss, outputs, targets)
    return linear_per_example_grads(features, deltas, bias=layer.bias is not None)
