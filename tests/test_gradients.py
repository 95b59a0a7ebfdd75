import warnings

import pytest
import torch
from torch import nn

import influkit as ik

from influkit.gradients import per_example_grads, per_example_grads_serial, project_per_example_grads, total_grad


def test_chunked_vmap_equals_serial_loop(mlp_stage):
    x, y = mlp_stage.data.take(torch.arange(len(mlp_stage)))
    serial = per_example_grads_serial(mlp_stage, x, y)
    for chunk in (1, 7, 64):
        assert torch.allclose(per_example_grads(mlp_stage, x, y, chunk_size=chunk), serial, rtol=0, atol=1e-14)


def test_projection_and_total_match_the_matrix(mlp_stage):
    x, y = mlp_stage.data.take(torch.arange(len(mlp_stage)))
    g = per_example_grads_serial(mlp_stage, x, y)
    s = torch.randn(g.shape[1], 4)
    assert torch.allclose(project_per_example_grads(mlp_stage, x, y, s, chunk_size=9), g @ s, atol=1e-13)
    assert torch.allclose(total_grad(mlp_stage, x, y, chunk_size=11), g.sum(0), atol=1e-13)


def test_gradients_over_a_parameter_subset(mlp_stage):
    x, y = mlp_stage.data.take(torch.arange(10))
    names = mlp_stage.param_names[2:]
    serial = per_example_grads_serial(mlp_stage, x, y, names)
    assert serial.shape == (10, 6 * 3 + 3)
    assert torch.allclose(per_example_grads(mlp_stage, x, y, names), serial, atol=1e-14)


def _item_loss(outputs, targets):
    """A loss vmap cannot trace: it reads a Python float out of a tensor."""
    scale = 1.0 + 0.0 * outputs.detach().abs().max().item()
    return nn.functional.cross_entropy(outputs * scale, targets, reduction="none")


def _tolist_loss(outputs, targets):
    """A loss vmap cannot trace: it rebuilds the targets from a Python list."""
    labels = torch.tensor(targets.tolist(), device=outputs.device)
    return nn.functional.cross_entropy(outputs, labels, reduction="none")


@pytest.mark.parametrize("loss", [_item_loss, _tolist_loss])
def test_unvectorizable_loss_falls_back_to_a_loop_and_warns_once(mlp_stage, loss):
    stage = mlp_stage.with_(regularizer=None, loss=loss)
    attributes = dict(vars(stage))
    x, y = stage.data.take(torch.arange(12))
    with pytest.warns(ik.VectorizationWarning, match="cannot run under torch.func.vmap"):
        fast = per_example_grads(stage, x, y, chunk_size=5)
    torch.testing.assert_close(fast, per_example_grads_serial(stage, x, y), rtol=1e-12, atol=1e-14)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ik.VectorizationWarning)  # once per stage
        again = per_example_grads(stage, x, y, chunk_size=5)
    assert torch.equal(again, fast)
    assert vars(stage) == attributes  # remembered by influkit, nothing written onto the user's Stage


def test_total_grad_sized_from_the_budget_keeps_the_probe_gradient(mlp_stage):
    """Without chunk_size the probe that sizes the chunks computes the first two examples' gradient; it is part of
    the sum, not computed again: each example passes through the model once."""
    x, y = mlp_stage.data.take(torch.arange(len(mlp_stage)))
    expected = per_example_grads_serial(mlp_stage, x, y).sum(0)
    seen = []
    counted = ik.Stage(mlp_stage.model, lambda out, t: (seen.append(out.shape[0]), mlp_stage.loss(out, t))[1],
                       (x, y))
    seen.clear()
    assert torch.allclose(total_grad(counted, x, y), expected, atol=1e-13)
    assert sum(seen) == len(x)
