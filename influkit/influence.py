"""Single-stage influence functions (Koh & Liang 2017).

For a stage with objective L(θ) = (1/n) Σ_i ℓ(z_i; θ) + R(θ) minimized at θ̂, up-weighting z by ε moves
θ̂ by −H⁻¹∇ℓ(z)·ε, so the influence on the summed test loss f(T) = Σ_t ℓ(x_t) is

    I(z, T) = −∇f(T)ᵀ H⁻¹ ∇ℓ(z)        (positive = up-weighting z raises the test loss: harmful)

and removing z (ε = −1/n) changes the test loss by −I(z, T)/n. One solve s = H⁻¹∇f(T) serves every z;
the scores are then the batched dot products −∇ℓ(z)ᵀ s.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch

from .curvature import HessianOperator
from .data import as_examples
from .errors import InputError
from .gradients import per_example_grads, project_per_example_grads, total_grad
from .results import InfluenceResult
from .solvers import DenseOperator, solve
from .stage import Stage


def check_example_shape(stage: Stage, inputs: torch.Tensor, name: str) -> None:
    """Raise :class:`InputError` if ``inputs`` rows do not have the shape of the stage's data rows."""
    expected = stage.data.take(torch.arange(1))[0].shape[1:]
    if inputs.shape[1:] != expected:
        raise InputError(
            f"{name} has examples of shape {tuple(inputs.shape[1:])}, the stage's data has {tuple(expected)}; "
            "pass (inputs, targets) with one row per example, or indices into the stage's data."
        )


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
    """Influence I(z, T) = −∇f(T)ᵀ H⁻¹ ∇ℓ(z) of each training example z on the test loss.

    z, x_test: (inputs, targets) tensors, or 1-D indices into the stage's data.
    params: names/prefixes of the parameters the Hessian is taken over (default: the stage's trained ones).
    solver, damping, tol, max_iter: see :func:`influkit.solvers.solve`. The default ``minres`` converges
    with κ(H), needs one HVP per step and tolerates indefinite H; ``benchmarks/bench_core.py`` measured
    ``cg`` (on H²) 2–4× slower and failing at κ ≈ 1e5, and ``direct`` fastest for p ≲ 3,000 with large κ.
    hessian_samples: estimate H on a seeded random sample of this many training examples.
    per_test: return the (len(z), len(x_test)) matrix (one batched solve with len(x_test) right-hand sides).
    """
    names = stage.select(params)
    (zx, zy), z_ids = as_examples(z, stage.data, "z")
    (tx, ty), _ = as_examples(x_test, stage.data, "x_test")
    check_example_shape(stage, zx, "z")
    check_example_shape(stage, tx, "x_test")
    timings = {}

    start = time.perf_counter()
    if per_test:
        rhs = per_example_grads(stage, tx, ty, names, chunk_size=chunk_size).T
    else:
        rhs = total_grad(stage, tx, ty, names)
    timings["test_gradient"] = time.perf_counter() - start

    operator = HessianOperator(stage, names, samples=hessian_samples, seed=seed)
    sol = solve(operator, rhs, solver, damping=damping, tol=tol, max_iter=max_iter, progress=progress)

    start = time.perf_counter()
    values = -project_per_example_grads(stage, zx, zy, sol.x, names, chunk_size=chunk_size, progress=progress)
    timings["train_gradients"] = time.perf_counter() - start
    timings["solve"] = sol.seconds
    return InfluenceResult(
        values=values if per_test else values.reshape(-1),
        n_train=len(stage),
        index=z_ids,
        method="single-stage",
        diagnostics={"solve": sol.summary(), "seconds": timings, "hessian_samples": hessian_samples},
    )


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
    operator = HessianOperator(stage, names, samples=hessian_samples, seed=seed)
    if solver == "direct":
        operator = DenseOperator(operator.dense())
        rhs_chunk = grads.shape[0]
    values, summaries = [], []
    for s in range(0, grads.shape[0], rhs_chunk):
        block = grads[s : s + rhs_chunk]
        sol = solve(operator, block.T, solver, damping=damping, tol=tol, max_iter=max_iter)
        values.append(-(block * sol.x.T).sum(dim=1))
        summaries.append(sol.summary())
    return InfluenceResult(
        values=torch.cat(values),
        n_train=len(stage),
        index=z_ids,
        method="self-influence",
        diagnostics={"solves": summaries},
    )
