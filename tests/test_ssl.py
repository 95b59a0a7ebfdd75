"""Tests of influkit.ssl: hypergradient vs finite differences of re-optimized problems, fast per-example
gradients, M-Adam, losses, the Algorithm 1 trainer and input errors."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import cross_entropy, l2, need, tanh_mlp
from torch import nn

import influkit as ik
from influkit.curvature import HessianOperator
from influkit.errors import InputError
from influkit.gradients import per_example_grads, per_example_grads_serial
from influkit.ssl import (
    Consistency,
    MaskedAdam,
    PseudoLabel,
    SSLConfig,
    ShiftNoise,
    UnsupervisedLoss,
    hypergradient,
    last_layer_grads,
    linear_grad_dot,
    soft_cross_entropy,
    train_ssl,
)
from influkit.training import fit_lbfgs, newton_refine


class Teacher(UnsupervisedLoss):
    """Soft targets from a fixed linear teacher: the unsupervised targets do not move when θ is re-optimized."""

    def __init__(self, d_in: int, classes: int):
        self.map = torch.randn(d_in, classes, generator=torch.Generator().manual_seed(7))

    def targets(self, inputs):
        return torch.softmax(inputs @ self.map, dim=-1)

    def prepare(self, model, inputs):
        return inputs, self.targets(inputs)


def weighted_soft_ce(outputs, targets):
    return targets[:, 0] * soft_cross_entropy(outputs, targets[:, 1:])


def weighted_stage(model, names, labeled, unlabeled, teacher, weights, reg):
    """A Stage whose objective (mean of c_i ℓ_i) equals mean_D ℓ_S + (1/|U|) Σ λ_u ℓ_U + R."""
    (x, y), n_l, n_u = labeled, labeled[0].shape[0], unlabeled.shape[0]
    n = n_l + n_u
    coef = torch.cat([torch.full((n_l,), n / n_l), n * weights / n_u])
    soft = torch.cat([nn.functional.one_hot(y, 3).double(), teacher.targets(unlabeled)])
    data = (torch.cat([x, unlabeled]), torch.cat([coef[:, None], soft], 1))
    return ik.Stage(model, weighted_soft_ce, data, params=names, regularizer=reg)


def make_problem(n_u: int = 20, seed: int = 3):
    """(labeled, unlabeled, val, weights, teacher): 24 labeled, n_u unlabeled, 15 validation points, 3 classes."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(24, 4, generator=gen, dtype=torch.float64)
    y = torch.randint(0, 3, (24,), generator=gen)
    u = torch.randn(n_u, 4, generator=gen, dtype=torch.float64)
    xv = torch.randn(15, 4, generator=gen, dtype=torch.float64)
    yv = torch.randint(0, 3, (15,), generator=gen)
    w = 0.5 + torch.rand(n_u, generator=gen, dtype=torch.float64)
    return (x, y), u, (xv, yv), w, Teacher(4, 3)


@pytest.fixture(scope="module")
def problem():
    return make_problem()


def fit(model, names, labeled, u, teacher, w, reg):
    stage = weighted_stage(model, names, labeled, u, teacher, w, reg)
    fit_lbfgs(stage, max_iter=300)
    assert newton_refine(stage, steps=6) < 1e-12
    return stage


def reoptimized_val_loss(model, names, labeled, u, val, teacher, w, reg):
    """L_S(V, θ*(Λ = w)) with θ* re-solved by Newton from the model's current θ to ‖∇L‖ < 1e-12; θ is restored."""
    named = dict(model.named_parameters())
    start = {n: named[n].detach().clone() for n in names}
    assert newton_refine(weighted_stage(model, names, labeled, u, teacher, w, reg), steps=8) < 1e-12
    with torch.no_grad():
        value = float(cross_entropy(model(val[0]), val[1]).mean())
        for n in names:
            named[n].copy_(start[n])
    return value


def finite_difference(model, names, labeled, u, val, teacher, w, reg, which, eps=1e-4):
    """Central difference of L_S(V, θ*(Λ)) in λ_u, re-solving θ* by Newton to ‖∇L‖ < 1e-12."""
    out = []
    for u_idx in which:
        values = []
        for sign in (1.0, -1.0):
            shifted = w.clone()
            shifted[u_idx] += sign * eps
            values.append(reoptimized_val_loss(model, names, labeled, u, val, teacher, shifted, reg))
        out.append((values[0] - values[1]) / (2 * eps))
    return torch.tensor(out)


