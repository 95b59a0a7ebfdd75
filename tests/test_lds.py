"""LDS: the metric against scipy and closed forms, ridge regression with closed-form re-training (exact influence
near 1, shuffled scores near 0), the resumable harness, chain re-training and the gradient dot product baseline."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from conftest import need
from torch.func import functional_call

import influkit as ik
from influkit.gradients import per_example_grads
from influkit.apps import lds as H  # the re-training harness and baselines
from influkit.validation import lds as L  # the metric
from influkit.links import StagePlan
from influkit.training import train_to_stationarity
from influkit.validation.retrain import Retrainer, reset_parameters

LAM = 0.05


# ------------------------------------------------------------------------------------------------ metric


def test_random_subsets_are_seeded_and_exactly_sized():
    a = L.random_subsets(41, 12, alpha=0.5, seed=3)
    assert a.shape == (12, 41) and a.dtype == torch.bool
    assert (a.sum(1) == round(0.5 * 41)).all()
    assert torch.equal(a, L.random_subsets(41, 12, alpha=0.5, seed=3))
    assert not torch.equal(a, L.random_subsets(41, 12, alpha=0.5, seed=4))
    assert len({tuple(r.tolist()) for r in a}) == 12
    with pytest.raises(ik.InputError, match="alpha"):
        L.random_subsets(10, 5, alpha=1.0)


def test_lds_is_the_mean_of_scipy_spearman_per_query():
    stats = need("scipy.stats")
    gen = np.random.default_rng(0)
    masks = L.random_subsets(30, 20, seed=1).numpy()
    scores = gen.normal(size=(30, 6))
    outputs = masks @ scores + gen.normal(scale=2.0, size=(20, 6))
    expected = [stats.spearmanr(masks @ scores[:, t], outputs[:, t])[0] for t in range(6)]
    np.testing.assert_allclose(L.lds_per_query(scores, masks, outputs), expected, rtol=1e-12)
    assert L.lds(scores, masks, outputs) == pytest.approx(np.mean(expected), rel=1e-12)


def test_outputs_linear_in_the_subset_give_lds_one_and_the_sign_matters():
    masks = L.random_subsets(25, 15, seed=2)
    scores = torch.randn(25, 4, generator=torch.Generator().manual_seed(0))
    outputs = 3.0 + 0.7 * masks.double() @ scores  # any increasing affine map of the summed scores
    assert L.lds(scores, masks, outputs) == pytest.approx(1.0)
    assert L.lds(-scores, masks, outputs) == pytest.approx(-1.0)
    # the "removal" convention f0 + Σ_{i∉S} removal_i, removal = −score/n, ranks the same way
    removal_form = 1.0 + (~masks).double() @ (-scores / 25)
    assert L.lds(scores, masks, removal_form) == pytest.approx(1.0)


def test_constant_query_is_left_out_with_a_warning():
    masks = L.random_subsets(20, 10, seed=0)
    scores = torch.randn(20, 2, generator=torch.Generator().manual_seed(1))
    outputs = torch.stack([masks.double() @ scores[:, 0], torch.ones(10)], dim=1)
    with pytest.warns(UserWarning, match="1 of 2 queries"):
        assert L.lds(scores, masks, outputs) == pytest.approx(1.0)


def test_metric_refuses_mismatched_shapes():
    masks = L.random_subsets(20, 10, seed=0)
    with pytest.raises(ik.InputError, match=r"\(n, q\)"):
        L.lds(torch.randn(19, 2), masks, torch.randn(10, 2))
    with pytest.raises(ik.InputError, match=r"\(M, q\)"):
        L.lds(torch.randn(20, 2), masks, torch.randn(10, 3))


# ----------------------------------------------------------------------------- ridge: a known answer


class Ridge:
    """Mean squared error ½(xᵀθ − y)² + (λ/2)‖θ‖²: exact influence by the Chain, re-training in closed form."""

    def __init__(self, n: int = 120, d: int = 4, q: int = 20, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        w = torch.randn(d, generator=gen)
        self.x = torch.randn(n, d, generator=gen)
        self.y = self.x @ w + 0.5 * torch.randn(n, generator=gen)
        self.tx = torch.randn(q, d, generator=gen)
        self.ty = self.tx @ w + 0.5 * torch.randn(q, generator=gen)
        self.n, self.d = n, d
        model = nn.Linear(d, 1, bias=False)
        with torch.no_grad():
            model.weight.copy_(self.fit(torch.arange(n))[None])
        self.stage = ik.Stage(model, self.loss, (self.x, self.y), regularizer=lambda p: 0.5 * LAM * sum((v**2).sum() for v in p.values()))
        self.chain = ik.Chain([self.stage], solve=ik.SolveConfig(solver="direct"))

    @staticmethod
    def loss(out, t):
        return 0.5 * (out.squeeze(-1) - t) ** 2

    def fit(self, idx):
        a, b = self.x[idx], self.y[idx]
        return torch.linalg.solve(a.T @ a / len(idx) + LAM * torch.eye(self.d), a.T @ b / len(idx))

    def retrain(self, idx, seed):
        return 0.5 * (self.tx @ self.fit(idx) - self.ty) ** 2


@pytest.fixture(scope="module")
def ridge():
    return Ridge()


def test_ridge_exact_influence_has_lds_near_one_and_shuffled_near_zero(ridge, tmp_path):
    scores = ridge.chain.query((ridge.tx, ridge.ty), per_test=True).scores()
    run = H.run_lds(ridge.retrain, ridge.n, tmp_path, n_subsets=60, seeds=(0,), progress=False)
    exact = run.lds(scores)
    assert exact > 0.85
    assert run.lds(-scores.values) == pytest.approx(-exact)
    gen = torch.Generator().manual_seed(0)
    shuffled = [run.lds(scores.values[torch.randperm(ridge.n, generator=gen)]) for _ in range(5)]
    assert abs(np.mean(shuffled)) < 0.1
    table = run.table({"exact": scores, "shuffled": scores.values[torch.randperm(ridge.n, generator=gen)]})
    assert table.loc["exact", "LDS"] == pytest.approx(exact) and table.loc["exact", "queries"] == 20
    assert table.attrs["M"] == 60


def test_chain_retrain_matches_closed_form_ridge(ridge):
    idx = L.random_subsets(ridge.n, 3, seed=5)[0].nonzero().reshape(-1)
    retrain = H.ChainOutputs(ridge.chain, (ridge.tx, ridge.ty))
    torch.testing.assert_close(retrain(idx, seed=1), ridge.retrain(idx, 1), rtol=1e-8, atol=1e-12)
    assert retrain.gradient_norms[-1][0] < 1e-9
    torch.testing.assert_close(ridge.stage.model.weight.detach()[0], ridge.fit(torch.arange(ridge.n)))  # untouched


# ------------------------------------------------------------------------------------------------ harness


class Interrupted(Exception):
    """Stands for a crash or Ctrl-C in the middle of a run."""


def test_harness_resumes_after_interruption_without_recomputing(ridge, tmp_path):
    calls: list[tuple[int, int]] = []
    crash = [True]  # crash once, on the 7th re-training

    def retrain(idx, seed):
        calls.append((int(idx.sum()), seed))
        if len(calls) == 7 and crash and crash.pop():
            raise Interrupted("simulated interruption")
        return ridge.retrain(idx, seed)

    kw = dict(n_subsets=8, seeds=(0, 1), setup={"model": "ridge"}, progress=False)
    with pytest.raises(Interrupted):
        H.run_lds(retrain, ridge.n, tmp_path / "run", **kw)
    assert len(list((tmp_path / "run" / "outputs").glob("*.safetensors"))) == 6
    partial = H.load_lds(tmp_path / "run")
    assert not partial.complete and int(torch.isfinite(partial.outputs[..., 0]).sum()) == 6
    first = list(calls[:6])
    calls.clear()
    run = H.run_lds(retrain, ridge.n, tmp_path / "run", **kw)
    assert len(calls) == 16 - 6 and not set(calls) & set(first)
    fresh = H.run_lds(ridge.retrain, ridge.n, tmp_path / "fresh", **kw)
    torch.testing.assert_close(run.outputs, fresh.outputs, rtol=0, atol=0)
    calls.clear()
    again = H.run_lds(retrain, ridge.n, tmp_path / "run", **kw)
    assert calls == [] and torch.equal(again.outputs, run.outputs)
    torch.testing.assert_close(H.load_lds(tmp_path / "run").outputs, run.outputs, rtol=0, atol=0)


@pytest.mark.parametrize("change", [{"alpha": 0.4}, {"seeds": (0, 2)}, {"n_subsets": 9}, {"setup": {"model": "other"}}])
def test_harness_refuses_a_different_setup(ridge, tmp_path, change):
    kw = dict(n_subsets=8, seeds=(0, 1), setup={"model": "ridge"}, progress=False)
    H.run_lds(ridge.retrain, ridge.n, tmp_path, **kw)
    with pytest.raises(ik.InputError, match="different setup"):
        H.run_lds(ridge.retrain, ridge.n, tmp_path, **(kw | change))


def test_harness_refuses_nan_outputs_and_stores_nothing(ridge, tmp_path):
    with pytest.raises(ik.NumericalError, match="NaN"):
        H.run_lds(lambda idx, seed: torch.full((3,), float("nan")), ridge.n, tmp_path, n_subsets=4, seeds=(0,), progress=False)
    assert not list((tmp_path / "outputs").glob("*.safetensors"))


def test_plot_and_long_frame(ridge, tmp_path):
    matplotlib = need("matplotlib")

    matplotlib.use("Agg")
    scores = ridge.chain.query((ridge.tx, ridge.ty), per_test=True).scores()
    run = H.run_lds(ridge.retrain, ridge.n, tmp_path, n_subsets=10, seeds=(0, 1), progress=False)
    fig = run.plot(scores, title="ridge")
    assert "Spearman" in fig.axes[1].get_title() and "LDS" in fig.axes[0].get_title()
    frame = run.to_frame()
    assert len(frame) == 10 * 2 * 20 and set(frame["seed"]) == {0, 1}


# ----------------------------------------------------------------------------- two-stage chains


ALPHA = 0.05


class Net(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.enc = nn.Linear(4, 3)
        self.head = nn.Linear(3, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.enc(x)))


def ce(out, y):
    return nn.functional.cross_entropy(out, y, reduction="none")


def l2(params):
    return 0.5 * 0.05 * sum((p**2).sum() for p in params.values())


def data(seed: int, n: int = 30):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=gen)
    return x, (x[:, 0] + 0.5 * x[:, 1] * x[:, 2] > 0).long()


def two_stage(case: int) -> tuple[ik.Chain, tuple]:
    pre = ik.Stage(Net(0), ce, data(1), regularizer=l2)
    train_to_stationarity(pre)
    fin_model = Net(1)
    fin_model.enc.load_state_dict(pre.model.enc.state_dict())
    fin = ik.Stage(fin_model, ce, data(2), params="head" if case == 1 else None, regularizer=l2)
    link = ik.Link("enc", case=case, alpha=ALPHA)
    train_to_stationarity(StagePlan(fin, link, StagePlan(pre)).objective(fin, pre.state()))
    chain = ik.Chain([pre, fin], [link], solve=ik.SolveConfig(solver="direct"))
    return chain, data(3, n=7)


@pytest.mark.parametrize("case", [1, 2])
def test_chain_retrain_warm_on_everything_reproduces_the_trained_chain(case):
    """At the chain's own optimum the re-training objectives (loss, L2, Case 2 proximal term) are stationary."""
    chain, test = two_stage(case)
    before = {n: t.clone() for n, t in chain.stages[1].state().items()}
    retrain = H.ChainOutputs(chain, test, Retrainer(optimizer=train_to_stationarity, init="warm", keep_weights=False))
    out = retrain(torch.arange(len(chain.stages[0])), seed=0)
    with torch.no_grad():
        expected = chain.stages[1].losses(chain.stages[1].trained(), *test)
    torch.testing.assert_close(out, expected, rtol=1e-7, atol=1e-10)
    assert all(torch.equal(before[n], t) for n, t in chain.stages[1].state().items())


