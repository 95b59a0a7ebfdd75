"""Ground truth for checking curvature: the explicit Hessian of a stage objective, ``jacfwd`` of ``grad``.

influkit never needs this matrix itself — ``HessianOperator`` applies H through Hessian-vector products and
``HessianOperator.dense`` assembles it from them. This is the *independent* reference those are checked
against in the tests and benchmarks: forward-over-reverse differentiation of the whole objective as one
function of the flattened parameters, sharing no code with the product path.

Not ``torch.func.hessian``: in torch 2.13 it is ``jacfwd(jacrev(f))``, and its inner ``jacrev`` of a scalar
function differentiates ``layer_norm`` wrongly when the normalized input depends on the parameters (a
Linear → LayerNorm → Linear network gets an asymmetric Hessian, off by O(0.1)). ``jacfwd(grad(f))`` agrees
with double-backward products and with central differences of the gradient; the tests check it on exactly
that network.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from ..errors import InputError
from ..params import ParamSpace, point
from ..stage import Stage


def _penalty(stage: Stage, space: ParamSpace, extra) -> Callable[[torch.Tensor], torch.Tensor]:
    """v ↦ R(v) + extra(v) on flattened parameters (0 when the stage has neither)."""

    def penalty(v: torch.Tensor) -> torch.Tensor:
        params = space.unflatten(v)
        reg = stage.regularization(params)
        value = (v * 0).sum() if reg is None else reg
        return value + extra(params) if extra is not None else value

    return penalty


def explicit_hessian(
    stage: Stage,
    names: Sequence[str] | None = None,
    *,
    indices: torch.Tensor | None = None,
    extra: Callable[[Mapping[str, torch.Tensor]], torch.Tensor] | None = None,
    chunk_size: int | None = 128,
) -> torch.Tensor:
    """(p, p): the dense Hessian of the stage objective over ``names``, by ``jacfwd(grad(objective))``.

    H = ∇²_θ [(1/s) Σ_{i∈S} ℓ(x_i; θ) + R(θ) + extra(θ)], θ the parameters ``names`` (default: the trained ones)
    flattened in :class:`~influkit.params.ParamSpace` order, every other parameter fixed at its current value;
    S = ``indices`` (default: all s = n examples). ``extra`` takes the dict of ``names`` (e.g. a proximal term).

    chunk_size: examples per ``jacfwd`` call (None: all of S at once). Each call pushes p tangents
    through the model together, so memory grows like p × chunk_size activations. Costs O(p) gradient
    evaluations and O(p²) memory — small models only.
    """
    names = list(stage.param_names if names is None else names)
    space = ParamSpace(point(stage.state(), names))
    flat = space.flatten(point(stage.state(), names)).detach()
    idx = torch.arange(len(stage)) if indices is None else torch.as_tensor(indices, dtype=torch.long).reshape(-1)
    if idx.numel() == 0:
        raise InputError("the Hessian over no examples is undefined: pass indices=None or a non-empty index set.")
    if chunk_size is not None and chunk_size <= 0:
        raise InputError(f"chunk_size must be positive, got {chunk_size}.")
    chunk = idx.numel() if chunk_size is None else chunk_size
    scale = 1.0 / idx.numel()

    def data_part(v: torch.Tensor, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return stage.losses(space.unflatten(v), inputs, targets).sum() * scale

    h = torch.func.jacfwd(torch.func.grad(_penalty(stage, space, extra)))(flat)
    for start in range(0, idx.numel(), chunk):
        inputs, targets = stage.data.take(idx[start : start + chunk])
        h = h + torch.func.jacfwd(torch.func.grad(data_part))(flat, inputs.to(flat.device), targets.to(flat.device))
    return h


def explicit_gauss_newton(
    stage: Stage,
    names: Sequence[str] | None = None,
    *,
    indices: torch.Tensor | None = None,
    extra: Callable[[Mapping[str, torch.Tensor]], torch.Tensor] | None = None,
) -> torch.Tensor:
    """(p, p): the generalized Gauss-Newton matrix of the stage objective over ``names``, explicitly.

    G = (1/s) Σ_{i∈S} J_iᵀ ∇²_f ℓ(f_i, y_i) J_i + ∇²[R + extra], with J_i = ∂f(x_i; θ)/∂θ the Jacobian of the
    model's outputs (``jacrev``) and ∇²_f ℓ the Hessian of the loss in the outputs (``jacfwd`` of ``grad``),
    assembled example by example; shares no code with ``HessianOperator(curvature="gauss-newton")``.
    """
    names = list(stage.param_names if names is None else names)
    space = ParamSpace(point(stage.state(), names))
    flat = space.flatten(point(stage.state(), names)).detach()
    idx = torch.arange(len(stage)) if indices is None else torch.as_tensor(indices, dtype=torch.long).reshape(-1)
    if idx.numel() == 0:
        raise InputError("the Gauss-Newton matrix over no examples is undefined: pass indices=None or a non-empty index set.")

    g = torch.func.jacfwd(torch.func.grad(_penalty(stage, space, extra)))(flat)
    for i in idx.tolist():
        inputs, targets = stage.data.take(torch.tensor([i]))
        inputs, targets = inputs.to(flat.device), targets.to(flat.device)
        outputs = stage.outputs(space.unflatten(flat), inputs).detach()
        jac = torch.func.jacrev(lambda v: stage.outputs(space.unflatten(v), inputs).reshape(-1))(flat)  # (d, p)
        curv = torch.func.jacfwd(torch.func.grad(lambda o: stage.loss(o.reshape(outputs.shape), targets).sum()))(
            outputs.reshape(-1))  # (d, d)
        g = g + jac.T @ curv @ jac / idx.numel()
    return g


def explicit_measure_grads(
    stage: Stage,
    measure: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    inputs: torch.Tensor,
    targets: torch.Tensor,
    names: Sequence[str] | None = None,
) -> torch.Tensor:
    """(T, p): row t is ∇_θ m(model(x_t; θ), y_t), the gradient of the measure of test example t over ``names``.

    One ``jacrev`` of the vector of T measures as a function of the flattened parameters (every other parameter
    fixed): shares no code with influkit's per-example gradients, which ``Chain.query(measure=...)`` uses.
    """
    names = list(stage.param_names if names is None else names)
    space = ParamSpace(point(stage.state(), names))
    flat = space.flatten(point(stage.state(), names)).detach()
    return torch.func.jacrev(lambda v: measure(stage.outputs(space.unflatten(v), inputs), targets))(flat)
