
import math

import pytest
import torch

import influkit as ik
from influkit.curvature import HessianOperator
from influkit.gradients import total_grad
from influkit.solvers import APPROXIMATE_TOL, METHODS, SOLVERS, default_tol, solve
from conftest import cross_entropy, explicit_hessian


def spd_matrix(p=30, cond=1e3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(p, p, generator=gen))
    evals = torch.logspace(0, torch.log10(torch.tensor(cond)), p)
    return q @ torch.diag(evals) @ q.T, evals


def indefinite_matrix(p=30, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(p, p, generator=gen))
    evals = torch.linspace(1.0, 10.0, p) * torch.where(torch.arange(p) % 3 == 0, -1.0, 1.0)
    return q @ torch.diag(evals) @ q.T


@pytest.mark.parametrize("method,rtol", [("direct", 1e-8), ("cg", 1e-6), ("cg_spd", 1e-6), ("minres", 1e-6)])
def test_solvers_match_linalg_solve_on_real_hessian(mlp_stage, method, rtol):
    h = explicit_hessian(mlp_stage)
    op = HessianOperator(mlp_stage)
    b = torch.randn(op.dim, 3, generator=torch.Generator().manual_seed(0))
    # cg damps H²; plain CG needs H + λI positive definite (this untrained MLP's H is indefinite)
    damping = {"cg": 1e-4, "cg_spd": 1e-2 - min(0.0, float(torch.linalg.eigvalsh(h)[0]))}.get(method, 1e-2)
    system = h @ h + damping * torch.eye(op.dim) if method == "cg" else h + damping * torch.eye(op.dim)
    target = h @ b if method == "cg" else b
    expected = torch.linalg.solve(system, target)
    sol = solve(op, b, method, damping=damping, tol=1e-10, max_iter=3000)
    assert sol.converged
    assert (sol.x - expected).norm() / expected.norm() <= rtol


@pytest.mark.parametrize("method", ["direct", "cg", "cg_spd", "minres", "lissa"])
def test_undamped_solvers_agree_on_spd_matrix(method):
    h, _ = spd_matrix(cond=1e2)
    b = torch.randn(30, 4, generator=torch.Generator().manual_seed(1))
    expected = torch.linalg.solve(h, b)
    sol = solve(h, b, method, tol=1e-12, max_iter=5000)
    assert sol.converged and sol.residual <= 1e-12
    true_residual = ((h @ sol.x - b).norm(dim=0) / b.norm(dim=0)).max()
    assert true_residual <= 2e-12  # the residual it reports is the one it has
    assert (sol.x - expected).norm() / expected.norm() <= 1e-8


def test_cg_on_h_squared_solves_indefinite_where_plain_cg_fails():
    h = indefinite_matrix()
    b = torch.randn(30, generator=torch.Generator().manual_seed(2))
    expected = torch.linalg.solve(h, b)
    good = solve(h, b, "cg", tol=1e-12)
    assert good.converged
    assert (good.x - expected).norm() / expected.norm() <= 1e-8
    with pytest.warns(ik.ConvergenceWarning):
        bad = solve(h, b, "cg_spd", tol=1e-12)
    assert not bad.converged
    assert (bad.x - expected).norm() / expected.norm() > 1e-2
    minres = solve(h, b, "minres", tol=1e-12)
    assert minres.converged and (minres.x - expected).norm() / expected.norm() <= 1e-8


def test_minres_needs_fewer_products_than_cg_on_h_squared():
    h, _ = spd_matrix(p=200, cond=1e3)
    b = torch.randn(200, generator=torch.Generator().manual_seed(3))
    cg = solve(h, b, "cg", tol=1e-8, max_iter=5000)
    mr = solve(h, b, "minres", tol=1e-8, max_iter=5000)
    assert mr.converged and cg.converged
    assert mr.products < cg.products


def test_multiple_right_hand_sides_equal_one_at_a_time():
    h, _ = spd_matrix()
    b = torch.randn(30, 5, generator=torch.Generator().manual_seed(4))
    for method in ("cg", "minres", "cg_spd"):
        together = solve(h, b, method, tol=1e-12).x
        apart = torch.stack([solve(h, b[:, j], method, tol=1e-12).x for j in range(5)], dim=1)
        assert torch.allclose(together, apart, atol=1e-10)


