import numpy as np
import pytest
import torch

import influkit as ik
from influkit.gradients import per_example_grads_serial
from influkit.training import HessianFactor, fit_lbfgs, newton_fit
from conftest import cross_entropy, explicit_hessian, l2, need
from test_multistage import build


def closed_form(stage, z_idx, test):
    """−∇f(T)ᵀ H⁻¹ ∇ℓ(z) from the explicit Hessian and serial gradients."""
    h = explicit_hessian(stage)
    zx, zy = stage.data.take(z_idx)
    g_z = per_example_grads_serial(stage, zx, zy)
    g_t = per_example_grads_serial(stage, *test)
    return -(g_z @ torch.linalg.solve(h, g_t.T))  # (len(z), len(test))


@pytest.mark.parametrize("solver", ["direct", "cg", "minres"])
def test_influence_equals_closed_form(logreg_digits, solver):
    stage, test = logreg_digits
    test = (test[0][:20], test[1][:20])
    z = torch.arange(0, 300, 7)
    expected = closed_form(stage, z, test)
    res = ik.influence(stage, z, test, solve=ik.SolveConfig(solver=solver), progress=False)
    tol = 1e-8 if solver == "direct" else 1e-6
    assert torch.allclose(res.values, expected.sum(1), rtol=0, atol=tol * expected.sum(1).abs().max())
    per = ik.influence(stage, z, test, solve=ik.SolveConfig(solver=solver), per_test=True, progress=False)
    assert per.values.shape == (len(z), 20)
    assert torch.allclose(per.values, expected, rtol=0, atol=tol * expected.abs().max())
    assert torch.allclose(res.removal, -res.values / 300)


def test_influence_by_index_equals_by_tensors(logreg_digits):
    stage, test = logreg_digits
    z = torch.tensor([3, 17, 250])
    by_index = ik.influence(stage, z, test, solve=ik.SolveConfig(solver="direct"), progress=False)
    by_tensor = ik.influence(stage, stage.data.take(z), test, solve=ik.SolveConfig(solver="direct"), progress=False)
    assert torch.allclose(by_index.values, by_tensor.values)
    assert by_index.index.tolist() == [3, 17, 250]


def test_self_influence_matches_closed_form(logreg_digits):
    stage, _ = logreg_digits
    z = torch.arange(0, 300, 31)
    h = explicit_hessian(stage)
    g = per_example_grads_serial(stage, *stage.data.take(z))
    expected = -(g * torch.linalg.solve(h, g.T).T).sum(1)
    for solver in ("direct", "minres"):
        res = ik.self_influence(stage, z, solve=ik.SolveConfig(solver=solver), rhs_chunk=4, progress=False)
        assert torch.allclose(res.values, expected, rtol=1e-6)
    assert (res.values < 0).all()


def test_loo_retraining_agrees_on_real_digits(logreg_digits):
    """Predicted removal effect vs actual leave-one-out refit of L2 logistic regression (Koh & Liang Fig. 2)."""
    stage, test = logreg_digits
    res = ik.influence(stage, torch.arange(300), test, solve=ik.SolveConfig(solver="direct"), progress=False)
    order = torch.argsort(res.values.abs(), descending=True)
    rng = np.random.default_rng(0)
    chosen = list(order[:20].tolist()) + list(rng.choice(order[20:].numpy(), 20, replace=False))
    base_state = {k: v.clone() for k, v in stage.model.state_dict().items()}
    x, y = stage.data.take(torch.arange(300))
    base_loss = float(stage.losses(stage.trained(), *test).sum())
    factor = HessianFactor(stage)  # the Hessian at the optimum preconditions every leave-one-out refit
    actual = []
    for i in chosen:
        keep = torch.ones(300, dtype=torch.bool)
        keep[i] = False
        model = torch.nn.Linear(64, 10).double()
        model.load_state_dict(base_state)  # warm start from the optimum
        loo = ik.Stage(model, stage.loss, (x[keep], y[keep]), regularizer=stage.regularizer)
        assert newton_fit(loo, factor=factor, tol=1e-12) < 1e-11
        actual.append(float(loo.losses(loo.trained(), *test).sum()) - base_loss)
    # the objective is a mean: removing one of n examples also rescales the others by n/(n-1)
    predicted = res.removal[chosen].numpy()
    stats = need("scipy.stats")
    pearson = stats.pearsonr(predicted, actual)[0]
    spearman = stats.spearmanr(predicted, actual)[0]
    assert pearson >= 0.95, pearson
    assert spearman >= 0.9, spearman



