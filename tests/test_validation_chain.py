"""Leave-out retraining of a whole chain (influkit/validation/retrain.py, loo.py) on a tiny float64 3-stage chain.

Ground truths: (1) the retrained chain satisfies every stage's stationarity condition, written out here by hand
(removed examples gone from stage 1, Case 1 blocks equal to the retrained previous stage, Case 2 proximal term
centred at the retrained previous stage); (2) influence is the first-order term of leave-out retraining: with
stage 1's data repeated r times the optimum, the Hessians and the scores do not change, removing one copy of z
is ε = −1/(r·n), so the relative gap between the actual change and −I/(r·n) must shrink like 1/r.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn
from torch.func import functional_call

import influkit as ik
from influkit.training import fit_lbfgs, newton_fit
from influkit.links import StagePlan
from influkit.validation import Retrainer, leave_out_retrain
from influkit.validation.retrain import kept
from conftest import cross_entropy as ce, l2 as l2_of

ALPHA = 0.05
DECAY = 0.02  # every stage of every link combination ends at a minimum that is not the all-zero one (measured)
ENC, ADAPTER, HEAD = ["enc.weight", "enc.bias"], ["adapter.weight", "adapter.bias"], ["head.weight", "head.bias"]


class Net(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.enc = nn.Linear(4, 3, dtype=torch.float64)
        self.adapter = nn.Linear(3, 3, dtype=torch.float64)
        self.head = nn.Linear(3, 2, dtype=torch.float64)

    def forward(self, x):
        return self.head(torch.tanh(self.adapter(torch.tanh(self.enc(x)))))


l2 = l2_of(DECAY)  # the regularizer every stage here trains with


def data(seed: int, n: int = 24):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=gen, dtype=torch.float64)
    y = (x[:, 0] + 0.5 * x[:, 1] * x[:, 2] + 0.3 * torch.randn(n, generator=gen, dtype=torch.float64) > 0).long()
    return x, y


def build_chain(cases, repeat: int = 1) -> tuple[ik.Chain, tuple]:
    """Pretrain (all) → adapt (link 1 shares enc) → finetune (link 2 shares enc + adapter), trained to ‖∇‖ ≤ 1e-12."""
    x0, y0 = data(10, n=20)
    sets = [(x0.repeat(repeat, 1), y0.repeat(repeat)), data(11), data(12)]
    trained = [
        None,
        (ADAPTER + HEAD) if cases[0] == 1 else None,
        HEAD if cases[1] == 1 else None,
    ]
    inherited = [[], ENC, ENC + ADAPTER]
    links = [ik.Link("enc", case=cases[0], alpha=ALPHA), ik.Link({"enc": "enc", "adapter": "adapter"}, case=cases[1], alpha=ALPHA)]
    stages, plans = [], []
    for k in range(3):
        model = Net(k)
        if k:
            with torch.no_grad():
                previous = dict(stages[-1].model.named_parameters())
                for name, p in model.named_parameters():
                    if name in inherited[k]:
                        p.copy_(previous[name])
        stage = ik.Stage(model, ce, sets[k], params=trained[k], regularizer=l2)
        plans.append(StagePlan(stage, links[k - 1] if k else None, plans[-1] if k else None))
        objective = plans[-1].objective(stage, stages[-1].state() if k else None)
        fit_lbfgs(objective, max_iter=500, tol=1e-10, restarts=2)
        assert newton_fit(objective, tol=1e-12) <= 1e-12
        stages.append(stage)
    return ik.Chain(stages, links, solve=ik.SolveConfig(solver="direct")), data(13, n=10)


CASES = list(itertools.product((1, 2), (1, 2)))


def grad_norm(f, params: dict) -> float:
    g = torch.func.grad(f)(params)
    return float(torch.sqrt(sum((v**2).sum() for v in g.values())))


@pytest.mark.parametrize("cases", CASES, ids=[f"links{a}{b}" for a, b in CASES])
def test_retrained_chain_is_stationary_at_the_right_points(cases):
    chain, _ = build_chain(cases)
    originals = [{n: t.clone() for n, t in s.state().items()} for s in chain.stages]
    removed = torch.tensor([2, 5, 11])
    stages, norms = Retrainer()(chain, kept(20, removed))
    assert max(norms) <= 1e-10
    for stage, before in zip(chain.stages, originals):  # the chain itself is untouched
        assert all(torch.equal(stage.state()[n], t) for n, t in before.items())
    states = [s.state() for s in stages]
    keep = torch.ones(20, dtype=torch.bool)
    keep[removed] = False
    x, y = chain.stages[0].data.take(keep.nonzero().reshape(-1))

    # stage 1: (1/m) Σ over the kept examples + R (each kept example keeps its weight), stationary everywhere
    def f1(p):
        return ce(functional_call(stages[0].model, p, (x,)), y).sum() / 20 + l2(p)
    assert grad_norm(f1, dict(states[0])) <= 1e-9
    # stages 2 and 3: Case 1 blocks equal the retrained previous stage; Case 2 blocks stationary with the
    # proximal term centred there
    shared = [None, ENC, ENC + ADAPTER]
    for k in (1, 2):
        previous, state, case = states[k - 1], states[k], cases[k - 1]
        xk, yk = chain.stages[k].data.take(torch.arange(len(chain.stages[k])))
        if case == 1:
            assert all(torch.equal(state[n], previous[n]) for n in shared[k])
            free = [n for n in state if n not in shared[k] and n in chain.plans[k].trained]
        else:
            free = list(chain.plans[k].trained)
            moved = max(float((state[n] - originals[k][n]).abs().max()) for n in shared[k])
            assert moved > 1e-6  # the shared block did follow the change of the previous stage

        def fk(p, k=k, case=case, free=free):
            full = dict(state) | p
            value = ce(functional_call(stages[k].model, full, (xk,)), yk).mean()
            value = value + l2({n: full[n] for n in chain.stages[k].param_names})
            if case == 2:
                value = value + ALPHA * sum(((full[n] - previous[n]) ** 2).sum() for n in shared[k])
            return value

        assert grad_norm(fk, {n: state[n] for n in free}) <= 1e-9, (k, case)


@pytest.mark.parametrize("cases", CASES, ids=[f"links{a}{b}" for a, b in CASES])
def test_leave_out_change_matches_influence_to_first_order(cases):
    z = [1, 7, 13]
    gaps = {}
    for repeat in (2, 8):
        chain, test = build_chain(cases, repeat)
        res = chain.query(test).scores(torch.tensor(z))
        frame = leave_out_retrain(chain, z, test, predicted=res, progress=False)
        assert (frame["grad_norm"] <= 1e-10).all()
        actual, predicted = torch.tensor(frame["actual"].values), torch.tensor(frame["predicted"].values)
        assert torch.equal(predicted, res.removal.double())
        gaps[repeat] = (actual - predicted).abs() / predicted.abs()
    # first order: the relative gap is O(1/(r·n)), so 4× the data cuts it ~4× (measured 3.9–5.4×) for every z
    assert (gaps[8] < 0.1).all(), gaps
    assert (gaps[8] < 0.35 * gaps[2]).all(), gaps


def test_groups_log_resume_and_lbfgs():
    chain, test = build_chain((2, 1))
    res = chain.query(test).scores()
    removals = [3, [4, 9], (0, 1, 2)]
    frame = leave_out_retrain(chain, removals, test, predicted=res, progress=False)
    assert list(frame["removed"]) == ["3", "4+9", "0+1+2"]
    removal = res.removal.double()
    assert frame["predicted"].tolist() == pytest.approx([float(removal[3]), float(removal[4] + removal[9]),
                                                         float(removal[:3].sum())], rel=1e-12)
    lbfgs = leave_out_retrain(chain, removals, test, Retrainer(optimizer="lbfgs", max_steps=500, tol=1e-9),
                                    progress=False)
    # L-BFGS's line search stalls near ‖∇‖ ~ 5e-8 here (measured), so it agrees with Newton to ~1e-6
    assert (lbfgs["grad_norm"] <= 1e-6).all()
    torch.testing.assert_close(torch.tensor(lbfgs["actual"].values), torch.tensor(frame["actual"].values),
                               rtol=0, atol=2e-6)


def test_log_rows_are_reused(tmp_path):
    chain, test = build_chain((1, 2))
    log = tmp_path / "runs.csv"
    first = leave_out_retrain(chain, [0, 5], test, log=log, progress=False)
    # a recipe that cannot reach the optimum would give other numbers: equal frames prove the log was read
    again = leave_out_retrain(chain, [0, 5], test, Retrainer(optimizer="lbfgs", max_steps=1), log=log, progress=False)
    assert again["actual"].tolist() == first["actual"].tolist()
    assert len(log.read_text().splitlines()) == 1 + 3  # header, baseline, two removals


def test_errors():
    with pytest.raises(ik.InputError, match="unknown optimizer"):
        Retrainer(optimizer="adam")
    chain, test = build_chain((1, 1))
    with pytest.raises(ik.InputError, match="not indices"):
        leave_out_retrain(chain, [20], test, progress=False)
    with pytest.raises(ik.InputError, match="empty"):
        leave_out_retrain(chain, [], test, progress=False)
