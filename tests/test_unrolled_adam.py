"""Adam runs under unrolled attribution: the preconditioned sharpness ``ik.unrolled.sharpness`` reports equals
λ_max(P⁻¹H) of a dense float64 Hessian and the preconditioner recomputed from the record, Adam's edge of stability
2(1 + β₁)/(1 − β₁) is where the frozen-preconditioner iteration stops being stable, and ``ik.unrolled.diagnose``
fires on a tiny AdamW run whose single drops the metagradient predicts badly, with a remedy that, applied with the
same data and initialization, makes the predictions agree with replay."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import influkit as ik
from influkit.unrolled import SGD, Adam, AdamW, Record
from influkit.unrolled.stability import edge_of_stability


class Linear(nn.Module):
    """y = x·θ (one weight vector, no bias)."""

    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(d))

    def forward(self, x):
        return x @ self.weight


def squared(outputs, targets):
    return 0.5 * (outputs - targets) ** 2


@pytest.mark.parametrize("optimizer", [Adam(lr=0.05, betas=(0.9, 0.99), weight_decay=0.3),
                                       AdamW(lr=0.05, betas=(0.5, 0.9), eps=1e-3, weight_decay=0.1)])
def test_preconditioned_sharpness_of_a_quadratic_is_the_dense_eigenvalue_of_p_inverse_h(optimizer):
    """Least squares: H = XᵀX/n at every θ (+ Adam's coupled decay λI). The preconditioner of the step from θ_t is
    recomputed here from the recorded v_t and the full-batch gradient d_t (v_{t+1} = β₂v_t + (1 − β₂)d_t²,
    P = √(v_{t+1}/(1 − β₂^{t+1})) + ε; at the last checkpoint v_T's own), and λ_max(P⁻¹H) taken densely."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(12, 6, generator=gen, dtype=torch.float64) * torch.linspace(0.2, 2.0, 6, dtype=torch.float64)
    y = torch.randn(12, generator=gen, dtype=torch.float64)
    stage = ik.Stage(Linear(6).double().eval(), squared, (x, y))
    record = Record()
    record.train(stage, optimizer, steps=7, batch_size=12, checkpoint_every=3)
    table = ik.unrolled.sharpness(record, steps=6)  # Lanczos on a 6-dimensional operator: exact after 6 steps
    assert list(table["step"]) == [0, 3, 6, 7] and table["preconditioned"].all()
    beta1, beta2 = optimizer.betas
    decay = 0.0 if optimizer.decoupled else optimizer.weight_decay
    hessian = x.T @ x / len(y) + decay * torch.eye(6, dtype=torch.float64)
    run = record.runs[0]
    for row in table.itertuples():
        theta, state = run.checkpoints[row.step]
        v, t = state["v"]["weight"], row.step
        if t < run.steps:
            d = x.T @ (x @ theta["weight"] - y) / len(y) + decay * theta["weight"]
            v, t = beta2 * v + (1 - beta2) * d**2, t + 1
        p = torch.sqrt(v / (1 - beta2**t)) + optimizer.eps
        dense = float(torch.linalg.eigvalsh(hessian / p.sqrt()[:, None] / p.sqrt()[None, :])[-1])
        assert row.max_eigenvalue == pytest.approx(dense, rel=1e-9)
        assert row.lr_times_eigenvalue == pytest.approx(optimizer.lr * dense, rel=1e-9)
        assert row.edge == pytest.approx(2 * (1 + beta1) / (1 - beta1))
        assert row.past_edge == (optimizer.lr * dense > row.edge)


@pytest.mark.parametrize("beta1", [0.0, 0.5, 0.9])
def test_adams_edge_is_where_the_frozen_preconditioner_iteration_turns_unstable(beta1):
    """With P frozen, Adam on a quadratic along an eigen-direction a of P⁻¹H is m ← β₁m + (1 − β₁)aθ, θ ← θ − ηm:
    bounded for η·a 1 % below 2(1 + β₁)/(1 − β₁), growing without bound 1 % above."""
    edge = edge_of_stability(Adam(lr=1.0, betas=(beta1, 0.999)))
    assert edge == pytest.approx(2 * (1 + beta1) / (1 - beta1))

    def largest(eta_a: float) -> float:
        theta, m, top = 1.0, 0.0, 0.0
        for _ in range(4000):
            m = beta1 * m + (1 - beta1) * eta_a * theta
            theta = theta - m
            top = max(top, abs(theta))
        return top

    assert largest(0.99 * edge) < 100
    assert largest(1.01 * edge) > 1e6


def test_sgd_rows_keep_the_plain_hessian():
    """SGD rows are not preconditioned: λ_max(H) + coupled decay beside 2(1 + μ)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(10, 4, generator=gen, dtype=torch.float64)
    y = torch.randn(10, generator=gen, dtype=torch.float64)
    record = Record()
    record.train(ik.Stage(Linear(4).double().eval(), squared, (x, y)), SGD(lr=0.1, momentum=0.5, weight_decay=0.2),
                 steps=4, batch_size=10, checkpoint_every=2)
    table = ik.unrolled.sharpness(record, steps=4)
    expected = float(torch.linalg.eigvalsh(x.T @ x / 10)[-1]) + 0.2
    assert not table["preconditioned"].any()
    assert list(table["max_eigenvalue"]) == pytest.approx([expected] * 3, rel=1e-9)
    assert (table["edge"] == 3.0).all()


class MLP(nn.Module):
    def __init__(self, width: int = 128):
        super().__init__()
        self.embedding = nn.Sequential(nn.Linear(64, width), nn.Tanh())
        self.head = nn.Linear(width, 5)

    def forward(self, x):
        return self.head(self.embedding(x))


def digits_run(warmup: int = 0) -> tuple[Record, tuple]:
    """AdamW (lr 0.02) on 200 real digits 0–4 for 40 steps of 20, the same seeded start and batches every time;
    ``warmup``: lr_t = lr·min(1, (t + 1)/warmup)."""
    pytest.importorskip("sklearn")
    from influkit.apps.datasets import load_digits_tensors
    from influkit.apps.objectives import cross_entropy

    x, y = load_digits_tensors()
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[perm][y[perm] < 5], y[perm][y[perm] < 5]
    torch.manual_seed(0)
    stage = ik.Stage(MLP().double().eval(), cross_entropy, (x[:200], y[:200]))
    record = Record()
    schedule = (lambda t: 0.02 * min(1.0, (t + 1) / warmup)) if warmup else None
    record.train(stage, AdamW(lr=0.02), steps=40, batch_size=20, schedule=schedule)
    return record, (x[200:250], y[200:250])


def single_drop_pearson(record: Record, test, drops: int = 25) -> float:
    """Pearson r of −score_z and the replayed change of the summed test loss with w_z = 0, over the first examples."""
    scores = ik.unrolled.metagradients(record, test)[0]
    base = ik.unrolled.outputs(record, test).sum()
    replayed = []
    for z in range(drops):
        w = torch.ones(len(record.runs[0].stage), dtype=torch.float64)
        w[z] = 0
        replayed.append(float(ik.unrolled.outputs(record, test, w).sum() - base))
    predicted = -scores.values.double()[torch.argsort(scores.index)][:drops]
    return float(torch.corrcoef(torch.stack([predicted, torch.tensor(replayed, dtype=torch.float64)]))[0, 1])


def test_diagnose_names_a_warmup_that_makes_single_drops_agree_with_replay():
    """AdamW on real digits: its first steps are far past Adam's edge (v̂ rests on one or two batches), and the
    metagradient predicts single drops badly although it is the run's derivative (linearity at t = 1e-4). diagnose
    finds both and names a warmup W; the same run warmed up over W steps predicts them well and raises no finding."""
    record, test = digits_run()
    table = ik.unrolled.sharpness(record, first=6)
    assert table.loc[table["step"] == 0, "past_edge"].all()
    scores = ik.unrolled.metagradients(record, test)[0]
    linear = ik.unrolled.linearity(record, test, scores, fraction=0.02, sets=4, steps=(1.0, 1e-4))
    found = ik.unrolled.diagnose(table, linear)
    assert list(found["finding"]) == ["past the edge of stability", "whole drops are non-linear"]
    warmup = int(found["warmup"].iloc[0])
    assert 1 < warmup <= 40 and f"over the first {warmup} steps" in found["remedy"].iloc[0]
    assert single_drop_pearson(record, test) < 0.7
    remedied, _ = digits_run(warmup)
    assert single_drop_pearson(remedied, test) > 0.9
    assert ik.unrolled.diagnose(ik.unrolled.sharpness(remedied, first=6)).empty


def test_diagnose_of_a_run_below_the_edge_finds_nothing_and_sgd_past_it_is_told_its_learning_rate():
    """A sharpness table below the edge gives no finding; an SGD stage past it (η·λ = 2.5× the edge 2) is told to
    divide lr by that factor over the margin, which puts every row at the margin's share of the edge (default half)."""
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(10, 4, generator=gen, dtype=torch.float64)
    y = torch.randn(10, generator=gen, dtype=torch.float64)
    lam = float(torch.linalg.eigvalsh(x.T @ x / 10)[-1])
    for lr, past in ((1.0 / lam, False), (5.0 / lam, True)):
        record = Record()
        record.train(ik.Stage(Linear(4).double().eval(), squared, (x, y)), SGD(lr=lr), steps=3, batch_size=10)
        table = ik.unrolled.sharpness(record, steps=4)
        found = ik.unrolled.diagnose(table)
        if not past:
            assert found.empty
        else:
            assert list(found["finding"]) == ["past the edge of stability"] and found["warmup"].isna().all()
            assert ik.unrolled.stability.MARGIN == 0.5
            assert float(found["lr_divisor"].iloc[0]) == pytest.approx(2.5 / 0.5, rel=1e-9)
            at_edge = ik.unrolled.diagnose(table, margin=1.0)
            assert float(at_edge["lr_divisor"].iloc[0]) == pytest.approx(2.5, rel=1e-9)
