"""Unrolled attribution (influkit.unrolled): the record replays exactly, and the exact metagradient equals central
finite differences of the *re-run* training with w_z = 1 ± ε, for SGD + momentum and AdamW, one stage and
pretrain → finetune (Case 1 fixed block, Case 2 proximal, plain finetuning from the pretrained block, LoRA adapters); full-batch descent run to convergence
gives the influence function's I(z, T)/m."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

import influkit as ik
from influkit.memory import SAFETY, MemoryBudgetError
from influkit.unrolled import SGD, Adam, AdamW, Record, metagradient
from influkit.unrolled.stability import preconditioner

from conftest import cross_entropy, l2

EPS = 1e-5


class Net(nn.Module):
    """``head(embedding(x))`` with a one-layer tanh embedding (the shared block)."""

    def __init__(self, classes: int, d_in: int = 5, width: int = 4):
        super().__init__()
        self.embedding = nn.Sequential(nn.Linear(d_in, width), nn.Tanh())
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        return self.head(self.embedding(x))


class LoRALinear(nn.Module):
    """base(x) + B A x: the base layer (weight, bias) is the inherited block, A and B the trained adapters (B = 0
    at the start, as LoRA initializes it)."""

    def __init__(self, d_in: int, d_out: int, rank: int = 2):
        super().__init__()
        self.base = nn.Linear(d_in, d_out)
        self.lora_A = nn.Parameter(0.3 * torch.randn(rank, d_in))
        self.lora_B = nn.Parameter(torch.zeros(d_out, rank))

    def forward(self, x):
        return self.base(x) + x @ self.lora_A.T @ self.lora_B.T


class LoRANet(nn.Module):
    def __init__(self, classes: int, d_in: int = 5, width: int = 4):
        super().__init__()
        self.embedding = nn.Sequential(LoRALinear(d_in, width), nn.Tanh())
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        return self.head(self.embedding(x))


def data(n: int, classes: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 5, generator=gen), torch.randint(0, classes, (n,), generator=gen)


TEST = data(4, 2, seed=9)


def pretrain(record: Record, optimizer, steps: int = 11, batch_size: int = 4) -> ik.Stage:
    torch.manual_seed(0)
    stage = ik.Stage(Net(3).eval(), cross_entropy, data(12, 3, seed=1), regularizer=l2(1e-2))
    record.train(stage, optimizer, steps=steps, batch_size=batch_size, checkpoint_every=4)
    return stage


def finetune(record: Record, case: str, optimizer) -> ik.Stage:
    torch.manual_seed(1)
    if case == "lora":
        model, params, link = LoRANet(2).eval(), ["embedding.0.lora_A", "embedding.0.lora_B", "head"], \
            ik.Link({"embedding.0.base": "embedding.0"}, case=1)
    else:
        model, params = Net(2).eval(), ("head" if case == "case1" else None)
        link = ik.Link.finetune("embedding") if case == "finetune" else \
            ik.Link("embedding", case=1 if case == "case1" else 2, alpha=0.05)
    stage = ik.Stage(model, cross_entropy, data(10, 2, seed=2), params=params, regularizer=l2(1e-2))
    schedule = lambda t: 0.1 * (1 - t / 20)  # noqa: E731 (a decaying learning rate, recorded step by step)
    record.train(stage, optimizer, steps=9, batch_size=3, link=link, schedule=schedule, checkpoint_every=4)
    return stage


SCENARIOS = {
    "one stage, SGD + momentum": (SGD(lr=0.2, momentum=0.9, weight_decay=1e-3), None, None),
    "one stage, AdamW": (AdamW(lr=0.05, weight_decay=0.1), None, None),
    "case 1: AdamW -> SGD + momentum": (AdamW(lr=0.05), "case1", SGD(lr=0.1, momentum=0.9)),
    "case 2: SGD + momentum -> AdamW": (SGD(lr=0.2, momentum=0.8, nesterov=True), "case2", AdamW(lr=0.1)),
    "plain finetuning: SGD + momentum -> AdamW": (SGD(lr=0.2, momentum=0.8), "finetune", AdamW(lr=0.1)),
    "LoRA: AdamW -> Adam": (AdamW(lr=0.05), "lora", Adam(lr=0.1, weight_decay=1e-3)),
}


def recorded(name: str) -> Record:
    pre_opt, case, fin_opt = SCENARIOS[name]
    record = Record()
    pretrain(record, pre_opt)
    if case is not None:
        finetune(record, case, fin_opt)
    return record


def replayed_loss(record: Record, stage: int, z: int, eps: float) -> float:
    weights = [torch.ones(len(run.stage)) for run in record.runs]
    weights[stage][z] += eps
    return float(ik.unrolled.outputs(record, TEST, weights).sum())


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_metagradient_equals_central_differences_of_the_rerun_training(name):
    record = recorded(name)
    results = ik.unrolled.metagradients(record, TEST)
    assert len(results) == len(record)
    for k, result in enumerate(results):
        for z in (0, 3, 7):
            fd = (replayed_loss(record, k, z, EPS) - replayed_loss(record, k, z, -EPS)) / (2 * EPS)
            assert float(result.values[z]) == pytest.approx(fd, rel=1e-6, abs=1e-9), (k, z)
        assert torch.equal(result.removal, -result.values)
    assert results[0].diagnostics["replay"]["max_error"] == 0.0


MIDPOINT = 0.75  # the mean midpoint 1 − f/2 of dropping half the pretraining set


@pytest.mark.parametrize("name", ["one stage, SGD + momentum", "one stage, AdamW", "case 1: AdamW -> SGD + momentum"])
def test_metagradient_at_other_weights_equals_central_differences_of_the_training_rerun_there(name):
    """at = w̄ (pretraining examples weighted 0.75, finetuning ones as recorded): values[z] equals
    (measure(replay(w̄ + ε e_z)) − measure(replay(w̄ − ε e_z))) / 2ε, and differs from the metagradient at w = 1."""
    record = recorded(name)
    at = [torch.full((12,), MIDPOINT)] + [None] * (len(record) - 1)
    results = ik.unrolled.metagradients(record, TEST, at=at)
    plain = ik.unrolled.metagradients(record, TEST)
    for k, result in enumerate(results):
        for z in (0, 3, 7):
            fd = []
            for eps in (EPS, -EPS):
                weights = [torch.full((12,), MIDPOINT)] + [torch.ones(len(run.stage)) for run in record.runs[1:]]
                weights[k][z] += eps
                fd.append(float(ik.unrolled.outputs(record, TEST, weights).sum()))
            assert float(result.values[z]) == pytest.approx((fd[0] - fd[1]) / (2 * EPS), rel=1e-6, abs=1e-9), (k, z)
        assert torch.equal(result.removal, -result.values)
        assert (result.values - plain[k].values).abs().max() > 1e-4 * plain[k].values.abs().max()
    as_float = ik.unrolled.metagradients(record, TEST, at=[MIDPOINT])  # a float entry: every example of stage 0
    assert all(torch.equal(a.values, b.values) for a, b in zip(as_float, results))
    diagnostics = results[0].diagnostics
    assert diagnostics["replay"]["max_error"] == 0.0
    assert diagnostics["settings"]["at"][0] == {"min": MIDPOINT, "mean": MIDPOINT, "max": MIDPOINT}
    moved = ik.unrolled.reweighted(record, at)
    assert ik.unrolled.verify(moved) == 0.0 and ik.unrolled.verify(record) == 0.0
    for a, b in zip(ik.unrolled.replay(moved), ik.unrolled.replay(record, at)):
        assert all(torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("name", ["one stage, AdamW", "case 2: SGD + momentum -> AdamW"])
def test_metagradient_at_one_is_the_recorded_runs_bit_for_bit(name):
    record = recorded(name)
    plain = ik.unrolled.metagradients(record, TEST, per_test=True, pull="batched")  # one way: the same sums
    for at in (None, 1.0, [torch.ones(12)]):
        results = ik.unrolled.metagradients(record, TEST, per_test=True, at=at, pull="batched")
        assert all(torch.equal(a.values, b.values) for a, b in zip(results, plain)), at
    assert plain[0].diagnostics["settings"]["at"] is None


def one_step_record(seed: int):
    """(record, test set): one full-batch SGD step of a linear model under squared error on 8 examples — a test loss
    quadratic in the data weights."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    stage = ik.Stage(nn.Linear(3, 2).eval(), squared_error, (torch.randn(8, 3, generator=gen),
                                                            torch.randn(8, 2, generator=gen)))
    test = (torch.randn(4, 3, generator=gen), torch.randn(4, 2, generator=gen))
    record = Record()
    record.train(stage, SGD(lr=0.4, momentum=0.9), steps=1, batch_size=8)
    return record, test


