"""influkit.validation.check_retraining: predicted removal effects against the user's own retraining, with the noise
floor of retraining itself — on a convex model trained to its minimum (float64 L2 logistic regression on real
digits, L-BFGS), where influence and retraining must agree."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from conftest import cross_entropy, digits, l2, need

import influkit as ik
from influkit.training import fit_lbfgs, newton_refine
from influkit.validation import check_retraining, plot_check

WEIGHT = 0.3  # strong L2: removing 2 of 300 (3 of 150 in the two-stage MLP) stays in the linear regime


def retrainer(stage, test):
    """retrain(keep, seed): the logistic regression re-fitted to its minimum on ``keep``, every kept example keeping
    its weight 1/m (the regularizer scaled by m/|keep|: the objective whose ε = −1/m the scores linearize);
    deterministic — the seed changes nothing (each kept set is trained once). Returns the summed test loss."""
    m = len(stage)
    x, y = stage.data.take(torch.arange(m))

    done: dict[bytes, float] = {}  # deterministic: a kept set trained once serves every seed and test

    def retrain(keep: torch.Tensor, seed: int) -> float:
        key = keep.numpy().tobytes()
        if key not in done:
            done[key] = fit(keep)
        return done[key]

    def fit(keep: torch.Tensor) -> float:
        model = copy.deepcopy(stage.model)
        scale = m / len(keep)
        refit = ik.Stage(model, cross_entropy, (x[keep], y[keep]),
                         regularizer=lambda p: scale * l2(WEIGHT)(p))
        fit_lbfgs(refit, max_iter=500)
        newton_refine(refit)
        with torch.no_grad():
            return float(cross_entropy(model(test[0]), test[1]).sum())

    return retrain


@pytest.fixture(scope="module")
def convex():
    """Multinomial L2 logistic regression on 300 real digits at its minimum (L-BFGS, then Newton), 20 test digits."""
    x, y = digits()
    torch.manual_seed(0)
    stage = ik.Stage(torch.nn.Linear(64, 10).double(), cross_entropy, (x[:300], y[:300]), regularizer=l2(WEIGHT))
    fit_lbfgs(stage, max_iter=1000)
    assert newton_refine(stage) < 1e-12
    test = (x[300:320], y[300:320])
    res = ik.influence(stage, torch.arange(len(stage)), test, solve=ik.SolveConfig(solver="direct"), progress=False)
    return res, retrainer(stage, test)


def test_prediction_and_retraining_agree_on_a_convex_model_and_the_noise_floor_is_zero(convex):
    res, retrain = convex
    check = check_retraining(res, retrain, k=2, seeds=2, random=2, progress=False)
    table = check.table.set_index("group")
    assert list(table.index) == ["most harmful", "most helpful", "random 1", "random 2"]
    assert (table["size"] == 2).all() and (table["seeds"] == 2).all()
    # a deterministic retrainer: nothing moves with the seed
    assert check.noise_floor == 0.0 and (table["noise_floor"] == 0.0).all()
    assert np.allclose(table["actual_sd"], 0.0, atol=1e-12)
    # the linear prediction of removing 2 of 300 examples at a minimum: agreement up to second-order terms
    np.testing.assert_allclose(table["actual"], table["predicted"], rtol=0.1)
    assert table.loc["most harmful", "actual"] < 0 < table.loc["most helpful", "actual"]
    # the predicted column is the sum of the result's removal over the group
    removal = dict(zip(res.index.tolist(), res.removal.tolist()))
    top = torch.argsort(res.total, descending=True)[:2].tolist()
    assert table.loc["most harmful", "predicted"] == pytest.approx(sum(removal[i] for i in top), rel=1e-12)
    # one run per group and seed plus the baseline's
    assert len(check.runs) == (4 + 1) * 2


def test_noise_floor_is_the_baseline_spread_over_seeds_and_pairing_cancels_it(convex):
    res, retrain = convex
    shift = {0: 0.0, 1: 0.5, 2: -0.2}  # what a seed adds to every run with it (a batch order's effect)
    noisy = lambda keep, seed: retrain(keep, seed) + shift[seed]  # noqa: E731
    plain = check_retraining(res, retrain, k=2, seeds=1, random=0, progress=False)
    check = check_retraining(res, noisy, k=2, seeds=[0, 1, 2], random=0, progress=False)
    assert check.noise_floor == pytest.approx(np.std(list(shift.values()), ddof=1), rel=1e-12)
    # paired by seed, the seed's shift cancels in every change
    np.testing.assert_allclose(check.table["actual"], plain.table["actual"], rtol=1e-9)
    assert np.isnan(plain.noise_floor)  # one seed cannot measure a spread


def test_named_groups_and_bad_input(convex):
    res, retrain = convex
    check = check_retraining(res, retrain, k=2, seeds=1, random=0, groups={"first two": [0, 1]}, progress=False)
    row = check.table.set_index("group").loc["first two"]
    assert row["predicted"] == pytest.approx(float(res.removal[0] + res.removal[1]), rel=1e-12)
    whole = ik.InfluenceResult(values=res.values, n_train=res.n_train, removal_eps=-1.0)  # e.g. unrolled: removal = −score
    named = check_retraining(whole, retrain, k=2, seeds=1, random=0, groups={"first two": [0, 1]}, progress=False)
    assert named.table.set_index("group").loc["first two", "predicted"] == pytest.approx(-float(res.values[:2].sum()))
    with pytest.raises(ik.InputError, match="k must be"):
        check_retraining(res, retrain, k=0, progress=False)
    with pytest.raises(ik.InputError, match="seeds"):
        check_retraining(res, retrain, seeds=[1, 1], progress=False)
    with pytest.raises(ik.InputError, match="finite"):
        check_retraining(res, lambda keep, seed: float("nan"), k=2, seeds=1, random=0, progress=False)
    with pytest.raises(ik.InputError, match="stage-1 examples"):
        check_retraining(res, retrain, k=2, seeds=1, random=0, groups={"g": [10_000]}, progress=False)
    partial = ik.InfluenceResult(values=res.values[:5], index=torch.arange(5), n_train=res.n_train)
    with pytest.raises(ik.InputError, match="did not score"):
        check_retraining(partial, retrain, k=2, seeds=1, random=0, groups={"g": [7]}, progress=False)


def test_progress_bar_and_plot(convex, capsys, tmp_path):
    need("matplotlib")
    res, retrain = convex
    check = check_retraining(res, lambda keep, seed: retrain(keep, 0) + 0.1 * seed, k=2, seeds=2, random=1)
    assert "retraining" in capsys.readouterr().err  # the bar, on by default
    check_retraining(res, retrain, k=2, seeds=1, random=0, progress=False)
    assert capsys.readouterr().err == ""
    fig = plot_check(check.table, title="convex")
    ax = fig.axes[0]
    band = [p for p in ax.patches if p.get_label().startswith("noise floor")]
    assert len(band) == 1  # the noise floor drawn as a band around 0, ±sd
    box = band[0].get_bbox()  # its y in data coordinates
    assert np.isclose(box.y1, check.noise_floor) and np.isclose(box.y0, -check.noise_floor)
    paths = check.save(tmp_path, "convex")
    assert all(p.exists() for p in paths)


class Body(torch.nn.Module):
    """64 → 8 tanh features and a linear head: pretrained on digits 0–4, a new head finetuned on digits 5–9."""

    def __init__(self, classes: int = 5):
        super().__init__()
        self.body = torch.nn.Linear(64, 8)
        self.head = torch.nn.Linear(8, classes)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))


def test_a_two_stage_chain_at_its_minima_predicts_its_retraining():
    """Case 1 on real digits, both stages (a tanh MLP pretrained on 150 digits 0–4, a new head finetuned on 100 digits
    5–9), each with (0.3/2)‖θ‖², trained to their minima in float64, scored with exact solves: the check's predicted removals (ε = −1/m of
    the pretraining objective, carried through the finetuning's implicit response) match retraining both stages to
    their minima without each group, every kept example keeping its weight 1/m — the units a 1/m, sum-vs-mean or
    per-test error of a chain's removal would break."""
    x, y = digits()
    low, high = (y <= 4).nonzero()[:, 0], (y >= 5).nonzero()[:, 0]
    pre_data, fin_data, test = (x[low[:150]], y[low[:150]]), (x[high[:100]], y[high[:100]] - 5), \
        (x[high[100:120]], y[high[100:120]] - 5)
    torch.manual_seed(0)
    pre = ik.Stage(Body().double(), cross_entropy, pre_data, regularizer=l2(WEIGHT))
    fit_lbfgs(pre, max_iter=2000)
    assert newton_refine(pre, steps=6) < 1e-10
    torch.manual_seed(1)
    fin_model = Body().double()
    fin_model.body.load_state_dict(pre.model.body.state_dict())
    fin = ik.Stage(fin_model, cross_entropy, fin_data, params="head", regularizer=l2(WEIGHT))
    fit_lbfgs(fin, max_iter=2000)
    assert newton_refine(fin, steps=6) < 1e-10
    res = ik.score(pre, fin, None, test, shared="body", case=1, solve=ik.SolveConfig(solver="direct"), progress=False)
    m = len(pre)

    def retrain(keep: torch.Tensor, seed: int) -> float:
        model = copy.deepcopy(pre.model)
        refit = ik.Stage(model, cross_entropy, (pre_data[0][keep], pre_data[1][keep]),
                         regularizer=lambda p: m / len(keep) * l2(WEIGHT)(p))
        if len(keep) < m:
            fit_lbfgs(refit, max_iter=500)
        newton_refine(refit, steps=6)
        head = copy.deepcopy(fin.model)
        head.body.load_state_dict(model.body.state_dict())
        refit_head = ik.Stage(head, cross_entropy, fin_data, params="head", regularizer=l2(WEIGHT))
        newton_refine(refit_head, steps=6)
        with torch.no_grad():
            return float(cross_entropy(head(test[0]), test[1]).sum())

    check = check_retraining(res, retrain, k=3, seeds=1, random=1, progress=False)
    table = check.table.set_index("group")
    assert table.loc["most harmful", "actual"] < 0 < table.loc["most helpful", "actual"]
    # first order in the removal: the most harmful group's second-order part is about a fifth of it (−0.077 against
    # −0.098), well inside the factor 2 or more that a wrong 1/m, a sum for a mean or a per-test count would make
    np.testing.assert_allclose(table["actual"], table["predicted"], rtol=0.3)