@pytest.mark.parametrize("case", [1, 2])
def test_chain_retrain_on_a_subset_reaches_the_subset_chain_optimum(case):
    """Stationarity of each re-trained stage, checked on objectives written out here independently."""
    chain, test = two_stage(case)
    subset = L.random_subsets(30, 3, seed=0)[1].nonzero().reshape(-1)
    (pre, fin), _ = H.ChainOutputs(chain, test).retrainer(chain, subset, seed=2)
    x, y = data(1)
    p = {n: t.detach().clone().requires_grad_() for n, t in pre.model.named_parameters()}
    objective = ce(functional_call(pre.model, p, (x[subset],)), y[subset]).mean() + l2(p)
    assert max(float(g.abs().max()) for g in torch.autograd.grad(objective, list(p.values()))) < 1e-8
    assert not torch.allclose(p["enc.weight"], chain.stages[0].model.enc.weight)
    f = {n: t.detach().clone().requires_grad_() for n, t in fin.model.named_parameters()}
    xf, yf = data(2)
    loss = ce(functional_call(fin.model, f, (xf,)), yf).mean()
    if case == 1:
        torch.testing.assert_close(f["enc.weight"], p["enc.weight"], rtol=0, atol=0)
        objective, wrt = loss + l2({n: f[n] for n in ("head.weight", "head.bias")}), ["head.weight", "head.bias"]
    else:
        proximal = ALPHA * sum(((f[n] - p[n]) ** 2).sum() for n in ("enc.weight", "enc.bias"))
        objective, wrt = loss + l2(f) + proximal, list(f)
    grads = torch.autograd.grad(objective, [f[n] for n in wrt])
    assert max(float(g.abs().max()) for g in grads) < 1e-8


