"""influkit.stationarity: where a stage stands, on closed forms (a quadratic at and off its minimum, a saddle, a
singular problem) whose gradient and Hessian spectrum are known exactly, and in a Chain's diagnostics, warning
and report."""

from __future__ import annotations

import math
import warnings
from dataclasses import replace

import pytest
import torch
from torch import nn

import influkit as ik
from influkit.curvature import HessianOperator
from influkit.operators import DenseOperator
from influkit.report import write_report
from influkit.stationarity import GRADIENT_TOL, assess, eigenvalue_tol, extreme_eigenvalues, verdict

from conftest import cross_entropy, digits, l2

KEYS = {"gradient_norm", "min_eigenvalue", "max_eigenvalue", "verdict"}


class Point(nn.Module):
    """outputs = θ for every example: the loss alone shapes the objective (closed forms below)."""

    def __init__(self, theta):
        super().__init__()
        self.theta = nn.Parameter(torch.as_tensor(theta, dtype=torch.float64).clone())

    def forward(self, x):
        return self.theta.expand(x.shape[0], -1)


def quadratic_stage(diagonal, theta, pulls) -> ik.Stage:
    """L(θ) = mean_i [½ θᵀ D θ + a_iᵀ θ], D = diag(``diagonal``), a_i = ``pulls``[i]: ∇L = Dθ + mean a, H = D, and
    the per-example loss gradients are Dθ + a_i."""
    d = torch.tensor(diagonal, dtype=torch.float64)
    loss = lambda out, a: 0.5 * (out * d * out).sum(-1) + (a * out).sum(-1)  # noqa: E731
    return ik.Stage(Point(theta).eval(), loss, (torch.zeros(len(pulls), 1), torch.as_tensor(pulls, dtype=torch.float64)))


PULLS = [[1.0, -2.0, 0.5], [-1.0, 2.0, -0.5], [3.0, 0.0, 1.0], [-3.0, 0.0, -1.0]]  # mean 0: θ = 0 is stationary


def position(stage):
    return assess(stage, None, HessianOperator(stage))


def typical(diagonal, theta):
    d, t = torch.tensor(diagonal), torch.tensor(theta, dtype=torch.float64)
    return float(torch.stack([(d * t + torch.tensor(a)).norm() for a in PULLS]).pow(2).mean().sqrt())


def test_a_quadratic_at_its_minimum():
    pos = position(quadratic_stage([4.0, 1.0, 0.25], [0.0, 0.0, 0.0], PULLS))
    assert pos.verdict == "minimum" and pos.gradient_norm == 0.0
    assert pos.min_eigenvalue == pytest.approx(0.25, rel=1e-12) and pos.max_eigenvalue == pytest.approx(4.0, rel=1e-12)
    assert pos.typical_gradient == pytest.approx(typical([4.0, 1.0, 0.25], [0.0] * 3), rel=1e-12)


def test_off_the_minimum_the_relative_gradient_norm_is_exact():
    theta = [0.1, -0.2, 0.3]
    pos = position(quadratic_stage([4.0, 1.0, 0.25], theta, PULLS))
    expected = float((torch.tensor([4.0, 1.0, 0.25]) * torch.tensor(theta)).norm()) / typical([4.0, 1.0, 0.25], theta)
    assert pos.verdict == "non-stationary" and pos.gradient_norm == pytest.approx(expected, rel=1e-12)
    assert pos.gradient_norm > GRADIENT_TOL


@pytest.mark.parametrize("repeat", [1, 17])
def test_the_objective_gradient_with_a_regularizer_is_exact(repeat, monkeypatch):
    """∇L = Dθ + mean a_i + wθ (R = (w/2)‖θ‖²), exact from the hooked pass's backward (the batch gradient of a
    parameter in no registered layer), no gradient pass of the check's own. That parameter's per-example norms no
    hook gives: g² is their mean over a seeded sample of light_sample(n) examples — all 4 of them (g exact,
    source "pass"), or 8 of 68 ("pass+sample", g² the mean over exactly those 8 examples)."""
    from influkit import stationarity

    theta, d, w = [0.1, -0.2, 0.3], [4.0, 1.0, 0.25], 0.5
    plain = quadratic_stage(d, theta, PULLS * repeat)
    stage = ik.Stage(plain.model, plain.loss, plain.data.take(torch.arange(len(plain))), regularizer=l2(w))
    monkeypatch.setattr(stationarity, "gradient", lambda *a, **k: pytest.fail("a second gradient pass"))
    pos = position(stage)
    expected = float(((torch.tensor(d) + w) * torch.tensor(theta, dtype=torch.float64)).norm())
    assert pos.objective_gradient == pytest.approx(expected, rel=1e-12)
    assert pos.gradient_norm == pytest.approx(expected / pos.typical_gradient, rel=1e-12)
    n = 4 * repeat
    sample = torch.randperm(n, generator=torch.Generator().manual_seed(0))[: stationarity.light_sample(n)]
    pulls = torch.tensor(PULLS * repeat, dtype=torch.float64)[sample]
    own = torch.tensor(d, dtype=torch.float64) * torch.tensor(theta, dtype=torch.float64) + pulls  # ∇ℓ_i = Dθ + a_i
    assert pos.typical_gradient == pytest.approx(float(own.pow(2).sum(1).mean().sqrt()), rel=1e-12)
    assert (pos.gradient_source, pos.sample, pos.gradient_bound) == (("pass", 4) if repeat == 1 else ("pass+sample", 8)) + (0.0,)


