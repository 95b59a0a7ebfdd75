"""The exact top curvature directions that complete a factored curvature in approximate unrolling.

A block-diagonal curvature misses the cross-layer top of a transformer's spectrum, so its pieces barely damp the
directions the run contracts fastest; the k largest eigenpairs (g_i, V_i) of each stage's Hessian (or Gauss-Newton
matrix) at its final parameters are put into every piece exactly: the curvature V diag(g) Vᵀ + (I − VVᵀ) C (I − VVᵀ).
"""

from __future__ import annotations

import importlib.util
import warnings

import torch

from ..curvature import HessianOperator
from ..extras import require
from ..memory import resolve as budget_of
from .run import StageRun

TOP_AUTO = 20
"""The most eigenpairs per stage ``top="auto"`` puts into the factored pieces."""
TOP_AUTO_PARAMETERS = 1_000_000
"""The most trained parameters of a stage for which ``top="auto"`` computes them: ARPACK needs 2k + 1 to 4k
products in float64, which cost several times the plain EK-FAC pieces and grow with the stage (the costs measured are
in ``benchmarks/results/bench_transformer/`` and ``studies/results/fidelity/``); above it pass ``top=k``."""


def top_count(top: int | str, p: int, itemsize: int, budget: int | None) -> tuple[int, str]:
    """(k, why): the number of top eigenpairs of a stage with p trained parameters. ``top`` itself when
    it is a number; for "auto" none when p > TOP_AUTO_PARAMETERS, else the largest k ≤ TOP_AUTO whose ARPACK
    workspace (ncv = max(2k + 1, 20) float64 vectors of p; none when k ≥ p − 1, which is dense: p² float64) plus the
    k kept vectors (``itemsize`` bytes per entry) fit in half of ``budget`` (bytes; None: the default budget), and 0
    where scipy is missing (with a warning naming the extra)."""
    if top != "auto":
        return int(top), "given"
    if p > TOP_AUTO_PARAMETERS:
        return 0, (f"auto: {p:,} trained parameters > TOP_AUTO_PARAMETERS ({TOP_AUTO_PARAMETERS:,}), where the "
                   "eigenpairs' products cost several times the pieces; pass top=k to have them")
    half = budget_of(budget) // 2

    def workspace(k: int) -> int:
        lanczos = p * p * 8 if k >= p - 1 else max(2 * k + 1, 20) * p * 8
        return lanczos + k * p * itemsize

    k = min(TOP_AUTO, p)
    while k and workspace(k) > half:
        k -= 1
    if not k:
        return 0, f"auto: one eigenpair's workspace ({workspace(1) / 2**30:.2f} GiB) is over half the budget left"
    if importlib.util.find_spec("scipy") is None:
        warnings.warn("approximate(top='auto') found no scipy, so its factored pieces have no exact top curvature "
                      "directions (top=0); pip install 'influkit[unrolled]' to add them.", stacklevel=4)
        return 0, "auto: scipy (ARPACK) is not installed"
    return k, "auto" if k == min(TOP_AUTO, p) else f"auto: as many as fit half the budget left ({half / 2**30:.2f} GiB)"


def top_directions(run: StageRun, theta_end: dict, k: int, dtype: torch.dtype, curvature: str = "hessian",
                    scale: float = 1.0) -> tuple[tuple[torch.Tensor, torch.Tensor], int]:
    """((g (k,), V (p, k)), products taken): the k largest (algebraic) eigenpairs of the stage objective's Hessian,
    or its Gauss-Newton matrix (``curvature``), at ``theta_end`` (the model holds the stage's inherited block), by
    ARPACK's Lanczos on its products, or densely when k ≥ p − 1 (either way through scipy: ``top_count`` takes none
    without it). A stage re-run at one weight c per example (``at=``) has c·H_data + ∇²(R + proximal) (the
    operator's ``data_weight``), times ``scale`` (a Trainer stage's, :func:`~.segments.linearized`)."""
    linalg = require("scipy.sparse.linalg", "approximate(..., top=k)")
    weight = scale * (1.0 if run.weights is None else float(run.weights[0]))
    operator = HessianOperator(run.stage, list(run.trained), at=theta_end, curvature=curvature,
                               extra=run.proximal(), data_weight=weight)
    p = operator.dim
    if k >= p - 1:
        dense = operator.matvec(torch.eye(p, dtype=operator.dtype, device=operator.device)).double()
        values, vectors = torch.linalg.eigh(0.5 * (dense + dense.T))
        return (values[-k:].to(dtype), vectors[:, -k:].to(dtype)), operator.products
    matvec = lambda x: operator.matvec(torch.as_tensor(x, dtype=operator.dtype, device=operator.device  # noqa: E731
                                               ).reshape(p, -1)).double().cpu().numpy().reshape(x.shape)
    values, vectors = linalg.eigsh(linalg.LinearOperator((p, p), matvec=matvec, dtype=float), k=k, which="LA")
    device = theta_end[next(iter(theta_end))].device
    return (torch.as_tensor(values, dtype=dtype, device=device),
            torch.as_tensor(vectors, dtype=dtype, device=device)), operator.products
