"""The :class:`Operator` protocol — anything that applies a symmetric p×p matrix — and the small operators.

Solvers accept any object with ``dim``, ``dtype``, ``device`` and ``matvec`` taking (p,) or (p, k). What else an
operator can do is declared by the capability protocols it satisfies, each one method or attribute:
:class:`HasDense` (``dense()``: the explicit matrix, which ``direct`` factors), :class:`Factorable`
(``factor(damping)``: a kept factorization of A + λI) and :class:`CountsProducts` (``products``: the number of
products applied so far, reported by every solve). :class:`~influkit.curvature.HessianOperator` (Hessian-vector products of
a stage objective) is the main one; this module holds the generic ones: a dense matrix (with its
factorization cached per damping, so repeated ``direct`` solves cost one triangular solve), a sum of
operators, and a dense matrix built on first use.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import torch

from .errors import ConvergenceWarning, InputError, NumericalError, warn


@runtime_checkable
class Operator(Protocol):
    """A symmetric linear operator on flat parameter vectors. ``dense()`` may be added for ``direct``."""

    @property
    def dim(self) -> int: ...

    @property
    def dtype(self) -> torch.dtype: ...

    @property
    def device(self) -> torch.device: ...

    def matvec(self, vec: torch.Tensor) -> torch.Tensor:
        """A·vec for vec of shape (p,) or (p, k)."""
        ...


@runtime_checkable
class HasDense(Protocol):
    """An operator that can form its explicit matrix."""

    def dense(self) -> torch.Tensor: ...


@runtime_checkable
class Factorable(Protocol):
    """An operator that keeps the factorization of A + λI per damping (``direct`` solves reuse it)."""

    def factor(self, damping: float = 0.0, progress: bool = False) -> "SymmetricFactor": ...


@runtime_checkable
class CountsProducts(Protocol):
    """An operator that counts the matrix-vector products it applied (``products``)."""

    products: int


def dense_form(operator) -> bool:
    """Whether ``operator`` can give its explicit matrix (:class:`HasDense` or :class:`Factorable`)."""
    return isinstance(operator, (HasDense, Factorable))


def products_of(operator) -> int:
    """The products ``operator`` applied so far (0 for one that does not count them, :class:`CountsProducts`)."""
    return operator.products if isinstance(operator, CountsProducts) else 0


def count_products(vec: torch.Tensor) -> int:
    """Number of matrix-vector products a (p,) or (p, k) argument stands for."""
    return vec.shape[1] if vec.dim() == 2 else 1


class SymmetricFactor:
    """(A + λI)⁻¹ for a dense symmetric A: Cholesky when A + λI is positive definite, else the
    eigendecomposition A = V diag(e) Vᵀ as V diag(1/(e + λ)) Vᵀ, near-zero e + λ treated as zero
    (pseudo-inverse, with a warning)."""

    def __init__(self, matrix: torch.Tensor, damping: float = 0.0):
        if not torch.isfinite(matrix).all():
            raise NumericalError("the dense Hessian holds NaN/Inf; compute it in float64 or add damping.")
        eye = torch.eye(matrix.shape[0], dtype=matrix.dtype, device=matrix.device)
        self.shifted = matrix + damping * eye
        self.damping = float(damping)
        self.cholesky, info = torch.linalg.cholesky_ex(self.shifted)
        self.eigen: tuple[torch.Tensor, torch.Tensor] | None = None
        self.indefinite = False  # H has eigenvalues below −cutoff (known when Cholesky failed)
        self.extremes: tuple[float, float] | None = None  # A's smallest and largest eigenvalue (when eigh ran)
        if int(info) != 0:
            self.cholesky = None
            evals, evecs = torch.linalg.eigh(matrix)
            if not torch.isfinite(evals).all():
                raise NumericalError("the Hessian's eigendecomposition failed (NaN); use float64 or add damping.")
            self.extremes = (float(evals[0]), float(evals[-1]))
            shifted = evals + damping
            cutoff = shifted.abs().max() * matrix.shape[0] * torch.finfo(matrix.dtype).eps
            keep = shifted.abs() > cutoff
            self.indefinite = bool(evals.min() < -cutoff)
            if not keep.all():
                warn(_singular_advice(evals, damping, int((~keep).sum()), float(cutoff)), ConvergenceWarning)
            inverse = torch.where(keep, 1.0 / torch.where(keep, shifted, torch.ones_like(shifted)), torch.zeros_like(shifted))
            self.eigen = (inverse, evecs)

    def solve(self, rhs: torch.Tensor) -> torch.Tensor:
        """(A + λI)⁻¹ rhs for rhs of shape (p, k)."""
        if self.cholesky is not None:
            return torch.cholesky_solve(rhs, self.cholesky)
        inverse, evecs = self.eigen
        return evecs @ (inverse[:, None] * (evecs.T @ rhs))


def _singular_advice(evals: torch.Tensor, damping: float, dropped: int, cutoff: float) -> str:
    """Why H + λI has eigenvalues at zero, and what makes it invertible: an indefinite H (eigenvalues on both
    sides of −λ: the stage is not at a minimum), or a positive semi-definite H without damping."""
    lowest, largest = float(evals.min()), float(evals.abs().max())
    head = f"{dropped} eigenvalues of H + λI (λ = {damping:g}) within {cutoff:.1e} of zero were treated as zero (pseudo-inverse)"
    if lowest < -cutoff:
        negative = int((evals + damping < -cutoff).sum())
        return (f"the Hessian is indefinite: {negative} eigenvalues of H + λI are negative (H's smallest {lowest:.2e}), "
                f"so the stage is not at a minimum (e.g. trained for a few Adam steps, or a saddle); {head}. Solve the "
                "positive semi-definite Gauss-Newton matrix instead, curvature=CurvatureConfig(matrix='gauss-newton') "
                f"with SolveConfig(damping={1e-3 * largest:.1e}) (1e-3 of ‖H‖), or use damping > {-lowest:.2e} "
                "(−λ_min(H)).")
    return (f"the Hessian is singular: {head}; add damping (e.g. damping={max(1e-3 * largest, 10 * cutoff):.1e}, "
            "1e-3 of ‖H‖) or a regularizer for a unique answer.")


class DenseOperator:
    """A dense symmetric matrix as an :class:`Operator`; its factorization is cached per damping."""

    def __init__(self, matrix: torch.Tensor):
        if matrix.dim() != 2 or matrix.shape[0] != matrix.shape[1]:
            raise InputError(f"a Hessian must be a square matrix, got shape {tuple(matrix.shape)}.")
        self.matrix = matrix
        self.products = 0
        self._factors: dict[float, SymmetricFactor] = {}

    @property
    def dim(self) -> int:
        return self.matrix.shape[0]

    @property
    def dtype(self) -> torch.dtype:
        return self.matrix.dtype

    @property
    def device(self) -> torch.device:
        return self.matrix.device

    def matvec(self, vec: torch.Tensor) -> torch.Tensor:
        self.products += count_products(vec)
        return self.matrix @ vec

    def dense(self) -> torch.Tensor:
        return self.matrix

    def factor(self, damping: float = 0.0, progress: bool = False) -> SymmetricFactor:
        """The (cached) factorization of matrix + damping·I (``progress``: unused, the matrix is at hand)."""
        if float(damping) not in self._factors:
            self._factors[float(damping)] = SymmetricFactor(self.matrix, damping)
        return self._factors[float(damping)]


class SumOperator:
    """The sum A = Σ_k A_k of operators on the same vectors, as one operator."""

    def __init__(self, operators: Sequence[Operator]):
        if not operators:
            raise InputError("a sum of operators needs at least one operator.")
        dims = {op.dim for op in operators}
        if len(dims) != 1:
            raise InputError(f"operators of different sizes {sorted(dims)} cannot be summed.")
        self.operators = list(operators)

    @property
    def dim(self) -> int:
        return self.operators[0].dim

    @property
    def dtype(self) -> torch.dtype:
        return self.operators[0].dtype

    @property
    def device(self) -> torch.device:
        return self.operators[0].device

    @property
    def products(self) -> int:
        return sum(products_of(op) for op in self.operators)

    def matvec(self, vec: torch.Tensor) -> torch.Tensor:
        return sum(op.matvec(vec) for op in self.operators)

    def dense(self) -> torch.Tensor:
        """The explicit matrix (sum of the parts' dense matrices)."""
        return sum(op.dense() for op in self.operators)


class LazyDenseOperator(DenseOperator):
    """A dense symmetric operator whose matrix is built on first use (e.g. the identity ablation never needs it)."""

    def __init__(self, dim: int, build: Callable[[], torch.Tensor], dtype: torch.dtype, device: torch.device):
        self._dim, self._dtype, self._device = dim, dtype, torch.device(device)
        self._build = build
        self._matrix: torch.Tensor | None = None
        self.products = 0
        self._factors = {}

    @property
    def matrix(self) -> torch.Tensor:
        if self._matrix is None:
            self._matrix = self._build()
        return self._matrix

    @property
    def dim(self) -> int:
        return self._dim

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    @property
    def device(self) -> torch.device:
        return self._device