@pytest.mark.parametrize("fisher", ["empirical", "sampled", "exact"])
@pytest.mark.parametrize("kind", ["ekfac", "kfac", "diagonal"])
def test_a_factored_fits_data_pass_measures_the_exact_objective_gradient(fisher, kind, monkeypatch):
    """fit_curvature(gradient=True): ‖∇L‖ (mean loss + R + the proximal extra) and g = (mean_i ‖∇ℓ_i‖²)^½ over every
    example, from the pass's own backward (empirical Fisher) or one more of the true labels (sampled, exact), equal
    the plain gradient pass's and the per-example gradients' — Kronecker layers (a dense layer's squared norms from
    its Gram matrices) and a LayerNorm's diagonal block alike — the LayerNorm's from its hooks, with no per-example
    backward pass beyond those the fit runs for its own diagonal block."""
    import influkit.factored.fit as factored

    from influkit.curvature import gradient
    from influkit.factored import fit_curvature
    from influkit.gradients import per_example_grad_rows
    from influkit.params import ParamSpace

    torch.manual_seed(0)
    x, y = torch.randn(37, 2, 6, dtype=torch.float64), torch.randint(0, 3, (37,))
    model = nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Tanh(), nn.Flatten(), nn.Linear(10, 3)).double()
    stage = ik.Stage(model, cross_entropy, (x, y), regularizer=l2(0.05), batch_size=8)
    names = stage.param_names
    anchor = {nm: t.detach() + 0.1 for nm, t in stage.state().items() if nm in names}
    extra = lambda p: 0.3 * sum(((p[nm] - anchor[nm]) ** 2).sum() for nm in names)  # noqa: E731
    exact = gradient(stage, names, extra=extra)
    rows = torch.cat(list(per_example_grad_rows(stage, x, y, names, chunk_size=37)))
    passes = spy(monkeypatch, factored, "_diagonal_rows", "none")
    measured = fit_curvature(stage, kind=kind, fisher=fisher, extra=extra, gradient=True).gradient
    assert measured.examples == 37 and measured.seconds > 0
    assert measured.norm == pytest.approx(float(ParamSpace(exact).flatten(exact).norm()), rel=1e-12)
    assert measured.typical == pytest.approx(float(rows.pow(2).sum(1).mean().sqrt()), rel=1e-12)
    measuring = len(passes)
    assert fit_curvature(stage, kind=kind, fisher=fisher).gradient is None and len(passes) == 2 * measuring > 0


@pytest.mark.parametrize("fisher", ["sampled", "empirical"])
def test_the_fits_batch_size_counts_the_true_label_backward_it_adds(fisher):
    """With a measured gradient and sampled labels the data pass keeps one more set of output-gradients (the true
    labels', B × T × out per layer) through a second backward: the probe's bytes per example grow by at least
    those (the default batch then shrinks); on the empirical Fisher the pass's own backward is the true-label one
    and nothing is added."""
    from influkit.factored import fit_curvature

    torch.manual_seed(0)
    x, y = torch.randn(24, 3, 6, dtype=torch.float64), torch.randint(0, 3, (24,))
    model = nn.Sequential(nn.Linear(6, 40), nn.LayerNorm(40), nn.Tanh(), nn.Flatten(), nn.Linear(120, 3)).double()
    stage = ik.Stage(model, cross_entropy, (x, y), batch_size=8)
    plain = fit_curvature(stage, kind="ekfac", fisher=fisher).info["memory"]["bytes_per_example"]
    measuring = fit_curvature(stage, kind="ekfac", fisher=fisher, gradient=True).info["memory"]["bytes_per_example"]
    true_outputs = (3 * 40 + 40 * 3 + 3) * 8  # the two Linear layers' and the LayerNorm's output-gradients
    if fisher == "empirical":  # the probe's allocator-level count wanders by a few bytes between calls
        assert abs(measuring - plain) < true_outputs / 10
    else:
        assert measuring >= plain + true_outputs


@pytest.mark.filterwarnings("ignore::influkit.errors.StationarityWarning")  # an untrained model: not at a minimum
@pytest.mark.parametrize("fisher", ["sampled", "empirical"])
def test_a_stage_solved_by_ekfac_stands_where_its_fits_data_pass_says_with_the_full_checks_verdict(fisher, monkeypatch):
    """A stage solved by EK-FAC gets the check from that fit's data pass: ‖∇L‖ and g from every example (no gradient
    pass, no per-example gradient pass, no Hessian-vector product), the eigenvalues those of the fitted EK-FAC. Its
    r is the full check's exact r and its verdict the full check's."""
    from influkit import curvature, stationarity

    x, y = digits(400)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 50), nn.Tanh(), nn.Linear(50, 10)).double()
    stage = ik.Stage(model, cross_entropy, (x, y), regularizer=l2(1e-2))
    for bias in (6.0, 0.0):  # r ≈ 0.6 (every example pulls class 0's logit down) and the untrained r ≈ 0.13
        with torch.no_grad():
            model[2].bias[0] = bias
        full = ik.Chain([stage], solve=ik.SolveConfig(solver="minres", damping=1e-2, max_iter=2)).fit().positions[0]
        products = spy(monkeypatch, curvature, "hvp", "batch_size")
        monkeypatch.setattr(stationarity, "gradient", lambda *a, **k: pytest.fail("a gradient pass over all the data"))
        monkeypatch.setattr(stationarity, "per_example_grad_rows", lambda *a, **k: pytest.fail("a per-example pass"))
        chain = ik.Chain([stage], solve=ik.SolveConfig(solver="ekfac", damping=1e-2),
                         curvature=ik.CurvatureConfig(fisher=fisher)).fit()
        light = chain.positions[0]
        monkeypatch.undo()
        assert products == [] and light.lanczos_steps == 0 and light.eigenvalue_source == "ekfac"
        assert (light.gradient_source, light.sample, light.gradient_bound) == ("fit", 400, 0.0)
        assert light.verdict == full.verdict == "non-stationary"
        assert light.objective_gradient == pytest.approx(full.objective_gradient, rel=1e-10)
        ekfac = chain.curvature(0).approximations["ekfac"]
        assert (light.min_eigenvalue, light.max_eigenvalue) == (ekfac.smallest(), ekfac.largest())
        assert "EKFAC eigenvalues" in light.describe() and "±" not in light.describe()