@pytest.fixture(scope="module")
def small_stage():
    torch.manual_seed(0)
    x, y = torch.randn(50, 4, dtype=torch.float64), torch.randint(0, 3, (50,))
    stage = ik.Stage(torch.nn.Linear(4, 3).double(), cross_entropy, (x, y), regularizer=l2(1e-2))
    fit_lbfgs(stage, max_iter=300)
    return stage


def test_unknown_keywords_are_refused(small_stage):
    test = small_stage.data.take(torch.arange(5))
    with pytest.raises(TypeError, match="unexpected keyword argument 'solvr'"):
        ik.influence(small_stage, torch.arange(3), test, solvr="direct")
    with pytest.raises(TypeError, match="unexpected keyword argument 'damping'"):  # solve settings: solve=SolveConfig
        ik.self_influence(small_stage, torch.arange(3), damping=0.1)
    with pytest.raises(TypeError, match="unexpected keyword argument 'rhs'"):
        ik.solve(torch.eye(2, dtype=torch.float64), torch.ones(2, dtype=torch.float64), rhs=1)
    pre, fin, x_test = build(1)
    with pytest.raises(TypeError, match="unexpected keyword argument 'solver'"):
        ik.score(pre, fin, torch.arange(3), x_test, shared="embedding", solver="direct")


def test_auto_is_the_default_everywhere_and_its_choice_is_recorded(small_stage):
    test = small_stage.data.take(torch.arange(5))
    res = ik.influence(small_stage, torch.arange(10), test)
    (solve,) = res.diagnostics["solves"]
    assert solve["solver"] == "cg_spd" and solve["choice"].startswith("auto: at a minimum")  # one right-hand side
    pre, fin, x_test = build(1)
    res = ik.score(pre, fin, torch.arange(8), x_test, shared="embedding")
    assert [s["solver"] for s in res.diagnostics["solves"]] == ["cg_spd", "cg_spd"]  # both stages at a minimum
    assert all(s["choice"].startswith("auto:") for s in res.diagnostics["solves"])
    assert all(c["solver"] == "auto" and c["damping"] == 0.0 for c in res.diagnostics["settings"]["solve"])
    sol = ik.solve(torch.eye(3, dtype=torch.float64) * 2, torch.ones(3, dtype=torch.float64))
    assert sol.solver == "direct" and sol.choice.startswith("auto:")

    class MatvecOnly:  # an Operator with no dense form: auto cannot factor it and runs MINRES
        dim, dtype, device = 3, torch.float64, torch.device("cpu")

        def matvec(self, v):
            return 2 * v

    sol = ik.solve(MatvecOnly(), torch.ones(3, dtype=torch.float64))
    assert sol.solver == "minres" and "no dense()" in sol.choice and sol.converged
    torch.testing.assert_close(sol.x, torch.full((3,), 0.5, dtype=torch.float64))


def test_suspicious_self_influence_finds_flipped_labels_on_real_digits():
    """The README's mislabel recipe, ``ik.self_influence(stage).suspicious(k)``: L2 logistic regression on 300 real
    digits with 30 labels flipped; the 30 examples it flags first hold 25 of them (the 30 largest scores, what
    ``top(30)`` returns, hold none: the suspicious self-influences are the most negative)."""
    from torch import nn

    from conftest import cross_entropy, digits, l2
    from influkit.training import fit_lbfgs, newton_refine

    x, y = digits(300, seed=3)
    gen = torch.Generator().manual_seed(0)
    flipped = torch.randperm(300, generator=gen)[:30]
    noisy = y.clone()
    noisy[flipped] = (y[flipped] + torch.randint(1, 10, (30,), generator=gen)) % 10
    torch.manual_seed(0)
    stage = ik.Stage(nn.Linear(64, 10).double(), cross_entropy, (x, noisy), regularizer=l2(1e-2))
    fit_lbfgs(stage, max_iter=1000)
    assert newton_refine(stage) < 1e-10
    res = ik.self_influence(stage)
    flagged = res.suspicious(30)
    found = int(torch.isin(torch.tensor(flagged["example"].tolist()), flipped).sum())
    assert found >= 24  # 30 flipped among 300; a random 30 would hold 3
    assert (flagged["removal"].diff().dropna() <= 0).all() and (flagged["score"] < 0).all()
    assert int(torch.isin(torch.tensor(res.top(30)["example"].tolist()), flipped).sum()) <= 3
    with pytest.raises(ik.InputError, match="suspicious\\(\\) ranks a self-influence result"):
        ik.influence(stage, torch.arange(5), (x[:3], noisy[:3])).suspicious(3)
