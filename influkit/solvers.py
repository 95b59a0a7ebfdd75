"""Inverse-Hessian solvers behind one interface: ``solve(operator, b, method, damping=λ)``.

Each method returns a :class:`Solution` (x, iterations, relative residual, converged flag, time, number of
Hessian-vector products). ``b`` may hold several right-hand sides as columns, shape (p, k).

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
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from tqdm.auto import tqdm

from .errors import ConvergenceWarning, InputError, NumericalError
from .operators import DenseOperator, Operator, SymmetricFactor

METHODS = ("direct", "cg", "cg_spd", "minres", "lissa", "identity")
APPROXIMATIONS = ("kfac", "ekfac", "arnoldi")
SOLVERS = METHODS + APPROXIMATIONS
PRECONDITIONERS = ("kfac", "ekfac", "diagonal")
PRECONDITIONED = ("minres", "cg_spd")


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


# ``solver="auto"`` factors the dense Hessian up to this many parameters and runs MINRES above it.
# benchmarks/bench_auto.py: direct (p HVPs to build H, one Cholesky) beats MINRES to float64 tolerance on the
# trained digits MLPs/CNNs measured there up to a few thousand parameters, and its factor is reused by every
# later query of a fitted Chain; above it the O(p²) memory and p HVPs grow faster than MINRES' iterations.
# Above it MINRES runs unpreconditioned: on the trained networks measured, EK-FAC preconditioning costs HVPs
# instead of saving them (benchmarks/bench_scale.py, Fashion-MNIST CNN p = 39,109, λ = 1: 35 vs 23 HVPs to the
# same tolerance, shifts 1-16 tried; λ = 0.1: residual 0.19 vs 0.087 after 60; bench_auto.py MLPs: 2-2.6x the
# iterations). ``preconditioner=`` still asks for it (or auto + an explicit preconditioner).
AUTO_DIRECT_MAX = 3000


@dataclass(frozen=True)
class SolveConfig:
    """How one inverse-Hessian system (H + λI) x = b is solved: the settings every influence method shares.

    solver: one of ``SOLVERS`` or ``"auto"`` (``direct`` for p ≤ ``AUTO_DIRECT_MAX``, else ``minres``, with
    ``preconditioner`` if one is given; the choice and its reason are recorded in :attr:`Solution.choice`).
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
    (the Case 1/2 cross derivatives) stay exact Hessian products either way.

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

    def __post_init__(self) -> None:
        if self.solver not in SOLVERS + ("auto",):
            raise InputError(f"unknown solver {self.solver!r}; choose 'auto' or one of {SOLVERS}.")
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
        if (self.preconditioner is not None or self.deflate) and self.solver not in PRECONDITIONED + ("auto",):
            raise InputError(f"a preconditioner (or deflate) applies to solver='minres' or 'cg_spd', not {self.solver!r}.")
        from .factored.fisher import FISHER

        if self.fisher not in FISHER:
            raise InputError(f"unknown fisher {self.fisher!r}; choose one of {FISHER}.")
        if self.rank <= 0:
            raise InputError(f"rank must be positive, got {self.rank}.")
        from .curvature import CURVATURES

        if self.curvature not in CURVATURES:
            raise InputError(f"unknown curvature {self.curvature!r}; choose one of {CURVATURES}.")

    def method(self, dim: int) -> tuple[str, str]:
        """(the method to run on a p = ``dim`` system, why)."""
        if self.solver != "auto":
            return self.solver, ""
        if dim <= AUTO_DIRECT_MAX:
            return "direct", f"auto: p = {dim} ≤ {AUTO_DIRECT_MAX}, a dense factorization is fastest"
        return "minres", f"auto: p = {dim} > {AUTO_DIRECT_MAX}, MINRES (indefinite-safe, one HVP per step)"

    def _plan(self, dim: int) -> tuple[str, str | Callable | None, bool]:
        """(method, preconditioner name or callable or None, whether Lanczos eigenpairs are needed)."""
        method, _ = self.method(dim)
        pre = self.preconditioner
        if method not in PRECONDITIONED:
            pre = None
        return method, pre, method == "arnoldi" or (self.deflate and method in PRECONDITIONED)

    def prepare(self, operator: Operator, *, progress: bool = False) -> dict:
        """Fit what this config needs on ``operator`` (factored curvature, Lanczos eigenpairs), once.

        Kept in ``operator.fitted`` ({"curvature": FactoredCurvature, "arnoldi": ArnoldiInverse, "notes": [...]})
        and returned. The curvature is fitted on the operator's stage, parameters, examples (``hessian_samples``)
        and extra term, so the operator must be a :class:`~influkit.curvature.HessianOperator` (``solver="auto"``
        falls back to no preconditioner otherwise, and to ``fisher="empirical"`` for losses whose predictive
        distribution is not recognised; the notes say so).
        """
        method, pre, needs_eigen = self._plan(operator.dim)
        fitted = getattr(operator, "fitted", None)
        if fitted is None:
            fitted = {"notes": []}
            try:
                operator.fitted = fitted
            except AttributeError:
                pass
        kind = method if method in ("kfac", "ekfac") else pre if isinstance(pre, str) else None
        if kind is not None and not _matches(fitted.get("curvature"), kind, self):
            fitted["curvature"] = self._fit_curvature(operator, kind, fitted["notes"], progress)
        if needs_eigen and not _matches_eigen(fitted.get("arnoldi"), self):
            from .factored import ArnoldiInverse, lanczos

            theta, vectors, info = lanczos(operator, self.rank, seed=self.seed, progress=progress)
            fitted["arnoldi"] = ArnoldiInverse(theta, vectors, self.damping, operator.dtype, info | {"seed": self.seed})
        return fitted

    def _fit_curvature(self, operator, kind: str, notes: list, progress: bool):
        from .factored import FactoredCurvatureError, fit_curvature

        stage = getattr(operator, "stage", None)
        if stage is None:
            if self.solver == "auto":
                notes.append("no preconditioner: the operator has no Stage to fit factors on")
                return None
            raise InputError(
                f"{kind!r} needs the Hessian operator of a Stage (the factors come from the model's layers); "
                f"got a {type(operator).__name__}. Use influkit.curvature.HessianOperator or a Chain."
            )
        args = dict(names=operator.names, kind=kind, indices=operator.indices, extra=operator.extra,
                    at=getattr(operator, "at", None), seed=self.seed, progress=progress)
        try:
            return fit_curvature(stage, fisher=self.fisher, **args)
        except FactoredCurvatureError:
            if self.solver != "auto" or self.fisher != "sampled":
                raise
            notes.append("EK-FAC on the empirical Fisher: the loss's predictive distribution is not recognised")
            return fit_curvature(stage, fisher="empirical", **args)

    def _preconditioner(self, fitted: dict, pre, operator) -> tuple[Callable | None, str]:
        """(M⁻¹ as a callable, its name) from the fitted objects."""
        if pre is None:
            base, name = None, ""
        elif callable(pre):
            base, name = pre, getattr(pre, "__qualname__", type(pre).__name__)
        else:
            curvature = fitted.get("curvature")
            if curvature is None:
                base, name = None, ""
            else:
                shift = self.damping if self.damping > 0 else 1e-3 * curvature.mean_eigenvalue()
                base, name = (lambda r: curvature.solve(r, shift)), f"{pre} ({curvature.info['fisher']} Fisher)"
        arnoldi = fitted.get("arnoldi")
        if self.deflate and arnoldi is not None:
            from .factored import deflated

            base = deflated(base, arnoldi.eigenvalues, arnoldi.eigenvectors, self.damping)
            name = f"{name or 'identity'} deflated by {arnoldi.eigenvalues.numel()} Lanczos eigenpairs"
        return base, name

    def solve(self, operator: Operator, b: torch.Tensor, *, progress: bool = False, warn: bool = True) -> "Solution":
        """:func:`solve` with these settings (``auto`` resolved for ``operator.dim``; factors fitted if needed)."""
        method, why = self.method(operator.dim)
        _, pre, _ = self._plan(operator.dim)
        fitted = self.prepare(operator, progress=progress) if (pre is not None or method in APPROXIMATIONS or self.deflate) else {}
        preconditioner, name = self._preconditioner(fitted, pre, operator) if method in PRECONDITIONED else (None, "")
        approximation = None
        if method in ("kfac", "ekfac"):
            approximation, name = fitted["curvature"], f"{method} ({fitted['curvature'].info['fisher']} Fisher)"
        elif method == "arnoldi":
            approximation, name = fitted["arnoldi"], f"arnoldi (rank {fitted['arnoldi'].eigenvalues.numel()})"
        sol = solve(
            operator, b, method, damping=self.damping, tol=self.tol, max_iter=self.max_iter,
            preconditioner=preconditioner, approximation=approximation, progress=progress, warn=warn,
        )
        notes = list(fitted.get("notes", []))
        if why and name:
            why = f"{why}, preconditioned by {name}"
        sol.choice = "; ".join([why] + notes) if notes else why
        sol.preconditioner = name
        return sol

    def fitted_state(self, operator: Operator, prefix: str = "") -> tuple[dict[str, torch.Tensor], dict]:
        """(tensors, JSON meta) of what :meth:`prepare` fitted on ``operator``, for :meth:`restore` (bit-identical)."""
        fitted = getattr(operator, "fitted", None) or {}
        tensors: dict[str, torch.Tensor] = {}
        meta: dict = {"notes": list(fitted.get("notes", []))}
        if fitted.get("curvature") is not None:
            t, m = fitted["curvature"].state(prefix + "curvature.")
            tensors.update(t)
            meta["curvature"] = m
        if fitted.get("arnoldi") is not None:
            t, m = fitted["arnoldi"].state(prefix + "arnoldi.")
            tensors.update(t)
            meta["arnoldi"] = m
        return tensors, meta

    def restore(self, operator: Operator, tensors: dict[str, torch.Tensor], meta: dict, prefix: str = "") -> dict:
        """Put the fitted objects saved by :meth:`fitted_state` back on ``operator``; returns ``operator.fitted``."""
        from .factored import ArnoldiInverse, FactoredCurvature
        from .params import ParamSpace, point

        fitted: dict = {"notes": list(meta.get("notes", []))}
        if "curvature" in meta:
            space = ParamSpace(point(operator.stage.state(), operator.names, getattr(operator, "at", None)))
            fitted["curvature"] = FactoredCurvature.from_state(tensors, meta["curvature"], space, prefix + "curvature.")
        if "arnoldi" in meta:
            fitted["arnoldi"] = ArnoldiInverse.from_state(tensors, meta["arnoldi"], self.damping, operator.dtype,
                                                          operator.device, prefix + "arnoldi.")
        operator.fitted = fitted
        return fitted

    def summary(self) -> dict:
        """The settings as JSON-friendly values (a callable preconditioner is named by its type)."""
        out = asdict(self)
        if callable(self.preconditioner):
            out["preconditioner"] = getattr(self.preconditioner, "__qualname__", type(self.preconditioner).__name__)
        return out


