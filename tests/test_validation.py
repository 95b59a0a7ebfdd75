import numpy as np
import pandas as pd
import pytest
import torch

import influkit as ik
from influkit.validation import Retrainer, leave_out_retrain, loo_corr, pearson, sign_agreement, spearman, top_k_overlap
from conftest import need
from test_multistage import ALPHA, build


def test_metrics_against_scipy():
    stats = need("scipy.stats")
    rng = np.random.default_rng(0)
    p = rng.normal(size=50)
    a = p + rng.normal(scale=0.5, size=50)
    assert pearson(p, a) == pytest.approx(stats.pearsonr(p, a)[0], abs=1e-12)
    assert spearman(p, a) == pytest.approx(stats.spearmanr(p, a)[0], abs=1e-12)
    assert sign_agreement([1, -1, 2, 3], [2, 1, 1, -1]) == 0.5
    assert top_k_overlap([4, 3, 2, 1], [1, 3, 4, 2], k=2) == 0.5
    summary = loo_corr(p, a)
    assert summary["n"] == 50 and summary["pearson"] == pytest.approx(pearson(p, a))
    with pytest.raises(ik.InputError):
        pearson([1, 2, 3], [1, 2])
    with pytest.raises(ik.InputError):
        pearson([1, 2, float("nan")], [1, 2, 3])


@pytest.fixture(scope="module", params=[1, 2])
def harness_problem(request):
    case = request.param
    pre, fin, test = build(case, n_pretrain=400, teacher=True)  # removing 1 of 400 is a small, near-linear perturbation
    res = ik.score(pre, fin, torch.arange(400), test, shared="embedding", case=case, alpha=ALPHA,
                   solve=ik.SolveConfig(solver="direct", damping=0.0), progress=False)
    chain = ik.Chain([pre, fin], [ik.Link("embedding", case=case, alpha=ALPHA)])
    retrainer = Retrainer(optimizer="newton", tol=1e-12, max_steps=200, keep_weights=False)
    return case, pre, fin, test, res, chain, retrainer


def test_harness_agrees_with_scores_on_a_well_posed_problem(harness_problem):
    case, pre, fin, test, res, chain, retrainer = harness_problem
    removals = torch.argsort(res.values.abs(), descending=True)[:8].tolist() + [101, 207, 322, 341]
    frame = leave_out_retrain(chain, removals, test, retrainer, predicted=res, progress=False)
    assert list(frame.columns) == ["removed", "test_loss", "actual", "grad_norm", "predicted"]
    assert pearson(frame["predicted"], frame["actual"]) >= 0.99
    # the originals were not touched
    again = ik.score(pre, fin, torch.arange(400), test, shared="embedding", case=case, alpha=ALPHA,
                     solve=ik.SolveConfig(solver="direct", damping=0.0), progress=False)
    assert torch.allclose(again.values, res.values)


def test_group_removal_sums_predictions(harness_problem):
    case, pre, fin, test, res, chain, retrainer = harness_problem
    frame = leave_out_retrain(chain, [[3, 9]], test, retrainer, predicted=res, progress=False)
    assert frame["removed"].tolist() == ["3+9"]
    assert frame["predicted"].iloc[0] == pytest.approx(float(res.removal[3] + res.removal[9]))


def test_resume_after_interruption_gives_identical_rows(tmp_path, harness_problem):
    case, pre, fin, test, res, chain, retrainer = harness_problem
    log = tmp_path / "loo.csv"
    removals = [0, 5, 11, 13]
    whole = leave_out_retrain(chain, removals, test, retrainer, progress=False)

    calls = []

    def interrupted(c, keep):
        if len(calls) == 3:  # baseline + two removals done, then the run dies
            raise KeyboardInterrupt
        calls.append(keep)
        return retrainer(c, keep)

    with pytest.raises(KeyboardInterrupt):
        leave_out_retrain(chain, removals, test, interrupted, log=log, progress=False)
    assert len(pd.read_csv(log)) == 3
    calls.clear()
    resumed = leave_out_retrain(chain, removals, test, lambda c, k: (calls.append(k), retrainer(c, k))[1], log=log, progress=False)
    assert len(calls) == 2  # only the two missing removals were retrained
    pd.testing.assert_frame_equal(resumed, whole)