def test_chain_retrain_from_scratch_is_seeded():
    chain, test = two_stage(1)
    retrain = H.ChainOutputs(chain, test)
    subset = L.random_subsets(len(chain.stages[0]), 3, seed=0)[0].nonzero().reshape(-1)
    a, b = retrain(subset, seed=3), retrain(subset, seed=3)
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert max(max(norms) for norms in retrain.gradient_norms) < 1e-8
    model = Net(5)
    original = {n: p.detach().clone() for n, p in model.named_parameters()}
    torch.manual_seed(9)
    reset_parameters(model, ["head.weight", "head.bias"])
    named = dict(model.named_parameters())
    assert torch.equal(named["enc.weight"], original["enc.weight"])
    assert not torch.equal(named["head.weight"], original["head.weight"])


@pytest.mark.parametrize("case", [1, 2])
def test_gradient_dot_is_the_negated_shared_block_dot_product(case):
    chain, test = two_stage(case)
    shared = ["enc.weight", "enc.bias"]
    res = H.gradient_dot(chain, test)
    g_test = per_example_grads(chain.stages[1], *test, shared)
    g_pre = per_example_grads(chain.stages[0], *chain.stages[0].data.take(torch.arange(30)), shared)
    torch.testing.assert_close(res.values, -g_pre @ g_test.T)
    if case == 2:  # the identity ablation of Case 2 is 2α times the dot product (same LDS)
        ident = ik.Chain(chain.stages, chain.links, solve=ik.SolveConfig(solver="identity"))
        torch.testing.assert_close(ident.query(test, per_test=True).scores().values, 2 * ALPHA * res.values)


def test_gradient_dot_single_stage_equals_identity_solver(ridge):
    ident = ik.Chain([ridge.stage], solve=ik.SolveConfig(solver="identity"))
    expected = ident.query((ridge.tx, ridge.ty), per_test=True).scores().values
    torch.testing.assert_close(H.gradient_dot(ridge.chain, (ridge.tx, ridge.ty)).values, expected)
