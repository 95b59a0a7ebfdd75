"""influkit.krylov: each iteration against a dense float64 solve (torch.linalg) of the same system.

CG, MINRES (plain, preconditioned and with the roundoff floor), LiSSA's Richardson iteration and the power
iteration are called directly on explicit matrices, batched over columns of different scales, and compared with
``torch.linalg.solve`` / ``eigvalsh``; MINRES's Lanczos tridiagonal must reveal A's inertia.
"""

from __future__ import annotations

import pytest
import torch

from influkit import krylov
from influkit.errors import NumericalError


class Counter:
    """A progress bar stand-in that counts the iterations reported to it."""

    def __init__(self):
        self.n = 0

    def update(self, k):
        self.n += k


def symmetric(p=40, evals=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(p, p, generator=gen, dtype=torch.float64))
    return (q * evals) @ q.T


def spd(p=40, cond=1e3, seed=0):
    return symmetric(p, torch.logspace(0, torch.log10(torch.tensor(cond)).item(), p, dtype=torch.float64), seed)


def indefinite(p=40, seed=0):
    evals = torch.linspace(0.5, 8.0, p, dtype=torch.float64) * torch.where(torch.arange(p) % 4 == 0, -1.0, 1.0)
    return symmetric(p, evals, seed)


def targets(p=40, k=3, seed=1):
    """k right-hand sides scaled 1, 1e3, 1e-3: the stopping test is relative per column."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(p, k, generator=gen, dtype=torch.float64) * torch.tensor([1.0, 1e3, 1e-3])[:k]


def rel_err(x, expected):
    return ((x - expected).norm(dim=0) / expected.norm(dim=0)).max().item()


def test_cg_matches_dense_solve_per_column():
    a, c = spd(), targets()
    bar = Counter()
    x, iterations = krylov.cg(lambda v: a @ v, c, tol=1e-12, max_iter=500, bar=bar, require_positive=True)
    assert rel_err(x, torch.linalg.solve(a, c)) <= 1e-9
    assert 0 < iterations <= 500 and bar.n == iterations
    assert ((c - a @ x).norm(dim=0) / c.norm(dim=0)).max() <= 1e-12
    # batching changes nothing: each column alone gives the same solution (a batch iterates until its last column
    # converges, so a column may take one step more than alone: the same vector to the solve's tolerance, not bits)
    for j in range(c.shape[1]):
        alone, _ = krylov.cg(lambda v: a @ v, c[:, j:j + 1], 1e-12, 500, Counter(), require_positive=True)
        assert rel_err(alone[:, 0], x[:, j]) <= 1e-12


def test_cg_preconditioner_same_solution_fewer_iterations():
    # badly scaled SPD: D S D with S well conditioned; the Jacobi preconditioner undoes the scaling
    d = torch.logspace(-2, 2, 40, dtype=torch.float64)
    a = d[:, None] * spd(cond=10.0) * d[None, :]
    c = targets()
    plain, n_plain = krylov.cg(lambda v: a @ v, c, 1e-11, 2000, Counter(), require_positive=True)
    jacobi, n_jacobi = krylov.cg(lambda v: a @ v, c, 1e-11, 2000, Counter(), require_positive=True,
                                 preconditioner=lambda r: r / a.diagonal()[:, None])
    expected = torch.linalg.solve(a, c)
    assert rel_err(jacobi, expected) <= 1e-6 and rel_err(plain, expected) <= 1e-5
    assert n_jacobi < n_plain


def test_cg_stops_at_negative_curvature_and_says_so():
    a, c = indefinite(), targets()
    stats = {}
    _, iterations = krylov.cg(lambda v: a @ v, c, 1e-12, 500, Counter(), require_positive=True, stats=stats)
    assert stats.get("negative_curvature") is True and iterations < 500
    # without the check it runs on (CG's recurrences do not need positive curvature to be defined)
    stats = {}
    krylov.cg(lambda v: a @ v, c, 1e-12, 20, Counter(), require_positive=False, stats=stats)
    assert "negative_curvature" not in stats


def test_cg_zero_column_stays_zero():
    a, c = spd(), targets()
    c[:, 1] = 0.0
    x, _ = krylov.cg(lambda v: a @ v, c, 1e-12, 500, Counter(), require_positive=True)
    assert torch.equal(x[:, 1], torch.zeros(40, dtype=torch.float64)) and torch.isfinite(x).all()
    assert rel_err(x[:, [0, 2]], torch.linalg.solve(a, c[:, [0, 2]])) <= 1e-9


def test_minres_solves_indefinite_and_its_lanczos_counts_negative_eigenvalues():
    a, c = indefinite(), targets()
    stats = {}
    x, iterations = krylov.minres(lambda v: a @ v, c, 1e-12, 500, Counter(), stats=stats)
    assert rel_err(x, torch.linalg.solve(a, c)) <= 1e-9
    assert 0 < iterations <= 500
    # the largest ‖A v‖/‖v‖ over the Lanczos vectors: a lower bound of ‖A‖₂ = 8, of its order
    assert 4.0 <= stats["norm"] <= 8.0 + 1e-9
    # k < p Lanczos steps: T_k's eigenvalues interlace A's, so T_k has between 1 and A's 10 negative ones
    # (run to p steps and beyond, lost orthogonality repeats converged Ritz values: the count may then exceed 10)
    negatives = int((torch.linalg.eigvalsh(a) < 0).sum())
    stats = {}
    krylov.minres(lambda v: a @ v, c, 1e-12, 20, Counter(), stats=stats)
    assert negatives == 10 and 1 <= krylov.negative_ritz_values(stats["lanczos"]) <= negatives
    stats = {}
    krylov.minres(lambda v: spd() @ v, c, 1e-12, 500, Counter(), stats=stats)
    assert krylov.negative_ritz_values(stats["lanczos"]) == 0


def test_minres_preconditioned_matches_dense_and_refuses_indefinite_preconditioner():
    a, c = indefinite(), targets()
    m_inv = torch.linalg.inv(spd(cond=10.0, seed=3))
    x, _ = krylov.minres(lambda v: a @ v, c, 1e-11, 500, Counter(), preconditioner=lambda r: m_inv @ r)
    assert rel_err(x, torch.linalg.solve(a, c)) <= 1e-8
    assert ((c - a @ x).norm(dim=0) / c.norm(dim=0)).max() <= 1e-11  # the true residual is what stops it
    with pytest.raises(NumericalError, match="not positive definite"):
        krylov.minres(lambda v: a @ v, c, 1e-11, 500, Counter(), preconditioner=lambda r: -r)


def test_minres_roundoff_floor_is_returned_and_respected():
    a, c = indefinite(), targets()
    eps = torch.finfo(torch.float64).eps
    x, _, floor = krylov.minres(lambda v: a @ v, c, 1e-14, 500, Counter(), eps=eps)
    relres = ((c - a @ x).norm(dim=0) / c.norm(dim=0)).max().item()
    # floor = eps·(‖A‖‖x‖/‖c‖ + 1) ≥ eps; it stopped at the tolerance or the floor; x is the solution
    assert eps <= floor <= 1e-12
    assert relres <= max(1e-14, floor) * 10
    assert rel_err(x, torch.linalg.solve(a, c)) <= 1e-10


def test_richardson_is_the_truncated_neumann_series_and_converges():
    a, c = spd(cond=10.0), targets()
    scale = 1.2 * torch.linalg.eigvalsh(a).max().item()
    x5, iterations = krylov.richardson(lambda v: a @ v, c, scale, tol=0.0, max_iter=5, bar=Counter())
    step = torch.eye(40, dtype=torch.float64) - a / scale
    series = sum(torch.linalg.matrix_power(step, i) for i in range(6)) @ c / scale  # Σ_{i=0}^{5} (I − A/s)^i c / s
    assert iterations == 5 and torch.allclose(x5, series, rtol=1e-12, atol=0)
    x, iterations = krylov.richardson(lambda v: a @ v, c, scale, tol=1e-10, max_iter=5000, bar=Counter())
    assert iterations < 5000 and rel_err(x, torch.linalg.solve(a, c)) <= 1e-9


def test_largest_eigenvalue_is_the_spectral_radius():
    evals = torch.cat([torch.linspace(-3.0, 2.0, 39, dtype=torch.float64), torch.tensor([-6.0])])
    a = symmetric(40, evals)
    value = krylov.largest_eigenvalue(lambda v: a @ v, torch.zeros(40, dtype=torch.float64), steps=200)
    assert value == pytest.approx(6.0, rel=1e-8)
    assert krylov.largest_eigenvalue(lambda v: 0 * v, torch.zeros(40, dtype=torch.float64)) == 0.0