@pytest.mark.filterwarnings("ignore::influkit.errors.StationarityWarning")  # an untrained model: not at a minimum
def test_an_ekfac_fit_over_a_hessian_sample_leaves_the_check_to_a_sample_whose_bound_holds_the_exact_norm(monkeypatch):
    """EK-FAC fitted over hessian_samples < n measures another objective's gradient: the light check then takes the
    per-example gradients of light_sample(n) examples, ∇L estimated from them when r − bound > GRADIENT_TOL (no
    gradient pass, no Hessian-vector product), drawn on to the size that settles it when that is ≤ n/4, else one
    gradient pass; its verdict is the full check's, and the exact r lies inside the sampled r ± bound."""
    from influkit import curvature, stationarity

    x, y = digits(400)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 50), nn.Tanh(), nn.Linear(50, 10)).double()
    with torch.no_grad():
        model[2].bias[0] = 6.0  # every example pulls class 0's logit down: far from stationary (r ≈ 0.6)
    stage = ik.Stage(model, cross_entropy, (x, y), regularizer=l2(1e-2))
    sampled = ik.CurvatureConfig(hessian_samples=300)
    ekfac = ik.SolveConfig(solver="ekfac", damping=1e-2)
    full = ik.Chain([stage], solve=ik.SolveConfig(solver="minres", damping=1e-2, max_iter=2)).fit().positions[0]
    products = spy(monkeypatch, curvature, "hvp", "batch_size")
    monkeypatch.setattr(stationarity, "gradient", lambda *a, **k: pytest.fail("a gradient pass over all the data"))
    chain = ik.Chain([stage], solve=ekfac, curvature=sampled).fit()
    light = chain.positions[0]
    assert products == [] and light.lanczos_steps == 0 and light.eigenvalue_source == "ekfac"
    assert (light.gradient_source, full.gradient_source) == ("sample", "pass") and full.gradient_bound == 0.0
    assert light.sample == stationarity.light_sample(400) == 25 and full.sample == 400
    assert light.verdict == full.verdict == "non-stationary"
    assert abs(light.gradient_norm - full.gradient_norm) <= light.gradient_bound
    fitted = chain.curvature(0).approximations["ekfac"]
    assert (light.min_eigenvalue, light.max_eigenvalue) == (fitted.smallest(), fitted.largest())
    assert "EKFAC eigenvalues" in light.describe() and "±" in light.describe()
    with torch.no_grad():
        model[2].bias[0] = 2.0  # r ≈ 0.4: inside 25 examples' bound, settled by drawing on to the size that settles it
    grown = ik.Chain([stage], solve=ekfac, curvature=sampled).fit().positions[0]
    assert grown.gradient_source == "sample" and 25 < grown.sample <= 400 // stationarity.LIGHT_GROW_SHARE
    with torch.no_grad():
        model[2].bias[0] = 0.0  # untrained, r ≈ 0.13: settling would take more than n/4 examples: one gradient pass
    monkeypatch.undo()
    products = spy(monkeypatch, curvature, "hvp", "batch_size")
    unsettled = ik.Chain([stage], solve=ekfac, curvature=sampled).fit().positions[0]
    assert unsettled.gradient_source == "data" and unsettled.gradient_bound == 0.0 and products == []
    assert unsettled.verdict == "non-stationary" and unsettled.eigenvalue_source == "ekfac"


def test_the_light_check_of_a_stationary_stage_has_the_full_checks_verdict_and_lanczos_steps(logreg_digits):
    """At a minimum the fit's data pass gives r (below GRADIENT_TOL) and the Lanczos steps on the exact H decide, as
    in the full check: the same verdict and eigenvalues, the fitted EK-FAC's eigenvalues unused."""
    from influkit.factored import fit_curvature

    stage, _ = logreg_digits
    full = position(stage)
    light = assess(stage, None, HessianOperator(stage),
                   factored=lambda: fit_curvature(stage, kind="ekfac", gradient=True))
    assert light.verdict == full.verdict == "minimum" and light.gradient_source == "fit"
    assert light.gradient_norm < GRADIENT_TOL and light.eigenvalue_source == "lanczos"
    assert light.max_eigenvalue == pytest.approx(full.max_eigenvalue, rel=1e-12)
    assert light.lanczos_steps == full.lanczos_steps


def test_a_saddle():
    pos = position(quadratic_stage([2.0, -0.5, 1.0], [0.0, 0.0, 0.0], PULLS))
    assert pos.verdict == "saddle"
    assert pos.min_eigenvalue == pytest.approx(-0.5, rel=1e-12) and pos.max_eigenvalue == pytest.approx(2.0, rel=1e-12)


def test_a_singular_problem():
    pos = position(quadratic_stage([2.0, 0.0, 1.0], [0.0, 0.0, 0.0], PULLS))
    assert pos.verdict == "singular" and abs(pos.min_eigenvalue) <= 1e-14


