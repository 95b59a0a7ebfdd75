"""Every deprecated solve keyword of the entry points still works — same numbers as ``solve=SolveConfig(...)`` — and
warns with a DeprecationWarning naming its replacement (pyproject ignores DeprecationWarning, so each is asserted)."""

from __future__ import annotations

import pytest
import torch
from conftest import cross_entropy, l2, tanh_mlp
from sklearn.datasets import make_moons
from torch import nn

import influkit as ik
from influkit.ssl import Neumann, PseudoLabel, hypergradient, train_ssl
from influkit.training import fit_lbfgs
from test_multistage import ALPHA, build
from test_ssl import make_problem

# (keyword, deprecated value, the SolveConfig that replaces it)
SINGLE = [
    ("solver", "minres", ik.SolveConfig(solver="minres")),
    ("damping", 0.1, ik.SolveConfig(damping=0.1)),
    ("tol", 1e-6, ik.SolveConfig(solver="minres", tol=1e-6)),
    ("max_iter", 3, ik.SolveConfig(solver="minres", max_iter=3)),
    ("hessian_samples", 30, ik.SolveConfig(hessian_samples=30)),
    ("seed", 4, ik.SolveConfig(hessian_samples=30, seed=4)),
]


@pytest.fixture(scope="module")
def stage():
    torch.manual_seed(0)
    x, y = torch.randn(50, 4, dtype=torch.float64), torch.randint(0, 3, (50,))
    stage = ik.Stage(nn.Linear(4, 3).double(), cross_entropy, (x, y), regularizer=l2(1e-2))
    fit_lbfgs(stage, max_iter=300)
    return stage


def _warned(record, keyword: str, where: str) -> None:
    messages = [str(w.message) for w in record if issubclass(w.category, DeprecationWarning)]
    assert any(f"{where}({keyword}=...) is deprecated" in m and f"SolveConfig({keyword}=...)" in m for m in messages), messages


@pytest.mark.parametrize("keyword,value,config", SINGLE)
def test_influence_keyword_aliases(stage, keyword, value, config):
    extra = {"solver": "minres"} if keyword in ("tol", "max_iter") else {}
    extra |= {"hessian_samples": 30} if keyword == "seed" else {}
    test = stage.data.take(torch.arange(5))
    with pytest.warns(DeprecationWarning) as record:
        old = ik.influence(stage, torch.arange(10), test, **{keyword: value}, **extra)
    _warned(record, keyword, "influkit.influence")
    new = ik.influence(stage, torch.arange(10), test, solve=config)
    torch.testing.assert_close(old.values, new.values, rtol=0, atol=0)
    assert old.diagnostics["settings"]["solve"] == new.diagnostics["settings"]["solve"]


@pytest.mark.parametrize("keyword,value,config", SINGLE)
def test_self_influence_keyword_aliases(stage, keyword, value, config):
    extra = {"solver": "minres"} if keyword in ("tol", "max_iter") else {}
    extra |= {"hessian_samples": 30} if keyword == "seed" else {}
    with pytest.warns(DeprecationWarning) as record:
        old = ik.self_influence(stage, torch.arange(10), **{keyword: value}, **extra)
    _warned(record, keyword, "influkit.self_influence")
    new = ik.self_influence(stage, torch.arange(10), solve=config)
    torch.testing.assert_close(old.values, new.values, rtol=0, atol=0)
    assert old.diagnostics["settings"] == new.diagnostics["settings"]


@pytest.fixture(scope="module")
def two_stages():
    return build(1)


@pytest.mark.parametrize("keyword,value,configs", [
    ("solver", ("cg", "minres"), [ik.SolveConfig(solver="cg"), ik.SolveConfig(solver="minres")]),
    ("damping", (1e-2, 1e-8), [ik.SolveConfig(damping=1e-2), ik.SolveConfig(damping=1e-8)]),
    ("solver", "identity", [ik.SolveConfig(solver="identity")] * 2),
    ("hessian_samples", 30, [ik.SolveConfig(hessian_samples=30), ik.SolveConfig()]),  # one value: pretraining only
    ("hessian_samples", (30, 20), [ik.SolveConfig(hessian_samples=30), ik.SolveConfig(hessian_samples=20)]),
    ("tol", 1e-6, [ik.SolveConfig(tol=1e-6)] * 2),
    ("max_iter", 50, [ik.SolveConfig(max_iter=50)] * 2),
    ("seed", 3, [ik.SolveConfig(seed=3)] * 2),
])
def test_score_keyword_aliases(two_stages, keyword, value, configs):
    pre, fin, test = two_stages
    kw = dict(shared="embedding", case=1, alpha=ALPHA)
    with pytest.warns(DeprecationWarning) as record:
        old = ik.score(pre, fin, torch.arange(8), test, **{keyword: value}, **kw)
    messages = [str(w.message) for w in record if issubclass(w.category, DeprecationWarning)]
    assert any(f"influkit.score({keyword}=...) is deprecated" in m and "SolveConfig(" in m for m in messages), messages
    new = ik.score(pre, fin, torch.arange(8), test, solve=configs, **kw)
    torch.testing.assert_close(old.values, new.values, rtol=0, atol=0)
    assert old.diagnostics["settings"]["solve"] == [c.summary() for c in configs]


def test_solve_method_alias():
    h = torch.tensor([[4.0, 1.0], [1.0, 3.0]], dtype=torch.float64)
    b = torch.tensor([1.0, 2.0], dtype=torch.float64)
    with pytest.warns(DeprecationWarning, match=r"influkit.solve\(method=...\) is deprecated.*solver="):
        old = ik.solve(h, b, method="minres")
    assert old.method == "minres"
    torch.testing.assert_close(old.x, ik.solve(h, b, "minres").x, rtol=0, atol=0)


