"""Training a stage to its optimum: fit_lbfgs, newton_refine, newton_fit, HessianFactor, train_adam.

Ground truth: ridge regression, whose optimum is closed-form, θ* = (X̃ᵀX̃/n + λI)⁻¹ X̃ᵀy/n with X̃ = [X, 1].
"""

from __future__ import annotations

import pytest
import torch
from conftest import cross_entropy, explicit_hessian, l2
from torch import nn

import influkit as ik
from influkit.params import ParamSpace
from influkit.training import HessianFactor, fit_lbfgs, gradient_norm, newton_fit, newton_refine, train_adam

RIDGE = 0.1


def squared(outputs, targets):
    return 0.5 * (outputs[:, 0] - targets) ** 2


def ridge_stage(n: int = 50, d: int = 4, seed: int = 0) -> ik.Stage:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen)
    y = x @ torch.randn(d, generator=gen) + 0.3 * torch.randn(n, generator=gen) + 1.0
    torch.manual_seed(seed)
    return ik.Stage(nn.Linear(d, 1).double(), squared, (x, y), regularizer=l2(RIDGE))


def closed_form(stage: ik.Stage, keep: torch.Tensor | None = None) -> torch.Tensor:
    """(weight, bias) of the ridge optimum over the examples ``keep`` (default all)."""
    x, y = stage.data.take(torch.arange(len(stage)) if keep is None else keep)
    design = torch.cat([x, torch.ones(x.shape[0], 1)], dim=1)
    n = x.shape[0]
    return torch.linalg.solve(design.T @ design / n + RIDGE * torch.eye(design.shape[1]), design.T @ y / n)


def flat(stage: ik.Stage) -> torch.Tensor:
    return torch.cat([stage.model.weight.detach().reshape(-1), stage.model.bias.detach()])


def test_fit_lbfgs_reaches_the_closed_form_optimum_and_newton_refine_polishes_it():
    stage = ridge_stage()
    assert gradient_norm(stage) > 1e-2
    norm = fit_lbfgs(stage, max_iter=100, restarts=1)
    assert norm <= 1e-6 and norm == gradient_norm(stage)  # line searches on float64 losses stall near 1e-8
    assert torch.allclose(flat(stage), closed_form(stage), rtol=0, atol=1e-6)
    assert newton_refine(stage) <= 1e-13
    assert torch.allclose(flat(stage), closed_form(stage), rtol=0, atol=1e-13)


def test_newton_refine_and_newton_fit_reach_the_optimum_from_afar():
    stage = ridge_stage(seed=1)
    assert newton_refine(stage, steps=1) < 1e-12  # a quadratic: one Newton step is exact
    assert torch.allclose(flat(stage), closed_form(stage), rtol=0, atol=1e-12)
    far = ridge_stage(seed=1)
    with torch.no_grad():
        far.model.weight.fill_(5.0)
    assert newton_fit(far, tol=1e-12) <= 1e-12
    assert torch.allclose(flat(far), closed_form(far), rtol=0, atol=1e-12)


def test_newton_fit_reuses_a_factor_across_leave_out_refits():
    """The Hessian factor at the full optimum preconditions the refits without one example (the LOO use)."""
    stage = ridge_stage(seed=2)
    fit_lbfgs(stage)
    factor = HessianFactor(stage)
    for i in (0, 17):
        keep = torch.tensor([j for j in range(len(stage)) if j != i])
        loo = stage.without(torch.tensor([i])).with_(model=nn.Linear(4, 1).double())
        loo.model.load_state_dict(stage.model.state_dict())
        assert newton_fit(loo, factor=factor, tol=1e-12) <= 1e-12
        assert torch.allclose(flat(loo), closed_form(stage, keep), rtol=0, atol=1e-12)
    with pytest.raises(ik.InputError, match="other parameters"):
        newton_fit(stage.with_(params="weight"), factor=factor)


def test_newton_fit_on_logistic_regression_reaches_a_zero_gradient():
    """Not a quadratic: Newton steps with backtracking; checked by an independent autograd gradient."""
    gen = torch.Generator().manual_seed(4)
    x, y = torch.randn(60, 5, generator=gen), torch.randint(0, 3, (60,), generator=gen)
    torch.manual_seed(0)
    model = nn.Linear(5, 3).double()
    with torch.no_grad():
        model.weight.mul_(20.0)  # far from the optimum: full Newton steps would overshoot
    stage = ik.Stage(model, cross_entropy, (x, y), regularizer=l2(1e-2))
    start = float(stage.objective())
    assert newton_fit(stage, tol=1e-12) <= 1e-12
    model.zero_grad()
    (cross_entropy(model(x), y).mean() + 0.005 * sum(p.square().sum() for p in model.parameters())).backward()
    assert max(float(p.grad.abs().max()) for p in model.parameters()) <= 1e-12
    assert float(stage.objective()) < start


