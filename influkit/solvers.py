"""Inverse-Hessian solvers behind one interface: ``solve(operator, b, method, damping=λ)``.

Each method returns a :class:`Solution` (x, iterations, relative residual, converged flag, time, number of
Hessian-vector products). ``b`` may hold several right-hand sides as columns, shape (p, k).

| method     | solves                    | needs           | converges with | notes                              |
|------------|---------------------------|-----------------|----------------|------------------------------------|
| ``direct`` | (H + λI) x = b            | the dense H     | exact          | p ≲ 5,000; Cholesky, else eigh     |
| ``cg``     | (H² + λI) x = H b         | 2 HVPs / step   | κ(H)²          | the multi-stage paper's eq. 16;    |
|            |                           |                 |                | any symmetric H, indefinite too    |
| ``cg_spd`` | (H + λI) x = b            | 1 HVP / step    | κ(H)           | H + λI must be positive definite   |
| ``minres`` | (H + λI) x = b            | 1 HVP / step    | κ(H)           | any symmetric H, indefinite too    |
| ``lissa``  | (H + λI) x = b            | 1 HVP / step    | κ(H) (slow)    | Richardson iteration with a scale  |
| ``identity`` | x = b                   | nothing         | —              | the paper's ablation (H := I)      |

The damping λ is a ridge on the system each method solves: note that for ``cg`` it is added to H², so
λ_cg ≈ λ² of the other methods gives a similar regularization.
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


@dataclass
class Solution:
    """The result of one (batched) inverse-Hessian solve.

    residual: the largest relative residual ‖A x − c‖ / ‖c‖ over the columns, for the system A x = c the
    method solves (see the module table); NaN for ``identity``, which solves nothing.
    choice: why this method ran (set when :class:`SolveConfig` chose it with ``solver="auto"``).
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

    def summary(self) -> dict:
        """The diagnostics without the solution vector."""
        out = asdict(self)
        out.pop("x")
        return out


# ``solver="auto"`` factors the dense Hessian up to this many parameters and runs MINRES above it.
# benchmarks/bench_auto.py: direct (p HVPs to build H, one Cholesky) beats MINRES to float64 tolerance on the
# trained digits MLPs/CNNs measured there up to a few thousand parameters, and its factor is reused by every
# later query of a fitted Chain; above it the O(p²) memory and p HVPs grow faster than MINRES' iterations.
AUTO_DIRECT_MAX = 3000


@dataclass(frozen=True)
class SolveConfig:
    """How one inverse-Hessian system (H + λI) x = b is solved: the settings every influence method shares.

    solver: one of ``METHODS`` or ``"auto"`` (``direct`` for p ≤ ``AUTO_DIRECT_MAX``, else ``minres``; the
    choice and its reason are recorded in :attr:`Solution.choice`).
    damping: λ ≥ 0 added to H (to H² for ``cg``). tol, max_iter: stopping rule of iterative solvers
    (defaults: :func:`default_tol`, min(10·p, 2,000)). hessian_samples: estimate H on a seeded random
    sample of this many examples (seed ``seed``). preconditioner: for ``cg_spd``, M⁻¹ as a callable on
    (p, k) residuals, M ≈ H + λI positive definite.
    """

    solver: str = "auto"
    damping: float = 0.0
    tol: float | None = None
    max_iter: int | None = None
    hessian_samples: int | None = None
    preconditioner: Callable[[torch.Tensor], torch.Tensor] | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.solver not in METHODS + ("auto",):
            raise InputError(f"unknown solver {self.solver!r}; choose 'auto' or one of {METHODS}.")
        if not self.damping >= 0:
            raise InputError(f"damping must be ≥ 0, got {self.damping}.")
        if self.hessian_samples is not None and self.hessian_samples <= 0:
            raise InputError(f"hessian_samples must be positive, got {self.hessian_samples}.")
        if self.preconditioner is not None and not callable(self.preconditioner):
            raise InputError("preconditioner must be a callable applying M⁻¹ to (p, k) vectors.")

    def method(self, dim: int) -> tuple[str, str]:
        """(the method to run on a p = ``dim`` system, why)."""
        if self.solver != "auto":
            return self.solver, ""
        if dim <= AUTO_DIRECT_MAX:
            return "direct", f"auto: p = {dim} ≤ {AUTO_DIRECT_MAX}, a dense factorization is fastest"
        return "minres", f"auto: p = {dim} > {AUTO_DIRECT_MAX}, MINRES (indefinite-safe, one HVP per step)"

    def solve(self, operator: Operator, b: torch.Tensor, *, progress: bool = False, warn: bool = True) -> "Solution":
        """:func:`solve` with these settings (``auto`` resolved for ``operator.dim``)."""
        method, why = self.method(operator.dim)
        sol = solve(
            operator, b, method, damping=self.damping, tol=self.tol, max_iter=self.max_iter,
            preconditioner=self.preconditioner, progress=progress, warn=warn,
        )
        sol.choice = why
        return sol

    def summary(self) -> dict:
        """The settings as JSON-friendly values (a callable preconditioner is named by its type)."""
        out = asdict(self)
        if self.preconditioner is not None:
            out["preconditioner"] = getattr(self.preconditioner, "__qualname__", type(self.preconditioner).__name__)
        return out


