"""Hypergradient of the validation loss with respect to per-example weights of unlabeled data (Ren et al. 2020, eq. 6).

Training objective and validation loss (docs/conventions.md §1, means over each set):

    L(θ, Λ) = (1/|D|) Σ_{(x,y)∈D} ℓ_S(x, y; θ) + (1/|U|) Σ_{u∈U} λ_u ℓ_U(u; θ) + R(θ),
    L_S(V, θ) = (1/|V|) Σ_{(x,y)∈V} ℓ_S(x, y; θ).

At θ* = argmin_θ L, the implicit function theorem gives dθ*/dλ_u = −(1/|U|) H⁻¹ ∇_θ ℓ_U(u; θ*), so

    ∂L_S(V, θ*(Λ))/∂λ_u = −(1/|U|) ∇_θ L_S(V)ᵀ H⁻¹ ∇_θ ℓ_U(u),        H = ∇²_θ L(θ*, Λ).

Positive = up-weighting u raises the validation loss (a gradient step lowers λ_u). One solve s = H⁻¹ ∇L_S(V)
serves the whole unlabeled batch; the scores are then batched dot products −∇ℓ_U(u)ᵀ s / |U|.

H·v is the sum of the Hessian-vector products of two stages, the labeled one (mean of ℓ_S, plus R) and the
unlabeled one (mean of λ_u ℓ_U, with λ_u carried in the targets), so every influkit solver applies. The
paper's fast variant restricts θ to the final linear layer: its input features are computed once without a
graph, and its Hessian (formed explicitly, then inverted) and per-example gradients come in closed form
(:mod:`influkit.ssl.per_example`). The baselines
of the paper's Table A1 are ``SolveConfig(solver="identity")`` (Luketina et al.: H⁻¹ := I) and ``SolveConfig(solver="neumann", max_iter=K)``
(Lorraine et al.: H⁻¹ ≈ α Σ_{j<K} (I − αH)^j).

The result is an :class:`~influkit.results.InfluenceResult` over the unlabeled examples with
``values[u] = ∂L_S(V)/∂λ_u`` and ``n_train = |U|``. Its removal rule is the one that fits a weight: removing u
sets λ_u to 0, a change of −λ_u, so the first-order change of the validation loss is
``removal[u] = −λ_u · values[u]`` (``removal_eps`` holds −λ, one entry per example; an example whose weight is
already 0 has no effect to remove). :func:`hypergradient` is the one entry point (the former
``weight_hypergradient(...)`` is ``hypergradient(...).values``); Algorithm 1
(:func:`~influkit.ssl.trainer.train_ssl`) steps the weights along ``result.values``.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterable

import torch
from torch import nn

from ..curvature import HessianOperator, gradient
from ..operators import LazyDenseOperator, SumOperator
from ..params import ParamSpace, resolve_names
from ..errors import InputError
from ..gradients import project_per_example_grads
from ..results import InfluenceResult
from ..solvers import SolveConfig
from ..stage import Regularizer, Stage
from .losses import UnsupervisedLoss
from .per_example import (
    final_linear,
    head_features,
    linear_grad_dot,
    linear_hessian,
    linear_per_example_grads,
    logit_hessians,
    output_gradients,
)



def _weighted(loss: Callable) -> Callable:
    """Returns loss' with loss'(outputs, [λ | t]) = λ · loss(outputs, t): the weight rides in the targets' first column."""

    def weighted(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return targets[:, 0] * loss(outputs, targets[:, 1:])

    return weighted


def _times(outputs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    return outputs * weights


class _LossModule(nn.Module):
    """Wraps ``fn(model, x) -> (B,)`` as a module whose output is the per-example loss, so ``functional_call`` reaches it."""

    def __init__(self, model: nn.Module, fn: Callable):
        super().__init__()
        self.net = model
        self.fn = fn

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.fn(self.net, inputs)


def _check_inputs(labeled, unlabeled, val, weights) -> torch.Tensor:
    for name, pair in (("labeled", labeled), ("val", val)):
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and all(torch.is_tensor(t) for t in pair)):
            raise InputError(f"{name} must be an (inputs, targets) pair of tensors.")
        if pair[0].shape[0] != pair[1].shape[0] or pair[0].shape[0] == 0:
            raise InputError(
                f"{name} has {pair[0].shape[0]} inputs and {pair[1].shape[0]} targets; give the same, non-zero number."
            )
    if not torch.is_tensor(unlabeled) or unlabeled.dim() == 0 or unlabeled.shape[0] == 0:
        raise InputError("the unlabeled set is empty: give a tensor with at least one unlabeled example.")
    if unlabeled.shape[1:] != labeled[0].shape[1:]:
        raise InputError(
            f"unlabeled examples have shape {tuple(unlabeled.shape[1:])}, labeled ones {tuple(labeled[0].shape[1:])}."
        )
    weights = torch.as_tensor(weights)
    if weights.shape != (unlabeled.shape[0],):
        raise InputError(
            f"weights must have shape ({unlabeled.shape[0]},), one per unlabeled example; got {tuple(weights.shape)}."
        )
    if not torch.isfinite(weights).all() or (weights < 0).any():
        raise InputError("weights must be finite and ≥ 0 (a negative weight rewards the unsupervised loss).")
    return weights.detach()


def _functional_problem(model, sup_loss, unsup_loss, labeled, unlabeled, val, weights, names, regularizer):
    """(operator, ∇L_S(V), scores) over ``names`` by torch.func on the whole model."""
    sup = Stage(model, sup_loss, labeled, names, regularizer)
    val_stage = Stage(model, sup_loss, val, names)
    if isinstance(unsup_loss, UnsupervisedLoss):
        inputs, t = unsup_loss.prepare(model, unlabeled)
        unsup_model, unsup_names, loss = model, list(names), _weighted(unsup_loss.on_outputs)

        def targets(w):
            return torch.cat([w.to(t.dtype).unsqueeze(1), t], dim=1)

    else:
        inputs, unsup_model, loss = unlabeled, _LossModule(model, unsup_loss), _times
        unsup_names = ["net." + n for n in names]

        def targets(w):
            return w.to(unlabeled.dtype)

    unsup = Stage(unsup_model, loss, (inputs, targets(weights)), unsup_names)
    sup_hessian = HessianOperator(sup, names)
    operator = SumOperator([sup_hessian, HessianOperator(unsup, unsup_names)])
    g_val = sup_hessian.space.flatten(gradient(val_stage, names))
    ones = torch.ones_like(weights)

    def scores(s: torch.Tensor) -> torch.Tensor:
        return project_per_example_grads(unsup, inputs, targets(ones), s, unsup_names).reshape(-1)

    return operator, g_val, scores


def _cached_problem(model, head_name, sup_loss, unsup_loss, labeled, unlabeled, val, weights, regularizer):
    """(operator, ∇L_S(V), scores) over the final linear layer, with its input features computed once.

    The Hessian is formed explicitly in closed form (:func:`~influkit.ssl.per_example.linear_hessian`); the
    layer's problem is small, so it is solved in float64 whatever the model's precision.
    """
    layer = final_linear(model, head_name)
    prefix = head_name.rstrip(".") + "."
    inputs, t = unsup_loss.prepare(model, unlabeled)
    feats_l, feats_v, feats_u = (head_features(model, layer, x)[0].double() for x in (labeled[0], val[0], inputs))
    head = copy.deepcopy(layer).to(torch.float64)
    with torch.no_grad():
        out_l, out_v, out_u = head(feats_l), head(feats_v), head(feats_u)
    t, weights = t.double(), weights.double()
    has_bias = head.bias is not None
    space = ParamSpace({n: p.detach() for n, p in head.named_parameters()})
    n_l, n_u = feats_l.shape[0], feats_u.shape[0]

    def build() -> torch.Tensor:
        hessian = linear_hessian(
            feats_l, logit_hessians(sup_loss, out_l, labeled[1]), torch.full((n_l,), 1.0 / n_l, dtype=torch.float64),
            has_bias,
        ) + linear_hessian(feats_u, logit_hessians(unsup_loss.on_outputs, out_u, t), weights / n_u, has_bias)
        if regularizer is not None:
            flat = space.flatten({n: p.detach() for n, p in head.named_parameters()})
            hessian = hessian + torch.func.hessian(
                lambda v: regularizer({prefix + k: x for k, x in space.unflatten(v).items()})
            )(flat)
        return hessian

    operator = LazyDenseOperator(space.dim, build, space.dtype, space.device)
    g_val = linear_per_example_grads(feats_v, output_gradients(sup_loss, out_v, val[1]), bias=has_bias).mean(0)
    deltas_u = output_gradients(unsup_loss.on_outputs, out_u, t)

    def scores(s: torch.Tensor) -> torch.Tensor:
        parts = space.unflatten(s)
        return linear_grad_dot(feats_u, deltas_u, parts["weight"], parts.get("bias"))

    return operator, g_val, scores


def _is_final_linear_block(model: nn.Module, params, names: list[str]) -> bool:
    if not isinstance(params, str):
        return False
    try:
        head = model.get_submodule(params.rstrip("."))
    except AttributeError:
        return False
    prefix = params.rstrip(".") + "."
    return isinstance(head, nn.Linear) and names == [prefix + n for n, _ in head.named_parameters()]


def hypergradient(
    model: nn.Module,
    sup_loss: Callable,
    unsup_loss: Callable,
    labeled: tuple[torch.Tensor, torch.Tensor],
    unlabeled: torch.Tensor,
    val: tuple[torch.Tensor, torch.Tensor],
    weights: torch.Tensor,
    *,
    index: torch.Tensor | None = None,
    params: str | Iterable[str] | None = None,
    regularizer: Regularizer | None = None,
    solve: SolveConfig | None = None,
    cache_features: bool | None = None,
) -> InfluenceResult:
    """Returns an InfluenceResult with values[u] = ∂L_S(V, θ*(Λ))/∂λ_u = −(1/|U|) ∇_θL_S(V)ᵀ H⁻¹ ∇_θℓ_U(u).

    H = ∇²_θ L(θ*, Λ), L = mean_D ℓ_S + (1/|U|) Σ_u λ_u ℓ_U(u) + R; positive values mean up-weighting u raises
    the validation loss. ``n_train = |U|`` and ``removal = −λ_u · values`` (``removal_eps = −weights``): the
    first-order change of L_S(V) when u is removed, i.e. its weight set to 0. ``diagnostics`` holds the one
    solve (``"stage": 0``, with the reason of an ``auto`` choice), the seconds of each phase and the settings
    (``solver``: the method that ran, damping, cached_features, ...).

    model: in eval mode, at (approximately) θ*. sup_loss(outputs, targets) -> (B,).
    unsup_loss(model, inputs) -> (B,) with its pseudo-labels detached; an influkit.ssl
    :class:`~influkit.ssl.losses.UnsupervisedLoss` has its targets and augmentation drawn once, a plain callable
    must be deterministic (it is re-evaluated for every Hessian-vector product).
    labeled, val: (inputs, targets); unlabeled: inputs; weights: (len(unlabeled),) current λ ≥ 0.
    index: the ids of the unlabeled rows in a larger unlabeled set (default 0..len(unlabeled)−1).
    params: names/prefixes of θ (default: all parameters requiring grad), e.g. the final layer "fc".
    regularizer: R(dict of the θ tensors) -> scalar.
    solve: a :class:`~influkit.solvers.SolveConfig` (default ``SolveConfig()``: ``auto``, which factors the
    last layer's small Hessian exactly, as the paper does); ``SolveConfig(solver="neumann", max_iter=K, step=α)`` is
    Lorraine et al.'s baseline (a K-term Neumann series),
    ``SolveConfig(solver="identity")`` is Luketina et al.'s (H⁻¹ := I).
    cache_features: compute the final linear layer's input features once (the paper's fast variant); default:
    whenever ``params`` names the final nn.Linear layer and ``unsup_loss`` is an UnsupervisedLoss.
    """
    start = time.perf_counter()
    config = SolveConfig() if solve is None else solve
    if not callable(unsup_loss):
        raise InputError("unsup_loss must be callable as unsup_loss(model, inputs) -> (B,) per-example losses.")
    weights = _check_inputs(labeled, unlabeled, val, weights)
    if index is not None and torch.as_tensor(index).shape != (unlabeled.shape[0],):
        raise InputError(
            f"index must hold one id per unlabeled example, shape ({unlabeled.shape[0]},); "
            f"got {tuple(torch.as_tensor(index).shape)}."
        )
    names = resolve_names(model, params)
    eligible = isinstance(unsup_loss, UnsupervisedLoss) and _is_final_linear_block(model, params, names)
    if cache_features and not eligible:
        raise InputError(
            "cache_features=True needs params= the name of the final nn.Linear layer (e.g. 'fc') and an "
            "influkit.ssl UnsupervisedLoss (PseudoLabel, Consistency) so its targets can be prepared once."
        )
    cached = eligible if cache_features is None else bool(cache_features)
    if cached:
        operator, g_val, scores = _cached_problem(
            model, params, sup_loss, unsup_loss, labeled, unlabeled, val, weights, regularizer
        )
    else:
        operator, g_val, scores = _functional_problem(
            model, sup_loss, unsup_loss, labeled, unlabeled, val, weights, names, regularizer
        )
    setup = time.perf_counter() - start
    solution = config.solve(operator, g_val)
    settings = {
        "solver": solution.solver, "damping": float(config.damping), "cached_features": cached, "params": names,
        "n_labeled": labeled[0].shape[0], "n_val": val[0].shape[0],
    }
    settings |= {"tol": config.tol, "max_iter": config.max_iter, "step": config.step}
    start_scores = time.perf_counter()
    values = -scores(solution.x) / unlabeled.shape[0]
    return InfluenceResult(
        values=values.detach().to(unlabeled.dtype),
        n_train=unlabeled.shape[0],
        index=index,
        method="ssl weight hypergradient",
        diagnostics={
            "solves": [{"stage": 0, **solution.summary()}],
            "seconds": {"setup": setup, "solve": solution.seconds, "scores": time.perf_counter() - start_scores},
            "settings": settings,
        },
        removal_eps=-weights,
    )