def test_non_convergence_warns_with_residual():
    h, _ = spd_matrix(cond=1e6)
    b = torch.ones(30)
    with pytest.warns(ik.ConvergenceWarning, match="relative residual"):
        sol = solve(h, b, "cg", max_iter=3, tol=1e-12)
    assert not sol.converged and sol.iterations == 3 and sol.residual > 1e-12


def test_nan_right_hand_side_raises():
    h, _ = spd_matrix()
    b = torch.ones(30)
    b[3] = float("nan")
    with pytest.raises(ik.NumericalError):
        solve(h, b, "cg")


def test_bad_arguments_raise():
    h, _ = spd_matrix()
    with pytest.raises(ik.InputError, match="unknown solver"):
        solve(h, torch.ones(30), "newton")
    with pytest.raises(ik.InputError, match="rows"):
        solve(h, torch.ones(29), "cg")
    with pytest.raises(ik.InputError, match="damping"):
        solve(h, torch.ones(30), "cg", damping=-1.0)


def test_identity_returns_the_right_hand_side():
    h, _ = spd_matrix()
    b = torch.randn(30)
    sol = solve(h, b, "identity")
    assert torch.equal(sol.x, b) and sol.products == 0


def test_direct_pseudo_inverse_on_singular_hessian_warns():
    h = torch.diag(torch.tensor([2.0, 1.0, 0.0]))
    with pytest.warns(ik.ConvergenceWarning, match="singular"):
        sol = solve(h, torch.tensor([2.0, 1.0, 5.0]), "direct")
    assert torch.allclose(sol.x, torch.tensor([1.0, 1.0, 0.0]))


def test_diagnostics_are_reported():
    h, _ = spd_matrix()
    sol = solve(h, torch.ones(30), "cg", tol=1e-10)
    info = sol.summary()
    assert set(info) == {"solver", "iterations", "residual", "tol", "converged", "seconds", "products", "damping", "choice",
                         "preconditioner", "floor", "eigenvalues"}
    assert info["products"] == 2 * info["iterations"] + 2 + 1  # 2 per step, H·b, final residual check


def test_all_methods_listed():
    assert set(METHODS) == {"direct", "cg", "cg_spd", "minres", "lissa", "neumann", "identity"}
    assert set(SOLVERS) == set(METHODS) | {"kfac", "ekfac", "arnoldi"}



def test_neumann_is_the_truncated_series_with_k_terms():
    """Lorraine et al.'s x = α Σ_{j<K} (I − α(H + λI))^j b, a registered solver: K = max_iter terms (default 20)."""
    h, evals = spd_matrix(p=30, cond=50)
    b = torch.randn(30, 2, generator=torch.Generator().manual_seed(9))
    alpha, damping = 0.5 / float(evals.max()), 1e-2
    series, power = torch.zeros_like(b), b.clone()
    for _ in range(7):
        series, power = series + alpha * power, power - alpha * ((h + damping * torch.eye(30)) @ power)
    sol = ik.SolveConfig(solver="neumann", max_iter=7, step=alpha, damping=damping).solve(ik.DenseOperator(h), b)
    assert torch.allclose(sol.x, series, rtol=1e-12, atol=1e-15) and sol.iterations == 6
    assert solve(h, b, "neumann", step=alpha).iterations == 19
    with pytest.raises(ik.InputError, match="step must be > 0"):
        ik.SolveConfig(solver="neumann", step=0.0)

@pytest.mark.parametrize("method", ["minres", "cg_spd"])
def test_exact_preconditioner_solves_in_one_step(method):
    h, _ = spd_matrix(p=60, cond=1e6)
    b = torch.randn(60, 3, generator=torch.Generator().manual_seed(5))
    inverse = torch.linalg.inv(h)
    sol = solve(h, b, method, tol=1e-10, preconditioner=lambda r: inverse @ r)
    plain = solve(h, b, method, tol=1e-10, max_iter=5000, warn=False)
    assert sol.converged and sol.iterations <= 2 < plain.iterations
    assert (sol.x - torch.linalg.solve(h, b)).norm() / torch.linalg.solve(h, b).norm() <= 1e-8


def test_preconditioned_minres_on_indefinite_system_with_spd_preconditioner():
    """M = |H| (same eigenvectors, absolute eigenvalues) is SPD; M⁻¹H has eigenvalues ±1: MINRES needs 2 steps."""
    h = indefinite_matrix(p=40)
    evals, evecs = torch.linalg.eigh(h)
    m_inv = evecs @ torch.diag(1 / evals.abs()) @ evecs.T
    b = torch.randn(40, 2, generator=torch.Generator().manual_seed(6))
    sol = solve(h, b, "minres", tol=1e-12, preconditioner=lambda r: m_inv @ r)
    assert sol.converged and sol.iterations <= 3
    assert (sol.x - torch.linalg.solve(h, b)).norm() / torch.linalg.solve(h, b).norm() <= 1e-10


