"""Inverse-Hessian solvers as objects behind one interface, chosen from a :class:`SolveConfig` by a registry.

A :class:`Solver` is built for one config (``SolveConfig.build``) on a stage's
:class:`~influkit.fitted.FittedCurvature` (the operator H and its fitted approximations, which the chain owns and
hands over), prepared once (``prepare``: the dense factorization, or the approximation the method needs, asked of
the FittedCurvature, which fits it once), then solves any number of right-hand sides (``solve(b)``).
``solve(operator, b, solver, damping=λ)`` is the one-call form.
Each method returns a :class:`Solution` (x, iterations, relative residual, converged flag, time, number of
Hessian-vector products). ``b`` may hold several right-hand sides as columns, shape (p, k). The iterations themselves
are in :mod:`influkit.krylov`.

| method     | solves                    | needs           | converges with | notes                              |
|------------|---------------------------|-----------------|----------------|------------------------------------|
| ``direct`` | (H + λI) x = b            | the dense H     | exact          | p ≲ 5,000; Cholesky, else eigh     |
| ``cg``     | (H² + λI) x = H b         | 2 HVPs / step   | κ(H)²          | the multi-stage paper's eq. 16;    |
|            |                           |                 |                | any symmetric H, indefinite too    |
| ``cg_spd`` | (H + λI) x = b            | 1 HVP / step    | κ(M⁻¹H)        | H + λI must be positive definite   |
| ``minres`` | (H + λI) x = b            | 1 HVP / step    | κ(M⁻¹H)        | any symmetric H, indefinite too    |
| ``lissa``  | (H + λI) x = b            | 1 HVP / step    | κ(H) (slow)    | Richardson iteration, step α       |
| ``neumann`` | x = α Σ_{j<K} (I − α(H + λI))^j b | K − 1 HVPs | —        | approximate: K = ``max_iter`` terms |
| ``identity`` | x = b                   | nothing         | —              | the paper's ablation (H := I)      |
| ``kfac``, ``ekfac`` | x = (C + λI)⁻¹ b | the fitted factors | —           | approximate: C the (E)K-FAC curvature |
| ``arnoldi`` | x = V (Θ + λ)⁻¹ Vᵀ b     | k eigenpairs    | —              | approximate: top-k subspace only   |
| ``auto``   | decided by :func:`influkit.auto.decide` from where the stage stands | | | the default everywhere |

``minres`` and ``cg_spd`` take a **preconditioner** M ≈ H + λI, symmetric positive definite: the fitted K-FAC,
EK-FAC or diagonal-Fisher curvature (:mod:`influkit.factored`) plus λI, or any callable applying M⁻¹. The
answer is still the exact solution of (H + λI) x = b (the stopping test is on its true residual); M only
changes how many HVPs it takes. Preconditioned MINRES (Paige & Saunders 1975, in M⁻¹'s inner product) needs
M ≻ 0 but not H ≻ 0; preconditioned CG needs both. Optionally the top Lanczos eigenpairs of H deflate M
(:func:`influkit.factored.deflated`).

The damping λ is a ridge on the system each method solves: note that for ``cg`` it is added to H², so
λ_cg ≈ λ² of the other methods gives a similar regularization.

**Tolerance.** ``tol`` is on the relative residual ‖(H + λI)x − b‖/‖b‖ of the solved system (for ``cg`` of
its H² system), reported as :attr:`Solution.residual` for every method (the approximate ones too, one HVP
per column). The default (:func:`default_tol`) is reachable in the operator's precision: 1e-10 in float64,
1e-4 in float32, where one HVP itself carries a relative error of ~1e-6·κ; Krylov vectors are kept in float64
whatever the operator's dtype (float32 HVPs are cast), and a float32 solve that stalls at its floor stops and
says so (``Solution.floor``: the residual float32 arithmetic can certify for that x). Approximate inverses
are judged by :data:`APPROXIMATE_TOL` (0.5) unless ``tol`` is given. ``Solution.converged`` is residual ≤ tol for
every method — a pseudo-inverse of a singular H and an approximate inverse can be unconverged — and None where no
residual was computed (``identity``; approximate inverses unless ``SolveConfig(residual=True)``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from typing import ClassVar

import torch

from . import krylov
from . import auto
from .auto import Asked, Choice, Training, decide
from .errors import ConvergenceWarning, InputError, NumericalError, warn
from .factored import deflated
from .fitted import CurvatureConfig, FittedCurvature
from .operators import DenseOperator, Factorable, Operator, SymmetricFactor, dense_form, products_of
from .progress import bar as progress_bar
from .stage import all_finite

METHODS = ("direct", "cg", "cg_spd", "minres", "lissa", "neumann", "identity")
APPROXIMATE_INVERSES = ("kfac", "ekfac", "arnoldi")  # x = C⁻¹b for a fitted approximation C (factored.approximations)
SOLVERS = METHODS + APPROXIMATE_INVERSES  # the built-in solvers; :func:`register` adds more
PRECONDITIONERS = ("kfac", "ekfac", "diagonal")
STEP_MARGIN = 1.05  # lissa/neumann's default step 1/(STEP_MARGIN·|λ_max|): below the 2/|λ_max| where they diverge
FACTORED_PRECONDITIONERS = ("kfac", "ekfac")  # fitted from the model's layers, two data passes


@dataclass
class Solution:
    """The result of one (batched) inverse-Hessian solve.

    residual: the largest relative residual ‖A x − c‖ / ‖c‖ over the columns, for the system A x = c the
    method solves (see the module table); NaN where none was computed (``identity``, which solves nothing, and
    approximate inverses unless ``SolveConfig(residual=True)``).
    tol: the tolerance the residual is judged by; converged: residual ≤ tol, for every method (direct and
    pseudo-inverse solves and approximate inverses too), or None where no residual was computed (not checked).
    choice: why this method (and preconditioner) ran (set when :class:`SolveConfig` chose it with ``solver="auto"``).
    preconditioner: what preconditioned an iterative solve, or which fitted approximation gave x ("" if none).
    floor: the relative residual the operator's precision can certify for this x, ε·(‖A‖‖x‖/‖b‖ + 1)
    (NaN where not estimated); a residual near it cannot be improved by iterating.
    eigenvalues: (θ_min, θ_max, steps), extreme eigenvalues of the solved matrix (H, or G on the Gauss-Newton
    curvature; λ taken off) that the solve gave for free — the extreme Ritz values of an unpreconditioned
    ``minres``/``cg_spd`` solve's own Lanczos tridiagonal after its steps (:func:`influkit.krylov.extreme_ritz_values`;
    they lie within the spectrum), ``direct``'s exact ones when it fell back to an eigendecomposition (steps 0),
    ``arnoldi``'s fitted Ritz values (its Lanczos steps); None where the method gives none.
    """

    x: torch.Tensor
    solver: str
    iterations: int
    residual: float
    tol: float
    converged: bool | None
    seconds: float
    products: int
    damping: float
    choice: str = ""
    preconditioner: str = ""
    floor: float = math.nan
    eigenvalues: tuple[float, float, int] | None = None

    def summary(self) -> dict:
        """The diagnostics without the solution vector."""
        out = asdict(self)
        out.pop("x")
        return out


@dataclass(frozen=True)
class SolveConfig:
    """How one inverse-Hessian system (H + λI) x = b is solved (which H, and how its approximations are fitted, is
    the stage's :class:`~influkit.fitted.CurvatureConfig`).

    solver: one of ``SOLVERS`` or ``"auto"`` (:func:`influkit.auto.decide`: in a Chain from where each stage
    stands — exact solves at a minimum, the damped Gauss-Newton matrix off it; for a bare operator ``direct`` for
    p ≤ ``auto.DIRECT_MAX``, else ``minres``; the choice and its reason are recorded in :attr:`Solution.choice`).
    With ``"auto"``, a damping > 0, ``CurvatureConfig(matrix="gauss-newton")`` and a ``preconditioner`` are kept as given.
    ``"kfac"``/``"ekfac"``/``"arnoldi"`` are approximate inverses (x = C⁻¹ b, no iteration).
    damping: λ ≥ 0 added to H (to H² for ``cg``). tol: the relative residual a solve must reach to be converged
    (default: :func:`default_tol` for exact methods, :data:`APPROXIMATE_TOL` for approximate inverses and the
    truncated ``neumann`` series); max_iter: iterations of iterative solvers (default min(10·p, 2,000)).
    preconditioner: for ``minres``/``cg_spd``, ``"ekfac"``, ``"kfac"`` or ``"diagonal"`` (M = C + λI with C that
    fitted approximation; with λ = 0, 1e-3·trace(C)/p keeps M ≻ 0), or M⁻¹ as a callable on (p, k) residuals,
    M ≈ H + λI positive definite. deflate: also deflate the preconditioner with the top Lanczos eigenpairs of H
    (their number: ``CurvatureConfig.rank``). step: the step α of ``lissa`` and ``neumann``,
    x ← x + α(b − (H + λI)x) (default 1/(1.05·|λ_max(H + λI)|), by power iteration); ``neumann`` stops after
    K = ``max_iter`` terms (default 20), Lorraine et al.'s truncated series, whatever its residual.
    residual: with ``True``, approximate inverses report the true relative residual of their x, at the cost of one
    exact Hessian-vector product over the stage's data per solve: 2-3 times the scoring of the whole data set, and
    resident memory for its double-backward graph (``benchmarks/bench_transformer.py`` measures it); the default ``False`` skips it (residual NaN, converged
    None: not checked), as kronfluence and TRAK never check. Iterative and direct solves always report it.
    training: :class:`influkit.auto.Training` (lr, steps) of this stage, for auto's damping 1/(lr·steps) off a
    minimum.
    """

    solver: str = "auto"
    damping: float = 0.0
    tol: float | None = None
    max_iter: int | None = None
    step: float | None = None
    preconditioner: str | Callable[[torch.Tensor], torch.Tensor] | None = None
    deflate: bool = False
    residual: bool = False
    training: Training | None = None

    def __post_init__(self) -> None:
        if self.solver != "auto" and self.solver not in REGISTRY:
            raise InputError(f"unknown solver {self.solver!r}; choose 'auto' or one of {tuple(REGISTRY)}.")
        if not self.damping >= 0:
            raise InputError(f"damping must be ≥ 0, got {self.damping}.")
        if self.step is not None and not self.step > 0:
            raise InputError(f"step must be > 0, got {self.step}.")
        if self.tol is not None and not self.tol >= 0:
            raise InputError(f"tol must be a relative residual ≥ 0 (or None for the default), got {self.tol!r}.")
        if self.max_iter is not None and (isinstance(self.max_iter, bool) or not self.max_iter >= 1):
            raise InputError(f"max_iter must be ≥ 1 (or None for the default), got {self.max_iter!r}.")
        if isinstance(self.preconditioner, str):
            if self.preconditioner not in PRECONDITIONERS:
                raise InputError(f"unknown preconditioner {self.preconditioner!r}; choose one of {PRECONDITIONERS} or pass "
                                 "a callable applying M⁻¹.")
        elif self.preconditioner is not None and not callable(self.preconditioner):
            raise InputError("preconditioner must be 'ekfac', 'kfac', 'diagonal' or a callable applying M⁻¹ to (p, k) vectors.")
        if (self.preconditioner is not None or self.deflate) and not (
                self.solver == "auto" or REGISTRY[self.solver].accepts_preconditioner):
            raise InputError(f"a preconditioner (or deflate) applies to solver='minres' or 'cg_spd', not {self.solver!r}.")
        if self.training is not None and not isinstance(self.training, Training):
            raise InputError("training must be influkit.auto.Training(lr=..., steps=...).")

    def choose(self, dim: int, dense: bool = True) -> tuple[str, str]:
        """(the method to run on a p = ``dim`` system where the stage's position is unknown, why)."""
        choice = self.decide(None, dim, dense=dense)
        return choice.solver, choice.reason

    def decide(self, position, dim: int, *, matrix: str = "hessian", **context) -> Choice:
        """:func:`influkit.auto.decide` for these settings on a stage whose curvature settings name ``matrix``
        (``context``: n_rhs, memory, dense, itemsize)."""
        pre = self.preconditioner if isinstance(self.preconditioner, str) or self.preconditioner is None else "given"
        asked = Asked(solver=self.solver, damping=self.damping, matrix=matrix, preconditioner=pre,
                      training=self.training)
        choice = decide(position, dim, asked=asked, **context)
        return replace(choice, preconditioner=self.preconditioner) if pre == "given" else choice

    @property
    def spectrum(self) -> str:
        """What a stage's stationarity check measures of the eigenvalues off a stationary point for these settings
        (:func:`influkit.stationarity.assess`): ``"largest"`` — θ_max, which ``auto``'s damping reads when neither a
        damping nor :class:`~influkit.auto.Training` is given — else ``"verdict"``, nothing (a named solver and a
        given damping use no eigenvalue)."""
        needs = self.solver == "auto" and self.damping == 0 and self.training is None
        return "largest" if needs else "verdict"

    def factored_fit(self, dim: int) -> str | None:
        """The factored curvature (``"kfac"``/``"ekfac"``) a stage of p = ``dim`` fits for this solve off a minimum —
        the approximate inverse (a solver whose ``takes_factors``), the named preconditioner, or ``auto``'s EK-FAC
        above ``auto.PRECONDITION_MIN`` parameters — else None."""
        if self.solver != "auto" and REGISTRY[self.solver].takes_factors:
            return self.solver
        if self.preconditioner in FACTORED_PRECONDITIONERS:
            return self.preconditioner
        if self.solver == "auto" and self.preconditioner is None and dim > auto.PRECONDITION_MIN:
            return "ekfac"
        return None

    def chosen(self, choice: Choice) -> "SolveConfig":
        """These settings with ``choice``'s solver, damping and preconditioner in place of ``auto``'s (its matrix is
        the curvature's: :meth:`influkit.Chain.fit` hands the solver that FittedCurvature)."""
        return replace(self, solver=choice.solver, damping=choice.damping, preconditioner=choice.preconditioner)

    def build(self, operator: "Operator | torch.Tensor | FittedCurvature",
              curvature: CurvatureConfig | None = None, choice: Choice | None = None) -> "Solver":
        """The (unprepared) :class:`Solver` of this config: ``choice`` (from :meth:`decide`), else ``auto`` resolved
        for the operator's size alone.

        operator: a stage's :class:`FittedCurvature` (what a Chain hands over), or an Operator / dense tensor, which
        gets a FittedCurvature of its own with the settings ``curvature`` (default ``CurvatureConfig()``)."""
        if not isinstance(operator, FittedCurvature):
            operator = FittedCurvature(operator, curvature if curvature is not None else CurvatureConfig())
        elif curvature is not None and curvature != operator.config:
            raise InputError("give the curvature settings once: the FittedCurvature was fitted with its own CurvatureConfig.")
        if choice is None:
            op = operator.operator
            choice = self.decide(None, op.dim, matrix=operator.config.matrix, dense=dense_form(op))
        return REGISTRY[choice.solver](self.chosen(choice), operator, choice=choice.reason)

    def prepare(self, operator: "Operator | torch.Tensor | FittedCurvature", curvature: CurvatureConfig | None = None,
                choice: Choice | None = None, *, progress: bool = False) -> "Solver":
        """The :class:`Solver` of this config, prepared (what it needs fitted, fitted once: see :meth:`build`)."""
        return self.build(operator, curvature, choice).prepare(progress=progress)

    def solve(self, operator: "Operator | torch.Tensor | FittedCurvature", b: torch.Tensor,
              curvature: CurvatureConfig | None = None, *, progress: bool = False, warn: bool = True) -> "Solution":
        """x ≈ (H + λI)⁻¹ b with these settings: :meth:`prepare` then :meth:`Solver.solve`."""
        return self.prepare(operator, curvature, progress=progress).solve(b, progress=progress, warn=warn)

    def summary(self) -> dict:
        """The settings as JSON-friendly values (a callable preconditioner is named by its type)."""
        out = asdict(self)
        if callable(self.preconditioner):
            out["preconditioner"] = getattr(self.preconditioner, "__qualname__", type(self.preconditioner).__name__)
        return out


# ------------------------------------------------------------------------------------------------ solvers


REGISTRY: dict[str, type["Solver"]] = {}


def register(*names: str):
    """Class decorator: the :class:`Solver` subclass behind ``SolveConfig(solver=name)`` for each name (a new
    method is one class: ``_run`` and, if it fits something, ``_prepare``; tests/test_solvers.py registers one)."""

    def add(cls):
        for name in names:
            REGISTRY[name] = cls
        return cls

    return add


class Solver:
    """(H + λI)⁻¹ b, or the method's version of it, for one :class:`SolveConfig` on one stage's curvature.

    curvature: the stage's :class:`FittedCurvature` (its operator H and fitted approximations; ``prepare()`` asks
    it for what the method needs, fitted once there and shared by every solver handed the same object);
    ``solve(b)`` returns a :class:`Solution` for b of shape (p,) or (p, k). Subclasses fill in ``_prepare`` and
    ``_run(rhs, tol, max_iter, bar) -> (x, iterations, residual, floor)`` (residual NaN: not computed).
    """

    approximate: ClassVar[bool] = False  # True: x = C⁻¹b for a fitted approximation C (default tol APPROXIMATE_TOL)
    iterative: ClassVar[bool] = False  # True: runs ``max_iter`` steps at most, with a progress bar
    accepts_preconditioner: ClassVar[bool] = False  # True: SolveConfig(preconditioner=..., deflate=...) applies
    default_max_iter: ClassVar[int | None] = None  # None: min(10·p, 2,000)
    takes_factors: ClassVar[bool] = False  # True: x is fitted from a factored curvature (kfac, ekfac), whose blocks
    # can take b as token factors (:attr:`uses_token_factors`)
    multiplies: ClassVar[bool] = True  # its fit or its solve multiplies by the stage's operator (whose first product
    # records ∇L for the stationarity check: influkit.stationarity.from_solve)

    def __init__(self, config: SolveConfig, curvature: FittedCurvature, *, choice: str = ""):
        self.config, self.curvature, self.choice = config, curvature, choice
        self.operator = curvature.operator
        self.name = config.solver if config.solver != "auto" else config.choose(self.operator.dim)[0]
        self.automatic = choice.startswith("auto")  # chosen by influkit.auto, not named by the user
        self.preconditioner_name = ""

    @property
    def uses_token_factors(self) -> bool:
        """Whether :meth:`solve` takes b's Kronecker blocks as token factors: a factored solver without the residual
        check (which needs b formed)."""
        return self.takes_factors and not self.config.residual

    def prepare(self, *, progress: bool = False) -> "Solver":
        """Fit what this method needs on the operator (nothing by default). Returns self."""
        self._prepare(progress)
        return self

    def _prepare(self, progress: bool) -> None:
        pass

    def solve(self, b: torch.Tensor, *, progress: bool = False, warn: bool = True, factors: dict | None = None) -> Solution:
        """x ≈ (H + λI)⁻¹ b (the system of the module table), with its diagnostics.

        factors: for ``kfac``/``ekfac`` without ``residual``, b's Kronecker blocks given as token factors (b holds 0
        there; :class:`~influkit.factored.tokens.TokenGradient`), rotated from them."""
        if factors and not self.uses_token_factors:
            raise InputError(f"{self.name} solves a dense right-hand side; token factors apply to kfac/ekfac "
                             "without residual.")
        operator, damping = self.operator, self.config.damping
        single = b.dim() == 1
        rhs = b.reshape(-1, 1) if single else b
        if rhs.shape[0] != operator.dim:
            raise InputError(f"right-hand side has {rhs.shape[0]} rows, the Hessian is {operator.dim}×{operator.dim}.")
        if not all_finite(rhs) or not all(all_finite(t) for pair in (factors or {}).values() for t in pair):
            raise NumericalError("the right-hand side holds NaN or Inf (a gradient overflowed); check the model and data.")
        tol = self.config.tol if self.config.tol is not None else APPROXIMATE_TOL if self.approximate else \
            default_tol(rhs.dtype)
        max_iter = self.config.max_iter or self.default_max_iter or min(10 * operator.dim, 2000)
        start_products = products_of(operator)
        start = time.perf_counter()
        bar = progress_bar(max_iter, f"{self.name} solve", progress and self.iterative)
        if factors:
            x, iterations, residual, floor = self.approximation.solve(rhs, damping, factors).to(rhs.dtype), 0, math.nan, math.nan
        else:
            x, iterations, residual, floor = self._run(rhs, tol, max_iter, bar)
        bar.close()
        if not all_finite(x):
            raise NumericalError(
                f"the {self.name} solve produced NaN/Inf after {iterations} iterations; increase damping or use "
                "float64."
            )
        converged = None if math.isnan(residual) else bool(residual <= tol)  # None: not checked
        if converged is False and warn:
            self._warn_unconverged(iterations, residual, tol, floor, rhs.dtype)
        notes = list(self.curvature.notes)
        why = self.choice
        if why and self.preconditioner_name:
            why = f"{why}, {'fitted as' if self.approximate else 'preconditioned by'} {self.preconditioner_name}"
        return Solution(
            x=x.reshape(-1) if single else x, solver=self.name, iterations=iterations, residual=float(residual),
            tol=float(tol), converged=converged, seconds=time.perf_counter() - start,
            products=products_of(operator) - start_products, damping=float(damping),
            choice="; ".join([why] + notes) if notes else why, preconditioner=self.preconditioner_name,
            floor=float(floor), eigenvalues=None if factors else self._eigenvalues(),
        )

    def _run(self, rhs: torch.Tensor, tol: float, max_iter: int, bar) -> tuple[torch.Tensor, int, float, float]:
        raise NotImplementedError

    def _eigenvalues(self) -> tuple[float, float, int] | None:
        """(θ_min, θ_max, steps) of the solved matrix that the last ``_run`` gave for free (:attr:`Solution.eigenvalues`),
        or None."""
        return None

    def _warn_unconverged(self, iterations: int, residual: float, tol: float, floor: float, dtype) -> None:
        _warn_unconverged(self.name, iterations, residual, tol, floor, dtype, self.config.damping,
                          getattr(self, "stats", {}))

    def _system(self, rhs: torch.Tensor, squared: bool = False):
        """(A, c) of the system A x = c solved: (H + λI) x = b, or (H² + λI) x = H b with ``squared``."""
        op, damping = self.operator, self.config.damping
        if squared:
            return (lambda v: op.matvec(op.matvec(v)) + damping * v), op.matvec(rhs)
        return (lambda v: op.matvec(v) + damping * v), rhs

    def _approximation(self, name: str, progress: bool):
        """The stage's fitted approximation ``name`` (fitted now unless its FittedCurvature keeps one); under
        ``auto`` an unrecognised loss falls back to the empirical Fisher, and no stage to no preconditioner."""
        return self.curvature.approximation(name, progress=progress, fallback=self.automatic)


@register("identity")
class Identity(Solver):
    """x = b: every H⁻¹ replaced by I (the multi-stage paper's ablation); no residual (converged None)."""

    multiplies = False

    def _run(self, rhs, tol, max_iter, bar):
        return rhs.clone(), 0, math.nan, math.nan


@register("direct")
class Direct(Solver):
    """x = (H + λI)⁻¹ b from a factorization of the dense H (Cholesky, else an eigh pseudo-inverse), built once.

    Its residual is checked like any other method's: a pseudo-inverse of a singular H solves b only when b has no
    component in H's null space, and is reported unconverged otherwise."""

    def _prepare(self, progress: bool) -> None:
        self._factor(progress)

    _own: SymmetricFactor | None = None

    def _factor(self, progress: bool = False) -> SymmetricFactor:
        op, damping = self.operator, self.config.damping
        if isinstance(op, Factorable):
            return op.factor(damping, progress=progress)
        if not dense_form(op):
            raise InputError("solver='direct' needs an operator with a dense() Hessian; use 'minres' or 'cg'.")
        if self._own is None:
            self._own = SymmetricFactor(op.dense(), damping)
        return self._own

    def _run(self, rhs, tol, max_iter, bar):
        factor = self._factor()
        x = factor.solve(rhs)
        residual = krylov_residual(lambda v: factor.shifted @ v, x, rhs)
        return x, 1, residual, math.nan

    def _eigenvalues(self):
        extremes = self._factor().extremes
        return None if extremes is None else (*extremes, 0)

    def _warn_unconverged(self, iterations, residual, tol, floor, dtype) -> None:
        if self._factor().eigen is None:
            return super()._warn_unconverged(iterations, residual, tol, floor, dtype)
        if self._factor().indefinite:
            warn(f"direct: the pseudo-inverse leaves relative residual {residual:.2e} > tol {tol:.0e}: H + λI is "
                 "indefinite, with eigenvalues at zero; the stage is not at a minimum. Solve the positive semi-definite "
                 "Gauss-Newton matrix with damping instead (the factorization's warning names the values).",
                 ConvergenceWarning)
            return
        warn(f"direct: the pseudo-inverse leaves relative residual {residual:.2e} > tol {tol:.0e}: H + λI is singular "
             "and the right-hand side has a part in its null space, which no x can match (x is the least-squares "
             "answer). Add damping (SolveConfig(damping=...)) for a unique solution.", ConvergenceWarning)


class _Krylov(Solver):
    """An iterative solve on (H + λI) x = b, optionally preconditioned (minres, cg_spd) and deflated."""

    iterative = True

    def __init__(self, config: SolveConfig, curvature: FittedCurvature, *, choice: str = ""):
        super().__init__(config, curvature, choice=choice)
        self.apply_preconditioner: Callable | None = None

    def _prepare(self, progress: bool) -> None:
        config = self.config
        pre = config.preconditioner if self.accepts_preconditioner else None
        if pre is None and not (config.deflate and self.accepts_preconditioner):
            return
        base, name = (pre, getattr(pre, "__qualname__", type(pre).__name__)) if callable(pre) else (None, "")
        if isinstance(pre, str):
            curvature = self._approximation(pre, progress)
            if curvature is not None:
                shift = config.damping if config.damping > 0 else 1e-3 * curvature.mean_eigenvalue()
                base, name = (lambda r: curvature.solve(r, shift)), f"{pre} ({curvature.info['fisher']} Fisher)"
        if config.deflate and self.accepts_preconditioner:
            pairs = self._approximation("arnoldi", progress)
            base = deflated(base, pairs.eigenvalues, pairs.eigenvectors, config.damping)
            name = f"{name or 'identity'} deflated by {pairs.eigenvalues.numel()} Lanczos eigenpairs"
        self.apply_preconditioner, self.preconditioner_name = base, name

    def _eigenvalues(self):
        """The extreme Ritz values of the solve's Lanczos tridiagonal less λ, unpreconditioned (a preconditioned
        solve's are those of M⁻¹(H + λI), not H's)."""
        stats = getattr(self, "stats", {})
        if self.apply_preconditioner is not None or "lanczos" not in stats:
            return None
        ritz = krylov.extreme_ritz_values(stats["lanczos"])
        return None if ritz is None else (ritz[0] - self.config.damping, ritz[1] - self.config.damping, ritz[2])


@register("minres")
class MINRES(_Krylov):
    """MINRES on (H + λI) x = b: any symmetric H, indefinite too; converges with κ(M⁻¹H)."""

    accepts_preconditioner = True

    def _run(self, rhs, tol, max_iter, bar):
        apply, target = self._system(rhs)
        pre = self.apply_preconditioner
        self.stats = {}
        if pre is None and rhs.dtype == torch.float64:
            x, iterations = krylov.minres(apply, target, tol / 4, max_iter, bar, stats=self.stats)
            floor = math.nan
        else:
            eps = torch.finfo(rhs.dtype).eps
            x, iterations, floor = krylov.minres(_widened(apply, rhs.dtype), target.to(torch.float64), tol / 4, max_iter,
                                                 bar, preconditioner=_widened(pre, rhs.dtype), eps=eps, stats=self.stats)
            x = x.to(rhs.dtype)
        return x, iterations, krylov_residual(apply, x, target), floor


@register("cg_spd")
class CG(_Krylov):
    """Conjugate gradients on (H + λI) x = b, which must be positive definite; converges with κ(M⁻¹H)."""

    squared: ClassVar[bool] = False
    accepts_preconditioner = True

    def _run(self, rhs, tol, max_iter, bar):
        apply, target = self._system(rhs, squared=self.squared)
        # the recurrence residual drifts from the true one: aim a little below tol
        self.stats = {}
        x, iterations = krylov.cg(apply, target, tol / 4, max_iter, bar, require_positive=not self.squared,
                                  preconditioner=self.apply_preconditioner, stats=self.stats)
        return x, iterations, krylov_residual(apply, x, target), math.nan


@register("cg")
class CGSquared(CG):
    """CG on (H² + λI) x = H b, the multi-stage paper's eq. 16: any symmetric H; converges with κ(H)²."""

    squared = True
    accepts_preconditioner = False

    def _eigenvalues(self):
        return None  # its Ritz values are H²'s, which lose the sign of H's


@register("lissa")
class LiSSA(_Krylov):
    """Richardson iteration x ← x + α(b − (H + λI) x) (LiSSA, deterministic): α = ``step`` or 1/(``STEP_MARGIN``·|λ_max|)."""

    def _run(self, rhs, tol, max_iter, bar):
        apply, target = self._system(rhs)
        step = self.config.step
        scale = 1.0 / step if step is not None else STEP_MARGIN * krylov.largest_eigenvalue(apply, rhs)
        x, iterations = krylov.richardson(apply, target, scale, tol, max_iter, bar)
        return x, iterations, krylov_residual(apply, x, target), math.nan


@register("neumann")
class Neumann(LiSSA):
    """Lorraine et al.'s truncated Neumann series x = α Σ_{j<K} (I − α(H + λI))^j b, K = ``max_iter`` terms (default
    20): LiSSA stopped after K terms whatever its residual — an approximate inverse, like ``kfac`` (the residual of
    its x is reported and judged by ``APPROXIMATE_TOL`` unless ``tol`` is given)."""

    approximate = True
    default_max_iter = 20

    def _run(self, rhs, tol, max_iter, bar):
        return super()._run(rhs, 0.0, max_iter - 1, bar)  # x starts at α b, the first term


class _Approximation(Solver):
    """x = C⁻¹ b for a fitted approximation C of H + λI (no iteration); the residual is that of the true system
    (one exact Hessian-vector product per column, with ``SolveConfig(residual=True)``; by default skipped:
    converged None).

    Judged by ``APPROXIMATE_TOL`` unless ``tol`` is given: C is not H, so x is not (H + λI)⁻¹b; a residual above
    it means C⁻¹ misses b by more than half of b on this system."""

    approximate = True
    approximation = None  # set by prepare (or given to :func:`solve`)

    def _run(self, rhs, tol, max_iter, bar):
        x = self.approximation.solve(rhs, self.config.damping).to(rhs.dtype)
        if not self.config.residual:
            return x, 0, math.nan, math.nan
        apply, target = self._system(rhs)
        return x, 0, krylov_residual(apply, x, target), math.nan

    def _warn_unconverged(self, iterations, residual, tol, floor, dtype) -> None:
        remedy = (f"SolveConfig(solver='minres', preconditioner='{self.name}')" if self.name in PRECONDITIONERS
                  else "SolveConfig(solver='minres', deflate=True)")
        warn(
            f"{self.name}: the approximate inverse leaves relative residual {residual:.2e} > tol {tol:.0e} on "
            f"(H + λI)x = b: its x solves the fitted approximation, not the stage's Hessian, so the scores are "
            f"{self.name}'s, not the influence function's. For an exact solve (the same fit as its preconditioner) "
            f"pass {remedy}; to accept the approximation, pass a larger tol.", ConvergenceWarning)


@register("kfac", "ekfac")
class Factored(_Approximation):
    """K-FAC / EK-FAC: x = (C + λI)⁻¹ b with C the Kronecker-factored (eigenvalue-corrected) Gauss-Newton matrix."""

    takes_factors = True
    multiplies = False

    def _prepare(self, progress: bool) -> None:
        if self.approximation is None:
            self.approximation = self._approximation(self.name, progress)
        self.preconditioner_name = f"{self.name} ({self.approximation.info['fisher']} Fisher)"


@register("arnoldi")
class Arnoldi(_Approximation):
    """Schioppa et al.: x = V (Θ + λ)⁻¹ Vᵀ b on the top-``rank`` Lanczos eigenpairs (Θ, V) of H."""

    def _prepare(self, progress: bool) -> None:
        if self.approximation is None:
            self.approximation = self._approximation("arnoldi", progress)
        self.preconditioner_name = f"arnoldi (rank {self.approximation.eigenvalues.numel()})"

    def _eigenvalues(self):
        theta = self.approximation.eigenvalues
        return float(theta.min()), float(theta.max()), int(self.approximation.info.get("iterations", 0))


def _warn_unconverged(method: str, iterations: int, residual: float, tol: float, floor: float, dtype, damping: float,
                      stats: Mapping) -> None:
    """The warning of an unconverged solve, with the remedy for its cause: the precision floor, an indefinite
    H + λI (MINRES met a direction of negative curvature), or slow convergence on a positive definite system."""
    if not math.isnan(floor) and residual <= 10 * floor:
        advice = (f"that is the floor {str(dtype).replace('torch.', '')} arithmetic can certify for this system "
                  f"(~{floor:.1e}): pass tol ≥ {10 * floor:.0e}"
                  + (", or compute in float64." if dtype != torch.float64 else ", or add damping."))
    elif stats.get("negative_curvature"):
        advice = (f"CG met negative curvature: H + λI (λ = {damping:g}) is not positive definite, so the stage is not at "
                  "a minimum (e.g. trained for a few Adam steps, or a saddle). Use solver='minres' (or 'cg', on H²), "
                  "which solve the same indefinite system, or the positive semi-definite Gauss-Newton matrix with "
                  "damping, curvature=CurvatureConfig(matrix='gauss-newton') with SolveConfig(damping=λ > 0, e.g. 1e-3 of ‖H‖), "
                  "on which CG "
                  "converges.")
    elif "lanczos" in stats and (negative := krylov.negative_ritz_values(stats["lanczos"])) > 0:
        scale = stats["norm"]
        advice = (f"H + λI (λ = {damping:g}) is indefinite (MINRES's Lanczos matrix has {negative} negative "
                  "eigenvalues, Ritz values of H + λI), so the "
                  "stage is not at a minimum (e.g. trained for a few Adam steps, or a saddle), and its eigenvalues near "
                  "zero stall the solve. Solve the positive semi-definite Gauss-Newton system instead, "
                  f"curvature=CurvatureConfig(matrix='gauss-newton') with SolveConfig(damping={1e-3 * scale:.1e}) "
                  f"(1e-3 of ‖H‖ ≈ {scale:.1e}), or "
                  "add damping above |λ_min(H)| (H + λI then positive definite).")
    elif method == "lissa":
        advice = "use solver='minres' (its steps grow with √κ(H) where LiSSA's grow with κ(H))."
    elif method == "cg":
        advice = "raise max_iter, or use solver='minres' (converges with κ(H) where CG on H² needs κ(H)²)."
    else:
        advice = "raise max_iter (no negative curvature was met)."
    warn(f"{method} stopped after {iterations} iterations at relative residual {residual:.2e} > tol {tol:.0e}; "
         + advice, ConvergenceWarning)


# The default tolerance of approximate inverses (kfac, ekfac, arnoldi): their x = C⁻¹b is judged by the true
# relative residual ‖(H + λI)x − b‖/‖b‖; above 0.5 the fitted C misses b by more than half of b (x = 0 scores 1).
APPROXIMATE_TOL = 0.5


def default_tol(dtype: torch.dtype) -> float:
    """A relative-residual tolerance reachable in ``dtype``: 1e-10 in float64, 1e-4 otherwise."""
    return 1e-10 if dtype == torch.float64 else 1e-4


def krylov_residual(apply: Callable, x: torch.Tensor, target: torch.Tensor) -> float:
    """max over columns of ‖A x − c‖ / ‖c‖ (0 for a zero column)."""
    norms = target.norm(dim=0)
    res = (apply(x) - target).norm(dim=0) / norms.clamp_min(torch.finfo(target.dtype).tiny)
    return float(torch.where(norms > 0, res, torch.zeros_like(res)).max())


def _widened(fn: Callable | None, dtype: torch.dtype) -> Callable | None:
    """fn on float64 vectors for an operator/preconditioner working in ``dtype`` (cast in, cast back to float64)."""
    if fn is None or dtype == torch.float64:
        return fn
    return lambda v: fn(v.to(dtype)).to(torch.float64)


def solve(
    operator,
    b: torch.Tensor,
    solver: str = "auto",
    *,
    damping: float = 0.0,
    tol: float | None = None,
    max_iter: int | None = None,
    step: float | None = None,
    preconditioner: Callable[[torch.Tensor], torch.Tensor] | None = None,
    approximation=None,
    progress: bool = False,
    warn: bool = True,
) -> Solution:
    """Approximately x = H⁻¹ b (with damping λ as in the module table), for b of shape (p,) or (p, k).

    operator: an :class:`~influkit.operators.Operator` (e.g. :class:`~influkit.curvature.HessianOperator`), or
    a dense symmetric (p, p) tensor. ``direct`` also needs ``operator.dense()`` (or a cached ``factor``).
    solver: one of ``SOLVERS`` or ``"auto"`` (default; as in :class:`SolveConfig`, ``minres`` when the operator
    has no dense form). tol: relative residual to stop at (default
    :func:`default_tol`); max_iter: cap on iterations (default min(10·p, 2,000); for ``neumann``
    the number of terms, default 20); step: the step α of ``lissa`` and ``neumann`` (default 1/(1.05·|λ_max|), by
    power iteration).
    preconditioner: for ``minres`` and ``cg_spd``, M⁻¹ applied to (p, k) residuals, M ≈ H + λI symmetric
    positive definite (they then converge with κ(M⁻¹H) instead of κ(H)).
    approximation: for ``kfac``/``ekfac``/``arnoldi``, the fitted object whose ``solve(rhs, damping)`` gives x
    (:class:`~influkit.factored.FactoredCurvature`, :class:`~influkit.factored.ArnoldiInverse`).
    """
    if torch.is_tensor(operator):
        operator = DenseOperator(operator)
    if solver != "auto" and solver not in REGISTRY:
        raise InputError(f"unknown solver {solver!r}; choose 'auto' or one of {tuple(REGISTRY)}.")
    if damping < 0:
        raise InputError(f"damping must be ≥ 0, got {damping}.")
    if preconditioner is not None and not (solver != "auto" and REGISTRY[solver].accepts_preconditioner):
        raise InputError(f"a preconditioner applies to 'minres' and 'cg_spd', not {solver!r}.")
    if solver != "auto" and issubclass(REGISTRY[solver], _Approximation) and approximation is None:
        raise InputError(
            f"solver={solver!r} needs its fitted approximation: use SolveConfig(solver={solver!r}).solve(operator, b) "
            "or a Chain, which fit it, or pass approximation=influkit.factored.fit_curvature(...)."
        )
    config = SolveConfig(solver=solver, damping=damping, tol=tol, max_iter=max_iter, step=step)
    instance = config.build(operator)
    if isinstance(instance, _Krylov):
        instance.apply_preconditioner = preconditioner
    if isinstance(instance, _Approximation):
        instance.approximation = approximation
    return instance.solve(b, progress=progress, warn=warn)