def test_the_midpoint_rule_is_exact_where_the_measure_is_quadratic_in_the_weights():
    """One full-batch gradient step of a linear model under squared error: θ_1 = θ_0 − η (1/n) Σ w_z ∇ℓ(z; θ_0) is
    linear in w, the test loss quadratic, so removing D changes it by exactly −Σ_{z∈D} score_z(m) at the midpoint
    m = (1 + 1_D̄)/2 — where the plain linearization at w = 1 is off."""
    record, test = one_step_record(seed=5)
    dropped = torch.tensor([1, 4, 6])
    keep = torch.ones(8)
    keep[dropped] = 0.0
    actual = float((ik.unrolled.outputs(record, test, keep) - ik.unrolled.outputs(record, test)).sum())
    midpoint = ik.unrolled.metagradients(record, test, at=(1 + keep) / 2)[0].values
    linear = ik.unrolled.metagradients(record, test)[0].values
    assert float(-midpoint[dropped].sum()) == pytest.approx(actual, rel=1e-12, abs=1e-14)
    assert abs(float(-linear[dropped].sum()) - actual) > 1e-2 * abs(actual)


def test_the_mean_rule_gives_the_best_linear_fit_of_a_quadratic_response_over_random_halves():
    """The same quadratic response, every half D of the 8 examples dropped (70 sets): the least-squares fit of
    Δ(D) = test loss(w = 1_D̄) over (1, 1_D) has slopes exactly −score at the masks' mean w = 0.5 — the residual ½ eᵀHe
    (e = 1_D − ½) is orthogonal to (1, e) because halves are symmetric under e → −e — and not at w = 1 or 0.75."""
    import itertools

    record, test = one_step_record(seed=6)
    masks = torch.zeros(70, 8)
    for j, dropped in enumerate(itertools.combinations(range(8), 4)):
        masks[j, list(dropped)] = 1.0
    response = torch.stack([ik.unrolled.outputs(record, test, 1 - m).sum() for m in masks])
    design = torch.cat([torch.ones(70, 1), masks], dim=1)
    slopes = torch.linalg.lstsq(design, response.unsqueeze(1), driver="gelsd").solution[1:, 0]
    mean = ik.unrolled.metagradients(record, test, at=0.5)[0].values
    torch.testing.assert_close(slopes - slopes.mean(), -(mean - mean.mean()), rtol=1e-9, atol=1e-12)
    for other in (None, 0.75):
        away = ik.unrolled.metagradients(record, test, at=other)[0].values
        assert (slopes - slopes.mean() + away - away.mean()).abs().max() > 1e-3 * slopes.abs().max()


def test_bad_at_is_refused_with_the_fix():
    record = recorded("case 1: AdamW -> SGD + momentum")
    with pytest.raises(ik.InputError, match="at\\[0\\] must be a tensor of shape \\(12,\\)"):
        ik.unrolled.metagradients(record, TEST, at=torch.ones(5))
    with pytest.raises(ik.InputError, match="3 entries for a record of 2 stages"):
        ik.unrolled.metagradients(record, TEST, at=[0.5, None, 0.5])
    with pytest.raises(ik.InputError, match="w ≥ 0"):
        ik.unrolled.metagradients(record, TEST, at=-0.5)
    with pytest.raises(ik.InputError, match="w ≥ 0"):
        ik.unrolled.metagradients(record, TEST, at=[None, torch.full((10,), float("nan"))])
    adjoint = ik.unrolled.Adjoint({"head.weight": torch.zeros(2, 4)})
    with pytest.raises(ik.InputError, match="reweighted"):
        ik.unrolled.metagradients(record, adjoint, at=0.75)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_replay_reproduces_the_recorded_run_bit_for_bit(name):
    record = recorded(name)
    assert ik.unrolled.verify(record) == 0.0
    finals = ik.unrolled.replay(record)
    for run, final in zip(record.runs, finals):
        named = dict(run.stage.model.named_parameters())
        for n, value in final.items():
            assert torch.equal(value, run.final[n])
            assert torch.equal(value, named[n].detach())  # the trained model holds the recorded final values


def test_dropping_an_example_changes_the_replayed_run_and_the_record_does_not():
    record = recorded("case 1: AdamW -> SGD + momentum")
    dropped = torch.ones(12)
    dropped[5] = 0.0
    assert not torch.equal(ik.unrolled.outputs(record, TEST, dropped), ik.unrolled.outputs(record, TEST))
    assert ik.unrolled.verify(record) == 0.0


def test_per_test_columns_sum_to_the_summed_measure_and_the_result_saves(tmp_path):
    record = recorded("case 2: SGD + momentum -> AdamW")
    summed = ik.unrolled.metagradients(record, TEST)
    per_test = ik.unrolled.metagradients(record, TEST, per_test=True)
    for a, b in zip(summed, per_test):
        assert b.values.shape == (a.n_train, len(TEST[0]))
        torch.testing.assert_close(b.values.sum(1), a.values, rtol=1e-12, atol=1e-14)
    loaded = ik.load(per_test[0].save(tmp_path / "scores.safetensors"))
    assert torch.equal(loaded.removal, -per_test[0].values) and loaded.method == per_test[0].method


