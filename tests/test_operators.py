"""The Operator protocol and the generic operators: DenseOperator, SymmetricFactor, SumOperator, LazyDenseOperator."""

from __future__ import annotations

import pytest
import torch

import influkit as ik
from influkit.curvature import HessianOperator
from influkit.operators import DenseOperator, LazyDenseOperator, SumOperator, SymmetricFactor
from influkit.solvers import solve
from influkit.training import HessianFactor


def symmetric(p: int = 9, eigenvalues=None, seed: int = 0) -> torch.Tensor:
    """Q diag(e) Qᵀ with a seeded orthogonal Q (eigenvalues 1..p by default)."""
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(p, p, generator=gen))
    e = torch.arange(1.0, p + 1) if eigenvalues is None else torch.as_tensor(eigenvalues)
    return q @ torch.diag(e) @ q.T


def test_every_operator_satisfies_the_protocol(mlp_stage):
    matrix = symmetric()
    operators = [
        DenseOperator(matrix),
        SumOperator([DenseOperator(matrix), DenseOperator(matrix)]),
        LazyDenseOperator(9, lambda: matrix, matrix.dtype, "cpu"),
        HessianOperator(mlp_stage),
        HessianFactor(mlp_stage, damping=1e-3),
    ]
    for op in operators:
        assert isinstance(op, ik.Operator), type(op).__name__
        assert op.dtype == torch.float64 and op.device == torch.device("cpu")
        v = torch.randn(op.dim, 2, generator=torch.Generator().manual_seed(1))
        assert op.matvec(v).shape == (op.dim, 2) and op.matvec(v[:, 0]).shape == (op.dim,)
    assert not isinstance(matrix, ik.Operator) and not isinstance(SymmetricFactor(matrix), ik.Operator)


# ---- DenseOperator ----

def test_dense_operator_matvec_counts_products_and_caches_factors():
    matrix = symmetric()
    op = DenseOperator(matrix)
    v = torch.randn(9, 3, generator=torch.Generator().manual_seed(2))
    assert torch.equal(op.matvec(v), matrix @ v) and torch.equal(op.matvec(v[:, 1]), matrix @ v[:, 1])
    assert op.products == 4 and op.dense() is matrix and op.dim == 9
    first = op.factor(0.5)
    assert op.factor(0.5) is first  # cached per damping
    assert op.factor(0.0) is not first and op.factor(0) is op.factor(0.0)
    assert torch.allclose(first.solve(v), torch.linalg.solve(matrix + 0.5 * torch.eye(9), v), rtol=1e-12, atol=0)
    solve(op, v, "direct", damping=0.5)
    assert set(op._factors) == {0.0, 0.5}  # a direct solve reuses the cached factor
    with pytest.raises(ik.InputError, match="square"):
        DenseOperator(torch.zeros(3, 4))


# ---- SymmetricFactor: Cholesky, eigh inverse, pseudo-inverse ----

def test_cholesky_when_positive_definite():
    matrix = symmetric()
    factor = SymmetricFactor(matrix, damping=0.25)
    assert factor.cholesky is not None and factor.eigen is None
    b = torch.randn(9, 2, generator=torch.Generator().manual_seed(3))
    assert torch.allclose(factor.solve(b), torch.linalg.solve(matrix + 0.25 * torch.eye(9), b), rtol=1e-12, atol=0)


def test_eigh_inverse_when_indefinite_and_agrees_with_cholesky_on_the_same_system():
    indefinite = symmetric(eigenvalues=[-3.0, -1.0, 0.5, 1, 2, 3, 4, 5, 6])
    factor = SymmetricFactor(indefinite)
    assert factor.cholesky is None and factor.eigen is not None
    b = torch.randn(9, 2, generator=torch.Generator().manual_seed(4))
    assert torch.allclose(factor.solve(b), torch.linalg.solve(indefinite, b), rtol=1e-11, atol=0)
    # damping that makes the same matrix positive definite switches to Cholesky with the same answer
    shifted = SymmetricFactor(indefinite, damping=4.0)
    assert shifted.cholesky is not None
    assert torch.allclose(shifted.solve(b), torch.linalg.solve(indefinite + 4 * torch.eye(9), b), rtol=1e-11, atol=0)


def test_singular_matrix_gets_the_pseudo_inverse_with_a_warning():
    singular = symmetric(eigenvalues=[0.0, 0.0, -2.0, 1, 2, 3, 4, 5, 6])
    with pytest.warns(ik.ConvergenceWarning, match="2 eigenvalues"):
        factor = SymmetricFactor(singular)
    b = torch.randn(9, 3, generator=torch.Generator().manual_seed(5))
    assert torch.allclose(factor.solve(b), torch.linalg.pinv(singular, hermitian=True) @ b, rtol=0, atol=1e-12)


def test_non_finite_matrix_raises():
    matrix = symmetric()
    matrix[0, 0] = float("nan")
    with pytest.raises(ik.NumericalError, match="NaN"):
        SymmetricFactor(matrix)


# ---- SumOperator ----

def test_sum_operator_adds_matvecs_dense_and_products():
    a, b = symmetric(seed=1), symmetric(eigenvalues=torch.linspace(-1, 1, 9), seed=2)
    parts = [DenseOperator(a), DenseOperator(b)]
    total = SumOperator(parts)
    v = torch.randn(9, 4, generator=torch.Generator().manual_seed(6))
    assert torch.allclose(total.matvec(v), (a + b) @ v, rtol=1e-14, atol=1e-14)
    assert torch.equal(total.dense(), a + b)
    assert total.products == 8 and [p.products for p in parts] == [4, 4]
    x = solve(total, v, "direct").x
    assert torch.allclose(x, torch.linalg.solve(a + b, v), rtol=1e-10, atol=0)
    with pytest.raises(ik.InputError, match="different sizes"):
        SumOperator([DenseOperator(a), DenseOperator(torch.eye(3))])
    with pytest.raises(ik.InputError, match="at least one"):
        SumOperator([])


# ---- LazyDenseOperator ----

def test_lazy_dense_operator_builds_once_and_only_when_needed():
    matrix, builds = symmetric(), []

    def build():
        builds.append(1)
        return matrix

    op = LazyDenseOperator(9, build, torch.float64, "cpu")
    assert (op.dim, op.dtype, op.device) == (9, torch.float64, torch.device("cpu")) and not builds
    b = torch.randn(9, generator=torch.Generator().manual_seed(7))
    assert torch.equal(solve(op, b, "identity").x, b) and not builds  # the identity ablation never builds H
    x = solve(op, b, "direct").x
    assert torch.allclose(x, torch.linalg.solve(matrix, b), rtol=1e-12, atol=0)
    solve(op, b, "direct")
    assert torch.equal(op.matvec(b), matrix @ b)
    assert len(builds) == 1 and len(op._factors) == 1

