"""The one chain retrainer (influkit/validation/retrain.py) against the two-stage leave-out procedure written out by
hand on real digits chains, Case 1 and Case 2: re-run pretraining without the removed digits by Newton steps from
the trained weights; Case 1 copies the re-trained embedding W into the finetuned model and re-trains the head Θ;
Case 2 moves the finetuned W by the change of the pretrained W̄ and re-trains (W, Θ) with α‖W − W̄′‖² centred at
the re-trained W̄′. Both are deterministic (float64, the same Newton preconditioners), so the removal effects must
be equal, not close."""

from __future__ import annotations

import copy

import pytest
import torch

from influkit.apps.digits import DigitsSetup, train_stages
from influkit.chain import Chain
from influkit.errors import InputError
from influkit.stage import Stage
from influkit.training import newton_fit
from influkit.validation import Retrainer, leave_out_retrain
from influkit.validation.loo import summed_test_loss
from influkit.validation.retrain import kept

REMOVALS = [7, [3, 11]]  # one example, and a group of two


@pytest.fixture(scope="module")
def trained():
    """trained(case): (setup, split, pre, fin) of a small digits problem, trained once per case for this module."""
    cache = {}

    def get(case):
        if case not in cache:
            setup = DigitsSetup(case=case, n_pretrain=20, n_finetune=20, n_test=10, channels=(2, 4))
            split = setup.split()
            cache[case] = (setup, split, *train_stages(setup, split))
        return cache[case]

    return get


def by_hand(setup: DigitsSetup, pre: Stage, fin: Stage, group, test) -> float:
    """f(T) after re-training both stages without ``group`` (None: nothing removed), written out step by step."""
    pre_copy = pre.with_(model=copy.deepcopy(pre.model))
    fin_model = copy.deepcopy(fin.model)
    pretrain = pre_copy if group is None else pre_copy.without(torch.tensor(group))
    newton_fit(pretrain, factor=setup.factors[0], tol=setup.tol, max_steps=100)
    before, after = pre.state(), pre_copy.state()
    shared = [n for n, _ in fin_model.named_parameters() if n.startswith("embedding.")]
    named = dict(fin_model.named_parameters())
    with torch.no_grad():
        for n in shared:
            if setup.case == 1:
                named[n].copy_(after[n])
            else:
                named[n].add_(after[n] - before[n])
    finetune = fin.with_(model=fin_model)
    if setup.case == 2:
        centre = {n: after[n].clone() for n in shared}
        own, alpha = fin.regularizer, setup.alpha
        finetune = Stage(fin_model, fin.loss, fin._data, params=fin.param_names, batch_size=fin.data.batch_size,
                         regularizer=lambda p: own(p) + alpha * sum(((p[n] - c) ** 2).sum() for n, c in centre.items()))
    newton_fit(finetune, factor=setup.factors[1], tol=setup.tol, max_steps=100)
    return summed_test_loss(finetune, test)


@pytest.mark.parametrize("case", [1, 2])
def test_leave_out_through_the_retrainer_equals_the_two_stage_procedure(case, trained):
    setup, split, pre, fin = trained(case)
    chain = Chain([pre, fin], [setup.link()])
    frame = leave_out_retrain(chain, REMOVALS, split.test, setup.retrainer(), progress=False)
    baseline = by_hand(setup, pre, fin, None, split.test)
    expected = [by_hand(setup, pre, fin, g if isinstance(g, list) else [g], split.test) - baseline for g in REMOVALS]
    assert frame["actual"].tolist() == expected  # exact: the same deterministic computation
    assert min(abs(v) for v in expected) > 1e-6  # the removals do change the finetuned test loss


def test_kept_is_the_sorted_complement_and_bad_input_is_refused(trained):
    assert kept(6, [4, 1]).tolist() == [0, 2, 3, 5] and kept(6, None) is None and kept(6, []) is None
    setup, _, pre, fin = trained(1)
    chain = Chain([pre, fin], [setup.link()])
    with pytest.raises(InputError, match="unknown optimizer"):
        Retrainer(optimizer="sgd")
    with pytest.raises(InputError, match="init must be"):
        Retrainer(init="cold")
    with pytest.raises(InputError, match="indices of the 20 stage-1 examples"):
        Retrainer()(chain, torch.tensor([3, 20]))