@pytest.mark.parametrize("pull", ["looped", "batched", "vmapped"])
@pytest.mark.parametrize("name", ["case 2: SGD + momentum -> AdamW", "LoRA: AdamW -> Adam"])
def test_each_way_of_pulling_several_measures_gives_each_measures_own_metagradient(name, pull):
    """q > 1 outputs pulled one double backward per output (looped), one batched over them (batched) or by vmapped
    torch.func pullbacks: column j equals the one-measure metagradient of test point j alone (that path is checked
    against finite differences above)."""
    record = recorded(name)
    x, y = TEST
    per_test = ik.unrolled.metagradients(record, TEST, per_test=True, pull=pull)
    for j in range(len(x)):
        alone = ik.unrolled.metagradients(record, (x[j:j + 1], y[j:j + 1]))
        for a, b in zip(alone, per_test):
            torch.testing.assert_close(b.values[:, j], a.values, rtol=1e-12, atol=1e-14)
    assert per_test[0].diagnostics["pull"]["stages"] == [{"pull": pull, "trial": None}] * len(record)


def test_an_auto_several_measure_pass_times_each_pull_and_takes_the_fastest():
    record = recorded("case 1: AdamW -> SGD + momentum")
    first = ik.unrolled.metagradients(record, TEST, per_test=True)
    chosen = first[0].diagnostics["pull"]["stages"]
    for run, stage in zip(record.runs, chosen):
        seconds = stage["trial"]["seconds"]
        assert set(seconds) == {"looped", "batched", "vmapped"} and min(seconds.values()) > 0
        assert stage["pull"] == min(seconds, key=seconds.get)
    named = [ik.unrolled.metagradients(recorded("case 1: AdamW -> SGD + momentum"), TEST, per_test=True,
                                       pull=chosen[-1]["pull"]) for _ in range(2)]  # a way named: no trial, same bits
    assert all(torch.equal(a.values, b.values) for a, b in zip(*named))
    assert [s["trial"] for s in named[0][0].diagnostics["pull"]["stages"]] == [None] * len(record)
    with pytest.raises(ik.InputError, match="unknown pull"):
        ik.unrolled.metagradients(record, TEST, pull="fastest")


@pytest.mark.parametrize(
    "ours, theirs",
    [
        (SGD(lr=0.1, momentum=0.9, weight_decay=0.01), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01, foreach=False)),
        (SGD(lr=0.1, momentum=0.9, nesterov=True), lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, nesterov=True, foreach=False)),
        (Adam(lr=0.01, weight_decay=0.1), lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=0.1, foreach=False)),
        (AdamW(lr=0.01, weight_decay=0.1), lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=0.1, foreach=False)),
    ],
)
def test_update_rules_match_torch_optim(ours, theirs):
    gen = torch.Generator().manual_seed(0)
    start = {"a": torch.randn(3, 4, generator=gen), "b": torch.randn(4, generator=gen)}
    grads = [{n: torch.randn(v.shape, generator=gen) for n, v in start.items()} for _ in range(6)]
    leaves = {n: v.clone().requires_grad_(True) for n, v in start.items()}
    optimizer = theirs(list(leaves.values()))
    theta, state = dict(start), ours.init(start)
    for t, g in enumerate(grads):
        for n, leaf in leaves.items():
            leaf.grad = g[n].clone()
        optimizer.step()
        theta, state = ours.update(theta, state, g, ours.lr, t + 1)
    for n in start:
        torch.testing.assert_close(theta[n], leaves[n].detach(), rtol=1e-12, atol=1e-14)


def test_full_batch_descent_to_convergence_gives_the_influence_function_over_m():
    """dθ_∞/dw_z = −(1/m) H⁻¹∇ℓ(z), so the score → I(z, T)/m (DESIGN §1)."""
    torch.manual_seed(0)
    x, y = data(20, 3, seed=4)
    stage = ik.Stage(nn.Linear(5, 3).double().eval(), cross_entropy, (x, y), regularizer=l2(0.1))
    record = Record()
    record.train(stage, SGD(lr=1.0), steps=400, batch_size=20)
    test = data(6, 3, seed=5)
    scores = ik.unrolled.metagradients(record, test)[0].values
    influence = ik.influence(stage, torch.arange(20), test).values
    torch.testing.assert_close(scores, influence / 20, rtol=1e-8, atol=1e-12)


def test_a_users_loop_under_the_recorder_equals_the_training_helper():
    helper, loop = Record(), Record()
    pretrain(helper, SGD(lr=0.2, momentum=0.9), steps=6, batch_size=4)
    torch.manual_seed(0)
    stage = ik.Stage(Net(3).eval(), cross_entropy, data(12, 3, seed=1), regularizer=l2(1e-2))
    with loop.recorder(stage, SGD(lr=0.2, momentum=0.9), checkpoint_every=4) as rec:
        for idx in helper.runs[0].batches:
            rec.step(idx)
    assert loop.runs[0].lrs == helper.runs[0].lrs
    for n, value in helper.runs[0].final.items():
        assert torch.equal(loop.runs[0].final[n], value)


def test_segmented_reverse_pass_equals_one_segment():
    """Checkpoints every 4 steps (the reverse pass replays one 4-step segment at a time) give the scores of one
    16-step segment."""
    results = []
    for every in (4, 16):
        record = Record()
        torch.manual_seed(0)
        stage = ik.Stage(Net(3).eval(), cross_entropy, data(12, 3, seed=1), regularizer=l2(1e-2))
        record.train(stage, AdamW(lr=0.05), steps=16, batch_size=4, checkpoint_every=every)
        assert sorted(record.runs[0].checkpoints) == ([0, 4, 8, 12, 16] if every == 4 else [0, 16])
        results.append(ik.unrolled.metagradients(record, TEST)[0])
    torch.testing.assert_close(results[0].values, results[1].values, rtol=1e-12, atol=1e-15)
    assert results[0].diagnostics["memory"]["segment_steps"] == 4


def test_bad_records_are_refused_with_the_fix():
    record = Record()
    stage = pretrain(record, SGD(lr=0.1), steps=2)
    with pytest.raises(ik.InputError, match="link="):
        record.train(stage, SGD(lr=0.1), steps=1, batch_size=2)
    with pytest.raises(ik.InputError, match="ik.unrolled.SGD, Adam or AdamW"):
        Record().train(stage, torch.optim.SGD, steps=1, batch_size=2)
    with pytest.raises(ik.InputError, match="momentum"):
        SGD(lr=0.1, momentum=1.5)
    with pytest.raises(ik.InputError, match="shape \\(12,\\)"):
        ik.unrolled.replay(record, torch.ones(3))
    nesterov = Record()
    pretrain(nesterov, SGD(lr=0.1, momentum=0.5, nesterov=True), steps=2)
    with pytest.raises(ik.InputError, match="metagradients \\(exact\\)"):
        ik.unrolled.approximate(nesterov, TEST)
    uneven = torch.linspace(0.5, 1.0, 12)  # a factored curvature can be rescaled by one weight per stage only
    with pytest.raises(ik.InputError, match="weighted unevenly"):
        ik.unrolled.approximate(ik.unrolled.reweighted(record, uneven), TEST, curvature="ekfac")


