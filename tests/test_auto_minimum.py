"""auto at a stationary point above PRECONDITION_MIN: CG on H + λI at a minimum (MINRES at a singular one)
preconditioned by the EK-FAC the light stationarity check fitted — the same object, fitted once — whose answer is
the explicit float64 Hessian solve; explicit settings win. The threshold is lowered to these 21- and 53-parameter
stages (monkeypatch), as tests/test_auto.py does."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import influkit as ik
from influkit import auto
from influkit.auto import decide
from influkit.factored import kinds as factored
from influkit.gradients import total_grad
from influkit.stationarity import Position
from influkit.training import train_to_stationarity

from conftest import cross_entropy, explicit_hessian, l2

P = 53  # the MLP's trained parameters: 6·5 + 5 + 5·3 + 3


def minimum(low: float = 0.1, verdict: str = "minimum") -> Position:
    return Position(gradient_norm=0.0, min_eigenvalue=low, max_eigenvalue=4.0, verdict=verdict, objective_gradient=0.0,
                    typical_gradient=1.0, sample=10, lanczos_steps=20, eigenvalue_tol=1.5e-8, seconds=0.0)


@pytest.fixture
def fits(monkeypatch):
    """The threshold lowered to 10 parameters, and every factored fit recorded: [(kind, the fitted curvature)]."""
    monkeypatch.setattr(auto, "PRECONDITION_MIN", 10)
    calls = []
    fit = factored.fit_curvature

    def recorded(*args, **kwargs):
        calls.append((kwargs["kind"], fit(*args, **kwargs)))
        return calls[-1][1]

    monkeypatch.setattr(factored, "fit_curvature", recorded)
    return calls


@pytest.fixture(scope="module")
def trained():
    """A tanh MLP (nonconvex: its Hessian is not its Gauss-Newton matrix) trained to a minimum: L-BFGS, then
    Newton steps. Returns (stage, test examples)."""
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(80, 6, generator=gen), torch.randint(0, 3, (80,), generator=gen)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3)).double().eval()
    stage = ik.Stage(model, cross_entropy, (x[:60], y[:60]), regularizer=l2(1e-2))
    assert train_to_stationarity(stage) < 1e-10
    return stage, (x[60:], y[60:])


def test_the_choice_at_a_minimum_above_the_threshold_is_ekfac_preconditioned_cg(monkeypatch):
    monkeypatch.setattr(auto, "PRECONDITION_MIN", 100)
    above = decide(minimum(), 101)
    assert (above.matrix, above.solver, above.damping, above.preconditioner) == ("hessian", "cg_spd", 0.0, "ekfac")
    assert "at a minimum" in above.reason and "preconditioned by EK-FAC" in above.reason
    below = decide(minimum(), 100)
    assert (below.solver, below.preconditioner) == ("cg_spd", None) and "EK-FAC" not in below.reason
    many = decide(minimum(), auto.DIRECT_MAX + 1, n_rhs=50)  # too large to factor: exact CG, preconditioned
    assert (many.solver, many.preconditioner) == ("cg_spd", "ekfac")
    singular = decide(minimum(1e-12, "singular"), auto.DIRECT_MAX + 1)
    assert (singular.solver, singular.preconditioner) == ("minres", "ekfac") and "EK-FAC" in singular.reason
    assert decide(minimum(1e-12, "singular"), 101).solver == "direct"  # p ≤ DIRECT_MAX: the pseudo-inverse


def test_the_preconditioned_solve_is_the_explicit_hessian_solve_with_the_checks_ekfac_fitted_once(trained, fits):
    stage, test = trained
    chain = ik.Chain([stage], progress=False).fit()
    assert chain.positions[0].verdict == "minimum" and chain.dims == [P]
    assert [kind for kind, _ in fits] == ["ekfac"]  # the light check's fit, before the verdict was known
    query = chain.query(test)
    (solve,) = query.solves
    assert solve["solver"] == "cg_spd" and solve["preconditioner"].startswith("ekfac")
    assert "preconditioned by EK-FAC" in solve["choice"] and solve["converged"]
    assert chain.curvature(0).config.matrix == "hessian"  # the exact Hessian's solve ...
    assert chain.curvature(0).approximations["ekfac"] is fits[0][1]  # ... preconditioned by the check's EK-FAC
    assert [kind for kind, _ in fits] == ["ekfac"]  # not fitted again
    h = explicit_hessian(stage)
    b = total_grad(stage, *test)
    expected = torch.linalg.solve(h, b)
    assert (query.s - expected).norm() / expected.norm() <= 1e-8
    damped = chain.with_solve(ik.SolveConfig(damping=0.05)).query(test)  # λ as given, the same EK-FAC
    expected = torch.linalg.solve(h + 0.05 * torch.eye(P), b)
    assert (damped.s - expected).norm() / expected.norm() <= 1e-8
    assert damped.solves[0]["damping"] == 0.05 and [kind for kind, _ in fits] == ["ekfac"]


def test_a_saved_fit_keeps_the_shared_ekfac(trained, fits, tmp_path):
    stage, test = trained
    chain = ik.Chain([stage], progress=False)
    s = chain.query(test).s
    chain.save(tmp_path / "fit")
    loaded = ik.Chain([stage], progress=False).load(tmp_path / "fit")
    assert len(fits) == 1  # restored, not fitted
    torch.testing.assert_close(loaded.query(test).s, s, rtol=0, atol=0)


def test_explicit_settings_win_at_a_minimum(trained, fits):
    stage, test = trained
    h, b = explicit_hessian(stage), total_grad(stage, *test)
    named = ik.Chain([stage], solve=ik.SolveConfig(solver="cg_spd"), progress=False).query(test)
    assert named.solves[0]["preconditioner"] == "" and named.solves[0]["choice"] == ""
    assert fits == []  # a named solver: the full stationarity check, no factored fit
    diagonal = ik.Chain([stage], solve=ik.SolveConfig(preconditioner="diagonal"), progress=False).query(test)
    assert diagonal.solves[0]["solver"] == "cg_spd" and diagonal.solves[0]["preconditioner"].startswith("diagonal")
    assert [kind for kind, _ in fits] == ["diagonal"]
    fits.clear()
    kfac = ik.Chain([stage], solve=ik.SolveConfig(preconditioner="kfac"), progress=False).query(test)
    assert kfac.solves[0]["preconditioner"].startswith("kfac") and [kind for kind, _ in fits] == ["kfac"]  # once
    fits.clear()
    gauss_newton = ik.Chain([stage], curvature=ik.CurvatureConfig(matrix="gauss-newton"), progress=False)
    g_query = gauss_newton.query(test)
    assert gauss_newton.curvature(0).config.matrix == "gauss-newton" and [kind for kind, _ in fits] == ["ekfac"]
    assert g_query.solves[0]["preconditioner"].startswith("ekfac")
    for query in (named, diagonal, kfac):
        torch.testing.assert_close(query.s, torch.linalg.solve(h, b), rtol=1e-8, atol=0)


def test_a_singular_stationary_point_is_solved_by_minres_with_the_checks_ekfac(fits, monkeypatch):
    """Multinomial logistic regression without a regularizer: adding one vector to every class's weights and bias
    leaves the softmax unchanged, so H is singular at the minimum. Above DIRECT_MAX (lowered too) auto solves
    H + λI, λ = DAMPING_RATIO·θ_max, by MINRES preconditioned by the check's EK-FAC: the explicit solve."""
    monkeypatch.setattr(auto, "DIRECT_MAX", 10)
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(80, 6, generator=gen), torch.randint(0, 3, (80,), generator=gen)
    torch.manual_seed(0)
    stage = ik.Stage(nn.Linear(6, 3).double().eval(), cross_entropy, (x[:60], y[:60]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ik.ConvergenceWarning)  # the Newton steps' pseudo-inverse says H is singular
        assert train_to_stationarity(stage) < 1e-12
    with pytest.warns(ik.StationarityWarning, match="singular"):
        chain = ik.Chain([stage], progress=False).fit()
    query = chain.query((x[60:], y[60:]))
    (solve,) = query.solves
    assert chain.positions[0].verdict == "singular" and solve["solver"] == "minres" and solve["converged"]
    assert solve["preconditioner"].startswith("ekfac") and "EK-FAC" in solve["choice"]
    assert [kind for kind, _ in fits] == ["ekfac"] and chain.curvature(0).approximations["ekfac"] is fits[0][1]
    lam = solve["damping"]
    assert lam == pytest.approx(auto.DAMPING_RATIO * chain.positions[0].max_eigenvalue)
    expected = torch.linalg.solve(explicit_hessian(stage) + lam * torch.eye(21), total_grad(stage, x[60:], y[60:]))
    assert (query.s - expected).norm() / expected.norm() <= 1e-8


class RawLogits(nn.Module):
    """Logits x·W + c from bare parameters: no layer K-FAC knows, so the "EK-FAC" is all diagonal blocks."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(0.1 * torch.randn(6, 3))
        self.offset = nn.Parameter(torch.zeros(3))

    def forward(self, x):
        return x @ self.weight + self.offset


def test_without_a_factored_layer_the_checks_diagonal_blocks_precondition_the_exact_solve(fits):
    gen = torch.Generator().manual_seed(2)
    x, y = torch.randn(70, 6, generator=gen), torch.randint(0, 3, (70,), generator=gen)
    torch.manual_seed(0)
    stage = ik.Stage(RawLogits().double().eval(), cross_entropy, (x[:60], y[:60]), regularizer=l2(1e-2))
    assert train_to_stationarity(stage) < 1e-10
    chain = ik.Chain([stage], progress=False).fit()
    query = chain.query((x[60:], y[60:]))
    (solve,) = query.solves
    ekfac = chain.curvature(0).approximations["ekfac"]
    assert chain.positions[0].verdict == "minimum" and ekfac.info["diagonal"]  # no Kronecker block
    assert solve["preconditioner"].startswith("ekfac") and [kind for kind, _ in fits] == ["ekfac"] and ekfac is fits[0][1]
    expected = torch.linalg.solve(explicit_hessian(stage), total_grad(stage, x[60:], y[60:]))
    assert (query.s - expected).norm() / expected.norm() <= 1e-8
