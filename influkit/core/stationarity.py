"""Where a trained stage stands: its relative gradient norm, its extreme Hessian eigenvalues, and a verdict.

Influence functions differentiate the optimality condition ∇L(θ̂) = 0 and invert H = ∇²L(θ̂); they hold at a
minimum (∇L = 0, H ≻ 0). Models trained with Adam for a few epochs are rarely there. :func:`assess` measures it:

- ``gradient_norm`` r = ‖∇L(θ̂)‖ / g, where ∇L is the gradient of the whole objective (mean loss + regularizer
  + proximal term) and g = (mean_{i∈S} ‖∇ℓ_i(θ̂)‖²)^½ is the RMS of the per-example *loss* gradient norms over a
  seeded sample S of min(n, ``SAMPLE``) examples — "typical": the size of one example's pull, which the influence
  of one example is measured against.
- ``min_eigenvalue`` θ_min, ``max_eigenvalue`` θ_max: the extreme Ritz values of H after m = min(p, ``STEPS``)
  Lanczos steps (a :class:`~influkit.chain.Chain` asks ``FEW_STEPS`` for a stage solved by K-FAC/EK-FAC: one
  Hessian-vector product costs about three gradient passes, and 20 of them more than that solve's whole fit, two
  data passes and the eigendecompositions; fewer steps bound the spectrum less tightly, never wrongly) (three-term recurrence from a seeded start, O(p) memory, m Hessian-vector products). They bound
  the spectrum from inside, λ_min ≤ θ_min ≤ θ_max ≤ λ_max: a negative θ_min *certifies* negative curvature, a
  small |θ_min| certifies a near-null direction, a positive θ_min does not certify H ≻ 0 (curvature Lanczos did
  not reach in m steps is not seen).

Verdict, with ε = √(machine epsilon of H's dtype) (1.5e-8 in float64, 3.5e-4 in float32: a float32
Hessian-vector product carries a relative error well above float32's epsilon) and s = max(|θ_min|, |θ_max|):

| verdict            | when                                                     |
|--------------------|----------------------------------------------------------|
| ``non-stationary`` | r > ``GRADIENT_TOL`` (1e-3)                              |
| ``saddle``         | r ≤ ``GRADIENT_TOL`` and θ_min < −ε·s                    |
| ``singular``       | r ≤ ``GRADIENT_TOL`` and |θ_min| ≤ ε·s (or H = 0)        |
| ``minimum``        | r ≤ ``GRADIENT_TOL`` and θ_min > ε·s                     |

Cost: per-example gradients of the sample and m Hessian-vector products; when the sample is the whole data set
(n ≤ ``SAMPLE``) its per-example gradients also give ∇L (their mean plus the data-free part ∇(R + extra)), else one
more gradient pass over the data. Both passes run in the chunks the per-example gradients fit in the memory budget
(:mod:`influkit.memory`: rows included, so the plain gradient pass holds no more than the per-example one); a
:class:`~influkit.chain.Chain` without ``memory=`` runs a ``kfac``/``ekfac`` stage's passes and products in batches
of at most ``memory.DEFAULT_WORKING`` (``least=1``: :meth:`~influkit.chain.Chain._lean_check`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from .curvature import gradient, penalty_gradient, sample_indices
from .errors import StationarityWarning, warn
from .gradients import chunk_for, per_example_grad_rows
from .memory import DEFAULT_EXAMPLES
from .operators import Operator
from .params import ParamSpace, point
from .scoring import release_freed_memory
from .stage import Stage

GRADIENT_TOL = 1e-3  # r above it: not a stationary point
SAMPLE = 64  # examples whose per-example gradient norms give the typical norm g
STEPS = 20  # Lanczos steps (Hessian-vector products) for θ_min, θ_max
FEW_STEPS = 6  # the Lanczos steps a Chain asks for a stage solved by a factored inverse (kfac, ekfac)
VERDICTS = ("minimum", "saddle", "non-stationary", "singular")


@dataclass(frozen=True)
class Position:
    """Where one stage stands (module docstring): r, θ_min, θ_max, the verdict, and what it cost."""

    gradient_norm: float  # r = ‖∇L‖ / g
    min_eigenvalue: float  # θ_min ≥ λ_min
    max_eigenvalue: float  # θ_max ≤ λ_max
    verdict: str
    objective_gradient: float  # ‖∇L‖
    typical_gradient: float  # g, RMS per-example loss-gradient norm over the sample
    sample: int  # |S|
    lanczos_steps: int
    eigenvalue_tol: float  # ε
    seconds: float

    @property
    def at_minimum(self) -> bool:
        return self.verdict == "minimum"

    def summary(self) -> dict:
        """JSON-friendly, for ``diagnostics["stages"][k]`` (plus ``gradient_tol``, the threshold on r)."""
        return asdict(self) | {"gradient_tol": GRADIENT_TOL}

    @classmethod
    def from_summary(cls, summary: dict) -> "Position":
        """The position :meth:`summary` wrote."""
        return cls(**{k: v for k, v in summary.items() if k != "gradient_tol"})

    def describe(self) -> str:
        """One line: the verdict with the numbers it rests on."""
        return (f"{self.verdict}: ‖∇L‖ = {self.gradient_norm:.2g} × the typical per-example gradient norm "
                f"(stationary below {GRADIENT_TOL:g}), Hessian eigenvalues within [{self.min_eigenvalue:.3g}, "
                f"{self.max_eigenvalue:.3g}] ({self.lanczos_steps} Lanczos steps)")


def eigenvalue_tol(dtype: torch.dtype) -> float:
    """ε = √(machine epsilon of ``dtype``): relative size below which an eigenvalue counts as zero."""
    return math.sqrt(torch.finfo(dtype).eps)


def verdict(gradient_norm: float, min_eigenvalue: float, max_eigenvalue: float, tol: float) -> str:
    """The verdict of the module table for r = ``gradient_norm``, θ_min, θ_max and ε = ``tol``."""
    if not gradient_norm <= GRADIENT_TOL:
        return "non-stationary"
    scale = max(abs(min_eigenvalue), abs(max_eigenvalue))
    if min_eigenvalue < -tol * scale:
        return "saddle"
    if scale == 0 or min_eigenvalue <= tol * scale:
        return "singular"
    return "minimum"


def extreme_eigenvalues(operator: Operator, steps: int = STEPS, *, seed: int = 0) -> tuple[float, float, int]:
    """(θ_min, θ_max, m): the extreme Ritz values of the symmetric ``operator`` after m ≤ ``steps`` Lanczos steps.

    Plain three-term recurrence (no stored basis: three vectors, updated in place) in the operator's precision, at
    least float32 (a float32 Hessian-vector product carries float32's error anyway; float64 would triple the
    memory); loss of orthogonality only adds copies of converged Ritz values, not spurious
    extremes. Stops early on an invariant subspace (then the values are exact)."""
    p = operator.dim
    steps = max(1, min(steps, p))
    dtype = torch.promote_types(operator.dtype, torch.float32)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(p, generator=gen, dtype=torch.float64).to(device=operator.device, dtype=dtype)
    q /= q.norm()
    previous = torch.zeros_like(q)
    alphas, betas = [], []
    beta = 0.0
    for _ in range(steps):
        w = torch.sub(operator.matvec(q.to(operator.dtype)).to(dtype), previous, alpha=beta)  # a new vector
        alpha = float(q @ w)
        w.sub_(q, alpha=alpha)
        alphas.append(alpha)
        beta = float(w.norm())
        if beta <= 1e-12 * max(abs(a) for a in alphas) or len(alphas) == steps:
            break
        betas.append(beta)
        previous, q = q, w.div_(beta)
    m = len(alphas)
    tri = torch.diag(torch.tensor(alphas, dtype=torch.float64))
    if m > 1:
        off = torch.tensor(betas[: m - 1], dtype=torch.float64)
        tri += torch.diag(off, 1) + torch.diag(off, -1)
    theta = torch.linalg.eigvalsh(tri)
    return float(theta[0]), float(theta[-1]), m


def assess(stage: Stage, names: Sequence[str] | None, operator: Operator, *, extra: Callable | None = None,
           seed: int = 0, sample: int = SAMPLE, steps: int = STEPS, memory: int | None = None,
           least: int = DEFAULT_EXAMPLES) -> Position:
    """Where ``stage`` stands at its current parameters ``names`` (module docstring), after ``steps`` Lanczos steps.

    operator: H of the objective over ``names`` (e.g. the chain's :class:`~influkit.curvature.HessianOperator`,
    with its ``hessian_samples``); extra: the term the objective adds besides the stage's (Case 2's proximal term);
    memory: the budget in bytes the gradient passes are chunked by (None: the default, :mod:`influkit.memory`, whose
    floor of examples per chunk is ``least``).
    """
    start = time.perf_counter()
    names = stage.param_names if names is None else list(names)
    picked = sample_indices(len(stage), min(sample, len(stage)), seed)
    x, y = stage.data.take(torch.arange(len(stage)) if picked is None else picked)
    values = point(stage.state(), names)
    row = 2 * sum(t.numel() * t.element_size() for t in values.values())  # a gradient row and vmap's copy of it
    chunk = chunk_for(stage, x, y, names, None, row, "where the stage stands", memory, least)  # both passes' batch
    norms, summed = [], 0.0
    for rows in per_example_grad_rows(stage, x, y, names, chunk_size=chunk):
        norms.append(rows.norm(dim=1))
        summed = summed + rows.sum(0)
    typical = float(torch.cat(norms).double().pow(2).mean().sqrt())
    if picked is None:  # the sample is every example: ∇L = their mean gradient + ∇(R + extra), no second pass
        penalty = penalty_gradient(stage, names, extra=extra)
        objective = summed / len(stage) + (0.0 if penalty is None else ParamSpace(penalty).flatten(penalty))
    else:
        full = gradient(stage, names, extra=extra, batch_size=chunk)
        objective = ParamSpace(full).flatten(full)
    absolute = float(objective.double().norm())
    relative = absolute / typical if typical > 0 else (0.0 if absolute == 0 else math.inf)
    release_freed_memory()  # the passes' freed buffers back to the system before the products allocate theirs
    low, high, m = extreme_eigenvalues(operator, steps, seed=seed)
    tol = eigenvalue_tol(operator.dtype)
    return Position(gradient_norm=relative, min_eigenvalue=low, max_eigenvalue=high,
                    verdict=verdict(relative, low, high, tol), objective_gradient=absolute, typical_gradient=typical,
                    sample=int(x.shape[0]), lanczos_steps=m, eigenvalue_tol=tol, seconds=time.perf_counter() - start)


def warn_not_at_minimum(positions: Sequence[Position], names: Sequence[str], remedy: Sequence[str]) -> None:
    """One :class:`~influkit.errors.StationarityWarning` naming every stage not at a minimum, pointing at the first
    line outside influkit (the user's call). ``remedy[k]``: what ``auto`` did about stage k (or how to change it)."""
    lines = [f"stage {k} ({names[k]}) is not at a minimum — {pos.describe()}; {remedy[k]}"
             for k, pos in enumerate(positions) if not pos.at_minimum]
    if lines:
        warn("influence functions assume each stage is at a minimum of its objective (see diagnostics['stages']):"
             "\n  " + "\n  ".join(lines), StationarityWarning)
