"""``Chain.query(measure=...)``: any differentiable test function, against explicit-Hessian formulas in float64."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import influkit as ik
from conftest import cross_entropy, l2
from influkit.gradients import per_example_grads_serial
from influkit.training import fit_lbfgs
from influkit.validation.reference import explicit_hessian, explicit_measure_grads
from test_multistage import ALPHA, build, explicit_scores


def margin(logits, y):
    """The docstring's example: logit of the true class minus the largest other logit."""
    true = torch.arange(logits.shape[-1]) == y[:, None]
    other = logits.masked_fill(true, float("-inf")).amax(-1)
    return logits.gather(-1, y[:, None]).squeeze(-1) - other


def log_prob_of_class_1(logits, y):
    return torch.log_softmax(logits, -1)[:, 1]


@pytest.fixture(scope="module", params=[1, 2])
def problem(request):
    case = request.param
    pre, fin, test = build(case)
    return case, pre, fin, test, torch.arange(0, 60, 3)


@pytest.mark.parametrize("measure", [margin, log_prob_of_class_1])
def test_measure_matches_explicit_formulas_case_1_and_2(problem, measure):
    """Case 1 and Case 2, per test example and summed: the measure's gradient replaces the test loss's everywhere,
    the Case 1 term b (direct derivative through the fixed shared block) included."""
    case, pre, fin, test, z = problem
    expected = explicit_scores(pre, fin, z, test, case, measure=measure)
    chain = ik.Chain([pre, fin], [ik.Link("embedding", case=case, alpha=ALPHA)], solve=ik.SolveConfig(solver="direct"))
    per = chain.query(test, measure=measure, per_test=True).scores(z)
    assert per.values.shape == (len(z), len(test[0]))
    assert (per.values - expected).norm() / expected.norm() <= 1e-8
    summed = chain.query(test, measure=measure).scores(z)
    assert (summed.values - expected.sum(1)).norm() / expected.sum(1).norm() <= 1e-8
    loss = explicit_scores(pre, fin, z, test, case)
    assert (loss - expected).norm() / expected.norm() > 0.1  # the measure is not the loss: the test can tell
    via_score = ik.score(pre, fin, z, test, shared="embedding", case=case, alpha=ALPHA, measure=measure,
                         solve=ik.SolveConfig(solver="direct"))
    torch.testing.assert_close(via_score.values, summed.values, rtol=1e-10, atol=1e-12)


def test_default_measure_is_the_loss(problem):
    case, pre, fin, test, z = problem
    chain = ik.Chain([pre, fin], [ik.Link("embedding", case=case, alpha=ALPHA)], solve=ik.SolveConfig(solver="direct"))
    explicit = chain.query(test, measure=cross_entropy, per_test=True).scores(z).values
    default = chain.query(test, per_test=True).scores(z).values
    torch.testing.assert_close(explicit, default, rtol=1e-12, atol=1e-14)


def test_single_stage_measure_matches_explicit_hessian():
    torch.manual_seed(0)
    x, y = torch.randn(50, 4, dtype=torch.float64), torch.randint(0, 3, (50,))
    stage = ik.Stage(nn.Linear(4, 3).double(), cross_entropy, (x, y), regularizer=l2(1e-2))
    fit_lbfgs(stage, max_iter=300)
    test = torch.randn(6, 4, dtype=torch.float64), torch.randint(0, 3, (6,))
    z = torch.arange(0, 50, 5)
    g_t = explicit_measure_grads(stage, margin, *test)
    g_z = per_example_grads_serial(stage, *stage.data.take(z))
    expected = -g_z @ torch.linalg.solve(explicit_hessian(stage), g_t.T)
    for solver in ("direct", "minres"):
        got = ik.influence(stage, z, test, measure=margin, per_test=True, solve=ik.SolveConfig(solver=solver))
        assert (got.values - expected).norm() / expected.norm() <= 1e-8, solver


class TinyLM(nn.Module):
    """Next-token logits (B, L, V) of a bag-of-one-token model: small enough for an explicit Hessian."""

    def __init__(self, vocab=5, dim=3):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.out = nn.Linear(dim, vocab)

    def forward(self, tokens):
        return self.out(torch.tanh(self.embed(tokens)))


def sequence_nll(logits, labels):
    """Per-sequence next-token NLL; labels −100 where no loss (the docstring's completion NLL)."""
    return F.cross_entropy(logits[:, :-1].transpose(1, 2), labels[:, 1:], ignore_index=-100, reduction="none").sum(-1)


def test_completion_nll_with_the_prompt_masked():
    """The README's second example: a completion's NLL, prompt tokens masked with −100, on a tiny language model."""
    torch.manual_seed(1)
    tokens = torch.randint(0, 5, (40, 6))
    stage = ik.Stage(TinyLM().double(), sequence_nll, (tokens, tokens), regularizer=l2(1e-2))
    fit_lbfgs(stage, max_iter=300)
    prompts = torch.randint(0, 5, (4, 6))
    labels = prompts.clone()
    labels[:, :3] = -100  # the first three tokens are the prompt: no loss on them
    z = torch.arange(0, 40, 4)
    g_t = explicit_measure_grads(stage, sequence_nll, prompts, labels)
    g_z = per_example_grads_serial(stage, *stage.data.take(z))
    expected = -g_z @ torch.linalg.solve(explicit_hessian(stage), g_t.T)
    got = ik.influence(stage, z, (prompts, labels), measure=sequence_nll, per_test=True,
                       solve=ik.SolveConfig(solver="direct"))
    assert (got.values - expected).norm() / expected.norm() <= 1e-8
    unmasked = ik.influence(stage, z, (prompts, prompts), per_test=True, solve=ik.SolveConfig(solver="direct"))
    assert (unmasked.values - got.values).norm() / got.values.norm() > 0.05  # masking the prompt changes the scores


def test_measure_errors_and_fingerprint(problem):
    case, pre, fin, test, z = problem
    chain = ik.Chain([pre, fin], [ik.Link("embedding", case=case, alpha=ALPHA)], solve=ik.SolveConfig(solver="direct"))
    with pytest.raises(ik.LossError, match="measure"):
        chain.query(test, measure=lambda out, y: out.sum())  # one value for the batch, not one per example
    with pytest.raises(ik.InputError, match="measure must be callable"):
        chain.query(test, measure="margin")
    assert chain.query(test, measure=margin).fingerprint() != chain.query(test).fingerprint()