def _matches(curvature, kind: str, config: SolveConfig) -> bool:
    return curvature is not None and curvature.kind == kind and curvature.info.get("seed") == config.seed and (
        curvature.info.get("fisher") == config.fisher or config.solver == "auto")


def _matches_eigen(arnoldi, config: SolveConfig) -> bool:
    return arnoldi is not None and arnoldi.eigenvalues.numel() >= min(config.rank, arnoldi.eigenvectors.shape[0]) and \
        arnoldi.info.get("seed") == config.seed


def default_tol(dtype: torch.dtype) -> float:
    """A relative-residual tolerance reachable in ``dtype``: 1e-10 in float64, 1e-4 otherwise."""
    return 1e-10 if dtype == torch.float64 else 1e-4


def solve(
    operator,
    b: torch.Tensor,
    method: str = "cg",
    *,
    damping: float = 0.0,
    tol: float | None = None,
    max_iter: int | None = None,
    scale: float | None = None,
    preconditioner: Callable[[torch.Tensor], torch.Tensor] | None = None,
    approximation=None,
    progress: bool = False,
    warn: bool = True,
) -> Solution:
    """Approximately x = H⁻¹ b (with damping λ as in the module table), for b of shape (p,) or (p, k).

    operator: an :class:`~influkit.operators.Operator` (e.g. :class:`~influkit.curvature.HessianOperator`), or
    a dense symmetric (p, p) tensor. ``direct`` also needs ``operator.dense()`` (or a cached ``factor``).
    tol: relative residual to stop at (default :func:`default_tol`); max_iter: cap on iterations
    (default min(10·p, 2,000)); scale: LiSSA's step 1/scale (default 1.05·|λ_max| by power iteration).
    preconditioner: for ``minres`` and ``cg_spd``, M⁻¹ applied to (p, k) residuals, M ≈ H + λI symmetric
    positive definite (they then converge with κ(M⁻¹H) instead of κ(H)).
    approximation: for ``kfac``/``ekfac``/``arnoldi``, the fitted object whose ``solve(rhs, damping)`` gives x
    (:class:`~influkit.factored.FactoredCurvature`, :class:`~influkit.factored.ArnoldiInverse`).
    """
    if torch.is_tensor(operator):
        operator = DenseOperator(operator)
    if method not in SOLVERS:
        raise InputError(f"unknown solver {method!r}; choose one of {SOLVERS}.")
    if damping < 0:
        raise InputError(f"damping must be ≥ 0, got {damping}.")
    if preconditioner is not None and method not in PRECONDITIONED:
        raise InputError(f"a preconditioner applies to 'minres' and 'cg_spd', not {method!r}.")
    if method in APPROXIMATIONS and approximation is None:
        raise InputError(
            f"solver={method!r} needs its fitted approximation: use SolveConfig(solver={method!r}).solve(operator, b) "
            "or a Chain, which fit it, or pass approximation=influkit.factored.fit_curvature(...)."
        )
    single = b.dim() == 1
    rhs = b.reshape(-1, 1) if single else b
    if rhs.shape[0] != operator.dim:
        raise InputError(f"right-hand side has {rhs.shape[0]} rows, the Hessian is {operator.dim}×{operator.dim}.")
    if not torch.isfinite(rhs).all():
        raise NumericalError("the right-hand side holds NaN or Inf (a gradient overflowed); check the model and data.")
    tol = default_tol(rhs.dtype) if tol is None else tol
    max_iter = min(10 * operator.dim, 2000) if max_iter is None else max_iter
    start_products = getattr(operator, "products", 0)
    start = time.perf_counter()
    floor = math.nan

    if method == "identity":
        x, iterations, residual = rhs.clone(), 0, math.nan
    elif method == "direct":
        x, iterations, residual = _direct(operator, rhs, damping)
    elif method in APPROXIMATIONS:
        x, iterations = approximation.solve(rhs, damping).to(rhs.dtype), 0
        apply, target = _system(operator, rhs, "minres", damping)
        residual = _relative_residual(apply, x, target)
    else:
        apply, target = _system(operator, rhs, method, damping)
        bar = tqdm(total=max_iter, desc=f"{method} solve", disable=not progress, leave=False)
        if method in ("cg", "cg_spd"):
            # the recurrence residual drifts from the true one: aim a little below tol
            x, iterations = _cg(
                apply, target, tol / 4, max_iter, bar, require_positive=method == "cg_spd",
                preconditioner=preconditioner, warn=warn,
            )
        elif method == "minres":
            if preconditioner is None and rhs.dtype == torch.float64:
                x, iterations = _minres(apply, target, tol / 4, max_iter, bar)
            else:
                eps = torch.finfo(rhs.dtype).eps
                x, iterations, floor = _minres(_widened(apply, rhs.dtype), target.to(torch.float64), tol / 4, max_iter,
                                               bar, preconditioner=_widened(preconditioner, rhs.dtype), eps=eps)
                x = x.to(rhs.dtype)
        else:
            step = scale if scale is not None else 1.05 * _largest_eigenvalue(apply, rhs)
            x, iterations = _richardson(apply, target, step, tol, max_iter, bar)
        bar.close()
        residual = _relative_residual(apply, x, target)

    if not torch.isfinite(x).all():
        raise NumericalError(
            f"the {method} solve produced NaN/Inf after {iterations} iterations; increase damping or use "
            "float64."
        )
    converged = method in ("identity", "direct") + APPROXIMATIONS or residual <= tol
    if not converged and warn:
        if not math.isnan(floor) and residual <= 10 * floor:
            advice = (f"that is the floor {str(rhs.dtype).replace('torch.', '')} arithmetic can certify for this system "
                      f"(~{floor:.1e}): pass tol ≥ {10 * floor:.0e}"
                      + (", or compute in float64." if rhs.dtype != torch.float64 else ", or add damping."))
        elif method == "minres":
            advice = "raise max_iter, add damping, or precondition (preconditioner='ekfac')."
        else:
            advice = ("raise max_iter, add damping, or try solver='minres' (indefinite-safe, converges with κ(H) "
                      "instead of κ(H)²).")
        warnings.warn(
            f"{method} stopped after {iterations} iterations at relative residual {residual:.2e} > tol {tol:.0e}; "
            + advice,
            ConvergenceWarning,
            stacklevel=2,
        )
    return Solution(
        x=x.reshape(-1) if single else x,
        method=method,
        iterations=iterations,
        residual=float(residual),
        converged=bool(converged),
        seconds=time.perf_counter() - start,
        products=getattr(operator, "products", 0) - start_products,
        damping=float(damping),
        floor=float(floor),
    )


