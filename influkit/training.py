"""Training a stage to its optimum: full-batch L-BFGS (convex or small problems) and seeded mini-batch Adam.

Influence functions assume θ̂ minimizes the stage objective; these trainers update the model's trained
parameters in place and report how close to stationarity they got (‖∇L‖).
"""

from __future__ import annotations

import math

import torch
from tqdm.auto import tqdm

from .curvature import HessianOperator, gradient
from .errors import InputError
from .operators import DenseOperator
from .solvers import solve
from .stage import Stage


def fit_lbfgs(
    stage: Stage, *, max_iter: int = 500, tol: float = 1e-10, history: int = 50, restarts: int = 5
) -> float:
    """Minimize the stage objective over its trained parameters with full-batch L-BFGS; return ‖∇L‖ at the end.

    L-BFGS may stall on its change tolerance before ‖∇L‖ ≤ tol; it is then restarted (fresh curvature
    memory) up to ``restarts`` times.
    """
    named = dict(stage.model.named_parameters())
    params = [named[n] for n in stage.param_names]
    opt = torch.optim.LBFGS(
        params,
        lr=1.0,
        max_iter=max_iter,
        tolerance_grad=tol,
        tolerance_change=1e-14,
        history_size=history,
        line_search_fn="strong_wolfe",
    )

    def closure():
        opt.zero_grad()
        value = stage.objective({n: named[n] for n in stage.param_names})
        value.backward()
        return value

    norm = math.inf
    for _ in range(restarts + 1):
        opt.step(closure)
        norm = gradient_norm(stage)
        if norm <= tol:
            break
        opt.state.clear()
    return norm


def gradient_norm(stage: Stage) -> float:
    """‖∇L(θ)‖ over the trained parameters at their current values (0 at an exact optimum)."""
    g = gradient(stage, stage.param_names)
    return float(torch.sqrt(sum((v.detach() ** 2).sum() for v in g.values())))


def train_adam(
    stage: Stage,
    *,
    steps: int,
    lr: float = 1e-3,
    batch_size: int = 128,
    seed: int = 0,
    exclude: torch.Tensor | None = None,
    progress: bool = False,
) -> None:
    """``steps`` Adam steps on the stage objective with seeded mini-batches, in place.

    exclude: example indices left out; the remaining examples keep the order they would have had, so a
    leave-one-out run sees the same batches minus the removed example.
    """
    named = dict(stage.model.named_parameters())
    trained = {n: named[n] for n in stage.param_names}
    opt = torch.optim.Adam(trained.values(), lr=lr)
    gen = torch.Generator().manual_seed(seed)
    n = len(stage)
    keep = torch.ones(n, dtype=torch.bool)
    if exclude is not None:
        keep[torch.as_tensor(exclude)] = False
    order = torch.empty(0, dtype=torch.long)
    for _ in tqdm(range(steps), desc="adam", disable=not progress, leave=False):
        if order.numel() < batch_size:
            perm = torch.randperm(n, generator=gen)
            order = torch.cat([order, perm[keep[perm]]])
        idx, order = order[:batch_size], order[batch_size:]
        x, y = stage.data.take(idx)
        opt.zero_grad()
        loss = stage.losses(trained, x, y).mean()
        reg = stage.regularization(trained)
        (loss + (reg if reg is not None else 0.0)).backward()
        opt.step()


def newton_refine(stage: Stage, *, steps: int = 3, damping: float = 0.0) -> float:
    """Newton steps θ ← θ − (H + λI)⁻¹∇L with the dense Hessian (small p); return ‖∇L‖ at the end.

    Polishes an L-BFGS solution below the gradient norm that line searches on float64 loss values reach.
    """
    named = dict(stage.model.named_parameters())
    operator = HessianOperator(stage)
    for _ in range(steps):
        g = operator.space.flatten(gradient(stage, stage.param_names))
        step = solve(operator, g, "direct", damping=damping).x
        with torch.no_grad():
            for name, delta in operator.space.unflatten(step).items():
                named[name].sub_(delta)
    return gradient_norm(stage)


