"""Single-stage influence functions (Koh & Liang 2017).

For a stage with objective L(θ) = (1/n) Σ_i ℓ(z_i; θ) + R(θ) minimized at θ̂, up-weighting z by ε moves
θ̂ by −H⁻¹∇ℓ(z)·ε, so the influence on the summed test loss f(T) = Σ_t ℓ(x_t) is

    I(z, T) = −∇f(T)ᵀ H⁻¹ ∇ℓ(z)        (positive = up-weighting z raises the test loss: harmful)

and removing z (ε = −1/n) changes the test loss by −I(z, T)/n. One solve s = H⁻¹∇f(T) serves every z;
the scores are then the batched dot products −∇ℓ(z)ᵀ s.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from .chain import Chain
from .curvature import HessianOperator
from .data import as_examples
from .gradients import per_example_grads
from .results import InfluenceResult
from .solvers import SolveConfig
from .stage import Stage, check_example_shape


def influence(
    stage: Stage,
    z,
    x_test,
    *,
    params: str | Iterable[str] | None = None,
    solver: str = "minres",
    damping: float = 0.0,
    hessian_samples: int | None = None,
    per_test: bool = False,
    tol: float | None = None,
    max_iter: int | None = None,
    chunk_size: int = 128,
    seed: int = 0,
    progress: bool = True,
) -> InfluenceResult:
    """Influence I(z, T) = −∇f(T)ᵀ H⁻¹ ∇ℓ(z) of each training example z on the test loss: ``Chain([stage])``.

    z, x_test: (inputs, targets) tensors, or 1-D indices into the stage's data.
    params: names/prefixes of the parameters the Hessian is taken over (default: the stage's trained ones).
    solver, damping, tol, max_iter, hessian_samples, seed: a :class:`~influkit.solvers.SolveConfig`. The default
    ``minres`` converges with κ(H), needs one HVP per step and tolerates indefinite H;
    ``benchmarks/bench_core.py`` measured ``cg`` (on H²) 2–4× slower and failing at κ ≈ 1e5.
    per_test: return the (len(z), len(x_test)) matrix (one batched solve with len(x_test) right-hand sides).
    """
    config = SolveConfig(solver=solver, damping=damping, tol=tol, max_iter=max_iter,
                         hessian_samples=hessian_samples, seed=seed)
    chain = Chain([stage if params is None else stage.with_(params=params)], solve=config)
    query = chain.query(x_test, per_test=per_test, chunk_size=chunk_size, progress=progress)
    return query.scores(z, chunk_size=chunk_size, progress=progress)


def self_influence(
    stage: Stage,
    z=None,
    *,
    params: str | Iterable[str] | None = None,
    solver: str = "direct",
    damping: float = 0.0,
    hessian_samples: int | None = None,
    rhs_chunk: int = 256,
    tol: float | None = None,
    max_iter: int | None = None,
    chunk_size: int = 128,
    seed: int = 0,
    progress: bool = True,
) -> InfluenceResult:
    """Self-influence I(z, z) = −∇ℓ(z)ᵀ H⁻¹ ∇ℓ(z) of each training example on its own loss.

    Negative for a positive definite H; removing z raises its own loss by −I(z, z)/n = ``removal``, large for
    examples the model fits only by memorizing them (outliers, mislabelled points). z defaults to all data.
    ``direct`` factors H once; iterative solvers take ``rhs_chunk`` right-hand sides per batched solve.
    """
    names = stage.select(params)
    z = torch.arange(len(stage)) if z is None else z
    (zx, zy), z_ids = as_examples(z, stage.data, "z")
    check_example_shape(stage, zx, "z")
    grads = per_example_grads(stage, zx, zy, names, chunk_size=chunk_size, progress=progress)
    config = SolveConfig(solver=solver, damping=damping, tol=tol, max_iter=max_iter,
                         hessian_samples=hessian_samples, seed=seed)
    operator = HessianOperator(stage, names, samples=hessian_samples, seed=seed)
    if config.method(operator.dim)[0] == "direct":  # one factorization serves every right-hand side at once
        rhs_chunk = grads.shape[0]
    values, summaries = [], []
    for s in range(0, grads.shape[0], rhs_chunk):
        block = grads[s : s + rhs_chunk]
        sol = config.solve(operator, block.T)
        values.append(-(block * sol.x.T).sum(dim=1))
        summaries.append({"stage": 0, "examples": [s, s + block.shape[0]], **sol.summary()})
    return InfluenceResult(
        values=torch.cat(values),
        n_train=len(stage),
        index=z_ids,
        method="self-influence",
        diagnostics={"solves": summaries, "settings": config.summary()},
    )