def _widened(fn: Callable | None, dtype: torch.dtype) -> Callable | None:
    """fn on float64 vectors for an operator/preconditioner working in ``dtype`` (cast in, cast back to float64)."""
    if fn is None or dtype == torch.float64:
        return fn
    return lambda v: fn(v.to(dtype)).to(torch.float64)


def _system(operator, rhs: torch.Tensor, method: str, damping: float):
    """(A, c) of the system A x = c that ``method`` solves."""
    if method == "cg":
        return (lambda v: operator.matvec(operator.matvec(v)) + damping * v), operator.matvec(rhs)
    return (lambda v: operator.matvec(v) + damping * v), rhs


def _relative_residual(apply: Callable, x: torch.Tensor, target: torch.Tensor) -> float:
    norms = target.norm(dim=0)
    res = (apply(x) - target).norm(dim=0) / norms.clamp_min(torch.finfo(target.dtype).tiny)
    return float(torch.where(norms > 0, res, torch.zeros_like(res)).max())


def _direct(operator, rhs: torch.Tensor, damping: float):
    """x = (H + λI)⁻¹ b from the operator's cached factorization, or from a factorization of its dense()."""
    if hasattr(operator, "factor"):
        factor = operator.factor(damping)
    elif hasattr(operator, "dense"):
        factor = SymmetricFactor(operator.dense(), damping)
    else:
        raise InputError("solver='direct' needs an operator with a dense() Hessian; use 'minres' or 'cg'.")
    x = factor.solve(rhs)
    residual = float(((factor.shifted @ x - rhs).norm(dim=0) / rhs.norm(dim=0).clamp_min(1e-300)).max())
    return x, 1, residual