class HessianFactor(DenseOperator):
    """The dense H + μI of a stage objective with its Cholesky factor, for repeated Newton-type steps.

    An :class:`~influkit.operators.Operator` (``matvec`` applies H + μI); ``solve`` applies (H + μI)⁻¹.
    μ = ``damping``; if H + μI is not positive definite (a saddle region), μ is raised to 2|λ_min(H)| so that
    −(H + μI)⁻¹∇L is a descent direction (Levenberg's damping).
    """

    def __init__(self, stage: Stage, *, damping: float = 0.0):
        operator = HessianOperator(stage)
        self.space = operator.space
        self.names = list(stage.param_names)
        dense = operator.dense()
        eye = torch.eye(dense.shape[0], dtype=dense.dtype, device=dense.device)
        self.damping = damping
        if int(torch.linalg.cholesky_ex(dense + damping * eye)[1]) != 0:
            self.damping = 2 * abs(float(torch.linalg.eigvalsh(dense)[0])) + damping
        super().__init__(dense + self.damping * eye)
        self.factor(0.0)

    def solve(self, vec: torch.Tensor) -> torch.Tensor:
        """(H + μI)⁻¹ vec for vec of shape (p,) or (p, k)."""
        return self.factor(0.0).solve(vec.reshape(vec.shape[0], -1)).reshape(vec.shape)


def newton_fit(
    stage: Stage, *, factor: HessianFactor | None = None, tol: float = 1e-10, max_steps: int = 100
) -> float:
    """Minimize the stage objective by Newton steps θ ← θ − t·H(θ)⁻¹∇L(θ) with backtracking on t; return ‖∇L‖.

    H(θ)⁻¹∇L is solved by CG on Hessian-vector products preconditioned with ``factor`` H₀ (e.g. the Hessian
    at a nearby optimum, factorized once and reused across leave-out runs), so each step costs a few HVPs;
    when that CG fails, H₀ is refactored at θ (Levenberg-damped if indefinite) and its step is taken.
    Stops at ‖∇L‖ ≤ tol, or after three steps without a 10% decrease (the round-off floor of the gradient).
    """
    named = dict(stage.model.named_parameters())
    trained = {n: named[n] for n in stage.param_names}
    factor = factor or HessianFactor(stage)
    if factor.names != list(stage.param_names):
        raise InputError("the Hessian factor was built for other parameters than this stage trains.")
    best, stalls = math.inf, 0
    for _ in range(max_steps):
        g = factor.space.flatten(gradient(stage, stage.param_names))
        norm = float(g.norm())
        if norm <= tol:
            break
        stalls = stalls + 1 if norm > 0.9 * best else 0
        if stalls >= 3:
            break
        best = min(best, norm)
        newton = solve(HessianOperator(stage), g, "cg_spd", preconditioner=factor.solve, tol=1e-10,
                       max_iter=50, warn=False)
        if not newton.converged:  # H(θ) drifted from H₀ or is indefinite here: refactor at θ
            factor = HessianFactor(stage)
        step = factor.space.unflatten(newton.x if newton.converged else factor.solve(g))
        with torch.no_grad():
            start = float(stage.objective(trained))
            for t in 0.5 ** torch.arange(12):
                for name, delta in step.items():
                    named[name].sub_(t * delta)
                if float(stage.objective(trained)) <= start + 1e-13 * abs(start):
                    break
                for name, delta in step.items():
                    named[name].add_(t * delta)
    return gradient_norm(stage)


def train_to_stationarity(stage: Stage, *, max_iter: int = 1000, tol: float = 1e-10) -> float:
    """Minimize the stage objective in place — full-batch L-BFGS, then Newton steps — and return ‖∇L‖ at the end.

    A dense Newton factor at the L-BFGS end point: for stages of up to a few thousand parameters.
    """
    fit_lbfgs(stage, max_iter=max_iter, tol=10 * tol, restarts=0)
    return newton_fit(stage, tol=tol)