@pytest.mark.parametrize("legacy,solve", [
    ({"solver": "minres", "tol": 1e-12}, ik.SolveConfig(solver="minres", tol=1e-12)),
    ({"damping": 1e-3}, ik.SolveConfig(damping=1e-3)),
    ({"solver": "cg_spd", "max_iter": 500, "tol": 1e-12}, ik.SolveConfig(solver="cg_spd", max_iter=500, tol=1e-12)),
    ({"solver": "neumann", "neumann_terms": 7, "neumann_alpha": 0.3, "damping": 1e-2}, Neumann(7, 0.3, 1e-2)),
])
def test_hypergradient_keyword_aliases(legacy, solve):
    labeled, u, val, w, teacher = make_problem()
    model = tanh_mlp(4, 6, 3, seed=2)
    args = (model, cross_entropy, teacher, labeled, u, val, w)
    with pytest.warns(DeprecationWarning) as record:
        old = hypergradient(*args, params="2", **legacy)
    messages = " | ".join(str(w.message) for w in record if issubclass(w.category, DeprecationWarning))
    for keyword in legacy:  # with solver="neumann", damping= is named in that warning's replacement, Neumann(damping=)
        assert f"influkit.ssl.hypergradient({keyword}" in messages or f"{keyword}=...)" in messages
    new = hypergradient(*args, params="2", solve=solve)
    torch.testing.assert_close(old.values, new.values, rtol=0, atol=0)
    assert old.diagnostics["settings"] == new.diagnostics["settings"]


def test_train_ssl_keyword_aliases():
    x, y = make_moons(120, noise=0.1, random_state=0)
    x, y = torch.tensor(x), torch.tensor(y)

    def run(**kw):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(2, 8), nn.ReLU(), nn.Linear(8, 2)).double()
        return train_ssl(model, cross_entropy, PseudoLabel(), (x[:10], y[:10]), x[40:], (x[10:40], y[10:40]),
                         steps=20, warmup=5, inner_steps=5, weight_lr=0.5, log_every=10, **kw).weights

    with pytest.warns(DeprecationWarning) as record:
        old = run(solver="minres", damping=0.1)
    messages = " | ".join(str(w.message) for w in record if issubclass(w.category, DeprecationWarning))
    assert "influkit.ssl.train_ssl(solver=...)" in messages and "influkit.ssl.train_ssl(damping=...)" in messages
    torch.testing.assert_close(old, run(solve=ik.SolveConfig(solver="minres", damping=0.1)), rtol=0, atol=0)


def test_unknown_keywords_and_double_settings_are_refused(stage, two_stages):
    test = stage.data.take(torch.arange(5))
    with pytest.raises(TypeError, match="unexpected keyword argument 'solvr'"):
        ik.influence(stage, torch.arange(3), test, solvr="direct")
    with pytest.raises(TypeError, match="unexpected keyword argument 'rhs'"):
        ik.solve(torch.eye(2, dtype=torch.float64), torch.ones(2, dtype=torch.float64), rhs=1)
    pre, fin, x_test = two_stages
    with pytest.raises(ik.InputError, match="solve settings once"):
        ik.score(pre, fin, torch.arange(3), x_test, shared="embedding", damping=(0.1, 0.1),
                 solve=[ik.SolveConfig(), ik.SolveConfig()])
    with pytest.raises(ik.InputError, match="solve settings once"):
        ik.influence(stage, torch.arange(3), test, solve=ik.SolveConfig(), tol=1e-3)
    with pytest.raises(ik.InputError, match="one value or one per stage"), pytest.warns(DeprecationWarning):
        ik.score(pre, fin, torch.arange(3), x_test, shared="embedding", damping=(0.1, 0.1, 0.1))


def test_auto_is_the_default_everywhere_and_its_choice_is_recorded(stage, two_stages):
    test = stage.data.take(torch.arange(5))
    res = ik.influence(stage, torch.arange(10), test)
    (solve,) = res.diagnostics["solves"]
    assert res.diagnostics["stages"][0]["verdict"] == "minimum"
    assert solve["method"] == "cg_spd" and solve["choice"].startswith("auto: at a minimum")  # one query batch
    pre, fin, x_test = two_stages
    res = ik.score(pre, fin, torch.arange(8), x_test, shared="embedding")
    by_verdict = {"minimum": "cg_spd", "singular": "direct", "saddle": "minres", "non-stationary": "minres"}
    assert [s["method"] for s in res.diagnostics["solves"]] == [by_verdict[s["verdict"]] for s in res.diagnostics["stages"]]
    assert all(s["choice"].startswith("auto:") for s in res.diagnostics["solves"])
    assert all(c["solver"] == "auto" and c["damping"] == 0.0 for c in res.diagnostics["settings"]["solve"])
    sol = ik.solve(torch.eye(3, dtype=torch.float64) * 2, torch.ones(3, dtype=torch.float64))
    assert sol.method == "direct" and sol.choice.startswith("auto:")

    class MatvecOnly:  # an Operator with no dense form: auto cannot factor it and runs MINRES
        dim, dtype, device = 3, torch.float64, torch.device("cpu")

        def matvec(self, v):
            return 2 * v

    sol = ik.solve(MatvecOnly(), torch.ones(3, dtype=torch.float64))
    assert sol.method == "minres" and "no dense()" in sol.choice and sol.converged
    torch.testing.assert_close(sol.x, torch.full((3,), 0.5, dtype=torch.float64))