@pytest.mark.parametrize("params", ["2", None], ids=["last-layer-cached", "full-network"])
def test_hypergradient_matches_finite_differences(problem, params):
    labeled, u, val, w, teacher = problem
    model = tanh_mlp(4, 6, 3, seed=1)
    names = ik.Stage(model, cross_entropy, labeled, params=params).param_names
    reg = l2(1e-2)
    fit(model, names, labeled, u, teacher, w, reg)
    which = [0, 5, 13]
    fd = finite_difference(model, names, labeled, u, val, teacher, w, reg, which)
    solvers = ["direct"] if params == "2" else ["direct", "cg_spd", "minres"]
    for solver in solvers:
        res = hypergradient(
            model, cross_entropy, teacher, labeled, u, val, w, params=params, regularizer=reg, solve=ik.SolveConfig(solver=solver, tol=1e-13)
        )
        assert res.diagnostics["settings"]["cached_features"] == (params == "2")
        assert res.diagnostics["solves"][0]["converged"]
        err = float((res.values[which] - fd).norm() / fd.norm())
        assert err <= 1e-3, (solver, err)


def test_removal_is_minus_weight_times_values_and_predicts_zeroing_a_weight():
    """removal[u] = −λ_u·values[u] is the first-order change of L_S(V) when λ_u is set to 0 and θ re-optimized.

    On a convex last-layer problem the remainder is second order in the weight change: setting λ_u to λ_u/2
    instead of 0 must cut the prediction error about 4× (≥ 3× required).
    """
    labeled, u, val, w, teacher = make_problem(n_u=60, seed=5)
    model = tanh_mlp(4, 6, 3, seed=1)
    names, reg = ["2.weight", "2.bias"], l2(1e-2)
    fit(model, names, labeled, u, teacher, w, reg)
    res = hypergradient(model, cross_entropy, teacher, labeled, u, val, w, params="2", regularizer=reg)
    assert res.n_train == 60 and torch.equal(res.index, torch.arange(60))
    assert torch.equal(res.removal_eps, -w) and torch.equal(res.removal, -w * res.values)
    assert torch.equal(torch.tensor(res.to_frame()["removal"].to_numpy()), res.removal)
    base = reoptimized_val_loss(model, names, labeled, u, val, teacher, w, reg)
    actual = {1.0: [], 0.5: []}
    for k in range(60):
        for fraction in actual:
            changed = w.clone()
            changed[k] *= 1.0 - fraction
            actual[fraction].append(reoptimized_val_loss(model, names, labeled, u, val, teacher, changed, reg) - base)
    removed = torch.tensor(actual[1.0])
    error = float((removed - res.removal).norm())
    assert error <= 0.15 * float(removed.norm()), error / float(removed.norm())
    assert torch.corrcoef(torch.stack([removed, res.removal]))[0, 1] >= 0.99
    assert error >= 3.0 * float((torch.tensor(actual[0.5]) - 0.5 * res.removal).norm())


def test_result_diagnostics_and_round_trip_bit_identical(problem, tmp_path):
    labeled, u, val, w, teacher = problem
    model = tanh_mlp(4, 6, 3, seed=2)
    ids = torch.arange(100, 120)
    res = hypergradient(model, cross_entropy, teacher, labeled, u, val, w, index=ids, params="2", solve=ik.SolveConfig(damping=1e-3))
    assert set(res.diagnostics) == {"solves", "seconds", "settings"}
    (solve,) = res.diagnostics["solves"]
    assert solve["stage"] == 0 and solve["solver"] == "direct" and solve["damping"] == 1e-3
    settings = res.diagnostics["settings"]
    assert settings["solver"] == "direct" and settings["damping"] == 1e-3 and settings["cached_features"]
    assert set(res.diagnostics["seconds"]) == {"setup", "solve", "scores"}
    assert torch.equal(res.index, ids) and res.n_train == 20
    back = ik.load(res.save(tmp_path / "hypergradient.safetensors"))
    assert torch.equal(back.values, res.values) and torch.equal(back.index, res.index)
    assert torch.equal(back.removal_eps, res.removal_eps) and torch.equal(back.removal, res.removal)
    assert (back.n_train, back.method) == (res.n_train, res.method)
    assert json.dumps(back.diagnostics, sort_keys=True) == json.dumps(res.diagnostics, sort_keys=True)  # NaN-safe


