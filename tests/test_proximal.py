"""influkit.proximal: a Case 2 link states its assumption (the finetuning minimized F + α‖W − W̄‖²) and checks it
against the drift of the finetuned block — float64, a tanh network pretrained and finetuned on real digits."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from conftest import cross_entropy, digits, l2

import influkit as ik
from influkit.links import StagePlan
from influkit.proximal import measure
from influkit.training import fit_lbfgs, newton_refine

ALPHA = 0.05


class Net(nn.Module):
    def __init__(self, classes: int):
        super().__init__()
        self.body = nn.Linear(64, 6)
        self.head = nn.Linear(6, classes)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))


@pytest.fixture(scope="module")
def pretrained():
    """Body + head pretrained to a minimum on 120 digits 0–2; finetuning data: 80 digits 3–4 (labels 0, 1)."""
    x, y = digits()
    pre_idx, fin_idx = (y <= 2).nonzero()[:120, 0], ((y >= 3) & (y <= 4)).nonzero()[:80, 0]
    torch.manual_seed(0)
    pre = ik.Stage(Net(3).double(), cross_entropy, (x[pre_idx], y[pre_idx]), regularizer=l2(1e-2))
    fit_lbfgs(pre, max_iter=1000)
    newton_refine(pre)
    return pre, (x[fin_idx], y[fin_idx] - 3)


def finetune_stage(pre, data, seed=1) -> ik.Stage:
    torch.manual_seed(seed)
    model = Net(2).double()
    model.body.load_state_dict(pre.model.body.state_dict())
    return ik.Stage(model, cross_entropy, data, regularizer=l2(1e-2))


def chain(pre, fin, alpha):
    return ik.Chain([pre, fin], [ik.Link("body", case=2, alpha=alpha)], solve=[ik.SolveConfig(solver="direct")] * 2)


def quiet_fit(pre, fin, alpha) -> tuple[ik.Chain, list]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        built = chain(pre, fin, alpha).fit()
    return built, [w for w in caught if issubclass(w.category, ik.ProximalWarning)]


def test_finetuning_with_the_proximal_term_at_its_minimum_agrees(pretrained):
    pre, data = pretrained
    fin = finetune_stage(pre, data)
    plan = StagePlan(fin, ik.Link("body", case=2, alpha=ALPHA), StagePlan(pre))
    objective = plan.objective(fin, pre.state())  # F + α‖W − W̄‖² over body and head
    fit_lbfgs(objective, max_iter=1000)
    assert newton_refine(objective) < 1e-11
    built, raised = quiet_fit(pre, fin, ALPHA)
    assert raised == []
    drift = built.drifts[1]
    assert built.drifts[0] is None and drift.agrees is True
    assert drift.alpha_fit == pytest.approx(ALPHA, rel=1e-6)  # ∇_W F = −2α(W − W̄) at the minimum
    assert drift.residual < 1e-6 and drift.drift > 1e-2
    res = built.query((data[0][:5], data[1][:5])).scores()
    assert res.diagnostics["stages"][1]["proximal"]["alpha_fit"] == pytest.approx(ALPHA, rel=1e-6)
    assert "proximal" not in res.diagnostics["stages"][0]


def own_loop(fin, data, optimizer, steps, fit_head=True):
    """The user's finetuning without a proximal term: the head fitted on the pretrained body (``fit_head``), then
    everything trained for ``steps`` full-batch steps of ``optimizer`` (stopped early)."""
    x, y = data
    if fit_head:
        fit_lbfgs(ik.Stage(fin.model, cross_entropy, data, params="head", regularizer=l2(1e-2)), max_iter=500)
    opt = optimizer(fin.model.parameters())
    for _ in range(steps):
        opt.zero_grad()
        (cross_entropy(fin.model(x), y).mean() + l2(1e-2)(dict(fin.model.named_parameters()))).backward()
        opt.step()


def test_finetuning_without_the_term_warns_and_the_alpha_it_names_silences_it(pretrained):
    pre, data = pretrained
    fin = finetune_stage(pre, data)
    own_loop(fin, data, lambda p: torch.optim.SGD(p, lr=0.5), 30)  # early-stopped descent: a proximal pull of its own
    with pytest.warns(ik.ProximalWarning, match=r"alpha=") as record:
        built = chain(pre, fin, 1.0).fit()
    drift = built.drifts[1]
    assert drift.agrees is False and drift.alpha_fit > 0
    named = f"alpha={drift.alpha_fit:.4g}"
    assert named in str(record[0].message)
    # the remedy: the α that matches the drift; the check then agrees and no longer warns
    remedied, raised = quiet_fit(pre, fin, float(f"{drift.alpha_fit:.4g}"))
    assert raised == [] and remedied.drifts[1].agrees is True
    assert remedied.drifts[1].alpha_fit == pytest.approx(drift.alpha_fit, rel=1e-12)  # α̂ does not depend on α
    assert remedied.drifts[1].residual == pytest.approx(remedied.drifts[1].residual_fit, rel=1e-3)


def test_a_drift_no_alpha_explains_warns_and_finetuning_with_the_term_silences_it(pretrained):
    pre, data = pretrained
    fin = finetune_stage(pre, data)
    own_loop(fin, data, lambda p: torch.optim.Adam(p, lr=1e-2), 60, fit_head=False)  # a fresh head: Adam moves far
    with pytest.warns(ik.ProximalWarning, match="finetune with the proximal term"):
        built = chain(pre, fin, ALPHA).fit()
    drift = built.drifts[1]
    assert drift.agrees is False and drift.alpha_fit <= 0  # the loss pulls the block away from W̄: no α explains it
    # the other remedy: finetune on with the proximal term to its minimum
    plan = StagePlan(fin, ik.Link("body", case=2, alpha=ALPHA), StagePlan(pre))
    objective = plan.objective(fin, pre.state())
    fit_lbfgs(objective, max_iter=1000)
    newton_refine(objective)
    remedied, raised = quiet_fit(pre, fin, ALPHA)
    assert raised == [] and remedied.drifts[1].agrees is True


def test_finetuning_without_the_term_to_its_own_minimum_warns(pretrained):
    pre, data = pretrained
    fin = finetune_stage(pre, data)
    fit_lbfgs(fin, max_iter=1000)  # F alone to its minimum: ∇_W F = 0, no pull towards W̄ at all
    newton_refine(fin)
    with pytest.warns(ik.ProximalWarning):
        built = chain(pre, fin, ALPHA).fit()
    assert abs(built.drifts[1].alpha_fit) < 1e-6 * ALPHA


def test_the_alpha_fit_is_the_least_squares_alpha(pretrained):
    """α̂ = −⟨∇_W F, d⟩ / (2‖d‖²) against autograd, and it minimizes ‖∇_W F + 2α d‖ over α."""
    pre, data = pretrained
    fin = finetune_stage(pre, data)
    with torch.no_grad():
        fin.model.body.weight.add_(0.05 * torch.randn(fin.model.body.weight.shape, generator=torch.Generator().manual_seed(3)))

    plan = StagePlan(fin, ik.Link("body", case=2, alpha=1.0), StagePlan(pre))
    fitted = measure(plan, pre.state())
    x, y = data
    objective = cross_entropy(fin.model(x), y).mean() + l2(1e-2)(dict(fin.model.named_parameters()))
    g = dict(zip(["body.weight", "body.bias"], torch.autograd.grad(objective, [fin.model.body.weight, fin.model.body.bias])))
    d = {n: (dict(fin.model.named_parameters())[n] - dict(pre.model.named_parameters())[n]).detach() for n in g}
    dot = sum(float((g[n] * d[n]).sum()) for n in g)
    norm2 = sum(float((d[n] ** 2).sum()) for n in d)
    assert fitted.alpha_fit == pytest.approx(-dot / (2 * norm2), rel=1e-10)
    assert fitted.drift == pytest.approx(norm2**0.5, rel=1e-12)
    flat = lambda t: torch.cat([t[n].detach().reshape(-1) for n in t])  # noqa: E731
    unexplained = (flat(g) + 2 * fitted.alpha_fit * flat(d)).norm()
    for other in (fitted.alpha_fit * 0.9, fitted.alpha_fit * 1.1, 0.0):  # least squares: no α leaves less
        assert unexplained <= (flat(g) + 2 * other * flat(d)).norm()
