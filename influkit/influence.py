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

from .chain import Chain, Measure
from .data import as_examples
from .errors import InputError
from .gradients import per_example_grads
from .results import InfluenceResult
from .scoring import Rows
from .fitted import CurvatureConfig
from .solvers import SolveConfig
from .stage import Stage, check_example_shape


def influence(
    stage: Stage,
    z=None,
    x_test=None,
    *,
    solve: SolveConfig | None = None,
    curvature: CurvatureConfig | str | None = None,
    params: str | Iterable[str] | None = None,
    measure: Measure | None = None,
    per_test: bool = False,
    chunk_size: int | None = None,
    progress: bool = True,
) -> InfluenceResult:
    """Influence I(z, T) = −∇f(T)ᵀ H⁻¹ ∇ℓ(z) of each training example z on the test loss: ``Chain([stage])``.

    z, x_test: (inputs, targets) tensors, or 1-D indices into the stage's data (z default None: every example;
    x_test required); both are checked before anything is fitted.
    solve: a :class:`~influkit.solvers.SolveConfig` (default ``SolveConfig()``: ``solver="auto"``, no damping; the
    choice and its reason are in ``diagnostics["solves"][0]["choice"]``).
    curvature: a :class:`~influkit.fitted.CurvatureConfig` (which matrix, ``hessian_samples``, how approximations are
    fitted; default ``CurvatureConfig()``: the exact Hessian on all the data), or its matrix's name as a string
    (``"gauss-newton"`` is ``CurvatureConfig("gauss-newton")``).
    params: names/prefixes of the parameters the Hessian is taken over (default: the stage's trained ones).
    measure: the test function per example, ``measure(outputs, targets) -> (B,)`` (default: the stage's loss);
    see :meth:`influkit.Chain.query`.
    per_test: return the (len(z), len(x_test)) matrix (one batched solve with len(x_test) right-hand sides).
    chunk_size: examples per scoring chunk (default: as many as the memory budget holds).
    progress: a bar on every phase longer than a few seconds (``False``: nothing printed).
    """
    if x_test is None:
        raise InputError("x_test is required: the test examples, (inputs, targets) or indices into the stage's data.")
    Rows.of(stage, z)  # z checked before the fit
    config = SolveConfig() if solve is None else solve
    chain = Chain([stage if params is None else stage.with_(params=params)], solve=config,
                  curvature=curvature or CurvatureConfig(), progress=progress)
    query = chain.query(x_test, measure=measure, per_test=per_test, chunk_size=chunk_size, progress=progress)
    return query.scores(z, chunk_size=chunk_size, progress=progress)


def self_influence(
    stage: Stage,
    z=None,
    *,
    solve: SolveConfig | None = None,
    curvature: CurvatureConfig | str | None = None,
    params: str | Iterable[str] | None = None,
    rhs_chunk: int = 256,
    chunk_size: int | None = None,
    progress: bool = True,
) -> InfluenceResult:
    """Self-influence I(z, z) = −∇ℓ(z)ᵀ H⁻¹ ∇ℓ(z) of each training example on its own loss.

    Negative for a positive definite H; removing z raises its own loss by −I(z, z)/n = ``removal``, large for
    examples the model fits only by memorizing them (outliers, mislabelled points). z defaults to all data.
    ``Chain([stage])``'s fitted solver (at a minimum ``auto`` factors H once) solves for ``rhs_chunk`` gradients at a
    time. solve, curvature, chunk_size: as in :func:`influence`.
    """
    config = SolveConfig() if solve is None else solve
    if rhs_chunk < 1:
        raise InputError(f"rhs_chunk must be ≥ 1, got {rhs_chunk}.")
    chain = Chain([stage if params is None else stage.with_(params=params)], solve=config,
                  curvature=curvature or CurvatureConfig(), progress=progress)
    plan = chain.plans[0]
    z = torch.arange(len(stage)) if z is None else z
    (zx, zy), z_ids = as_examples(z, plan.stage.data, "z")
    check_example_shape(plan.stage, zx, "z")
    chain.fit()
    solver = chain.solver(0, n_rhs=min(rhs_chunk, zx.shape[0]))
    start = time.perf_counter()
    chunking = {} if chunk_size is None else {"chunk_size": chunk_size}
    grads = per_example_grads(plan.stage, zx, zy, plan.trained, progress=progress, **chunking)
    seconds = {"fit": chain.fit_seconds, "example_gradients": time.perf_counter() - start, "solves": 0.0}
    values, summaries = [], []
    for s in range(0, grads.shape[0], rhs_chunk):
        block = grads[s : s + rhs_chunk]
        sol = solver.solve(block.T, progress=progress)
        values.append(-(block * sol.x.T).sum(dim=1))
        summaries.append({"stage": 0, "examples": [s, s + block.shape[0]], **sol.summary()})
        seconds["solves"] += sol.seconds
    return InfluenceResult(
        values=torch.cat(values),
        n_train=len(stage),
        index=z_ids,
        method="self-influence",
        diagnostics={"stages": [position.summary() for position in chain.positions], "solves": summaries,
                     "seconds": seconds,
                     "settings": config.summary() | {"curvature": chain.curvature_configs[0].summary()}},
    )