class LinearInTheta(nn.Module):
    """Pretraining model whose output is linear in (embedding.weight, head.weight): x[:, :6]·vec(W) + x[:, 6:]·U."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Linear(3, 2, bias=False)
        self.head = nn.Linear(2, 1, bias=False)

    def forward(self, x):
        return (x[:, :6] * self.embedding.weight.reshape(-1)).sum(1, keepdim=True) + x[:, 6:] @ self.head.weight.T


class Bilinear(LinearInTheta):
    """Finetuning model head(embedding(x)): bilinear in (W, Θ), so its objective is quadratic."""

    def forward(self, x):
        return self.head(self.embedding(x))


def linear_loss(outputs, targets):
    return outputs[:, 0] * targets


@pytest.mark.parametrize("case", [1, 2])
@pytest.mark.parametrize("segments", [1, 3])
@pytest.mark.parametrize("momentum", [0.0, 0.8])
def test_approximate_unrolling_equals_the_exact_metagradient_where_its_closed_form_is_exact(case, segments, momentum):
    """Full-batch SGD (a decaying learning rate, with and without momentum) on quadratic objectives with pretraining
    losses linear in θ: every step is the segment's linear map, so the segment recursion is exact across the
    boundary."""
    gen = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    pre = ik.Stage(LinearInTheta().eval(), linear_loss, (0.5 * torch.randn(10, 8, generator=gen),
                   torch.randn(10, generator=gen)), regularizer=l2(1.0))
    fin = ik.Stage(Bilinear().eval(), linear_loss, (0.5 * torch.randn(8, 3, generator=gen),
                   torch.randn(8, generator=gen)), params="head" if case == 1 else None, regularizer=l2(1.0))
    test = (0.5 * torch.randn(3, 3, generator=gen), torch.randn(3, generator=gen))
    record = Record()
    schedule = lambda t: 0.3 / (1 + 0.1 * t)  # noqa: E731
    record.train(pre, SGD(lr=0.3, momentum=momentum, weight_decay=0.1), steps=12, batch_size=10, schedule=schedule)
    record.train(fin, SGD(lr=0.3, momentum=momentum), steps=9, batch_size=8, schedule=schedule,
                 link=ik.Link("embedding", case=case, alpha=0.5))
    exact = ik.unrolled.metagradients(record, test, per_test=True)
    approx = ik.unrolled.approximate(record, test, segments=segments, per_test=True)
    torch.testing.assert_close(approx[0].values, exact[0].values, rtol=1e-9, atol=1e-12)
    assert exact[0].values.abs().max() > 1e-4  # the pretraining examples do reach the finetuned model
    if case == 1:  # the finetuning examples' gradients ∇_Θ ℓ = y·W x are constant too
        torch.testing.assert_close(approx[1].values, exact[1].values, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("momentum", [0.0, 0.5])
def test_past_the_edge_of_stability_a_piece_takes_the_gradient_flow_closed_form(momentum):
    """Full-batch SGD on a quadratic objective with every Hessian eigenvalue λ past the edge (ηλ > 2(1 + μ)): the
    recorded run's own linear map diverges (the exact metagradient grows as |1 − ηλ|^K), and the approximate
    unrolling takes SOURCE's exponential there, score_z = −(1/n) ∇ℓ(z)·∇m · (1 − exp(−λ K η/(1 − μ)))/λ — the
    response of gradient flow at the effective learning rate — and says so in its diagnostics."""
    gen = torch.Generator().manual_seed(5)
    torch.manual_seed(5)
    x, y = 0.5 * torch.randn(10, 8, generator=gen), torch.randn(10, generator=gen)
    x_test, y_test = 0.5 * torch.randn(3, 8, generator=gen), torch.randn(3, generator=gen)
    lr, decay, strength, steps = 0.3, 0.1, 4.0 * (1 + momentum) / 0.3, 12
    stage = ik.Stage(LinearInTheta().eval(), linear_loss, (x, y), regularizer=l2(strength))
    record = Record()
    record.train(stage, SGD(lr=lr, momentum=momentum, weight_decay=decay), steps=steps, batch_size=10)
    lam = strength + decay  # the objective's Hessian is λI: the losses are linear in θ
    flow = (1 - torch.exp(torch.tensor(-lam * steps * lr / (1 - momentum), dtype=x.dtype))) / lam
    expected = -(y[:, None] * y_test[None, :]) * (x @ x_test.T) * flow / len(y)  # ∇ℓ(z) = y_z x_z, ∇m_j = y_j x_j
    for segments in (1, 3):
        approx = ik.unrolled.approximate(record, (x_test, y_test), segments=segments, per_test=True)[0]
        torch.testing.assert_close(approx.values, expected, rtol=1e-9, atol=1e-12)
        stability = approx.diagnostics["stability"]
        assert stability["coordinates_past_the_edge"] == stability["coordinates"] == 8 * segments
        assert stability["largest_lr_times_eigenvalue"] == pytest.approx(lr * lam)
        assert stability["edge"] == pytest.approx(2 * (1 + momentum))
    exact = ik.unrolled.metagradients(record, (x_test, y_test), per_test=True)[0]
    assert exact.values.abs().max() > 100 * expected.abs().max()  # the discrete map itself diverges here


@pytest.mark.parametrize("optimizer, edge", [(SGD(lr=0.3, weight_decay=0.1), 2.0), (SGD(lr=0.3, momentum=0.5), 3.0),
                                              (SGD(lr=0.3, momentum=0.5, nesterov=True), 1.5)])
@pytest.mark.parametrize("strength", [1.0, 12.0])
def test_sharpness_on_a_quadratic_is_its_hessians_eigenvalue_beside_the_edge_of_stability(optimizer, edge, strength):
    """Losses linear in θ under R = (c/2)‖θ‖²: the Hessian is c·I at every checkpoint, so λ_max = c (+ SGD's coupled
    weight decay) exactly, and η·λ_max is past the edge 2(1 + μ) (Nesterov 2(1 + μ)/(1 + 2μ)) only for c = 12.
    (Adam's preconditioned rows: tests/test_unrolled_adam.py.)"""
    gen = torch.Generator().manual_seed(6)
    torch.manual_seed(6)
    stage = ik.Stage(LinearInTheta().eval(), linear_loss, (0.5 * torch.randn(10, 8, generator=gen),
                     torch.randn(10, generator=gen)), regularizer=l2(strength))
    record = Record()
    record.train(stage, optimizer, steps=6, batch_size=5, checkpoint_every=2)
    table = ik.unrolled.sharpness(record)
    assert list(table["step"]) == [0, 2, 4, 6] and (table["stage"] == 0).all()
    decay = optimizer.weight_decay
    torch.testing.assert_close(torch.tensor(table["max_eigenvalue"].values), torch.full((4,), strength + decay,
                               dtype=torch.float64), rtol=1e-9, atol=0)
    torch.testing.assert_close(torch.tensor(table["lr_times_eigenvalue"].values),
                               torch.full((4,), 0.3 * (strength + decay), dtype=torch.float64), rtol=1e-9, atol=0)
    assert list(table["edge"]) == pytest.approx([edge] * 4)
    assert list(table["past_edge"]) == [0.3 * (strength + decay) > edge] * 4


def test_sharpness_of_a_two_stage_record_is_the_top_eigenvalue_of_each_stages_objective():
    """Tanh network, AdamW pretraining then SGD + momentum finetuning of the head (Case 1): at every checkpoint the
    largest eigenvalue equals that of the dense Hessian of the stage's full-data objective there (float64),
    preconditioned by Adam's P = √v̂ + ε (``stability.preconditioner``) in the AdamW stage."""
    record = recorded("case 1: AdamW -> SGD + momentum")
    table = ik.unrolled.sharpness(record, steps=60)
    assert list(table["stage"]) == [0] * len(record.runs[0].checkpoints) + [1] * len(record.runs[1].checkpoints)
    for row in table.itertuples():
        run = record.runs[row.stage]
        theta = run.checkpoints[row.step][0]
        names = list(run.trained)
        x, y = run.stage.data.take(torch.arange(len(run.stage)))
        shapes = [theta[n].shape for n in names]

        def objective(flat, run=run, names=names, shapes=shapes, x=x, y=y):
            parts = dict(zip(names, (t.reshape(s) for t, s in zip(flat.split([s.numel() for s in shapes]), shapes))))
            return run.objective(parts, run.anchors, x, y, torch.ones(len(y), dtype=x.dtype))

        dense = torch.func.hessian(objective)(torch.cat([theta[n].reshape(-1) for n in names]))
        if row.preconditioned:
            scale = torch.cat([p.reshape(-1) for p in preconditioner(run, row.step, theta,
                                                                      run.checkpoints[row.step][1]).values()]).rsqrt()
            dense = scale[:, None] * dense * scale[None, :]
        assert row.max_eigenvalue == pytest.approx(float(torch.linalg.eigvalsh(dense)[-1]), rel=1e-8)
    assert table.loc[table["stage"] == 1, "edge"].eq(3.8).all()
    assert (table.loc[table["stage"] == 0, "edge"] - 38).abs().max() < 1e-9


def test_linearity_is_exact_where_the_run_is_affine_in_the_weights_and_tends_to_one_as_the_drop_shrinks():
    """Full-batch SGD + momentum on losses linear in θ under L2: θ_T is affine in w, so every replayed drop moves the
    (linear) test losses by exactly the metagradient's prediction (cosine and ratio 1 at t = 1). On the tanh network
    the whole drop is not linear, and the ratio and cosine tend to 1 as the drop shrinks (t = 1e-3)."""
    gen = torch.Generator().manual_seed(7)
    torch.manual_seed(7)
    stage = ik.Stage(LinearInTheta().eval(), linear_loss, (0.5 * torch.randn(10, 8, generator=gen),
                     torch.randn(10, generator=gen)), regularizer=l2(1.0))
    record = Record()
    record.train(stage, SGD(lr=0.3, momentum=0.5), steps=8, batch_size=10)
    test = (0.5 * torch.randn(3, 8, generator=gen), torch.randn(3, generator=gen))
    scores = ik.unrolled.metagradients(record, test, per_test=True)[0]
    table = ik.unrolled.linearity(record, test, scores, fraction=0.2, sets=3, steps=(1.0, 0.1))
    assert len(table) == 6
    torch.testing.assert_close(torch.tensor(table[["cosine", "ratio"]].to_numpy()), torch.ones(6, 2, dtype=torch.float64),
                               rtol=1e-8, atol=1e-8)
    tanh = recorded("one stage, SGD + momentum")
    scores = ik.unrolled.metagradients(tanh, TEST, per_test=True)[0]
    table = ik.unrolled.linearity(tanh, TEST, scores, fraction=0.2, sets=2, steps=(1.0, 1e-3))
    small = table[table["t"] == 1e-3]
    assert (small["ratio"] - 1).abs().max() < 1e-3 and (1 - small["cosine"]).max() < 1e-5
    summed = ik.unrolled.linearity(tanh, TEST, ik.unrolled.metagradients(tanh, TEST)[0], fraction=0.2, sets=2,
                                   steps=(1e-5,))  # one column: the summed measure's scores against its sum
    assert (summed["ratio"] - 1).abs().max() < 1e-4 and (summed["cosine"] == 1.0).all()
    with pytest.raises(ik.InputError, match="scores of stage 0"):
        ik.unrolled.linearity(tanh, TEST, ik.unrolled.metagradients(recorded("case 1: AdamW -> SGD + momentum"),
                                                                      TEST)[1])


def test_approximate_unrolling_at_other_weights_equals_the_exact_metagradient_there():
    """at=: the record re-run at other data weights (uneven on pretraining, one float on finetuning) and each piece
    linearized with the weighted objective's Hessian — on the quadratic objectives above, still every step's exact
    linear map, so equal to metagradients(at=) and unlike the plain (w = 1) scores."""
    gen = torch.Generator().manual_seed(4)
    torch.manual_seed(4)
    pre = ik.Stage(LinearInTheta().eval(), linear_loss, (0.5 * torch.randn(10, 8, generator=gen),
                   torch.randn(10, generator=gen)), regularizer=l2(1.0))
    fin = ik.Stage(Bilinear().eval(), linear_loss, (0.5 * torch.randn(8, 3, generator=gen),
                   torch.randn(8, generator=gen)), params="head", regularizer=l2(0.3))
    test = (0.5 * torch.randn(3, 3, generator=gen), torch.randn(3, generator=gen))
    record = Record()
    record.train(pre, SGD(lr=0.3, momentum=0.8), steps=12, batch_size=10)
    record.train(fin, SGD(lr=0.3, momentum=0.8), steps=9, batch_size=8, link=ik.Link("embedding", case=1))
    at = [0.5 + torch.rand(10, generator=gen), 0.7]
    exact = ik.unrolled.metagradients(record, test, per_test=True, at=at)
    approx = ik.unrolled.approximate(record, test, segments=3, per_test=True, at=at)
    plain = ik.unrolled.approximate(record, test, segments=3, per_test=True)
    for a, e, p in zip(approx, exact, plain):
        torch.testing.assert_close(a.values, e.values, rtol=1e-9, atol=1e-12)
        assert (a.values - p.values).abs().max() > 1e-3 * a.values.abs().max()


def ridge_refit_measure(final: dict) -> torch.Tensor:
    """(2,) test losses of a head refit to its optimum on the pretrained embedding (ridge regression in closed form):
    a later stage at its optimum that the record does not hold, reached by the implicit function Θ*(W)."""
    gen = torch.Generator().manual_seed(3)
    x, y, x_test = torch.randn(9, 5, generator=gen), torch.randn(9, generator=gen), torch.randn(2, 5, generator=gen)
    features = lambda inputs: torch.tanh(inputs @ final["embedding.0.weight"].T + final["embedding.0.bias"])  # noqa: E731
    h = features(x)
    head = torch.linalg.solve(h.T @ h + 0.1 * torch.eye(h.shape[1], dtype=h.dtype), h.T @ y)
    return (features(x_test) @ head - torch.tensor([0.5, -1.0], dtype=h.dtype)) ** 2


def test_metagradients_from_a_given_final_adjoint_equal_central_differences_of_the_rerun_training():
    """The adjoint d measure / d θ_T of a refit-to-optimum head, computed outside the record, handed into the
    pretraining run's reverse pass: equals (measure(replay(w_z = 1 + ε)) − measure(replay(1 − ε))) / 2ε."""
    record = Record()
    pretrain(record, SGD(lr=0.2, momentum=0.9, weight_decay=1e-3))
    final = {n: v.detach().requires_grad_(True) for n, v in record.runs[0].final.items()}
    values = ridge_refit_measure(final)
    rows = [torch.autograd.grad(values[i], list(final.values()), retain_graph=True, allow_unused=True) for i in range(2)]
    adjoint = {n: torch.stack([r[j] if r[j] is not None else torch.zeros_like(final[n]) for r in rows])
               for j, n in enumerate(final)}
    batched = ik.unrolled.metagradients(record, ik.unrolled.Adjoint(adjoint, batched=True), per_test=True)[0]
    summed = ik.unrolled.metagradients(record, ik.unrolled.Adjoint({n: a.sum(0) for n, a in adjoint.items()}))[0]
    assert batched.values.shape == (12, 2) and summed.values.shape == (12,)
    torch.testing.assert_close(batched.values.sum(1), summed.values, rtol=1e-12, atol=1e-14)
    for z in (0, 5, 11):
        fd = []
        for eps in (EPS, -EPS):
            w = torch.ones(12)
            w[z] += eps
            with torch.no_grad():
                fd.append(ridge_refit_measure(ik.unrolled.replay(record, w)[0]))
        expected = (fd[0] - fd[1]) / (2 * EPS)
        torch.testing.assert_close(batched.values[z], expected, rtol=1e-6, atol=1e-9)
    assert batched.values.abs().max() > 1e-3 and torch.equal(batched.removal, -batched.values)
    with pytest.raises(ik.InputError, match="not final values"):
        ik.unrolled.metagradients(record, ik.unrolled.Adjoint({"nope": torch.zeros(3)}))
    with pytest.raises(ik.InputError, match="parameter's shape"):
        ik.unrolled.metagradients(record, ik.unrolled.Adjoint({"head.weight": torch.zeros(2, 2)}))


class Readout(nn.Module):
    """head(embedding(x)) with linear layers: the finetuning model over a fixed linear embedding."""

    def __init__(self):
        super().__init__()
        self.embedding = nn.Linear(4, 3)
        self.head = nn.Linear(3, 2)

    def forward(self, x):
        return self.head(self.embedding(x))


class Embedding(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Linear(4, 3)

    def forward(self, x):
        return self.embedding(x)


def squared_error(outputs, targets):
    return ((outputs - targets) ** 2).sum(-1)


def linear_layer_stages(seed: int):
    """(pretraining stage, finetuning stage, test set): one linear layer per stage under squared error (the
    embedding; then the head on the fixed embedding), where EK-FAC with the exact Fisher is the Hessian."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    pre = ik.Stage(Embedding().eval(), squared_error, (torch.randn(14, 4, generator=gen), torch.randn(14, 3, generator=gen)),
                   regularizer=l2(0.1))
    fin = ik.Stage(Readout().eval(), squared_error, (torch.randn(10, 4, generator=gen), torch.randn(10, 2, generator=gen)),
                   params="head", regularizer=l2(0.1))
    return pre, fin, (torch.randn(3, 4, generator=gen), torch.randn(3, 2, generator=gen))


@pytest.mark.parametrize("kind", ["ekfac", "kfac"])
@pytest.mark.parametrize("momentum", [0.0, 0.7])
def test_factored_approximate_unrolling_equals_the_dense_one_where_the_factored_curvature_is_exact(kind, momentum):
    """Each stage trains one linear layer under squared error (pretraining: the embedding; finetuning: the head on
    the fixed embedding, Case 1): with the exact Fisher its (E)K-FAC equals the Hessian, so the factored pieces
    (f(C)·v in each layer's Kronecker eigenbasis) give the dense ones' scores on both stages."""
    pre, fin, test = linear_layer_stages(seed=0)
    record = Record()
    schedule = lambda t: 0.1 / (1 + 0.1 * t)  # noqa: E731
    record.train(pre, SGD(lr=0.1, momentum=momentum, weight_decay=0.05), steps=10, batch_size=14, schedule=schedule)
    record.train(fin, SGD(lr=0.1, momentum=momentum), steps=8, batch_size=10, schedule=schedule,
                 link=ik.Link("embedding", case=1))
    exact = ik.CurvatureConfig(fisher="exact")
    dense = ik.unrolled.approximate(record, test, segments=3, per_test=True)
    factored = ik.unrolled.approximate(record, test, segments=3, per_test=True, curvature=kind, config=exact)
    for d, f in zip(dense, factored):
        torch.testing.assert_close(f.values, d.values, rtol=1e-8, atol=1e-11)
        assert d.values.abs().max() > 1e-3
    assert kind in factored[0].method
    sampled = ik.unrolled.approximate(record, test, segments=3, curvature=kind)[0].values  # the sampled Fisher: close
    assert torch.corrcoef(torch.stack([sampled, dense[0].values.sum(1)]))[0, 1] > 0.5
    with pytest.raises(ik.InputError, match="unknown curvature"):
        ik.unrolled.approximate(record, test, curvature="lanczos")


@pytest.mark.parametrize("basis", ["each", "shared"])
def test_factored_approximate_unrolling_at_one_weight_per_stage_equals_the_dense_one(basis):
    """at= one float per stage: the factored curvature of the reweighted objective is the fitted one with its data
    part scaled (FactoredCurvature.scale_data); exact here (C = H), so equal to the dense pieces at the same weights.
    A curvature fitted at w = 1 and given as basis is refused for a reweighted stage."""
    pre, fin, test = linear_layer_stages(seed=2)
    record = Record()
    record.train(pre, SGD(lr=0.1, momentum=0.5), steps=9, batch_size=14)
    record.train(fin, SGD(lr=0.1, momentum=0.5), steps=6, batch_size=10, link=ik.Link("embedding", case=1))
    exact = ik.CurvatureConfig(fisher="exact")
    dense = ik.unrolled.approximate(record, test, segments=3, per_test=True, at=[0.5, 0.8])
    factored = ik.unrolled.approximate(record, test, segments=3, per_test=True, curvature="ekfac", basis=basis,
                                       config=exact, at=[0.5, 0.8])
    plain = ik.unrolled.approximate(record, test, segments=3, per_test=True)
    for d, f, p in zip(dense, factored, plain):
        torch.testing.assert_close(f.values, d.values, rtol=1e-8, atol=1e-11)
        assert (d.values - p.values).abs().max() > 1e-3 * d.values.abs().max()
    fitted = ik.factored.fit_curvature(pre, kind="ekfac", fisher="exact")
    with pytest.raises(ik.InputError, match="fitted at w = 1"):
        ik.unrolled.approximate(record, test, curvature="ekfac", basis=[fitted, None], at=0.5)


def test_factored_pieces_sharing_one_eigenbasis_equal_the_dense_ones_where_the_curvature_is_exact():
    """basis="shared": one EK-FAC eigenbasis per stage, eigenvalues re-estimated at each piece's end — exact here
    (one linear layer under squared error, exact Fisher: C = H at every θ), so equal to the dense pieces."""
    pre, fin, test = linear_layer_stages(seed=1)
    record = Record()
    record.train(pre, SGD(lr=0.1, momentum=0.6), steps=9, batch_size=14)
    record.train(fin, SGD(lr=0.1, momentum=0.6), steps=6, batch_size=10, link=ik.Link("embedding", case=1))
    exact = ik.CurvatureConfig(fisher="exact")
    dense = ik.unrolled.approximate(record, test, segments=3, per_test=True)
    shared = ik.unrolled.approximate(record, test, segments=3, per_test=True, curvature="ekfac", basis="shared",
                                     config=exact)
    for d, s in zip(dense, shared):
        torch.testing.assert_close(s.values, d.values, rtol=1e-8, atol=1e-11)
    with pytest.raises(ik.InputError, match="shared eigenbasis"):
        ik.unrolled.approximate(record, test, curvature="kfac", basis="shared")


def test_eigenvalues_in_a_kept_eigenbasis_are_the_gradients_second_moments_in_it():
    """fit_curvature(basis=C₀, at=θ'): C' = Q diag(qₖᵀ F(θ') qₖ) Qᵀ with Q C₀'s eigenvectors and F(θ') the empirical
    Fisher (1/n) Σ_i ∇ℓ_i ∇ℓ_iᵀ at θ' (explicit per-example gradients); at C₀'s own point it is C₀ again."""
    from torch.func import functional_call, grad, vmap

    from influkit.factored import fit_curvature

    gen = torch.Generator().manual_seed(2)
    torch.manual_seed(2)
    x, y = torch.randn(30, 4, generator=gen), torch.randint(0, 3, (30,), generator=gen)
    stage = ik.Stage(nn.Linear(4, 3).eval(), cross_entropy, (x, y))
    start = fit_curvature(stage, kind="ekfac", fisher="empirical")
    same = fit_curvature(stage, kind="ekfac", fisher="empirical", basis=start)
    torch.testing.assert_close(same.dense(), start.dense(), rtol=1e-12, atol=1e-14)
    moved = {n: p.detach() + 0.5 * torch.randn(p.shape, generator=gen) for n, p in stage.model.named_parameters()}
    rebased = fit_curvature(stage, kind="ekfac", fisher="empirical", basis=start, at=moved)
    per_example = vmap(grad(lambda p, xi, yi: cross_entropy(functional_call(stage.model, p, (xi[None],)), yi[None])[0]),
                       (None, 0, 0))(moved, x, y)
    rows = torch.cat([per_example[n].reshape(30, -1) for n in start.space.names], dim=1)
    fisher = rows.T @ rows / 30
    _, q = torch.linalg.eigh(start.dense())
    expected = q @ torch.diag(torch.diagonal(q.T @ fisher @ q)) @ q.T
    torch.testing.assert_close(rebased.dense(), expected, rtol=1e-9, atol=1e-12)
    assert (rebased.dense() - start.dense()).abs().max() > 1e-3  # the eigenvalues did move with θ


def test_a_given_budget_counts_the_state_the_unrolling_holds():
    """memory= bounds what approximate adds, the state it holds across phases included: each piece's u_ℓ (q × p) and
    its θ_ℓ where the piece ends off a checkpoint (replayed; a checkpoint is the record's) are taken off the budget
    of every later phase (``held_bytes``, counted here by hand), so a budget the held state would exceed yields
    smaller chunks — and the same scores (float64, up to the order of the sums); a budget the held state uses up
    is refused, naming what is held."""
    pre, fin, test = linear_layer_stages(seed=3)
    record = Record()
    record.train(pre, SGD(lr=0.1, momentum=0.5), steps=10, batch_size=7, checkpoint_every=4)  # checkpoints 0, 4, 8, 10
    record.train(fin, SGD(lr=0.1, momentum=0.5), steps=6, batch_size=5, checkpoint_every=3,  # checkpoints 0, 3, 6
                 link=ik.Link("embedding", case=1))
    free = ik.unrolled.approximate(record, test, segments=3, per_test=True)  # cuts at 0, 3, 7, 10 and 0, 2, 4, 6
    q, p0, p1, itemsize = 3, 4 * 3 + 3, 3 * 2 + 2, 8
    stage0 = itemsize * (3 * q * p0 + 2 * p0)  # three u_ℓ; θ_3 and θ_7 replayed
    stage1 = itemsize * (3 * q * p1 + 2 * p1)  # three u_ℓ; θ_2 and θ_4 replayed
    scoring = [r.diagnostics["memory"][-1] for r in free]
    assert [s["held_bytes"] for s in scoring] == [stage0 + stage1, stage1]  # stage 1's pieces wait for its own terms
    need = int(SAFETY * scoring[0]["bytes_per_example"])
    budget = stage0 + stage1 + 3 * need + 1  # three rows once the held state is counted ...
    assert budget // need > 3  # ... more without it
    tight = ik.unrolled.approximate(record, test, segments=3, per_test=True, memory=budget)
    assert tight[0].diagnostics["memory"][-1]["budget"] == budget - stage0 - stage1
    assert tight[0].diagnostics["chunks"]["chunk_size"] == 3 < free[0].diagnostics["chunks"]["chunk_size"] == len(pre)
    adjoint = [m for m in tight[1].diagnostics["memory"] if m["phase"] == "shared block's adjoint"]
    assert len(adjoint) == 3 and all(m["batch"] < len(fin) and m["budget"] < budget for m in adjoint)
    for t, f in zip(tight, free):
        torch.testing.assert_close(t.values, f.values, rtol=1e-12, atol=1e-15)
        assert f.values.abs().max() > 1e-3
    with pytest.raises(MemoryBudgetError, match="already holds [\\d,]+ bytes"):
        ik.unrolled.approximate(record, test, segments=3, memory=100)


@pytest.mark.parametrize("case", ["case1", "case2"])
def test_every_hessian_eigenpair_makes_the_factored_pieces_the_dense_hessians(case):
    """A tanh network under cross-entropy, where the Gauss-Newton matrix is not the Hessian: one piece per stage with
    every eigenpair of the stage's Hessian put in (the default top_curvature) gives the dense Hessian's scores; every
    eigenpair of the Gauss-Newton matrix does not."""
    record = Record()
    pretrain(record, SGD(lr=0.2, momentum=0.5, weight_decay=1e-3))
    finetune(record, case, SGD(lr=0.1, momentum=0.5))
    every = max(sum(t.numel() for t in run.checkpoints[0][0].values()) for run in record.runs)
    dense = ik.unrolled.approximate(record, TEST, segments=1, per_test=True)
    hessian = ik.unrolled.approximate(record, TEST, segments=1, per_test=True, curvature="ekfac", top=every)
    gauss_newton = ik.unrolled.approximate(record, TEST, segments=1, per_test=True, curvature="ekfac", top=every,
                                           top_curvature="gauss-newton")
    for d, h, g in zip(dense, hessian, gauss_newton):
        torch.testing.assert_close(h.values, d.values, rtol=1e-7, atol=1e-10)
        assert h.diagnostics["top"]["curvature"] == "hessian" and g.diagnostics["top"]["curvature"] == "gauss-newton"
    # the pretraining stage's tanh layer makes G ≠ H (case 1's finetuning trains only the linear head, where G = H)
    assert (gauss_newton[0].values - dense[0].values).abs().max() > 1e-3 * dense[0].values.abs().max()
    with pytest.raises(ik.InputError, match="top_curvature"):
        ik.unrolled.approximate(record, TEST, curvature="ekfac", top_curvature="fisher")


@pytest.mark.parametrize("momentum", [0.0, 0.8])
def test_top_directions_complete_the_factored_pieces(momentum):
    """One linear layer per stage under squared error, where the Gauss-Newton matrix is the Hessian: with the exact
    Fisher (EK-FAC = G = H) the top-2 split changes nothing; with the sampled Fisher (EK-FAC ≠ H) and every eigenpair
    of H put in exactly, the factored pieces give the dense Hessian's scores."""
    pre, fin, test = linear_layer_stages(seed=1)
    record = Record()
    record.train(pre, SGD(lr=0.1, momentum=momentum, weight_decay=0.05), steps=10, batch_size=14)
    record.train(fin, SGD(lr=0.1, momentum=momentum), steps=8, batch_size=10, link=ik.Link("embedding", case=1))
    dense = ik.unrolled.approximate(record, test, segments=3, per_test=True)
    exact_fisher = ik.CurvatureConfig(fisher="exact")
    split = ik.unrolled.approximate(record, test, segments=3, per_test=True, curvature="ekfac", config=exact_fisher,
                                    top=2)
    every = ik.unrolled.approximate(record, test, segments=3, per_test=True, curvature="ekfac",
                                    top=max(sum(t.numel() for t in run.checkpoints[0][0].values()) for run in record.runs))
    sampled = ik.unrolled.approximate(record, test, segments=3, per_test=True, curvature="ekfac", top=0)
    for d, s, e, plain in zip(dense, split, every, sampled):
        torch.testing.assert_close(s.values, d.values, rtol=1e-7, atol=1e-10)
        torch.testing.assert_close(e.values, d.values, rtol=1e-7, atol=1e-10)
        assert (plain.values - d.values).abs().max() > 1e-3 * d.values.abs().max()  # the sampled Fisher alone is not
        assert e.diagnostics["top"]["why"] == "given" and plain.diagnostics["top"]["directions"] == 0
    assert dense[0].diagnostics["top"]["directions"] == 0
    with pytest.raises(ik.InputError, match="top="):
        ik.unrolled.approximate(record, test, top=2)
    with pytest.raises(ik.InputError, match="top="):
        ik.unrolled.approximate(record, test, curvature="ekfac", top=-1)


def test_top_directions_of_a_stage_re_run_at_one_weight_are_those_of_its_weighted_objective():
    """at= one float c per stage: the matrix the top directions come from is c·H_data + ∇²R (here with an L2
    regularizer on both stages). With every eigenpair the sampled-Fisher pieces equal the dense Hessian's at the same
    weights — and would not with H_data + ∇²R (c = 1) taken in their place."""
    pre, fin, test = linear_layer_stages(seed=3)
    record = Record()
    record.train(pre, SGD(lr=0.1, momentum=0.5), steps=9, batch_size=14)
    record.train(fin, SGD(lr=0.1, momentum=0.5), steps=6, batch_size=10, link=ik.Link("embedding", case=1))
    every = max(sum(t.numel() for t in run.checkpoints[0][0].values()) for run in record.runs)
    dense = ik.unrolled.approximate(record, test, segments=3, per_test=True, at=[0.3, 0.6])
    split = ik.unrolled.approximate(record, test, segments=3, per_test=True, curvature="ekfac", top=every, at=[0.3, 0.6])
    unweighted = ik.unrolled.approximate(record, test, segments=3, per_test=True, curvature="ekfac", top=every)
    for d, s, u in zip(dense, split, unweighted):
        torch.testing.assert_close(s.values, d.values, rtol=1e-7, atol=1e-10)
        assert (u.values - d.values).abs().max() > 1e-3 * d.values.abs().max()


def test_top_auto_takes_what_half_the_budget_holds_and_says_why(monkeypatch):
    """top="auto" (the default): none above TOP_AUTO_PARAMETERS trained parameters; TOP_AUTO eigenpairs where
    ARPACK's workspace (max(2k + 1, 20) float64 vectors of p) and the k kept vectors fit in half the budget, fewer
    where they do not, none where one does not; dense (p² float64) when k ≥ p − 1. Without scipy it takes none and warns with the extra that adds them. On the tiny chain it takes
    every eigenpair (dense), so it equals the dense Hessian's pieces."""
    from influkit.unrolled.top import TOP_AUTO, TOP_AUTO_PARAMETERS, top_count

    k, why = top_count("auto", TOP_AUTO_PARAMETERS + 1, 4, 2**50)
    assert k == 0 and "TOP_AUTO_PARAMETERS" in why and "top=k" in why
    p = 10_000
    workspace = lambda k: max(2 * k + 1, 20) * p * 8 + k * p * 4  # noqa: E731
    assert top_count("auto", p, 4, 2 * workspace(TOP_AUTO)) == (TOP_AUTO, "auto")
    k, why = top_count("auto", p, 4, 2 * workspace(7) + 1)
    assert k == 7 and "half the budget" in why
    assert top_count("auto", p, 4, 2 * workspace(1) - 2)[0] == 0
    assert top_count(3, p, 4, 1) == (3, "given")
    assert top_count("auto", 12, 8, 2 * (12 * 12 * 8 + 12 * 12 * 8)) == (12, "auto")  # dense: k = p ≥ p − 1
    pre, fin, test = linear_layer_stages(seed=1)
    record = Record()
    record.train(pre, SGD(lr=0.1, momentum=0.8, weight_decay=0.05), steps=10, batch_size=14)
    record.train(fin, SGD(lr=0.1, momentum=0.8), steps=8, batch_size=10, link=ik.Link("embedding", case=1))
    dense = ik.unrolled.approximate(record, test, segments=3, per_test=True)
    auto = ik.unrolled.approximate(record, test, segments=3, per_test=True, curvature="ekfac")
    for d, a in zip(dense, auto):
        torch.testing.assert_close(a.values, d.values, rtol=1e-7, atol=1e-10)
        assert a.diagnostics["top"]["why"] == "auto"
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "scipy" else real(name, *a))
    with pytest.warns(UserWarning, match=r"influkit\[unrolled\]"):
        assert top_count("auto", p, 4, 2 * workspace(TOP_AUTO)) == (0, "auto: scipy (ARPACK) is not installed")