def _cg(apply, target, tol, max_iter, bar, require_positive: bool, preconditioner=None, warn: bool = True):
    """Batched (preconditioned) conjugate gradients on A x = c, A symmetric positive definite, a column each."""
    precondition = preconditioner or (lambda r: r)
    x = torch.zeros_like(target)
    r = target.clone()
    z = precondition(r)
    p = z.clone()
    rz = (r * z).sum(0)
    bnorm = target.norm(dim=0).clamp_min(torch.finfo(target.dtype).tiny)
    iterations = 0
    for iterations in range(1, max_iter + 1):
        active = r.norm(dim=0) / bnorm > tol
        if not active.any():
            iterations -= 1
            break
        ap = apply(p)
        curvature = (p * ap).sum(0)
        if require_positive and (curvature[active] <= 0).any():
            if not warn:
                break
            warnings.warn(
                "plain CG met negative curvature: H + λI is not positive definite; use solver='cg' (on H²) "
                "or 'minres'.",
                ConvergenceWarning,
                stacklevel=4,
            )
            break
        alpha = torch.where(active, rz / torch.where(active, curvature, torch.ones_like(curvature)), torch.zeros_like(rz))
        x = x + alpha * p
        r = r - alpha * ap
        z = precondition(r)
        rz_new = (r * z).sum(0)
        beta = torch.where(active, rz_new / rz.clamp_min(torch.finfo(rz.dtype).tiny), torch.zeros_like(rz))
        p = z + beta * p
        rz = torch.where(active, rz_new, rz)
        bar.update(1)
    return x, iterations


