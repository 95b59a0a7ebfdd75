"""influkit.apps.objectives: the per-example cross-entropy and the L2 regularizer."""

from __future__ import annotations

import torch

from influkit.apps.objectives import cross_entropy, l2


def test_cross_entropy_is_per_example_and_averages_to_torchs_mean():
    gen = torch.Generator().manual_seed(0)
    logits, y = torch.randn(7, 4, generator=gen), torch.randint(0, 4, (7,), generator=gen)
    per = cross_entropy(logits, y)
    assert per.shape == (7,)
    torch.testing.assert_close(per.mean(), torch.nn.functional.cross_entropy(logits, y))


def test_l2_is_half_weight_times_squared_norm_with_hessian_weight_identity():
    params = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([[3.0]])}
    assert float(l2(0.1)(params)) == 0.5 * 0.1 * 14.0
    h = torch.func.hessian(lambda v: l2(0.3)({"v": v}))(torch.zeros(3))
    torch.testing.assert_close(h, 0.3 * torch.eye(3))
