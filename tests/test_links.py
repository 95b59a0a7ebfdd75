"""influkit/links.py: the one place that decides how a stage inherits the shared block. The chain's Hessian of each
stage is the Hessian of the plan's objective, written out here by hand (loss + L2 [+ α‖S − S̄‖²]); receive() copies
or moves the block as documented."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, hessian

import influkit as ik
from influkit.curvature import HessianOperator
from influkit.links import StagePlan
from conftest import cross_entropy as ce, l2 as l2_of

ALPHA, DECAY = 0.07, 0.03
l2 = l2_of(DECAY)


class Net(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.enc = nn.Linear(3, 2, dtype=torch.float64)
        self.head = nn.Linear(2, 2, dtype=torch.float64)

    def forward(self, x):
        return self.head(torch.tanh(self.enc(x)))


def stages(case: int):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(12, 3, generator=gen, dtype=torch.float64)
    y = (x[:, 0] > 0).long()
    pre = ik.Stage(Net(0), ce, (x, y), regularizer=l2)
    fin_model = Net(1)
    with torch.no_grad():
        fin_model.enc.weight.copy_(pre.model.enc.weight + (0.0 if case == 1 else 0.1))
        fin_model.enc.bias.copy_(pre.model.enc.bias)
    fin = ik.Stage(fin_model, ce, (x[:8] * 2, 1 - y[:8]), params="head" if case == 1 else None, regularizer=l2)
    return pre, fin


@pytest.mark.parametrize("case", [1, 2])
def test_the_chains_hessian_is_the_plans_objective_written_by_hand(case):
    pre, fin = stages(case)
    chain = ik.Chain([pre, fin], [ik.Link("enc", case=case, alpha=ALPHA)], solve=ik.SolveConfig(solver="direct"))
    plan = chain.plans[1]
    assert plan.trained == (["head.weight", "head.bias"] if case == 1 else ["enc.weight", "enc.bias", "head.weight", "head.bias"])
    assert plan.fixed == (["enc.weight", "enc.bias"] if case == 1 else [])
    state, centre = fin.state(), pre.state()
    x, y = fin.data.take(torch.arange(len(fin)))

    def objective(p):
        full = dict(state) | p
        value = ce(functional_call(fin.model, full, (x,)), y).mean() + l2({n: full[n] for n in fin.param_names})
        if case == 2:
            value = value + ALPHA * sum(((full[n] - centre[n]) ** 2).sum() for n in ("enc.weight", "enc.bias"))
        return value

    params = {n: state[n] for n in plan.trained}
    blocks = hessian(objective)(params)
    dense = torch.cat([torch.cat([blocks[a][b].reshape(params[a].numel(), params[b].numel()) for b in params], 1)
                       for a in params])
    torch.testing.assert_close(chain.operator(1).dense(), dense, rtol=1e-12, atol=1e-12)
    stage = plan.objective(fin, centre)
    torch.testing.assert_close(HessianOperator(stage).dense(), dense, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(stage.objective(), objective(params), rtol=1e-14, atol=0)  # the centre is S̄


def test_receive_copies_case_1_and_moves_a_warm_case_2_block():
    pre, fin = stages(2)
    moved = {n: t + 0.5 for n, t in pre.state().items()}
    for case in (1, 2):
        plan = StagePlan(stages(case)[1], ik.Link("enc", case=case, alpha=ALPHA), StagePlan(pre))
        model = Net(1)
        own = {n: p.detach().clone() for n, p in model.named_parameters()}
        plan.receive(model, moved, pre.state())
        after = dict(model.named_parameters())
        for n in ("enc.weight", "enc.bias"):
            expected = moved[n] if case == 1 else own[n] + 0.5
            torch.testing.assert_close(after[n].detach(), expected, rtol=0, atol=1e-15)
        assert torch.equal(after["head.weight"].detach(), own["head.weight"])  # only the block is inherited
        plan.receive(model, moved)  # no original: a fresh start at the previous values, either case
        assert all(torch.equal(after[n].detach(), moved[n]) for n in ("enc.weight", "enc.bias"))


def test_plain_finetuning_is_case_2_without_a_proximal_term_and_bad_weights_are_refused():
    link = ik.Link.finetune("enc")
    assert link == ik.Link("enc", case=2, alpha=0.0) and link.plain and not ik.Link("enc", case=2).plain
    pre, fin = stages(2)
    plan = StagePlan(fin, link, StagePlan(pre), inherit=True)
    assert plan.trained == ["enc.weight", "enc.bias", "head.weight", "head.bias"] and plan.fixed == []
    assert float(plan.proximal(fin.state())) == 0.0  # the objective has no proximal term
    assert torch.equal(fin.model.enc.weight, pre.model.enc.weight)  # it starts from the previous stage's block
    for alpha in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ik.InputError, match="alpha ≥ 0"):
            ik.Link("enc", case=2, alpha=alpha)


def test_the_chain_refuses_plain_finetuning_naming_the_recorded_run():
    pre, fin = stages(2)
    with pytest.raises(ik.InputError, match=r"metagradients\(record, test\)") as refused:
        ik.Chain([pre, fin], [ik.Link.finetune("enc")])
    assert "does not depend on the previous stage's shared block" in str(refused.value)
