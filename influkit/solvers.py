"""Inverse-Hessian solvers as objects behind one interface, chosen from a :class:`SolveConfig` by a registry.

A :class:`Solver` is built for one config (``SolveConfig.build``), prepared once on an operator (``prepare``:
the dense factorization, the fitted factored curvature or eigenpairs the method needs, kept on
``operator.fitted``/the operator's factor cache), then solves any number of right-hand sides (``solve(b)``);
``state``/``load`` persist what ``prepare`` built. ``solve(operator, b, solver, damping=λ)`` is the one-call form.
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
| ``lissa``  | (H + λI) x = b            | 1 HVP / step    | κ(H) (slow)    | Richardson iteration with a scale  |
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
says so (``Solution.floor``: the residual float32 arithmetic can certify for that x).
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import ClassVar

import torch
from tqdm.auto import tqdm

from . import krylov
from .auto import Choice, Training, decide
from .curvature import CURVATURES
from .errors import ConvergenceWarning, InputError, NumericalError
from .factored import FISHER, ArnoldiInverse, FactoredCurvature, FactoredCurvatureError, deflated, fit_curvature, lanczos
from .operators import DenseOperator, Operator, SymmetricFactor
from .params import ParamSpace, point

METHODS = ("direct", "cg", "cg_spd", "minres", "lissa", "identity")
APPROXIMATIONS = ("kfac", "ekfac", "arnoldi")
SOLVERS = METHODS + APPROXIMATIONS  # the built-in solvers; :func:`register` adds more
PRECONDITIONERS = ("kfac", "ekfac", "diagonal")


@dataclass
class Solution:
    """The result of one (batched) inverse-Hessian solve.

    residual: the largest relative residual ‖A x − c‖ / ‖c‖ over the columns, for the system A x = c the
    method solves (see the module table); NaN for ``identity``, which solves nothing.
    choice: why this method (and preconditioner) ran (set when :class:`SolveConfig` chose it with ``solver="auto"``).
    preconditioner: what preconditioned an iterative solve, or which fitted approximation gave x ("" if none).
    floor: the relative residual the operator's precision can certify for this x, ε·(‖A‖‖x‖/‖b‖ + 1)
    (NaN where not estimated); a residual near it cannot be improved by iterating.
    """

    x: torch.Tensor
    method: str
    iterations: int
    residual: float
    converged: bool
    seconds: float
    products: int
    damping: float
    choice: str = ""
    preconditioner: str = ""
    floor: float = math.nan

    def summary(self) -> dict:
        """The diagnostics without the solution vector."""
        out = asdict(self)
        out.pop("x")
        return out


@dataclass(frozen=True)
class SolveConfig:
    """How one inverse-Hessian system (H + λI) x = b is solved: the settings every influence method shares.

    solver: one of ``SOLVERS`` or ``"auto"`` (:func:`influkit.auto.decide`: in a Chain from where each stage
    stands — exact solves at a minimum, the damped Gauss-Newton matrix off it; for a bare operator ``direct`` for
    p ≤ ``auto.DIRECT_MAX``, else ``minres``; the choice and its reason are recorded in :attr:`Solution.choice`).
    With ``"auto"``, a damping > 0, ``curvature="gauss-newton"`` and a ``preconditioner`` are kept as given.
    ``"kfac"``/``"ekfac"``/``"arnoldi"`` are approximate inverses (x = C⁻¹ b, no iteration).
    damping: λ ≥ 0 added to H (to H² for ``cg``). tol, max_iter: stopping rule of iterative solvers
    (defaults: :func:`default_tol`, min(10·p, 2,000)). hessian_samples: estimate H on a seeded random
    sample of this many examples (seed ``seed``). preconditioner: for ``minres``/``cg_spd``, ``"ekfac"``,
    ``"kfac"`` or ``"diagonal"`` (M = C + λI from :func:`influkit.factored.fit_curvature`; with λ = 0,
    1e-3·trace(C)/p keeps M ≻ 0), or M⁻¹ as a callable on (p, k) residuals, M ≈ H + λI positive definite.
    fisher: how the factored curvature estimates the Gauss-Newton matrix: ``"sampled"`` labels (default;
    cross-entropy or squared-error losses), ``"empirical"`` (true labels, any loss), ``"exact"``
    (:mod:`influkit.factored.fisher`). rank: eigenpairs of ``"arnoldi"`` and of ``deflate`` (Lanczos steps:
    max(2·rank, rank + 20)). deflate: also deflate the preconditioner with the top-``rank`` eigenpairs of H.
    curvature: the matrix H of every solve, ``"hessian"`` (default: the exact Hessian of the stage objective) or
    ``"gauss-newton"`` (the generalized Gauss-Newton matrix G ⪰ 0, :mod:`influkit.curvature`): G's damped system
    is positive definite for convex losses, so MINRES/CG converge where an indefinite H + λI stalls, and it is
    the matrix K-FAC/EK-FAC approximate, which makes them good preconditioners of it. The links between stages
    (the Case 1/2 cross derivatives) stay exact Hessian products either way. residual: approximate inverses
    (``kfac``/``ekfac``/``arnoldi``) report the true relative residual of their x, at the cost of one exact
    Hessian-vector product over the stage's data per solve (at transformer scale as much as the rest of the query);
    ``False`` skips it and reports NaN, as kronfluence and TRAK never check. Iterative and direct solves always report it.

    training: :class:`influkit.auto.Training` (lr, steps) of this stage, for auto's damping 1/(lr·steps) off a
    minimum.

    Fitted factors and eigenpairs are kept on the operator (``operator.fitted``), so one fit serves every solve
    with it; :meth:`influkit.Chain.fit` fits them up front and :meth:`influkit.Chain.save` stores them.
    """

    solver: str = "auto"
    damping: float = 0.0
    tol: float | None = None
    max_iter: int | None = None
    hessian_samples: int | None = None
    preconditioner: str | Callable[[torch.Tensor], torch.Tensor] | None = None
    seed: int = 0
    fisher: str = "sampled"
    rank: int = 50
    deflate: bool = False
    curvature: str = "hessian"
    residual: bool = True
    training: Training | None = None

    def __post_init__(self) -> None:
        if self.solver != "auto" and self.solver not in REGISTRY:
            raise InputError(f"unknown solver {self.solver!r}; choose 'auto' or one of {tuple(REGISTRY)}.")
        if not self.damping >= 0:
            raise InputError(f"damping must be ≥ 0, got {self.damping}.")
        if self.hessian_samples is not None and self.hessian_samples <= 0:
            raise InputError(f"hessian_samples must be positive, got {self.hessian_samples}.")
        if isinstance(self.preconditioner, str):
            if self.preconditioner not in PRECONDITIONERS:
                raise InputError(f"unknown preconditioner {self.preconditioner!r}; choose one of {PRECONDITIONERS} or pass "
                                 "a callable applying M⁻¹.")
        elif self.preconditioner is not None and not callable(self.preconditioner):
            raise InputError("preconditioner must be 'ekfac', 'kfac', 'diagonal' or a callable applying M⁻¹ to (p, k) vectors.")
        if (self.preconditioner is not None or self.deflate) and not (
                self.solver == "auto" or REGISTRY[self.solver].accepts_preconditioner):
            raise InputError(f"a preconditioner (or deflate) applies to solver='minres' or 'cg_spd', not {self.solver!r}.")
        if self.fisher not in FISHER:
            raise InputError(f"unknown fisher {self.fisher!r}; choose one of {FISHER}.")
        if self.rank <= 0:
            raise InputError(f"rank must be positive, got {self.rank}.")
        if self.curvature not in CURVATURES:
            raise InputError(f"unknown curvature {self.curvature!r}; choose one of {CURVATURES}.")
        if self.training is not None and not isinstance(self.training, Training):
            raise InputError("training must be influkit.auto.Training(lr=..., steps=...).")

    def method(self, dim: int, dense: bool = True) -> tuple[str, str]:
        """(the method to run on a p = ``dim`` system where the stage's position is unknown, why)."""
        choice = self.decide(None, dim, dense=dense)
        return choice.solver, choice.reason

    def decide(self, position, dim: int, **context) -> Choice:
        """:func:`influkit.auto.decide` for these settings (``context``: n_rhs, memory, dense, shared, itemsize)."""
        pre = self.preconditioner if isinstance(self.preconditioner, str) or self.preconditioner is None else "given"
        choice = decide(position, dim, training=self.training, solver=self.solver, damping=self.damping,
                        matrix=self.curvature, preconditioner=pre, **context)
        return replace(choice, preconditioner=self.preconditioner) if pre == "given" else choice

    def chosen(self, choice: Choice) -> "SolveConfig":
        """These settings with ``choice``'s matrix, solver, damping and preconditioner in place of ``auto``'s."""
        return replace(self, solver=choice.solver, curvature=choice.matrix, damping=choice.damping,
                       preconditioner=choice.preconditioner)

    def build(self, operator: Operator, choice: Choice | None = None) -> "Solver":
        """The (unprepared) :class:`Solver` of this config for ``operator``: ``choice`` (from :meth:`decide`), else
        ``auto`` resolved for the operator's size alone."""
        if choice is None:
            choice = self.decide(None, operator.dim, dense=hasattr(operator, "dense") or hasattr(operator, "factor"))
        return REGISTRY[choice.solver](self.chosen(choice), operator, choice=choice.reason)

    def prepare(self, operator: Operator, choice: Choice | None = None, *, progress: bool = False) -> "Solver":
        """The :class:`Solver` of this config, prepared on ``operator`` (what it needs fitted, fitted once)."""
        return self.build(operator, choice).prepare(progress=progress)

    def solve(self, operator: Operator, b: torch.Tensor, *, progress: bool = False, warn: bool = True) -> "Solution":
        """x ≈ (H + λI)⁻¹ b with these settings: :meth:`prepare` then :meth:`Solver.solve`."""
        return self.prepare(operator, progress=progress).solve(b, progress=progress, warn=warn)

    def summary(self) -> dict:
        """The settings as JSON-friendly values (a callable preconditioner is named by its type)."""
        out = asdict(self)
        if callable(self.preconditioner):
            out["preconditioner"] = getattr(self.preconditioner, "__qualname__", type(self.preconditioner).__name__)
        return out


# keywords the entry points took before ``solve=SolveConfig(...)``; still accepted for one release, with a warning
DEPRECATED_SOLVE_KEYWORDS = ("solver", "damping", "tol", "max_iter", "hessian_samples", "seed")


def solve_settings(solve: "SolveConfig | Sequence[SolveConfig] | None", deprecated: Mapping[str, object], where: str,
                   stages: int = 1, default: "SolveConfig | None" = None) -> "SolveConfig | list[SolveConfig]":
    """The SolveConfig (one, or one per stage when ``stages`` > 1) of an entry point called with ``solve=`` or with
    the deprecated solve keywords (``solver=``, ``damping=``, ... — each warns, naming its replacement).

    deprecated: the extra keywords the entry point received; a keyword that is not a solve setting is a TypeError,
    as for any function. A deprecated keyword holding a (value, value, ...) tuple gives one value per stage.
    The keywords change the fields of ``default`` (or of ``SolveConfig()``); with ``solve=`` too they are refused.
    """
    unknown = sorted(set(deprecated) - set(DEPRECATED_SOLVE_KEYWORDS))
    if unknown:
        raise TypeError(f"{where}() got an unexpected keyword argument {unknown[0]!r}")
    if solve is not None and deprecated:
        raise InputError(f"{where}: give the solve settings once, in solve=SolveConfig(...) (or one per stage), not "
                         f"also as {', '.join(deprecated)}=.")
    if not deprecated:
        solve = solve if solve is not None else default if default is not None else SolveConfig()
        return solve if stages == 1 or not isinstance(solve, SolveConfig) else [solve] * stages
    solve = default if default is not None else SolveConfig()
    per_stage: list[dict] = [{} for _ in range(stages)]
    for key, value in deprecated.items():
        example = (f"solve=[influkit.SolveConfig({key}=...), ...] (one per stage)" if isinstance(value, (tuple, list))
                   else f"solve=influkit.SolveConfig({key}=...)")
        warnings.warn(f"{where}({key}=...) is deprecated and will be removed in the next release; pass {example}.",
                      DeprecationWarning, stacklevel=3)
        if isinstance(value, (tuple, list)):
            if len(value) != stages:
                raise InputError(f"{key} must be one value or one per stage ({stages}), got {value!r}.")
            for settings, v in zip(per_stage, value):
                settings[key] = v
        else:
            for settings in per_stage:
                settings[key] = value
    configs = [replace(solve, **settings) for settings in per_stage]
    return configs[0] if stages == 1 else configs


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


def _fitted(operator) -> dict:
    """The dict on ``operator`` holding what solvers fitted on it ({"curvature", "arnoldi", "notes"}), created once."""
    fitted = getattr(operator, "fitted", None)
    if fitted is None:
        fitted = {"notes": []}
        try:
            operator.fitted = fitted
        except AttributeError:  # an operator that takes no attributes: the fit lives as long as this solver
            pass
    return fitted


class Solver:
    """(H + λI)⁻¹ b, or the method's version of it, for one :class:`SolveConfig` on one operator.

    ``prepare()`` fits what the method needs (once per operator: fitted objects are kept on ``operator.fitted``);
    ``solve(b)`` returns a :class:`Solution` for b of shape (p,) or (p, k); ``state(prefix)`` → (tensors, JSON meta)
    and ``load(tensors, meta, prefix)`` persist what ``prepare`` fitted, bit for bit. Subclasses fill in
    ``_prepare`` and ``_run(rhs, tol, max_iter, bar) -> (x, iterations, residual, floor)``.
    """

    exact: ClassVar[bool] = False  # True: converged by construction (no residual test)
    iterative: ClassVar[bool] = False  # True: runs ``max_iter`` steps at most, with a progress bar
    accepts_preconditioner: ClassVar[bool] = False  # True: SolveConfig(preconditioner=..., deflate=...) applies
    warn: bool = True  # warn on an unconverged solve (and, in CG, on negative curvature)

    def __init__(self, config: SolveConfig, operator: Operator, *, choice: str = ""):
        if torch.is_tensor(operator):
            operator = DenseOperator(operator)
        self.config, self.operator, self.choice = config, operator, choice
        self.name = config.solver if config.solver != "auto" else config.method(operator.dim)[0]
        self.automatic = choice.startswith("auto")  # chosen by influkit.auto, not named by the user
        self.preconditioner_name = ""
        self.fitted = _fitted(operator)

    def prepare(self, *, progress: bool = False) -> "Solver":
        """Fit what this method needs on the operator (nothing by default). Returns self."""
        self._prepare(progress)
        return self

    def _prepare(self, progress: bool) -> None:
        pass

    def solve(self, b: torch.Tensor, *, progress: bool = False, warn: bool = True) -> Solution:
        """x ≈ (H + λI)⁻¹ b (the system of the module table), with its diagnostics."""
        operator, damping = self.operator, self.config.damping
        single = b.dim() == 1
        rhs = b.reshape(-1, 1) if single else b
        if rhs.shape[0] != operator.dim:
            raise InputError(f"right-hand side has {rhs.shape[0]} rows, the Hessian is {operator.dim}×{operator.dim}.")
        if not torch.isfinite(rhs).all():
            raise NumericalError("the right-hand side holds NaN or Inf (a gradient overflowed); check the model and data.")
        tol = default_tol(rhs.dtype) if self.config.tol is None else self.config.tol
        max_iter = min(10 * operator.dim, 2000) if self.config.max_iter is None else self.config.max_iter
        start_products = getattr(operator, "products", 0)
        start = time.perf_counter()
        self.warn = warn
        bar = tqdm(total=max_iter, desc=f"{self.name} solve", disable=not (progress and self.iterative), leave=False)
        x, iterations, residual, floor = self._run(rhs, tol, max_iter, bar)
        bar.close()
        if not torch.isfinite(x).all():
            raise NumericalError(
                f"the {self.name} solve produced NaN/Inf after {iterations} iterations; increase damping or use "
                "float64."
            )
        converged = self.exact or residual <= tol
        if not converged and warn:
            _warn_unconverged(self.name, iterations, residual, tol, floor, rhs.dtype)
        notes = list(self.fitted.get("notes", []))
        why = self.choice
        if why and self.preconditioner_name:
            why = f"{why}, preconditioned by {self.preconditioner_name}"
        return Solution(
            x=x.reshape(-1) if single else x, method=self.name, iterations=iterations, residual=float(residual),
            converged=bool(converged), seconds=time.perf_counter() - start,
            products=getattr(operator, "products", 0) - start_products, damping=float(damping),
            choice="; ".join([why] + notes) if notes else why, preconditioner=self.preconditioner_name,
            floor=float(floor),
        )

    def _run(self, rhs: torch.Tensor, tol: float, max_iter: int, bar) -> tuple[torch.Tensor, int, float, float]:
        raise NotImplementedError

    def _system(self, rhs: torch.Tensor, squared: bool = False):
        """(A, c) of the system A x = c solved: (H + λI) x = b, or (H² + λI) x = H b with ``squared``."""
        op, damping = self.operator, self.config.damping
        if squared:
            return (lambda v: op.matvec(op.matvec(v)) + damping * v), op.matvec(rhs)
        return (lambda v: op.matvec(v) + damping * v), rhs

    def state(self, prefix: str = "") -> tuple[dict[str, torch.Tensor], dict]:
        """(tensors, JSON meta) of what :meth:`prepare` fitted on the operator, for :meth:`load` (bit-identical)."""
        tensors: dict[str, torch.Tensor] = {}
        meta: dict = {"notes": list(self.fitted.get("notes", []))}
        for key in ("curvature", "arnoldi"):
            if self.fitted.get(key) is not None:
                t, meta[key] = self.fitted[key].state(f"{prefix}{key}.")
                tensors.update(t)
        return tensors, meta

    def load(self, tensors: Mapping[str, torch.Tensor], meta: Mapping, prefix: str = "") -> "Solver":
        """Put what :meth:`state` saved back on the operator instead of fitting it again. Returns self."""
        op = self.operator
        self.fitted.clear()
        self.fitted["notes"] = list(meta.get("notes", []))
        if "curvature" in meta:
            space = ParamSpace(point(op.stage.state(), op.names, getattr(op, "at", None)))
            self.fitted["curvature"] = FactoredCurvature.from_state(tensors, meta["curvature"], space, prefix + "curvature.")
        if "arnoldi" in meta:
            self.fitted["arnoldi"] = ArnoldiInverse.from_state(tensors, meta["arnoldi"], op.dtype, op.device,
                                                               prefix + "arnoldi.")
        return self.prepare()  # finds what was just restored: nothing is fitted again

    # what several methods fit: the factored curvature C and the top Lanczos eigenpairs of H

    def _curvature(self, kind: str, progress: bool):
        """The fitted factored curvature of ``kind`` on the operator (fitted now unless a matching one is kept)."""
        if not _matches(self.fitted.get("curvature"), kind, self.config, self.automatic):
            self.fitted["curvature"] = self._fit_curvature(kind, progress)
        return self.fitted["curvature"]

    def _fit_curvature(self, kind: str, progress: bool):
        config, op, notes = self.config, self.operator, self.fitted.setdefault("notes", [])
        stage = getattr(op, "stage", None)
        if stage is None:
            if self.automatic:
                notes.append("no preconditioner: the operator has no Stage to fit factors on")
                return None
            raise InputError(
                f"{kind!r} needs the Hessian operator of a Stage (the factors come from the model's layers); "
                f"got a {type(op).__name__}. Use influkit.curvature.HessianOperator or a Chain."
            )
        args = dict(names=op.names, kind=kind, indices=op.indices, extra=op.extra, at=getattr(op, "at", None),
                    seed=config.seed, progress=progress)
        try:
            return fit_curvature(stage, fisher=config.fisher, **args)
        except FactoredCurvatureError:
            if not self.automatic or config.fisher != "sampled":
                raise
            notes.append("EK-FAC on the empirical Fisher: the loss's predictive distribution is not recognised")
            return fit_curvature(stage, fisher="empirical", **args)

    def _eigenpairs(self, progress: bool) -> ArnoldiInverse:
        """The top-``rank`` Lanczos eigenpairs of H (computed now unless matching ones are kept)."""
        if not _matches_eigen(self.fitted.get("arnoldi"), self.config):
            theta, vectors, info = lanczos(self.operator, self.config.rank, seed=self.config.seed, progress=progress)
            self.fitted["arnoldi"] = ArnoldiInverse(theta, vectors, self.operator.dtype, info | {"seed": self.config.seed})
        return self.fitted["arnoldi"]


@register("identity")
class Identity(Solver):
    """x = b: every H⁻¹ replaced by I (the multi-stage paper's ablation)."""

    exact = True

    def _run(self, rhs, tol, max_iter, bar):
        return rhs.clone(), 0, math.nan, math.nan


@register("direct")
class Direct(Solver):
    """x = (H + λI)⁻¹ b from a factorization of the dense H (Cholesky, else an eigh pseudo-inverse), built once."""

    exact = True

    def _prepare(self, progress: bool) -> None:
        self._factor()

    def _factor(self) -> SymmetricFactor:
        op, damping = self.operator, self.config.damping
        if hasattr(op, "factor"):
            return op.factor(damping)
        if not hasattr(op, "dense"):
            raise InputError("solver='direct' needs an operator with a dense() Hessian; use 'minres' or 'cg'.")
        if getattr(self, "_own", None) is None:
            self._own = SymmetricFactor(op.dense(), damping)
        return self._own

    def _run(self, rhs, tol, max_iter, bar):
        factor = self._factor()
        x = factor.solve(rhs)
        residual = float(((factor.shifted @ x - rhs).norm(dim=0) / rhs.norm(dim=0).clamp_min(1e-300)).max())
        return x, 1, residual, math.nan

    def state(self, prefix: str = "") -> tuple[dict[str, torch.Tensor], dict]:
        tensors, meta = super().state(prefix)
        if getattr(self.operator, "has_dense", False):
            tensors[f"{prefix}hessian"] = self.operator.dense()
        return tensors, meta

    def load(self, tensors, meta, prefix: str = "") -> "Solver":
        if f"{prefix}hessian" in tensors:
            self.operator.restore_dense(tensors[f"{prefix}hessian"])
        return super().load(tensors, meta, prefix)


class _Krylov(Solver):
    """An iterative solve on (H + λI) x = b, optionally preconditioned (minres, cg_spd) and deflated."""

    iterative = True

    def __init__(self, config: SolveConfig, operator: Operator, *, choice: str = ""):
        super().__init__(config, operator, choice=choice)
        self.apply_preconditioner: Callable | None = None

    def _prepare(self, progress: bool) -> None:
        config = self.config
        pre = config.preconditioner if self.accepts_preconditioner else None
        if pre is None and not (config.deflate and self.accepts_preconditioner):
            return
        base, name = (pre, getattr(pre, "__qualname__", type(pre).__name__)) if callable(pre) else (None, "")
        if isinstance(pre, str):
            curvature = self._curvature(pre, progress)
            if curvature is not None:
                shift = config.damping if config.damping > 0 else 1e-3 * curvature.mean_eigenvalue()
                base, name = (lambda r: curvature.solve(r, shift)), f"{pre} ({curvature.info['fisher']} Fisher)"
        if config.deflate and self.accepts_preconditioner:
            pairs = self._eigenpairs(progress)
            base = deflated(base, pairs.eigenvalues, pairs.eigenvectors, config.damping)
            name = f"{name or 'identity'} deflated by {pairs.eigenvalues.numel()} Lanczos eigenpairs"
        self.apply_preconditioner, self.preconditioner_name = base, name


@register("minres")
class MINRES(_Krylov):
    """MINRES on (H + λI) x = b: any symmetric H, indefinite too; converges with κ(M⁻¹H)."""

    accepts_preconditioner = True

    def _run(self, rhs, tol, max_iter, bar):
        apply, target = self._system(rhs)
        pre = self.apply_preconditioner
        if pre is None and rhs.dtype == torch.float64:
            x, iterations = krylov.minres(apply, target, tol / 4, max_iter, bar)
            floor = math.nan
        else:
            eps = torch.finfo(rhs.dtype).eps
            x, iterations, floor = krylov.minres(_widened(apply, rhs.dtype), target.to(torch.float64), tol / 4, max_iter,
                                                 bar, preconditioner=_widened(pre, rhs.dtype), eps=eps)
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
        x, iterations = krylov.cg(apply, target, tol / 4, max_iter, bar, require_positive=not self.squared,
                                  preconditioner=self.apply_preconditioner, warn=self.warn)
        return x, iterations, krylov_residual(apply, x, target), math.nan


@register("cg")
class CGSquared(CG):
    """CG on (H² + λI) x = H b, the multi-stage paper's eq. 16: any symmetric H; converges with κ(H)²."""

    squared = True
    accepts_preconditioner = False


@register("lissa")
class LiSSA(_Krylov):
    """Richardson iteration x ← x + (b − (H + λI) x)/s (LiSSA, deterministic): s = ``scale`` or 1.05·|λ_max|."""

    scale: float | None = None

    def _run(self, rhs, tol, max_iter, bar):
        apply, target = self._system(rhs)
        step = self.scale if self.scale is not None else 1.05 * krylov.largest_eigenvalue(apply, rhs)
        x, iterations = krylov.richardson(apply, target, step, tol, max_iter, bar)
        return x, iterations, krylov_residual(apply, x, target), math.nan


class _Approximation(Solver):
    """x = C⁻¹ b for a fitted approximation C of H + λI (no iteration); the residual is that of the true system."""

    exact = True
    approximation = None  # set by prepare (or given to :func:`solve`)

    def _run(self, rhs, tol, max_iter, bar):
        x = self.approximation.solve(rhs, self.config.damping).to(rhs.dtype)
        if not self.config.residual:
            return x, 0, math.nan, math.nan
        apply, target = self._system(rhs)
        return x, 0, krylov_residual(apply, x, target), math.nan


@register("kfac", "ekfac")
class Factored(_Approximation):
    """K-FAC / EK-FAC: x = (C + λI)⁻¹ b with C the Kronecker-factored (eigenvalue-corrected) Gauss-Newton matrix."""

    def _prepare(self, progress: bool) -> None:
        if self.approximation is None:
            self.approximation = self._curvature(self.name, progress)
        self.preconditioner_name = f"{self.name} ({self.approximation.info['fisher']} Fisher)"


@register("arnoldi")
class Arnoldi(_Approximation):
    """Schioppa et al.: x = V (Θ + λ)⁻¹ Vᵀ b on the top-``rank`` Lanczos eigenpairs (Θ, V) of H."""

    def _prepare(self, progress: bool) -> None:
        if self.approximation is None:
            self.approximation = self._eigenpairs(progress)
        self.preconditioner_name = f"arnoldi (rank {self.approximation.eigenvalues.numel()})"


def _warn_unconverged(method: str, iterations: int, residual: float, tol: float, floor: float, dtype) -> None:
    if not math.isnan(floor) and residual <= 10 * floor:
        advice = (f"that is the floor {str(dtype).replace('torch.', '')} arithmetic can certify for this system "
                  f"(~{floor:.1e}): pass tol ≥ {10 * floor:.0e}"
                  + (", or compute in float64." if dtype != torch.float64 else ", or add damping."))
    elif method == "minres":
        advice = "raise max_iter, add damping, or precondition (preconditioner='ekfac')."
    else:
        advice = ("raise max_iter, add damping, or try solver='minres' (indefinite-safe, converges with κ(H) "
                  "instead of κ(H)²).")
    warnings.warn(f"{method} stopped after {iterations} iterations at relative residual {residual:.2e} > tol {tol:.0e}; "
                  + advice, ConvergenceWarning, stacklevel=4)


def _matches(curvature, kind: str, config: SolveConfig, automatic: bool) -> bool:
    return curvature is not None and curvature.kind == kind and curvature.info.get("seed") == config.seed and (
        curvature.info.get("fisher") == config.fisher or automatic)


def _matches_eigen(arnoldi, config: SolveConfig) -> bool:
    return arnoldi is not None and arnoldi.eigenvalues.numel() >= min(config.rank, arnoldi.eigenvectors.shape[0]) and \
        arnoldi.info.get("seed") == config.seed


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
    scale: float | None = None,
    preconditioner: Callable[[torch.Tensor], torch.Tensor] | None = None,
    approximation=None,
    progress: bool = False,
    warn: bool = True,
    **deprecated,
) -> Solution:
    """Approximately x = H⁻¹ b (with damping λ as in the module table), for b of shape (p,) or (p, k).

    operator: an :class:`~influkit.operators.Operator` (e.g. :class:`~influkit.curvature.HessianOperator`), or
    a dense symmetric (p, p) tensor. ``direct`` also needs ``operator.dense()`` (or a cached ``factor``).
    solver: one of ``SOLVERS`` or ``"auto"`` (default; as in :class:`SolveConfig`, ``minres`` when the operator
    has no dense form). ``method=`` is its deprecated name. tol: relative residual to stop at (default
    :func:`default_tol`); max_iter: cap on iterations (default min(10·p, 2,000)); scale: LiSSA's step 1/scale
    (default 1.05·|λ_max| by power iteration).
    preconditioner: for ``minres`` and ``cg_spd``, M⁻¹ applied to (p, k) residuals, M ≈ H + λI symmetric
    positive definite (they then converge with κ(M⁻¹H) instead of κ(H)).
    approximation: for ``kfac``/``ekfac``/``arnoldi``, the fitted object whose ``solve(rhs, damping)`` gives x
    (:class:`~influkit.factored.FactoredCurvature`, :class:`~influkit.factored.ArnoldiInverse`).
    """
    if "method" in deprecated:
        warnings.warn("influkit.solve(method=...) is deprecated and will be removed in the next release; pass "
                      "solver=... (the third positional argument).", DeprecationWarning, stacklevel=2)
        solver = deprecated.pop("method")
    if deprecated:
        raise TypeError(f"solve() got an unexpected keyword argument {next(iter(deprecated))!r}")
    if torch.is_tensor(operator):
        operator = DenseOperator(operator)
    if solver != "auto" and solver not in REGISTRY:
        raise InputError(f"unknown solver {solver!r}; choose 'auto' or one of {tuple(REGISTRY)}.")
    if damping < 0:
        raise InputError(f"damping must be ≥ 0, got {damping}.")
    if preconditioner is not None and not (solver != "auto" and REGISTRY[solver].accepts_preconditioner):
        raise InputError(f"a preconditioner applies to 'minres' and 'cg_spd', not {solver!r}.")
    if solver in APPROXIMATIONS and approximation is None:
        raise InputError(
            f"solver={solver!r} needs its fitted approximation: use SolveConfig(solver={solver!r}).solve(operator, b) "
            "or a Chain, which fit it, or pass approximation=influkit.factored.fit_curvature(...)."
        )
    config = SolveConfig(solver=solver, damping=damping, tol=tol, max_iter=max_iter)
    instance = config.build(operator)
    if isinstance(instance, _Krylov):
        instance.apply_preconditioner = preconditioner
    if isinstance(instance, LiSSA):
        instance.scale = scale
    if isinstance(instance, _Approximation):
        instance.approximation = approximation
    return instance.solve(b, progress=progress, warn=warn)