def test_a_trained_logistic_regression_is_at_a_minimum(logreg_digits):
    stage, _ = logreg_digits
    pos = position(stage)
    h = torch.linalg.eigvalsh(ik.DenseOperator(HessianOperator(stage).dense()).matrix)
    assert pos.verdict == "minimum" and pos.gradient_norm < 1e-10
    # Ritz values lie inside the spectrum; the largest has converged in 20 steps
    assert h[0] <= pos.min_eigenvalue and pos.max_eigenvalue == pytest.approx(float(h[-1]), rel=1e-8)


@pytest.mark.parametrize("r, low, high, expected", [
    (0.0, 1.0, 2.0, "minimum"),
    (2 * GRADIENT_TOL, 1.0, 2.0, "non-stationary"),
    (2 * GRADIENT_TOL, -1.0, 2.0, "non-stationary"),
    (0.5 * GRADIENT_TOL, -1e-3, 2.0, "saddle"),
    (0.5 * GRADIENT_TOL, 1e-9, 2.0, "singular"),
    (0.5 * GRADIENT_TOL, -1e-9, 2.0, "singular"),
    (0.0, 0.0, 0.0, "singular"),
    (math.inf, 1.0, 2.0, "non-stationary"),
])
def test_the_verdict_thresholds(r, low, high, expected):
    assert verdict(r, low, high, eigenvalue_tol(torch.float64)) == expected


def test_the_singular_threshold_follows_the_precision():
    assert verdict(0.0, 1e-5, 1.0, eigenvalue_tol(torch.float64)) == "minimum"
    assert verdict(0.0, 1e-5, 1.0, eigenvalue_tol(torch.float32)) == "singular"


def test_ritz_values_bound_the_spectrum_and_are_exact_after_p_steps():
    gen = torch.Generator().manual_seed(0)
    q, _ = torch.linalg.qr(torch.randn(60, 60, generator=gen, dtype=torch.float64))
    eig = torch.linspace(-1.0, 5.0, 60, dtype=torch.float64)
    op = DenseOperator(q @ torch.diag(eig) @ q.T)
    low, high, m = extreme_eigenvalues(op, 10)
    assert m == 10 and -1.0 <= low < 0 and 0 < high <= 5.0
    low, high, _ = extreme_eigenvalues(op, 60)
    assert low == pytest.approx(-1.0, abs=1e-8) and high == pytest.approx(5.0, abs=1e-8)


# ---- in a Chain ----

def untrained_stage():
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(40, 8, generator=gen), torch.randint(0, 3, (40,), generator=gen)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    return ik.Stage(model, cross_entropy, (x, y), regularizer=l2(1e-3))


def test_every_result_says_where_each_stage_stands_and_warns_at_the_users_line(logreg_digits, tmp_path):
    stage, test = logreg_digits
    with warnings.catch_warnings():
        warnings.simplefilter("error", ik.StationarityWarning)  # at a minimum: no warning
        res = ik.influence(stage, torch.arange(5), test)
        own = ik.self_influence(stage, torch.arange(5))
    (minimum,) = res.diagnostics["stages"]
    assert KEYS <= set(minimum) and minimum["verdict"] == "minimum"
    assert own.diagnostics["stages"][0]["verdict"] == "minimum"
    assert own.diagnostics["solves"][0]["solver"] == "direct"  # 5 right-hand sides at once: one factorization
    moved = untrained_stage()
    with pytest.warns(ik.StationarityWarning, match=r"stage 0 \(Sequential\) is not at a minimum — non-stationary") as seen:
        res = ik.influence(moved, torch.arange(5), (moved.data.take(torch.arange(3))))
    assert len(seen) == 1 and seen[0].filename == __file__  # the user's line, not influkit's
    assert res.diagnostics["stages"][0]["verdict"] == "non-stationary"
    saved = ik.load(res.save(tmp_path / "r"))
    assert saved.diagnostics["stages"] == res.diagnostics["stages"]
    page = write_report(res, tmp_path / "page.html").read_text()
    assert "Where each stage stands" in page and "non-stationary" in page


def test_a_saved_fit_and_query_keep_the_positions(tmp_path):
    stage = untrained_stage()
    test = stage.data.take(torch.arange(3))
    with pytest.warns(ik.StationarityWarning):
        chain = ik.Chain([stage]).fit()
        path = chain.save(tmp_path / "fit")
        query = chain.query(test)
    loaded = ik.Chain([stage]).load(path)
    assert loaded.positions == chain.positions
    torch.testing.assert_close(loaded.query(test).s, query.s, rtol=1e-12, atol=0)
    again = ik.load_query(query.save(tmp_path / "q"), loaded)
    assert again.scores().diagnostics["stages"] == query.scores().diagnostics["stages"]


def spy(monkeypatch, module, name: str, keyword: str) -> list:
    """Replace ``module.name`` by a wrapper that records each call's ``keyword`` argument (None when not given)."""
    calls = []
    original = getattr(module, name)

    def recorded(*args, **kwargs):
        calls.append(kwargs.get(keyword))
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, recorded)
    return calls


