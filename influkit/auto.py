"""What ``solver="auto"`` solves for one stage, decided from where the stage stands: one pure function, :func:`decide`.

Inputs: the stage's :class:`~influkit.stationarity.Position` (None where unknown: a bare operator), its number of
trained parameters p, the number of right-hand sides of the query, the memory budget, optional
:class:`Training` facts, and what the user set. Output: a :class:`Choice` — the matrix (exact Hessian H or
Gauss-Newton G), the solver, the damping λ, the preconditioner, and the reason, recorded in
``diagnostics["solves"][k]["choice"]``.

| where the stage stands                | matrix | solver                                          | damping λ          |
|---------------------------------------|--------|-------------------------------------------------|--------------------|
| ``minimum`` (∇L ≈ 0, no negative curvature seen) | H | ``direct`` for several right-hand sides and p ≤ ``DIRECT_MAX`` (one factorization serves them all), else ``cg_spd`` (EK-FAC-preconditioned for p > ``PRECONDITION_MIN``) | as given (0) |
| ``singular`` (∇L ≈ 0, H ⪰ 0 with near-null directions) | H | ``direct`` (pseudo-inverse: the minimum-norm response) for p ≤ ``DIRECT_MAX``, else ``minres`` (EK-FAC-preconditioned for p > ``PRECONDITION_MIN``) | as given, else the spectral rule |
| ``saddle`` / ``non-stationary``       | G      | ``minres`` (EK-FAC-preconditioned for p > ``PRECONDITION_MIN``); the ``ekfac`` approximate inverse when also p·n_rhs > ``APPROXIMATE_WORK`` | as given, else 1/(ηT) with :class:`Training`, else the spectral rule |
| unknown (no stage)                    | H      | ``direct`` for p ≤ ``DIRECT_MAX`` when H can be formed, else ``minres`` | as given |

Why G off a minimum: the Hessian's indefinite part Σ_i Σ_c ∂ℓ/∂f_c ∇²f_c is what a non-zero gradient leaves; G
drops it, is ⪰ 0 for convex losses, and G + λI is positive definite, so the solve converges to its tolerance.

Why the approximate inverse when p·n_rhs is large: MINRES costs one product over the stage's data per step and
right-hand side, tens of steps each even preconditioned, while EK-FAC (C ≈ G fitted once, x = (C + λI)⁻¹b) costs
one fitting pass and then nothing per right-hand side. Its x is EK-FAC's, not the exact solve's (the reason says
so; ``SolveConfig(residual=True)`` measures the gap, at one exact product per right-hand side). ``studies/fidelity_minilm.py`` measures both on MiniLM
(``studies/results/fidelity/minilm-dapt.md``).

Why the EK-FAC preconditioner at a stationary point above ``PRECONDITION_MIN`` (CG at a minimum, MINRES at a
singular one): a Chain measures where such a stage stands with the light stationarity check
(:mod:`influkit.stationarity`), which fits the stage's EK-FAC (C ≈ G) before the verdict is known, since a solve off
the minimum needs it. At a stationary point that fitted object becomes the preconditioner M = C + λI (with λ = 0,
1e-3 times C's mean eigenvalue keeps M ≻ 0), shared with the Hessian's solve, not fitted again
(:meth:`influkit.fitted.FittedCurvature.share`): x is still the exact (H + λI)⁻¹b (the iteration stops on its true
residual), M changes only how many products it takes. H and G differ at a minimum by Σ_i Σ_c ∂ℓ_i/∂f_c ∇²f_c, which
vanishes for a linear head and is small where the fit is good. Each iteration then also applies M⁻¹, whose cost
grows with the layers' widths, not with n: on a wide layer fitted on few examples it can cost more than the
products it saves (``benchmarks/bench_auto_minimum.py``); a named ``solver="cg_spd"`` or ``"minres"`` solves
without it.

Damping rules (off a minimum, when the user gave none):

- **training** (:class:`Training`: T optimizer steps of learning rate η): λ = 1/(ηT). T steps of gradient descent
  of size η on a quadratic move θ by −[I − (I − ηH)^T] H⁻¹∇: H⁻¹ along curvatures ≫ 1/(ηT), ηT·I below — the
  response of a short continued training is H⁻¹ damped by about 1/(ηT).
- **spectral, scaled by how far off the minimum**: λ = ``DAMPING_RATIO`` · θ_max · min(1, r/``R_REF``), θ_max the
  largest eigenvalue the stationarity check found (H's Ritz value — off a stationary point, of the Hessian of a sample
  of the stage's examples — or the fitted EK-FAC's), r = ‖∇L‖/g the stage's
  gradient norm relative to the typical per-example gradient norm. At r ≥ ``R_REF`` it bounds the condition number
  of G + λI by about 1 + 1/``DAMPING_RATIO`` (G's largest eigenvalue is at most about H's: both share the
  Gauss-Newton part); nearer the minimum the damping shrinks in proportion to r, so a stage a hair off its minimum
  (r just above ``stationarity.GRADIENT_TOL``) is solved almost undamped, as its near-exact curvature deserves.
  ``R_REF`` is the gradient norm of the stages where ``DAMPING_RATIO`` was measured (docs/guides/defaults.md).

Every explicit setting wins: a named solver is used as given (no decision), and with ``solver="auto"`` a damping
> 0, ``matrix="gauss-newton"`` or a ``preconditioner`` is kept. A chain given one SolveConfig applies it to every
stage, exactly as a list of equal ones (a small head under ``solver="ekfac"`` is solved by EK-FAC: name
``solver="auto"`` or ``"direct"`` for it in a list to solve it exactly).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .errors import InputError
from .stationarity import Position

# the largest p solved with a dense factorization (p HVPs to build H, one Cholesky): benchmarks/bench_auto.py
DIRECT_MAX = 3000
# λ = DAMPING_RATIO · θ_max off a minimum without Training: studies/fidelity_lm.py (docs/concepts.md, "Where a stage stands")
DAMPING_RATIO = 1e-2
# the relative gradient norm r from which the full DAMPING_RATIO applies (below: λ ∝ r): the stages of
# studies/fidelity_lm.py where DAMPING_RATIO was measured stood at r = 0.017 and 0.037
R_REF = 0.03
# above this many parameters the iterative solve is preconditioned by EK-FAC (CG at a minimum, MINRES at a singular
# point or off a minimum), the one a Chain's light stationarity check fits: benchmarks/bench_auto_minimum.py
PRECONDITION_MIN = 10**6
# off a minimum, above PRECONDITION_MIN parameters and p·n_rhs > this, the EK-FAC approximate inverse replaces MINRES
APPROXIMATE_WORK = 2 * 10**6


@dataclass(frozen=True)
class Training:
    """How a stage was trained, for auto's damping off a minimum: ``steps`` steps of (stochastic) gradient descent
    with learning rate ``lr`` (the run the influence should describe, e.g. a continued training). Given as
    ``SolveConfig(training=Training(lr=..., steps=...))`` for that stage. λ = 1/(lr·steps) (module docstring)."""

    lr: float
    steps: int

    def __post_init__(self) -> None:
        if not (self.lr > 0 and self.steps > 0):
            raise InputError(f"Training needs lr > 0 and steps > 0, got lr={self.lr!r}, steps={self.steps!r}.")

    @property
    def damping(self) -> float:
        return 1.0 / (self.lr * self.steps)


@dataclass(frozen=True)
class Choice:
    """What one stage's solve runs: matrix ``"hessian"``/``"gauss-newton"``, solver, damping λ, preconditioner,
    and why (the ``reason`` starts with ``"auto:"`` when :func:`decide` chose; empty when the user named it all)."""

    matrix: str
    solver: str
    damping: float
    preconditioner: str | None
    reason: str

    def summary(self) -> dict:
        return asdict(self)


def spectral_damping(position: Position) -> float:
    """λ = DAMPING_RATIO · max(θ_max, 0) · min(1, r/R_REF) off a minimum (module docstring); at a singular
    stationary point, where the damping stands for H's null space rather than the distance, DAMPING_RATIO · θ_max."""
    if position.max_eigenvalue is None:
        raise InputError("the spectral damping needs θ_max, which this stage's stationarity check did not measure "
                         "(measured with spectrum='largest' or 'all'); give SolveConfig(damping=...) instead.")
    scale = 1.0 if position.verdict == "singular" else min(1.0, position.gradient_norm / R_REF)
    return DAMPING_RATIO * max(position.max_eigenvalue, 0.0) * scale


