"""influkit.scoring: both scoring methods size their chunks from the memory budget when no chunk_size is given."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import influkit as ik
from influkit.gradients import per_example_grads
from influkit.scoring import Rows, Scorer, score_rows

from conftest import cross_entropy, digits, l2


def test_per_example_scoring_without_chunk_size_equals_the_gradient_formula():
    """gradients="per-example" used to crash sizing its chunks (torch.func refuses the probe's saved-tensor hooks);
    its scores are −∇ℓ(z)ᵀ s for the query's s, as contraction's."""
    x, y = digits(120)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 6), nn.Tanh(), nn.Linear(6, 10)).double()
    stage = ik.Stage(model, cross_entropy, (x[:100], y[:100]), regularizer=l2(1e-2))
    query = ik.Chain([stage], solve=ik.SolveConfig(solver="direct", damping=1e-3)).query((x[100:], y[100:]))
    res = query.scores(gradients="per-example")
    assert res.diagnostics["scoring"]["gradients"] == "per-example"
    assert res.diagnostics["memory"][-1]["phase"] == "scoring" and res.diagnostics["memory"][-1]["batch"] >= 1
    expected = -(per_example_grads(stage, x[:100], y[:100]) @ query.s).reshape(res.values.shape)
    torch.testing.assert_close(res.values, expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(query.scores(gradients="contraction").values, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.filterwarnings("ignore::influkit.errors.StationarityWarning")  # an untrained model: not at a minimum
def test_query_and_scores_pass_each_example_through_the_model_once():
    """The probes that size the test gradient's and the scoring's chunks compute the first rows' gradient and scores:
    kept, not computed again — the query forwards each test example once, the scoring each scored row once — and
    the numbers are those of the gradient formula (float64)."""
    x, y = digits(120)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 6), nn.Tanh(), nn.Linear(6, 10)).double()
    seen = []

    def counted(outputs, targets):
        seen.append(outputs.shape[0])
        return cross_entropy(outputs, targets)

    stage = ik.Stage(model, counted, (x[:100], y[:100]), regularizer=l2(1e-2))
    chain = ik.Chain([stage], solve=ik.SolveConfig(solver="direct", damping=1e-3)).fit()
    chain.positions  # where the stage stands: ∇L from the dense H's products, g from a sample's forwards — not the query's
    seen.clear()
    query = chain.query((x[100:], y[100:]))
    assert sum(seen) == 20
    h = chain.operator(0).dense() + 1e-3 * torch.eye(stage.num_trained, dtype=torch.float64)
    torch.testing.assert_close(query.s, torch.linalg.solve(h, per_example_grads(stage, x[100:], y[100:]).sum(0)),
                               rtol=1e-10, atol=1e-12)
    seen.clear()
    res = query.scores()
    assert sum(seen) == 100 and res.diagnostics["scoring"]["verified"]
    expected = -(per_example_grads(stage, x[:100], y[:100]) @ query.s).reshape(res.values.shape)
    torch.testing.assert_close(res.values, expected, rtol=1e-10, atol=1e-12)
    rows = Rows.of(stage, None)
    for chunk in (1, 3):  # the probe's two rows split across chunks, and a chunk of probed and new rows
        scorer = Scorer(stage, stage.param_names, query.s, rows)
        scorer.chunk_size = chunk
        seen.clear()
        values, _ = score_rows(query.s, scorer, rows, progress=False)
        assert sum(seen) == 100 - scorer.probed.shape[0] == 98
        torch.testing.assert_close(values.reshape(res.values.shape), expected, rtol=1e-10, atol=1e-12)
