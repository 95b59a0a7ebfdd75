"""influkit.ensemble: scores averaged over independently trained chains."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import influkit as ik
from influkit.ensemble import Ensemble, average
from influkit.training import fit_lbfgs, newton_refine

from conftest import cross_entropy, l2


class Net(nn.Module):
    def __init__(self, n_out: int):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(6, 4), nn.Tanh())
        self.head = nn.Linear(4, n_out)

    def forward(self, x):
        return self.head(self.enc(x))


def _data(n: int, n_out: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, 6, generator=gen), torch.randint(0, n_out, (n,), generator=gen)


def _chain(init_seed: int, n_pretrain: int = 20) -> ik.Chain:
    """A Case 1 pretrain → finetune chain trained to stationarity from the initialization seeded by init_seed."""
    torch.manual_seed(init_seed)
    pre_model, fin_model = Net(3).double().eval(), Net(2).double().eval()
    pre = ik.Stage(pre_model, cross_entropy, _data(n_pretrain, 3, 0), regularizer=l2(1e-2))
    fit_lbfgs(pre, max_iter=500)
    newton_refine(pre)
    fin_model.enc.load_state_dict(pre_model.enc.state_dict())
    fin = ik.Stage(fin_model, cross_entropy, _data(16, 2, 1), params="head", regularizer=l2(1e-2))
    fit_lbfgs(fin, max_iter=500)
    newton_refine(fin)
    return ik.Chain([pre, fin], [ik.Link("enc", case=1)], solve=ik.SolveConfig(solver="direct"))


@pytest.fixture(scope="module")
def chains():
    return [_chain(seed) for seed in range(3)]


TEST = _data(5, 2, 2)


@pytest.mark.parametrize("per_test", [False, True])
def test_ensemble_is_the_mean_of_its_members(chains, per_test):
    members = [c.query(TEST, per_test=per_test).scores().values for c in chains]
    assert not torch.allclose(members[0], members[1])  # different optima: the average is not trivial
    result = Ensemble(chains).scores(x_test=TEST, per_test=per_test, progress=False)
    torch.testing.assert_close(result.values, torch.stack(members).mean(0), rtol=1e-12, atol=1e-14)
    assert result.values.shape == members[0].shape
    torch.testing.assert_close(result.removal, -result.values / 20)
    assert result.diagnostics["K"] == 3 and len(result.diagnostics["members"]) == 3


def test_ensemble_of_one_equals_the_chain(chains):
    alone = chains[0].query(TEST, per_test=True).scores(torch.arange(7))
    one = Ensemble(chains[:1]).scores(torch.arange(7), TEST, per_test=True, progress=False)
    torch.testing.assert_close(one.values, alone.values, rtol=0, atol=0)
    assert torch.equal(one.index, alone.index)


def test_members_with_other_example_counts_are_refused(chains):
    with pytest.raises(ik.InfluenceError, match="different numbers of examples"):
        Ensemble([chains[0], _chain(0, n_pretrain=18)])
    with pytest.raises(ik.InfluenceError, match="at least one chain"):
        Ensemble([])
    with pytest.raises(ik.InfluenceError, match="must be an influkit Chain"):
        Ensemble([chains[0], "chain"])


def test_average_refuses_results_over_other_examples(chains):
    query = chains[0].query(TEST)
    with pytest.raises(ik.InfluenceError, match="shape"):
        average([query.scores(torch.arange(5)), query.scores(torch.arange(6))])
    with pytest.raises(ik.InfluenceError, match="other examples"):
        average([query.scores(torch.arange(5)), query.scores(torch.arange(1, 6))])


def test_ensemble_attributes_the_measure_given(chains):
    """measure= reaches every member: the ensemble of one with a margin measure is that chain's margin scores."""
    def margin(logits, y):
        true = logits.gather(1, y[:, None])[:, 0]
        return true - logits.masked_fill(torch.nn.functional.one_hot(y, logits.shape[1]).bool(), -torch.inf).amax(1)

    alone = chains[0].query(TEST, measure=margin).scores(torch.arange(4))
    one = Ensemble(chains[:1]).scores(torch.arange(4), TEST, measure=margin, progress=False)
    torch.testing.assert_close(one.values, alone.values, rtol=0, atol=0)
    loss = Ensemble(chains[:1]).scores(torch.arange(4), TEST, progress=False)
    assert not torch.allclose(one.values, loss.values)
    with pytest.raises(ik.InfluenceError, match="x_test is required"):
        Ensemble(chains).scores(torch.arange(4))