def _minres(apply, target, tol, max_iter, bar, preconditioner=None, eps: float | None = None):
    """Batched MINRES (Paige & Saunders 1975) on A x = c for symmetric, possibly indefinite A.

    Lanczos builds a basis v_j of the Krylov space; a running QR of the tridiagonal matrix by Givens rotations
    (cs, sn) gives the iterate minimizing ‖A x − c‖ over the space, and phibar is that residual norm, so the
    stopping test costs nothing. With a preconditioner (M⁻¹, symmetric positive definite) the Lanczos process
    runs in the M⁻¹ inner product (v_j = M⁻¹-scaled) and x minimizes ‖A x − c‖_{M⁻¹}; phibar is then that
    norm, so the true residual c − A x is carried alongside (A w_j from the same products, no extra HVP) and
    the stopping test uses it.

    eps: given (the unit roundoff of the operator's products), the residual is carried as above even without
    a preconditioner, a column stops once its residual is below ``floor`` = eps·(‖A‖‖x‖/‖c‖ + 1) (‖A‖
    estimated from the products; measured on float32 matrices, the true residual stalls at 0.3-0.5 of it, so
    iterating further cannot be certified), and the call returns
    (x, iterations, largest floor); otherwise (x, iterations).
    """
    tiny = torch.finfo(target.dtype).tiny
    track = preconditioner is not None or eps is not None
    zeros = torch.zeros(target.shape[1], dtype=target.dtype, device=target.device)
    bnorm = target.norm(dim=0)
    x = torch.zeros_like(target)
    r1 = target.clone()
    r2 = target.clone()
    if preconditioner is not None:
        y = preconditioner(target)
        inner = (target * y).sum(0)
        if (inner < 0).any() or not torch.isfinite(inner).all():
            raise NumericalError("the preconditioner is not positive definite (bᵀM⁻¹b < 0); add damping to it.")
        beta1 = inner.sqrt()
    else:
        y = target.clone()
        beta1 = bnorm.clone()
    beta, oldb = beta1.clone(), zeros.clone()
    dbar, epsln, cs, sn = zeros.clone(), zeros.clone(), -torch.ones_like(zeros), zeros.clone()
    phibar = beta1.clone()
    w = torch.zeros_like(target)
    w2 = torch.zeros_like(target)
    if track:
        ax, aw, aw2 = torch.zeros_like(target), torch.zeros_like(target), torch.zeros_like(target)
    anorm = zeros.clone()
    floor = zeros.clone()
    active = beta1 > 0
    iterations = 0
    for iterations in range(1, max_iter + 1):
        if track:
            relres = (target - ax).norm(dim=0) / bnorm.clamp_min(tiny)
            if eps is not None:
                floor = eps * (anorm * x.norm(dim=0) / bnorm.clamp_min(tiny) + 1)
            active = active & (relres > tol) & (relres > floor)
        else:
            active = active & (phibar > tol * beta1)
        if not active.any():
            iterations -= 1
            break
        # normalize converged columns too: their (unused) Lanczos vectors would otherwise grow until they overflow
        safe_beta = torch.where(beta > tiny, beta, torch.ones_like(beta))
        v = y / safe_beta
        av = apply(v)
        anorm = torch.maximum(anorm, av.norm(dim=0) / v.norm(dim=0).clamp_min(tiny))
        y = av
        if iterations >= 2:
            y = y - (beta / torch.where(oldb > tiny, oldb, torch.ones_like(oldb))) * r1
        alfa = (v * y).sum(0)
        y = y - (alfa / safe_beta) * r2
        r1, r2 = r2, y
        if preconditioner is not None:
            y = preconditioner(r2)
            oldb, beta = beta, (r2 * y).sum(0).clamp_min(0).sqrt()
        else:
            oldb, beta = beta, y.norm(dim=0)
        oldeps = epsln
        delta = cs * dbar + sn * alfa
        gbar = sn * dbar - cs * alfa
        epsln = sn * beta
        dbar = -cs * beta
        gamma = torch.sqrt(gbar**2 + beta**2).clamp_min(tiny)
        cs, sn = gbar / gamma, beta / gamma
        phi = cs * phibar
        phibar = torch.where(active, sn * phibar, phibar)
        w1, w2 = w2, w
        w = (v - oldeps * w1 - delta * w2) / gamma
        x = torch.where(active, x + phi * w, x)
        if track:
            aw1, aw2 = aw2, aw
            aw = (av - oldeps * aw1 - delta * aw2) / gamma
            ax = torch.where(active, ax + phi * aw, ax)
        bar.update(1)
    if eps is not None:
        return x, iterations, float(floor.max())
    return x, iterations


def _largest_eigenvalue(apply, like: torch.Tensor, steps: int = 30) -> float:
    """|λ_max| of the operator by power iteration from a seeded random start."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    v = torch.randn(like.shape[0], 1, generator=gen, dtype=like.dtype).to(like.device)
    v = v / v.norm()
    value = 0.0
    for _ in range(steps):
        av = apply(v)
        value = float(av.norm())
        if value == 0.0:
            break
        v = av / value
    return value


def _richardson(apply, target, scale, tol, max_iter, bar):
    """LiSSA (Agarwal et al.) in its deterministic form: x ← x + (c − A x)/scale, i.e. x = Σ_j (I − A/s)^j c / s."""
    x = target / scale
    bnorm = target.norm(dim=0).clamp_min(torch.finfo(target.dtype).tiny)
    iterations = 0
    for iterations in range(1, max_iter + 1):
        residual = target - apply(x)
        if ((residual.norm(dim=0) / bnorm) <= tol).all():
            break
        x = x + residual / scale
        bar.update(1)
    return x, iterations