def test_columns_that_converge_early_stay_finite():
    """One right-hand side is an eigenvector (converges at once), the other needs hundreds of steps: the converged
    column's Lanczos vectors must not overflow into NaN (they are normalized although unused)."""
    h, _ = spd_matrix(p=200, cond=1e5)
    evals, evecs = torch.linalg.eigh(h)
    b = torch.stack([evecs[:, -1], torch.randn(200, generator=torch.Generator().manual_seed(7))], dim=1)
    scaled = 50.0 * h  # ‖A‖ ~ 5e6: an unnormalized Krylov vector overflows float64 within ~50 steps
    for pre in (None, lambda r: r / 50.0):
        sol = solve(scaled, b, "minres", tol=1e-11, max_iter=3000, preconditioner=pre, warn=False)
        assert torch.isfinite(sol.x).all()
        assert (sol.x - torch.linalg.solve(scaled, b)).norm() / torch.linalg.solve(scaled, b).norm() <= 1e-6


def test_float32_default_tolerance_is_reached_and_an_unreachable_one_stops_at_the_floor():
    h, _ = spd_matrix(p=100, cond=1e3)
    h32 = h.float()
    b = torch.randn(100, generator=torch.Generator().manual_seed(8)).float()
    sol = solve(h32, b, "minres")
    assert sol.converged and sol.residual <= default_tol(torch.float32) == 1e-4 and sol.x.dtype == torch.float32
    assert sol.floor < 1e-4
    with pytest.warns(ik.ConvergenceWarning, match="floor"):
        stuck = solve(h32, b, "minres", tol=1e-12, max_iter=2000)
    assert stuck.iterations < 500 and stuck.residual <= 10 * stuck.floor
    expected = torch.linalg.solve(h, b.double())
    assert (stuck.x.double() - expected).norm() / expected.norm() < 1e-3


def test_preconditioner_arguments_are_checked():
    h, _ = spd_matrix()
    with pytest.raises(ik.InputError, match="preconditioner applies"):
        solve(h, torch.ones(30), "cg", preconditioner=lambda r: r)
    with pytest.raises(ik.NumericalError, match="not positive definite"):
        solve(h, torch.ones(30), "minres", preconditioner=lambda r: -r)


# ---- solvers as objects: the registry is the dispatch ----

def test_every_solver_name_builds_its_registered_class_and_auto_resolves_by_size():
    from influkit.solvers import REGISTRY, Direct, Solver

    op = ik.DenseOperator(spd_matrix(20)[0].double())
    assert set(SOLVERS) <= set(REGISTRY)
    for name in SOLVERS:
        solver = ik.SolveConfig(solver=name).build(op)
        assert isinstance(solver, REGISTRY[name]) and isinstance(solver, Solver) and solver.name == name
    auto = ik.SolveConfig().build(op)
    assert isinstance(auto, Direct) and auto.choice.startswith("auto: p = 20")