def test_paths_agree_and_baselines(problem):
    labeled, u, val, w, teacher = problem
    model = tanh_mlp(4, 6, 3, seed=2)
    pl, reg = PseudoLabel(), l2(1e-2)
    args = (model, cross_entropy, pl, labeled, u, val, w)
    cached = hypergradient(*args, params="2", regularizer=reg).values
    vmapped = hypergradient(*args, params="2", regularizer=reg, cache_features=False).values
    plain = hypergradient(model, cross_entropy, lambda m, x: pl(m, x), labeled, u, val, w, params="2", regularizer=reg).values
    assert torch.allclose(cached, vmapped, rtol=1e-10, atol=1e-14)
    assert torch.allclose(cached, plain, rtol=1e-10, atol=1e-14)

    # baselines against their definitions on the dense Hessian of the same objective
    targs = (model, cross_entropy, teacher, labeled, u, val, w)
    hessian = HessianOperator(weighted_stage(model, ["2.weight", "2.bias"], labeled, u, teacher, w, reg)).dense()
    grads = last_layer_grads(model, "2", teacher.on_outputs, *teacher.prepare(model, u))
    g_val = last_layer_grads(model, "2", cross_entropy, *val).mean(0)
    alpha, terms, series, power = 0.3, 12, torch.zeros_like(g_val), g_val.clone()
    for _ in range(terms):
        series, power = series + alpha * power, power - alpha * (hessian @ power)
    neumann = hypergradient(*targs, params="2", regularizer=reg, solve=ik.SolveConfig(solver="neumann", max_iter=terms, step=alpha)).values
    assert torch.allclose(neumann, -(grads @ series) / u.shape[0], rtol=1e-10, atol=1e-15)
    identity = hypergradient(*targs, params="2", regularizer=reg, solve=ik.SolveConfig(solver="identity")).values
    assert torch.allclose(identity, -(grads @ g_val) / u.shape[0], rtol=1e-12, atol=1e-16)
    exact = hypergradient(*targs, params="2", regularizer=reg).values
    assert torch.allclose(exact, -(grads @ torch.linalg.solve(hessian, g_val)) / u.shape[0], rtol=1e-9, atol=1e-15)


def test_fast_per_example_grads_equal_vmap_and_serial(problem):
    labeled, u, _, _, _ = problem
    model = tanh_mlp(4, 6, 3, seed=4)
    pl = PseudoLabel(threshold=0.4)
    x, t = pl.prepare(model, u)
    assert (t.sum(1) == 0).any() and (t.sum(1) == 1).any()  # some examples below the threshold
    for loss, inputs, targets in ((pl.on_outputs, x, t), (cross_entropy, *labeled)):
        stage = ik.Stage(model, loss, (inputs, targets), params="2")
        fast = last_layer_grads(model, "2", loss, inputs, targets)
        assert torch.allclose(fast, per_example_grads(stage, inputs, targets, chunk_size=7), rtol=0, atol=1e-12)
        assert torch.allclose(fast, per_example_grads_serial(stage, inputs, targets), rtol=0, atol=1e-12)
    direction = torch.randn(6 * 3 + 3, dtype=torch.float64)
    fast = last_layer_grads(model, "2", cross_entropy, *labeled)
    features = model[:2](labeled[0]).detach()
    deltas = torch.softmax(model(labeled[0]), -1).detach() - nn.functional.one_hot(labeled[1], 3)
    dots = linear_grad_dot(features, deltas, direction[:18].reshape(3, 6), direction[18:])
    assert torch.allclose(dots, fast @ direction, atol=1e-13)


def test_madam_equals_adam_when_all_gradients_nonzero():
    gen = torch.Generator().manual_seed(0)
    start = torch.rand(50, generator=gen, dtype=torch.float64) + 1.0
    a, b = start.clone(), start.clone()
    opt_a = MaskedAdam([a], lr=0.01, nonnegative=False)
    opt_b = torch.optim.Adam([b], lr=0.01)
    for _ in range(25):
        g = torch.randn(50, generator=gen, dtype=torch.float64)
        a.grad, b.grad = g.clone(), g.clone()
        opt_a.step()
        opt_b.step()
    assert torch.allclose(a, b, rtol=0, atol=1e-12)
    assert torch.allclose(opt_a.state[a]["exp_avg_sq"], opt_b.state[b]["exp_avg_sq"], rtol=1e-12, atol=0)


def test_madam_leaves_masked_entries_untouched_and_clips():
    gen = torch.Generator().manual_seed(1)
    w = torch.rand(40, generator=gen, dtype=torch.float64)
    opt = MaskedAdam([w], lr=0.05)
    for step in range(30):
        g = torch.randn(40, generator=gen, dtype=torch.float64)
        mask = torch.rand(40, generator=gen) < 0.3
        g[~mask] = 0
        g[mask & (torch.arange(40) < 5)] = 1.0  # entries 0-4 are always pushed down, towards the clip
        state = opt.state[w]
        before = {k: v.clone() for k, v in state.items()} if state else None
        w_before = w.detach().clone()
        w.grad = g
        opt.step()
        if before is not None:
            for key in ("step", "exp_avg", "exp_avg_sq"):
                assert torch.equal(state[key][~mask], before[key][~mask]), key
            assert torch.equal(state["step"][mask], before["step"][mask] + 1)
        assert torch.equal(w[~mask], w_before[~mask])
        assert (w >= 0).all()
    assert (w[:5] == 0).any()


