import torch

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