def test_a_registered_solver_runs_through_solveconfig_and_a_chain(mlp_stage):
    """A new method is one class: register it, name it in a SolveConfig, and Chain/solve use it."""
    from influkit.solvers import REGISTRY, Solver, register

    @register("diagonal_jacobi")
    class DiagonalJacobi(Solver):
        exact = True

        def _prepare(self, progress):
            self.diagonal = torch.diagonal(self.operator.dense()) + self.config.damping

        def _run(self, rhs, tol, max_iter, bar):
            return rhs / self.diagonal[:, None], 0, float("nan"), float("nan")

    try:
        h = spd_matrix(10)[0].double()
        b = torch.randn(10, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        sol = ik.SolveConfig(solver="diagonal_jacobi", damping=0.5).solve(ik.DenseOperator(h), b)
        torch.testing.assert_close(sol.x, b / (torch.diagonal(h) + 0.5)[:, None])
        assert sol.solver == "diagonal_jacobi" and sol.damping == 0.5
        stage = mlp_stage
        test = stage.data.take(torch.arange(3))
        res = ik.Chain([stage], solve=ik.SolveConfig(solver="diagonal_jacobi")).query(test).scores(torch.arange(5))
        assert res.diagnostics["solves"][0]["solver"] == "diagonal_jacobi"
        with pytest.raises(ik.InputError, match="preconditioner"):
            ik.SolveConfig(solver="diagonal_jacobi", preconditioner="ekfac")
    finally:
        REGISTRY.pop("diagonal_jacobi")
    with pytest.raises(ik.InputError, match="unknown solver 'diagonal_jacobi'"):
        ik.SolveConfig(solver="diagonal_jacobi")


# ---- honest convergence: converged = residual ≤ tol for every method, None where no residual was computed


def singular_stage():
    """Logistic regression, 8 features → 2 classes (18 parameters), on 2 examples, no regularizer: rank(H) ≤ 2."""
    gen = torch.Generator().manual_seed(3)
    model = torch.nn.Linear(8, 2).double()
    return ik.Stage(model, cross_entropy, (torch.randn(2, 8, generator=gen), torch.tensor([0, 1])))


def test_direct_on_a_singular_hessian_reports_unconverged_with_its_residual():
    stage = singular_stage()
    h = explicit_hessian(stage)
    assert h.shape == (18, 18) and int(torch.linalg.matrix_rank(h)) < 18
    gen = torch.Generator().manual_seed(4)
    test = (torch.randn(3, 8, generator=gen), torch.tensor([1, 0, 1]))
    with pytest.warns(ik.ConvergenceWarning, match="pseudo-inverse leaves relative residual"):
        res = ik.Chain([stage], solve=ik.SolveConfig(solver="direct")).query(test).scores()
    solve_ = res.diagnostics["solves"][0]
    rhs = total_grad(stage, *test, stage.param_names)
    x = torch.linalg.pinv(h) @ rhs
    true = float((h @ x - rhs).norm() / rhs.norm())
    assert solve_["converged"] is False and solve_["tol"] == default_tol(torch.float64)
    assert true > 0.1 and solve_["residual"] == pytest.approx(true, rel=1e-6)
    # the warning's remedy: damping makes the system non-singular, and the solve converges
    damped = ik.Chain([stage], solve=ik.SolveConfig(solver="direct", damping=1e-3)).query(test).scores()
    assert damped.diagnostics["solves"][0]["converged"] is True


@pytest.mark.parametrize("solver,remedy", [("ekfac", dict(preconditioner="ekfac")), ("kfac", dict(preconditioner="kfac")),
                                           ("arnoldi", dict(deflate=True))])
def test_an_approximate_inverse_far_from_the_hessian_is_unconverged_and_the_remedy_converges(mlp_stage, solver, remedy):
    """The untrained tanh MLP's Hessian is indefinite, (E)K-FAC's curvature a Gauss-Newton matrix ⪰ 0 and 5 Lanczos
    pairs a small part of H: far apart. One warning, naming the exact solve with the same fit, which converges."""
    op = HessianOperator(mlp_stage)
    b = torch.randn(op.dim, 2, generator=torch.Generator().manual_seed(6))
    curvature = ik.CurvatureConfig(rank=5)
    with pytest.warns(ik.ConvergenceWarning, match="approximate inverse") as caught:
        sol = ik.SolveConfig(solver=solver, damping=1e-2, residual=True).solve(op, b, curvature)
    warned = [str(w.message) for w in caught if issubclass(w.category, ik.ConvergenceWarning)]
    assert len(warned) == 1 and "solver='minres'" in warned[0]
    h = explicit_hessian(mlp_stage) + 1e-2 * torch.eye(op.dim)
    true = float(((h @ sol.x - b).norm(dim=0) / b.norm(dim=0)).max())
    assert sol.residual == pytest.approx(true, rel=1e-8) and sol.residual > sol.tol == APPROXIMATE_TOL
    assert sol.converged is False
    fixed = ik.SolveConfig(solver="minres", damping=1e-2, **remedy).solve(op, b, curvature)
    assert fixed.converged is True and fixed.residual <= fixed.tol


def test_no_residual_means_converged_none_and_no_hessian_product(mlp_stage):
    op = HessianOperator(mlp_stage)
    b = torch.randn(op.dim, generator=torch.Generator().manual_seed(7))
    prepared = ik.SolveConfig(solver="ekfac", damping=1.0, residual=False).prepare(op)
    before = op.products
    sol = prepared.solve(b)
    assert op.products == before and sol.products == 0
    assert sol.converged is None and math.isnan(sol.residual)
    assert ik.SolveConfig(solver="identity").solve(op, b).converged is None


REGISTERED = sorted(__import__("influkit.solvers", fromlist=["REGISTRY"]).REGISTRY)


@pytest.mark.parametrize("name", REGISTERED)
def test_converged_is_residual_within_tol_for_every_solver(mlp_stage, name):
    """Each registered solver's summary carries its tol, and converged is exactly residual ≤ tol (None: no residual),
    the residual being that of the system the method solves, recomputed from the explicit Hessian."""
    op = HessianOperator(mlp_stage)
    b = torch.randn(op.dim, 2, generator=torch.Generator().manual_seed(8))
    damping = 1.0  # H + λI positive definite here: every method applies
    sol = ik.SolveConfig(solver=name, damping=damping, max_iter=50).solve(op, b, warn=False)
    summary = sol.summary()
    assert {"tol", "residual", "converged"} <= set(summary) and summary["tol"] == sol.tol > 0
    if math.isnan(sol.residual):
        assert sol.converged is None
        return
    assert sol.converged is (sol.residual <= sol.tol)
    h = explicit_hessian(mlp_stage)
    eye = torch.eye(op.dim)
    system, target = (h @ h + damping * eye, h @ b) if name == "cg" else (h + damping * eye, b)
    true = float(((system @ sol.x - target).norm(dim=0) / target.norm(dim=0)).max())
    assert sol.residual == pytest.approx(true, rel=1e-6, abs=1e-13)


def spectrum_matrix(evals: torch.Tensor, seed: int = 0) -> torch.Tensor:
    """Q diag(evals) Qᵀ in float64 for a seeded orthogonal Q: a symmetric matrix with the spectrum ``evals``."""
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(evals.numel(), evals.numel(), generator=gen, dtype=torch.float64))
    return q @ torch.diag(evals.double()) @ q.T