# ---- HessianFactor ----

@pytest.mark.parametrize("damping", [0.0, 1e-2])
def test_hessian_factor_is_an_operator_applying_h_plus_mu(mlp_stage, damping):
    """matvec = (H + μI)v against the explicit Hessian; μ = damping when H + damping·I is positive definite,
    else raised to 2|λ_min(H)| + damping (this untrained tanh MLP has an indefinite Hessian)."""
    h = explicit_hessian(mlp_stage)
    smallest = float(torch.linalg.eigvalsh(h)[0])
    assert smallest < -damping  # indefinite even after damping: the Levenberg rule applies
    factor = HessianFactor(mlp_stage, damping=damping)
    assert isinstance(factor, ik.Operator) and factor.dim == h.shape[0]
    assert factor.damping == pytest.approx(2 * abs(smallest) + damping, rel=1e-10)
    shifted = h + factor.damping * torch.eye(h.shape[0])
    v = torch.randn(h.shape[0], 3, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(factor.matvec(v), shifted @ v, rtol=0, atol=1e-10)
    assert torch.allclose(factor.solve(v), torch.linalg.solve(shifted, v), rtol=1e-9, atol=0)
    assert torch.allclose(factor.solve(v[:, 0]), torch.linalg.solve(shifted, v[:, 0]), rtol=1e-9, atol=0)
    assert torch.linalg.eigvalsh(shifted)[0] > 0


def test_hessian_factor_keeps_the_damping_when_positive_definite():
    stage = ridge_stage()
    factor = HessianFactor(stage, damping=1e-3)
    h = explicit_hessian(stage)
    assert factor.damping == 1e-3
    v = torch.randn(5, generator=torch.Generator().manual_seed(1))
    assert torch.allclose(factor.matvec(v), (h + 1e-3 * torch.eye(5)) @ v, rtol=0, atol=1e-13)
    assert factor.names == ["weight", "bias"] and isinstance(factor.space, ParamSpace)


# ---- train_adam ----

def test_full_batch_adam_approaches_the_optimum_and_exclude_drops_examples():
    stage = ridge_stage(seed=3)
    train_adam(stage, steps=400, lr=0.05, batch_size=len(stage))
    assert torch.allclose(flat(stage), closed_form(stage), rtol=0, atol=1e-8)
    left = ridge_stage(seed=3)
    drop = torch.arange(0, 50, 5)
    train_adam(left, steps=400, lr=0.05, batch_size=len(left), exclude=drop)
    keep = torch.tensor([i for i in range(50) if i % 5])
    assert torch.allclose(flat(left), closed_form(left, keep), rtol=0, atol=1e-8)
    assert not torch.allclose(flat(left), closed_form(left), rtol=0, atol=1e-2)


def test_adam_is_seeded_and_leave_out_runs_see_the_same_order():
    def run(seed, exclude=None):
        seen = []

        def recording(outputs, targets):
            seen.append(targets[:, 1].long().tolist())
            return squared(outputs, targets[:, 0])

        base = ridge_stage(n=20)
        data = base.data.take(torch.arange(20))
        torch.manual_seed(0)
        stage = ik.Stage(nn.Linear(4, 1).double(), recording,
                         (data[0], torch.stack([data[1], torch.arange(20.0)], dim=1)))
        seen.clear()  # the stage's own loss check
        train_adam(stage, steps=7, batch_size=6, seed=seed, exclude=exclude)
        return [i for batch in seen for i in batch], flat(stage)

    order, weights = run(seed=4)
    again, same = run(seed=4)
    assert order == again and torch.equal(weights, same)
    assert run(seed=5)[0] != order
    removed = order[2]
    loo, _ = run(seed=4, exclude=[removed])
    assert removed not in loo and len(loo) == len(order) == 7 * 6
    expected = [i for i in order if i != removed]  # the same stream with the removed example skipped
    assert loo[: len(expected)] == expected