@dataclass(frozen=True)
class Asked:
    """What the user set for a stage's solve: solver (anything but ``"auto"`` ends the decision), damping,
    matrix, preconditioner and the :class:`Training` facts (the solve and curvature settings, as :func:`decide`
    reads them)."""

    solver: str = "auto"
    damping: float = 0.0
    matrix: str = "hessian"
    preconditioner: str | None = None
    training: Training | None = None


def decide(position: Position | None, p: int, *, n_rhs: int = 1, memory: int | None = None, asked: Asked = Asked(),
           dense: bool = True, itemsize: int = 8) -> Choice:
    """The :class:`Choice` for a stage at ``position`` with p trained parameters (module table).

    n_rhs: right-hand sides solved at once (1 for a summed test loss, the test-set size with ``per_test``).
    memory: the budget in bytes (None: unbounded); a dense H needs 3·p²·``itemsize`` of it.
    asked: what the user set (:class:`Asked`; each explicit setting wins).
    dense: the operator can form H (False for a bare operator without ``dense()``).
    """
    solver, damping, matrix = asked.solver, asked.damping, asked.matrix
    preconditioner, training = asked.preconditioner, asked.training
    if solver != "auto":
        return Choice(matrix, solver, damping, preconditioner, "")
    prefix = "auto: "
    fits = dense and (memory is None or 3 * p * p * itemsize <= memory)
    if position is None:
        if p <= DIRECT_MAX and dense and preconditioner is None:
            return Choice(matrix, "direct", damping, None,
                          f"{prefix}p = {p} ≤ {DIRECT_MAX}, a dense factorization is fastest (where the stage stands "
                          "is unknown)")
        why = ("the operator has no dense() to factor" if not dense else f"p = {p} > {DIRECT_MAX}" if p > DIRECT_MAX
               else "a preconditioner is given")
        return Choice(matrix, "minres", damping, preconditioner,
                      f"{prefix}{why}, MINRES (indefinite-safe, one HVP per step)")
    where = position.verdict
    if where == "minimum":
        if n_rhs > 1 and p <= DIRECT_MAX and fits and preconditioner is None:
            return Choice(matrix, "direct", damping, None,
                          f"{prefix}at a minimum; {n_rhs} right-hand sides on p = {p} ≤ {DIRECT_MAX}: one dense "
                          "factorization serves them all")
        pre, how = _checks_ekfac(p, preconditioner)
        return Choice(matrix, "cg_spd", damping, pre,
                      f"{prefix}at a minimum (no negative curvature in {position.lanczos_steps} Lanczos steps): CG on "
                      f"the positive definite H + λI, one HVP per step{how}")
    if where == "singular":
        if p <= DIRECT_MAX and fits and damping == 0 and preconditioner is None:
            return Choice(matrix, "direct", 0.0, None,
                          f"{prefix}stationary but singular (θ_min = {position.min_eigenvalue:.2g}): the dense "
                          "pseudo-inverse, the minimum-norm response on H's range")
        lam, rule = _damping(position, damping, None)
        pre, how = _checks_ekfac(p, preconditioner)
        return Choice(matrix, "minres", lam, pre,
                      f"{prefix}stationary but singular (θ_min = {position.min_eigenvalue:.2g}): MINRES on H + λI, "
                      f"λ = {lam:.3g} ({rule}){how}")
    lam, rule = _damping(position, damping, training)
    off = f"{prefix}{where} ({position.describe().split(': ', 1)[1]}): the exact Hessian is not a minimum's; "
    if preconditioner is None and p > PRECONDITION_MIN and p * n_rhs > APPROXIMATE_WORK:
        return Choice("gauss-newton", "ekfac", lam, None,
                      f"{off}the EK-FAC approximate inverse of the Gauss-Newton matrix, (C + λI)⁻¹ with C ≈ G, "
                      f"λ = {lam:.3g} ({rule}): p·n_rhs = {p}·{n_rhs} > {APPROXIMATE_WORK:.0e}, where MINRES would "
                      "take tens of products over the data per right-hand side")
    pre = preconditioner if preconditioner is not None else ("ekfac" if p > PRECONDITION_MIN else None)
    how = f", preconditioned by EK-FAC (p = {p} > {PRECONDITION_MIN:.0e})" if pre == "ekfac" and preconditioner is None else ""
    return Choice("gauss-newton", "minres", lam, pre,
                  f"{off}MINRES on the Gauss-Newton matrix G + λI (positive definite), λ = {lam:.3g} ({rule}){how}")


def _checks_ekfac(p: int, given: str | None) -> tuple[str | None, str]:
    """(the preconditioner of an exact solve at a stationary point, what the reason adds): the given one, else above
    PRECONDITION_MIN the EK-FAC a Chain's light stationarity check fitted (module docstring), else none."""
    if given is not None or p <= PRECONDITION_MIN:
        return given, ""
    return "ekfac", f", preconditioned by EK-FAC (p = {p} > {PRECONDITION_MIN:.0e}), the stationarity check's fit"


def _damping(position: Position, given: float, training: Training | None) -> tuple[float, str]:
    """(λ, the rule that gave it): the given damping, else 1/(ηT), else the spectral rule."""
    if given > 0:
        return given, "as given"
    if training is not None:
        return training.damping, f"1/(ηT), η = {training.lr:g}, T = {training.steps}"
    if position.verdict == "singular":
        return spectral_damping(position), f"{DAMPING_RATIO:g} × θ_max = {position.max_eigenvalue:.3g}"
    return spectral_damping(position), (f"{DAMPING_RATIO:g} × θ_max × min(1, r/{R_REF:g}), θ_max = "
                                        f"{position.max_eigenvalue:.3g}, r = {position.gradient_norm:.2g}")