@pytest.mark.parametrize("method, evals", [
    ("minres", torch.linspace(-2.0, 7.0, 50)),  # indefinite
    ("cg_spd", torch.logspace(-1, 2, 50)),  # positive definite
])
@pytest.mark.parametrize("damping", [0.0, 0.3])
@pytest.mark.parametrize("columns", [1, 3])
def test_a_krylov_solves_ritz_values_bound_the_spectrum_and_are_a_lanczos_run_from_its_start(method, evals, damping,
                                                                                               columns):
    """MINRES and CG build a Lanczos tridiagonal of H + λI from b: their extreme Ritz values, less λ, lie within H's
    spectrum and equal those of a separate Lanczos run on H of as many steps from b (the Krylov space of H + λI is
    H's); over several right-hand sides the widest pair of the columns' runs."""
    from influkit.operators import DenseOperator
    from influkit.stationarity import extreme_eigenvalues

    h = spectrum_matrix(evals)
    b = torch.randn(50, columns, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    solution = ik.SolveConfig(solver=method, damping=damping, max_iter=8).solve(h, b, warn=False)
    low, high, steps = solution.eigenvalues
    assert steps == solution.iterations == 8
    assert evals.min() <= low < high <= evals.max()
    runs = [extreme_eigenvalues(DenseOperator(h), steps, start=b[:, j]) for j in range(columns)]
    assert all(m == steps for _, _, m in runs)
    assert low == pytest.approx(min(r[0] for r in runs), rel=1e-9, abs=1e-12)
    assert high == pytest.approx(max(r[1] for r in runs), rel=1e-9)


def test_the_eigenvalues_other_solvers_give_for_free():
    """direct: the exact extremes when it fell back to an eigendecomposition (indefinite H + λI), none after a
    Cholesky; cg (on H²) and a preconditioned solve: none (their Ritz values are H²'s, M⁻¹(H + λI)'s)."""
    evals = torch.linspace(-2.0, 7.0, 40)
    h = spectrum_matrix(evals)
    b = torch.ones(40, dtype=torch.float64)
    low, high, steps = ik.SolveConfig(solver="direct", damping=0.5).solve(h, b, warn=False).eigenvalues
    assert (low, high, steps) == (pytest.approx(-2.0, abs=1e-10), pytest.approx(7.0, abs=1e-10), 0)
    assert ik.SolveConfig(solver="direct", damping=3.0).solve(h, b).eigenvalues is None
    assert ik.SolveConfig(solver="cg", max_iter=5).solve(h, b, warn=False).eigenvalues is None
    pre = ik.SolveConfig(solver="minres", max_iter=5, preconditioner=lambda r: 0.5 * r)
    assert pre.solve(h, b, warn=False).eigenvalues is None
