"""influkit.scoring: both scoring methods size their chunks from the memory budget when no chunk_size is given."""

from __future__ import annotations

import torch
from torch import nn

import influkit as ik
from influkit.gradients import per_example_grads

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