def test_madam_entry_follows_adam_on_its_own_nonzero_gradients():
    gen = torch.Generator().manual_seed(2)
    w = torch.rand(10, generator=gen, dtype=torch.float64)
    grads = torch.randn(20, 10, generator=gen, dtype=torch.float64) * (torch.rand(20, 10, generator=gen) < 0.4)
    opt = MaskedAdam([w.requires_grad_(False)], lr=0.01, nonnegative=False)
    start = w.clone()
    for g in grads:
        w.grad = g.clone()
        opt.step()
    for j in range(10):
        scalar = start[j : j + 1].clone()
        adam = torch.optim.Adam([scalar], lr=0.01)
        for g in grads[:, j][grads[:, j] != 0]:
            scalar.grad = g.reshape(1).clone()
            adam.step()
        assert torch.allclose(w[j : j + 1], scalar, rtol=0, atol=1e-12)
        assert opt.state[w]["step"][j] == (grads[:, j] != 0).sum()


def test_shift_noise_moves_pixels_by_at_most_one():
    image = torch.zeros(5, 64, dtype=torch.float64)
    image[:, 3 * 8 + 4] = 1.0
    out = ShiftNoise(max_shift=1, noise=0.0, seed=0)(image).reshape(5, 8, 8)
    for k in range(5):
        (r, c), = out[k].nonzero().tolist()
        assert abs(r - 3) <= 1 and abs(c - 4) <= 1
    loss = Consistency(ShiftNoise(noise=0.1), threshold=0.0)
    model = nn.Sequential(nn.Linear(64, 10)).double()
    assert loss(model, torch.rand(6, 64, dtype=torch.float64)).shape == (6,)


def test_trainer_smoke():
    x, y = need("sklearn.datasets").make_moons(160, noise=0.1, random_state=0)
    x, y = torch.tensor(x), torch.tensor(y)
    torch.manual_seed(0)
    seen = []
    for mode in ("per-example", "single"):
        model = nn.Sequential(nn.Linear(2, 16), nn.ReLU(), nn.Linear(16, 2)).double()
        run = train_ssl(
            model, cross_entropy, PseudoLabel(), (x[:10], y[:10]), x[40:], (x[10:40], y[10:40]),
            SSLConfig(mode=mode, steps=40, warmup=10, inner_steps=5, weight_lr=0.5, log_every=20), progress=False,
            test=(x[40:], y[40:]), callback=lambda step, m, w: seen.append(step),
        )
        h = run.history
        assert list(h.step) == [0, 20, 40]
        assert h.weight_updates.iloc[-1] == 6
        assert run.weights.shape == (120,) and (run.weights >= 0).all()
        assert {"val_loss", "val_acc", "test_acc", "weight_std"} <= set(h.columns)
    assert h.weight_std.iloc[-1] < 1e-12  # single λ
    assert seen == [0, 20, 40] * 2


def test_input_errors(problem):
    labeled, u, val, w, teacher = problem
    model = tanh_mlp(4, 6, 3)
    args = (model, cross_entropy, teacher)
    with pytest.raises(InputError, match="targets"):
        hypergradient(*args, (labeled[0], labeled[1][:-1]), u, val, w)
    with pytest.raises(InputError, match="≥ 0"):
        hypergradient(*args, labeled, u, val, -w)
    with pytest.raises(InputError, match="shape"):
        hypergradient(*args, labeled, u, val, w[:-1])
    with pytest.raises(InputError, match="empty"):
        hypergradient(*args, labeled, u[:0], val, w[:0])
    with pytest.raises(InputError, match="shape"):
        hypergradient(*args, labeled, u[:, :3], val, w)
    with pytest.raises(InputError, match="final"):
        hypergradient(*args, labeled, u, val, w, params="0", cache_features=True)
    with pytest.raises(InputError, match="solver"):
        hypergradient(*args, labeled, u, val, w, solve=ik.SolveConfig(solver="newton"))
    with pytest.raises(InputError, match="empty"):
        train_ssl(model, cross_entropy, teacher, labeled, u[:0], val, progress=False)
    with pytest.raises(InputError, match="mode"):
        SSLConfig(mode="all")
    with pytest.raises(InputError, match="SSLConfig"):
        train_ssl(model, cross_entropy, teacher, labeled, u, val, {"mode": "single"})