def default_tol(dtype: torch.dtype) -> float:
    """A relative-residual tolerance reachable in ``dtype``: 1e-10 in float64, 1e-5 otherwise."""
    return 1e-10 if dtype == torch.float64 else 1e-5


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
    progress: bool = False,
    warn: bool = True,
) -> Solution:
    """Approximately x = H⁻¹ b (with damping λ as in the module table), for b of shape (p,) or (p, k).

    operator: an :class:`~influkit.operators.Operator` (e.g. :class:`~influkit.curvature.HessianOperator`), or
    a dense symmetric (p, p) tensor. ``direct`` also needs ``operator.dense()`` (or a cached ``factor``).
    tol: relative residual to stop at (default :func:`default_tol`); max_iter: cap on iterations
    (default min(10·p, 2,000)); scale: LiSSA's step 1/scale (default 1.05·|λ_max| by power iteration).
    preconditioner: for ``cg_spd``, M⁻¹ applied to (p, k) residuals, M ≈ H + λI positive definite
    (preconditioned CG converges with κ(M⁻¹H) instead of κ(H)).
    """
    if torch.is_tensor(operator):
        operator = DenseOperator(operator)
    if method not in METHODS:
        raise InputError(f"unknown solver {method!r}; choose one of {METHODS}.")
    if damping < 0:
        raise InputError(f"damping must be ≥ 0, got {damping}.")
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

    if method == "identity":
        x, iterations, residual = rhs.clone(), 0, math.nan
    elif method == "direct":
        x, iterations, residual = _direct(operator, rhs, damping)
    else:
        apply, target = _system(operator, rhs, method, damping)
        bar = tqdm(total=max_iter, desc=f"{method} solve", disable=not progress, leave=False)
        if method in ("cg", "cg_spd"):
            # the recurrence residual drifts from the true one: aim a little below tol
            x, iterations = _cg(
                apply, target, tol / 4, max_iter, bar, require_positive=method == "cg_spd",
                preconditioner=preconditioner if method == "cg_spd" else None, warn=warn,
            )
        elif method == "minres":
            x, iterations = _minres(apply, target, tol / 4, max_iter, bar)
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
    converged = method in ("identity", "direct") or residual <= tol
    if not converged and warn:
        warnings.warn(
            f"{method} stopped after {iterations} iterations at relative residual {residual:.2e} > tol {tol:.0e}; "
            + ("raise max_iter or add damping." if method == "minres" else "raise max_iter, add damping, or try "
               "solver='minres' (indefinite-safe, converges with κ(H) instead of κ(H)²)."),
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
    )


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


def _minres(apply, target, tol, max_iter, bar):
    """Batched MINRES (Paige & Saunders 1975) on A x = c for symmetric, possibly indefinite A.

    Lanczos builds an orthonormal basis v_j of the Krylov space; a running QR of the tridiagonal matrix by
    Givens rotations (cs, sn) gives the iterate minimizing ‖A x − c‖ over the space, and phibar is that
    residual norm, so the stopping test costs nothing.
    """
    tiny = torch.finfo(target.dtype).tiny
    zeros = torch.zeros(target.shape[1], dtype=target.dtype, device=target.device)
    beta1 = target.norm(dim=0)
    x = torch.zeros_like(target)
    r1 = target.clone()
    r2 = target.clone()
    y = target.clone()
    beta, oldb = beta1.clone(), zeros.clone()
    dbar, epsln, cs, sn = zeros.clone(), zeros.clone(), -torch.ones_like(zeros), zeros.clone()
    phibar = beta1.clone()
    w = torch.zeros_like(target)
    w2 = torch.zeros_like(target)
    active = beta1 > 0
    iterations = 0
    for iterations in range(1, max_iter + 1):
        active = active & (phibar > tol * beta1)
        if not active.any():
            iterations -= 1
            break
        safe_beta = torch.where(active & (beta > tiny), beta, torch.ones_like(beta))
        v = y / safe_beta
        y = apply(v)
        if iterations >= 2:
            y = y - (beta / torch.where(oldb > tiny, oldb, torch.ones_like(oldb))) * r1
        alfa = (v * y).sum(0)
        y = y - (alfa / safe_beta) * r2
        r1, r2 = r2, y
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
        bar.update(1)
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