@pytest.mark.filterwarnings("ignore::influkit.errors.StationarityWarning")  # an untrained model: not at a minimum
def test_without_memory_the_check_of_an_ekfac_stage_streams_the_rules_batch_and_finds_the_same_position(monkeypatch):
    """Without memory=, the check of a stage solved by EK-FAC runs any per-example gradient pass of its own (when the
    fit covers a Hessian sample, not every example) and any Hessian-vector product in batches of at most
    DEFAULT_WORKING (at least one example), not the DEFAULT_EXAMPLES floor: with DEFAULT_WORKING shrunk to one byte
    the operator plans 8 examples and the check 1, the gradient pass uses batches of 1, and the position equals the
    one a given budget finds (sums over batches: float64 rounding). When the fit covers every example its data pass
    gives r: no per-example gradient pass at all. A given memory= keeps the chain's operator for the check."""
    from influkit import curvature, memory, stationarity

    x, y = digits(100)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 50), nn.Tanh(), nn.Linear(50, 10)).double()
    stage = ik.Stage(model, cross_entropy, (x, y), regularizer=l2(1e-2))
    solve = ik.SolveConfig(solver="ekfac", damping=1e-2)
    sampled = ik.CurvatureConfig(hessian_samples=90)
    given = ik.Chain([stage], solve=solve, curvature=sampled, memory=2**30).fit()
    assert [p["phase"] for p in given.memory_plans()].count("stationarity check") == 0

    monkeypatch.setattr(memory, "DEFAULT_WORKING", 1)
    batches = spy(monkeypatch, curvature, "hvp", "batch_size")
    chunks = spy(monkeypatch, stationarity, "per_example_grad_rows", "chunk_size")
    assert ik.Chain([stage], solve=solve).fit().positions[0].gradient_source == "fit" and chunks == []
    chain = ik.Chain([stage], solve=solve, curvature=sampled).fit()
    plans = {p["phase"]: p for p in chain.memory_plans()}
    assert plans["Hessian-vector products"]["batch"] == memory.DEFAULT_EXAMPLES
    assert plans["stationarity check"]["batch"] == 1
    assert batches == []  # non-stationary: no product (the eigenvalues are EK-FAC's)
    assert chunks and set(chunks) == {1}  # the per-example gradient passes under the same rule (8 without it)
    small, normal = chain.positions[0], given.positions[0]
    assert small.gradient_source == normal.gradient_source != "fit"
    for field in ("gradient_norm", "min_eigenvalue", "max_eigenvalue", "objective_gradient", "typical_gradient"):
        assert getattr(small, field) == pytest.approx(getattr(normal, field), rel=1e-10, abs=0), field
    assert (small.verdict, small.lanczos_steps) == (normal.verdict, normal.lanczos_steps)


def counted_products(monkeypatch) -> list:
    """Every Hessian (or Gauss-Newton) vector product any HessianOperator applies from now on, one entry per column."""
    calls = []
    original = HessianOperator.matvec

    def matvec(self, vec):
        calls.extend([self.curvature] * (vec.shape[1] if vec.dim() == 2 else 1))
        return original(self, vec)

    monkeypatch.setattr(HessianOperator, "matvec", matvec)
    monkeypatch.setattr(HessianOperator, "__call__", matvec)
    return calls


EXPLICIT = ["direct", "cg", "cg_spd", "minres", "lissa", "neumann", "arnoldi", "identity", "ekfac", "kfac"]


@pytest.mark.filterwarnings("ignore::influkit.errors.StationarityWarning")  # an untrained model: not at a minimum
@pytest.mark.filterwarnings("ignore::influkit.errors.ConvergenceWarning")
@pytest.mark.parametrize("solver", EXPLICIT)
def test_a_non_stationary_stage_with_a_named_solve_and_damping_runs_no_product_for_its_check(solver, monkeypatch):
    """The gradient settles the verdict and the user named the solve: the fit's Hessian-vector products are exactly
    those its solver prepares (p for direct's dense H, arnoldi's Lanczos steps, none for the rest), the check's
    own are 0. The query's solve then fills in the eigenvalues where its own iterations give them: MINRES's and CG's
    Lanczos tridiagonal, bounding the exact Hessian's spectrum from inside."""
    stage = untrained_stage()
    products = counted_products(monkeypatch)
    chain = ik.Chain([stage], solve=ik.SolveConfig(solver=solver, damping=0.05, max_iter=6), progress=False).fit()
    where = chain.positions[0]
    prepared = {"direct": chain.dims[0], "arnoldi": 0}
    if solver == "arnoldi":
        prepared["arnoldi"] = chain.curvature(0).approximations["arnoldi"].info["products"]
    assert where.verdict == "non-stationary" and where.products == 0
    assert len(products) == prepared.get(solver, 0)
    if solver in ("ekfac", "kfac"):  # the light check: its fitted curvature's eigenvalues, no product
        assert where.eigenvalue_source == solver and where.gradient_source == "fit"
    else:
        assert where.eigenvalue_source == "none" and where.min_eigenvalue is None and where.max_eigenvalue is None
        assert "not measured" in where.describe()
    query = chain.query(stage.data.take(torch.arange(3)))
    solved = query.stages[0]
    if solver in ("minres", "cg_spd"):
        exact = torch.linalg.eigvalsh(HessianOperator(stage).dense())
        # CG stops at the negative curvature of this indefinite H + λI, before that step's coefficients
        assert solved["eigenvalue_source"] == solver and 0 < solved["lanczos_steps"] <= query.solves[0]["iterations"]
        assert exact[0] <= solved["min_eigenvalue"] + 1e-12 and solved["max_eigenvalue"] <= exact[-1] + 1e-12
    elif solver == "cg":
        assert solved["eigenvalue_source"] == "none"