def recorded_descent():
    """A recorded run of mini-batch SGD with momentum on a float64 softmax regression (24 examples, batches of 6)
    and the retraining a user would write: the same loop on a loader reshuffled by the seed."""
    from torch import nn

    from influkit.unrolled import SGD, Record

    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(24, 4, generator=gen), torch.randint(0, 3, (24,), generator=gen)
    test = (torch.randn(6, 4, generator=gen), torch.randint(0, 3, (6,), generator=gen))

    def trained(keep, seed, record=None):
        torch.manual_seed(0)
        model = nn.Linear(4, 3).double().eval()
        stage = ik.Stage(model, cross_entropy, (x[keep], y[keep]), regularizer=l2(1e-2))
        (record if record is not None else Record()).train(stage, SGD(lr=0.3, momentum=0.5), steps=20, batch_size=6, seed=seed)
        return float(cross_entropy(model(test[0]), test[1]).sum())

    record = Record()
    trained(torch.arange(24), 0, record)
    return record, test, trained


def test_a_recorded_run_gets_its_replayed_counterfactual_beside_the_users_retraining():
    record, test, retrain = recorded_descent()
    result = ik.unrolled.metagradients(record, test)[0]
    check = check_retraining(result, retrain, k=2, seeds=3, random=1, record=record, test=test, progress=False)
    table = check.table.set_index("group")
    for name, members in (("most harmful", torch.argsort(result.values, descending=True)[:2]),
                          ("most helpful", torch.argsort(result.values)[:2])):
        weights = torch.ones(24, dtype=torch.float64)
        weights[members] = 0
        replayed = float(ik.unrolled.outputs(record, test, [weights]).sum() - ik.unrolled.outputs(record, test).sum())
        assert table.loc[name, "replayed"] == pytest.approx(replayed, rel=1e-12)
        assert np.sign(table.loc[name, "replayed"]) == np.sign(table.loc[name, "predicted"])  # as predicted
    assert check.noise_floor > 0  # the user's reshuffled reruns move the measure with nothing removed


def test_one_seed_says_why_it_has_no_noise_floor_and_a_record_alone_needs_no_retrain():
    record, test, retrain = recorded_descent()
    result = ik.unrolled.metagradients(record, test)[0]
    with pytest.warns(UserWarning, match="one seed .* gives no noise floor.*seeds=2 or more"):
        check = check_retraining(result, retrain, k=2, seeds=[0], random=0, progress=False)
    assert np.isnan(check.noise_floor)
    alone = check_retraining(result, None, k=2, random=0, record=record, test=test, progress=False)
    assert alone.table["replayed"].notna().all() and alone.table["actual"].isna().all() and alone.runs.empty
    with pytest.raises(ik.InputError, match="retrain .* record"):
        check_retraining(result, None, progress=False)