@pytest.mark.filterwarnings("ignore::influkit.errors.ConvergenceWarning")
@pytest.mark.parametrize("solver", ["minres", "cg_spd", "cg", "lissa", "neumann", "direct", "arnoldi"])
@pytest.mark.parametrize("matrix,memory", [("hessian", None), ("hessian", 20_000), ("gauss-newton", None)])
def test_a_named_solve_gives_its_check_the_gradient_from_its_first_product(solver, matrix, memory, monkeypatch,
                                                                           tmp_path):
    """A stage solved by a named solver that multiplies by H or G, with its damping: the fit measures nothing, the
    first product of its solve (or of its fit: direct's dense H, arnoldi's Lanczos) records ∇L (cached graph,
    streamed batches — memory of 20 kB —, or the Gauss-Newton batches' kept graphs), and the check adds no data
    pass and no product: ∇L equals the full check's to 1e-10, g comes from light_sample(n) examples, and the exact
    r is at least the reported lower bound. The warning comes with the query; the position is kept for the next
    query and in a saved fit."""
    from influkit import stationarity

    stage = untrained_stage()
    full = assess(stage, None, HessianOperator(stage), spectrum="verdict")
    assert full.gradient_source == "pass"
    solve = ik.SolveConfig(solver=solver, damping=0.05, max_iter=4, **({"step": 1.0} if solver in ("lissa", "neumann") else {}))
    chain = ik.Chain([stage], solve=solve, curvature=ik.CurvatureConfig(matrix=matrix), memory=memory, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ik.StationarityWarning)
        chain.fit()
    assert chain._where == [None]
    for name in ("objective_gradient", "gradient", "_gradient_pass", "_gradient_norms", "extreme_eigenvalues"):
        monkeypatch.setattr(stationarity, name, lambda *a, name=name, **k: pytest.fail(f"the check ran {name}"))
    with pytest.warns(ik.StationarityWarning, match="solve's first product"):
        query = chain.query(stage.data.take(torch.arange(3)))
    monkeypatch.undo()
    operator = chain.curvature(0).operator
    assert operator.memory["cache_graph"] == (memory is None)
    fitted = chain.dims[0] if solver == "direct" else \
        chain.curvature(0).approximations["arnoldi"].info["products"] if solver == "arnoldi" else 0
    assert operator.products == query.solves[0]["products"] + fitted > 0  # the solve's own, none of the check's
    where = chain.positions[0]
    assert (where.gradient_source, where.verdict, where.products) == ("solve", "non-stationary", 0)
    assert where.sample == stationarity.light_sample(len(stage)) < len(stage)
    assert where.objective_gradient == pytest.approx(full.objective_gradient, rel=1e-10)
    assert where.gradient_norm - where.gradient_bound <= full.gradient_norm
    assert where.typical_gradient == pytest.approx(full.typical_gradient, rel=0.5)
    assert query.stages[0]["gradient_source"] == "solve"
    if solver in ("minres", "cg_spd"):
        assert query.stages[0]["eigenvalue_source"] == solver
    again = chain.query(stage.data.take(torch.arange(5)))
    assert again.stages[0]["objective_gradient"] == where.objective_gradient
    with pytest.warns(ik.StationarityWarning):  # a loaded fit says where its stages stand, as a fitted one does
        loaded = ik.Chain([stage], solve=solve, curvature=ik.CurvatureConfig(matrix=matrix), memory=memory,
                          progress=False).load(chain.save(tmp_path / "fit"))
    assert loaded.positions == chain.positions


@pytest.mark.filterwarnings("ignore::influkit.errors.StationarityWarning")  # an untrained model: not at a minimum
@pytest.mark.parametrize("memory", [None, 20_000])
def test_autos_check_takes_the_gradient_from_the_gauss_newton_graphs_its_solve_reuses(memory, monkeypatch):
    """solver='auto' off a minimum solves on G: where G's operator keeps its batch graphs, the check builds them at
    the fit and takes ∇L from them — exact to 1e-12, no data pass of its own —, g from light_sample(n) examples
    with a bound that holds the exact r, θ_max from the sampled Hessian's LARGEST_STEPS products; the query's solve
    reuses the same graphs (each batch's forward built once in fit + query). Where G streams its products (a 20 kB
    budget), the check makes its own hooked pass as before."""
    from influkit import curvature, stationarity

    stage = untrained_stage()
    full = assess(stage, None, HessianOperator(stage), spectrum="verdict")
    built = []
    original = curvature._GaussNewtonBatch.__init__
    monkeypatch.setattr(curvature._GaussNewtonBatch, "__init__",
                        lambda self, *a, **k: built.append(1) or original(self, *a, **k))
    passes = spy(monkeypatch, stationarity, "_gradient_pass", "progress")
    chain = ik.Chain([stage], memory=memory, progress=False).fit()
    where, fitted = chain.positions[0], len(built)
    query = chain.query(stage.data.take(torch.arange(3)))
    assert query.solves[0]["solver"] == "minres" and chain.operator(0).curvature == "gauss-newton"
    assert where.verdict == full.verdict == "non-stationary" and where.eigenvalue_source == "lanczos-sample"
    assert where.products == where.lanczos_steps == stationarity.LARGEST_STEPS
    if memory is None:
        assert (where.gradient_source, where.sample) == ("graph", stationarity.light_sample(len(stage)))
        assert passes == [] and fitted == len(built) == 1  # one batch's graph, built by the check, kept for the solve
        assert where.objective_gradient == pytest.approx(full.objective_gradient, rel=1e-12)
        assert where.gradient_norm - where.gradient_bound <= full.gradient_norm
        assert "Gauss-Newton graphs" in where.describe()
    else:
        assert where.gradient_source == "pass" and len(passes) == 1 and fitted == 0
        assert where.objective_gradient == pytest.approx(full.objective_gradient, rel=1e-12)


@pytest.mark.filterwarnings("ignore::influkit.errors.StationarityWarning")
def test_auto_reads_theta_max_only_where_its_damping_needs_it(monkeypatch):
    """solver='auto' off a minimum without a damping: θ_max from LARGEST_STEPS Lanczos steps on the Hessian of a
    seeded sample of min(n, SAMPLE) examples — within that sample Hessian's spectrum —, the damping read from it;
    with a damping given, or Training, no product at all."""
    from influkit import stationarity
    from influkit.auto import Training, spectral_damping

    x, y = digits(100)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 6), nn.Tanh(), nn.Linear(6, 10)).double()
    stage = ik.Stage(model, cross_entropy, (x, y), regularizer=l2(1e-2))
    products = counted_products(monkeypatch)
    where = ik.Chain([stage], progress=False).fit().positions[0]
    assert where.verdict == "non-stationary" and where.eigenvalue_source == "lanczos-sample"
    assert where.products == where.lanczos_steps == stationarity.LARGEST_STEPS == len(products)
    assert where.eigenvalue_sample == stationarity.SAMPLE
    sampled = torch.linalg.eigvalsh(HessianOperator(stage, samples=stationarity.SAMPLE).dense())
    assert sampled[0] <= where.min_eigenvalue <= where.max_eigenvalue <= sampled[-1] + 1e-12
    assert where.max_eigenvalue == pytest.approx(float(sampled[-1]), rel=0.05)  # the extreme converges first
    assert spectral_damping(where) > 0
    for named in (ik.SolveConfig(damping=0.05), ik.SolveConfig(training=Training(lr=0.1, steps=100))):
        products.clear()
        chain = ik.Chain([stage], solve=named, progress=False).fit()
        assert chain.positions[0].products == 0 and chain.positions[0].eigenvalue_source == "none"
        assert products == []  # MINRES on G + λI fits nothing


@pytest.mark.filterwarnings("ignore::influkit.errors.StationarityWarning")
@pytest.mark.parametrize("solve", [ik.SolveConfig(solver="minres", damping=0.05), ik.SolveConfig(solver="identity")])
def test_a_stationary_stage_with_a_named_solve_still_gets_its_lanczos_verdict(solve, logreg_digits):
    """Where the gradient leaves the verdict open (r ≤ GRADIENT_TOL), θ_min decides it whatever the solve: the STEPS
    Lanczos steps on the exact H, counted, at a minimum and at a saddle."""
    from influkit import stationarity

    stage, test = logreg_digits
    at_minimum = ik.Chain([stage], solve=solve, progress=False).fit().positions[0]
    assert at_minimum.verdict == "minimum" and at_minimum.eigenvalue_source == "lanczos"
    assert at_minimum.products == at_minimum.lanczos_steps == stationarity.STEPS
    assert at_minimum.min_eigenvalue > 0
    queried = ik.Chain([stage], solve=solve, progress=False)  # the solve's gradient leaves it open: the full check
    queried.query(test)
    assert replace(queried.positions[0], seconds=0.0) == replace(at_minimum, seconds=0.0)
    saddle = quadratic_stage([2.0, -0.5, 1.0], [0.0, 0.0, 0.0], PULLS)
    where = ik.Chain([saddle], solve=solve, progress=False).fit().positions[0]
    assert where.verdict == "saddle" and where.min_eigenvalue == pytest.approx(-0.5, rel=1e-12)


def test_the_checks_gradient_pass_measures_the_exact_objective_gradient_over_every_example(monkeypatch):
    """objective_gradient: one hooked pass over every example — the Linear layers' per-example norms from their
    Gram matrices, the LayerNorm's from its hooks — gives ‖∇L‖ (mean loss + R + the extra term) and
    g = (mean_i ‖∇ℓ_i‖²)^½ equal to the plain gradient pass's and the per-example gradients'; the check takes them
    (gradient_source "pass", sample n) with no per-example gradient pass and no gradient pass of its own."""
    from influkit import stationarity
    from influkit.curvature import gradient
    from influkit.factored.fit import objective_gradient
    from influkit.gradients import per_example_grad_rows
    from influkit.params import ParamSpace

    torch.manual_seed(0)
    x, y = torch.randn(37, 2, 6, dtype=torch.float64), torch.randint(0, 3, (37,))
    model = nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Tanh(), nn.Flatten(), nn.Linear(10, 3)).double()
    stage = ik.Stage(model, cross_entropy, (x, y), regularizer=l2(0.05), batch_size=8)
    names = stage.param_names
    anchor = {nm: t.detach() + 0.1 for nm, t in stage.state().items() if nm in names}
    extra = lambda p: 0.3 * sum(((p[nm] - anchor[nm]) ** 2).sum() for nm in names)  # noqa: E731
    exact = gradient(stage, names, extra=extra)
    norm = float(ParamSpace(exact).flatten(exact).norm())
    rows = torch.cat(list(per_example_grad_rows(stage, x, y, names, chunk_size=37)))
    typical = float(rows.pow(2).sum(1).mean().sqrt())
    measured = objective_gradient(stage, extra=extra)
    assert measured.examples == 37
    assert measured.norm == pytest.approx(norm, rel=1e-12) and measured.typical == pytest.approx(typical, rel=1e-12)
    monkeypatch.setattr(stationarity, "gradient", lambda *a, **k: pytest.fail("a second gradient pass"))
    monkeypatch.setattr(stationarity, "per_example_grad_rows", lambda *a, **k: pytest.fail("a per-example pass"))
    where = assess(stage, None, HessianOperator(stage, extra=extra), extra=extra, spectrum="verdict")
    assert (where.gradient_source, where.sample, where.gradient_bound) == ("pass", 37, 0.0)
    assert where.objective_gradient == pytest.approx(norm, rel=1e-12)
    assert where.gradient_norm == pytest.approx(norm / typical, rel=1e-12) and where.verdict == "non-stationary"


class TiedLM(nn.Module):
    """Token ids → logits (B, T, vocabulary) through a LayerNorm (BERT's head transform) and a decoder tied to the
    word embeddings: the tied weight's per-example gradient (embedding rows plus decoder outer products) is no single
    layer hook's, but both layers' together; ``shift``, a bare parameter, is in no registered layer."""

    def __init__(self, vocab: int = 11, dim: int = 4):
        super().__init__()
        self.emb, self.mix, self.out = nn.Embedding(vocab, dim, padding_idx=0), nn.Linear(dim, dim), nn.Linear(dim, vocab)
        self.norm, self.shift = nn.LayerNorm(dim), nn.Parameter(torch.linspace(-0.5, 0.5, dim))
        self.out.weight = self.emb.weight

    def forward(self, ids):
        return self.out(self.norm(torch.tanh(self.mix(self.emb(ids))) + self.shift))


def token_losses(logits, labels):
    return nn.functional.cross_entropy(logits.transpose(1, 2), labels, reduction="none").sum(1)


@pytest.mark.filterwarnings("ignore::influkit.errors.StationarityWarning")  # an untrained model: not at a minimum
@pytest.mark.parametrize("solve", [ik.SolveConfig(solver="ekfac", damping=1e-2),
                                   ik.SolveConfig(solver="minres", damping=1e-2, max_iter=2)])
def test_a_tied_decoder_gets_its_exact_gradient_and_norms_from_the_pass(solve, monkeypatch):
    """A decoder tied to the word embeddings: the EK-FAC fit's data pass (sampled labels) or the check's hooked pass
    gives ∇L exactly — the tied weight's and the decoder bias's batch gradient from the same backward, the decoder's
    part on the labelled positions only (every batch's true-label backward starts below it) — and their per-example
    norms exactly from the embedding's and the decoder's hooks (padding tokens included); only a parameter no layer
    owns takes one backward per example of light_sample(n) (counted, over that parameter alone, no batched
    per-example pass): g² is every hooked parameter's mean over every example plus its mean over that seeded sample;
    the verdict is the full check's."""
    from influkit import stationarity
    from influkit.curvature import gradient
    from influkit.gradients import per_example_grad_rows
    from influkit.params import ParamSpace

    import influkit.factored.fit as factored
    from influkit.layers import LayerNorm, Linear

    gen = torch.Generator().manual_seed(3)
    ids, labels = torch.randint(0, 11, (40, 5), generator=gen), torch.randint(0, 11, (40, 5), generator=gen)
    labels[torch.rand(40, 5, generator=gen) < 0.6] = -100  # masked-LM-like: most positions carry no gradient
    torch.manual_seed(0)
    stage = ik.Stage(TiedLM().double().eval(), token_losses, (ids, labels), regularizer=l2(1e-2), batch_size=16)
    names = stage.param_names
    exact = gradient(stage, names)
    norm = float(ParamSpace(exact).flatten(exact).norm())
    rows = {nm: torch.cat(list(per_example_grad_rows(stage, ids, labels, [nm], chunk_size=40))) for nm in names}
    unhooked = ["shift"]
    sample = torch.randperm(40, generator=torch.Generator().manual_seed(0))[: stationarity.light_sample(40)]
    squares = sum(rows[nm].pow(2).sum(1).mean() for nm in names if nm not in unhooked)
    squares = squares + sum(rows[nm][sample].pow(2).sum(1).mean() for nm in unhooked)
    full = assess(stage, None, HessianOperator(stage))  # the whole check's verdict, for comparison
    passes = []
    original = stationarity._example_squares
    monkeypatch.setattr(stationarity, "_example_squares",
                        lambda st, order, nms: passes.append((len(order), list(nms))) or original(st, order, nms))
    monkeypatch.setattr(stationarity, "per_example_grad_rows", lambda *a, **k: pytest.fail("a batched per-example pass"))
    monkeypatch.setattr(stationarity, "gradient", lambda *a, **k: pytest.fail("a gradient pass over all the data"))
    heads = spy(monkeypatch, factored, "head_backward", "none")
    tracked = []  # whether a layer's norms were handed tensors autograd still tracks (a graph kept across batches)
    for kind in (Linear, LayerNorm):  # the head's backward hands the LayerNorm below it a tracked g
        monkeypatch.setattr(kind, "example_norms", lambda self, a, g, norms=kind.example_norms:
                            tracked.append(a.requires_grad or g.requires_grad) or norms(self, a, g))
    where = ik.Chain([stage], solve=solve, progress=False).fit().positions[0]
    assert passes == [(8, unhooked)] and len(heads) == 3  # the true-label backward of each batch of 16, 16, 8
    assert tracked and not any(tracked)
    expected = "fit+sample" if solve.solver == "ekfac" else "pass+sample"
    assert (where.gradient_source, where.sample, where.gradient_bound) == (expected, 8, 0.0)
    assert where.objective_gradient == pytest.approx(norm, rel=1e-12)
    assert where.typical_gradient == pytest.approx(float(squares.sqrt()), rel=1e-12)
    assert where.verdict == full.verdict == "non-stationary" and where.products == 0
    assert "8 examples" in where.describe()
