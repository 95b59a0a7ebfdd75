import pytest
import torch

import influkit as ik
from influkit.curvature import HessianOperator, ProductSettings, gradient, hvp
from influkit.params import ParamSpace
from conftest import explicit_hessian


@pytest.mark.parametrize("mode,cache_graph", [("fwd-rev", False), ("rev-rev", False), ("rev-rev", True)])
def test_hvp_matches_explicit_hessian(mlp_stage, mode, cache_graph):
    h = explicit_hessian(mlp_stage)
    op = HessianOperator(mlp_stage, product=ProductSettings(cache_graph, mode))
    assert op._use_graph == cache_graph
    v = torch.randn(op.dim, 5, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(op.matvec(v), h @ v, rtol=0, atol=1e-10 * h.abs().max())
    assert torch.allclose(op.matvec(v[:, 0]), h @ v[:, 0], rtol=0, atol=1e-10 * h.abs().max())


def test_dense_equals_explicit(mlp_stage):
    h = explicit_hessian(mlp_stage)
    assert torch.allclose(HessianOperator(mlp_stage).dense(), h, atol=1e-12)


def test_mixed_block_product(mlp_stage):
    """The A-part of H·[0; v_B] is the cross derivative ∂²L/∂A∂B · v_B."""
    names = mlp_stage.param_names
    h = explicit_hessian(mlp_stage)
    space = ParamSpace(mlp_stage.trained())
    block_b = names[2:]  # second layer
    v_b = {n: torch.randn_like(mlp_stage.trained()[n]) for n in block_b}
    tangent = {n: (v_b[n] if n in v_b else torch.zeros_like(t)) for n, t in mlp_stage.trained().items()}
    out = space.flatten(hvp(mlp_stage, tangent))
    assert torch.allclose(out, h @ space.flatten(tangent), atol=1e-12)
    # restricting the output to block A reads off the off-diagonal block only
    sizes = sum(space.sizes[:2])
    cross = h[:sizes, sizes:]
    assert torch.allclose(out[:sizes], cross @ space.flatten(tangent)[sizes:], atol=1e-12)


def test_sampled_hessian_uses_a_seeded_subset(mlp_stage):
    op = HessianOperator(mlp_stage, samples=15, seed=3)
    assert op.indices.numel() == 15
    h_sub = explicit_hessian(mlp_stage, indices=op.indices)
    assert torch.allclose(op.dense(), h_sub, atol=1e-12)
    assert not torch.allclose(op.dense(), explicit_hessian(mlp_stage), atol=1e-6)
    again = HessianOperator(mlp_stage, samples=15, seed=3)
    assert torch.equal(again.indices, op.indices)


def test_gradient_matches_autograd(mlp_stage):
    params = {n: t.clone().requires_grad_(True) for n, t in mlp_stage.trained().items()}
    expected = torch.autograd.grad(mlp_stage.objective(params), list(params.values()))
    got = gradient(mlp_stage, mlp_stage.param_names)
    for e, n in zip(expected, params):
        assert torch.allclose(got[n], e, atol=1e-14)


@pytest.mark.parametrize("cache_graph", [True, False])
def test_gauss_newton_products_match_the_explicit_jacobian_form(mlp_stage, cache_graph):
    """G·v = (1/n) Σ J_iᵀ ∇²_f ℓ_i J_i v + ∇²R v, against J and ∇²_f ℓ built explicitly, cached or streamed,
    with a proximal extra term and on a sampled subset."""
    from influkit.validation.reference import explicit_gauss_newton

    centre = {n: t + 0.1 for n, t in mlp_stage.trained().items()}
    extra = lambda p: 0.7 * sum(((p[n] - centre[n]) ** 2).sum() for n in p)  # noqa: E731
    op = HessianOperator(mlp_stage, curvature="gauss-newton", product=ProductSettings(cache_graph), extra=extra,
                         samples=25, seed=1)
    g = explicit_gauss_newton(mlp_stage, indices=op.indices, extra=extra)
    v = torch.randn(op.dim, 3, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(op.matvec(v), g @ v, rtol=0, atol=1e-12 * g.abs().max())
    torch.testing.assert_close(op.matvec(v[:, 1]), g @ v[:, 1], rtol=0, atol=1e-12 * g.abs().max())
    assert op.products == 4


@pytest.mark.parametrize("curvature,mode,cache_graph", [("hessian", "rev-rev", True), ("hessian", "rev-rev", False),
                                                        ("hessian", "fwd-rev", False), ("gauss-newton", "rev-rev", True),
                                                        ("gauss-newton", "rev-rev", False)])
def test_data_weight_scales_the_data_part_only(mlp_stage, curvature, mode, cache_graph):
    """data_weight c: c·H_data + ∇²(R + extra), against the explicit matrices (R = 1e-3/2‖θ‖², extra = 0.7‖θ − m‖²:
    ∇²(R + extra) = 1.401·I), on every product path."""
    from influkit.validation.reference import explicit_gauss_newton

    centre = {n: t + 0.1 for n, t in mlp_stage.trained().items()}
    extra = lambda p: 0.7 * sum(((p[n] - centre[n]) ** 2).sum() for n in p)  # noqa: E731
    full = explicit_hessian(mlp_stage, extra=extra) if curvature == "hessian" else \
        explicit_gauss_newton(mlp_stage, extra=extra)
    penalty = 1.401 * torch.eye(full.shape[0], dtype=full.dtype)
    op = HessianOperator(mlp_stage, curvature=curvature, product=ProductSettings(cache_graph, mode), extra=extra,
                         data_weight=0.3)
    v = torch.randn(op.dim, 3, generator=torch.Generator().manual_seed(0))
    expected = (0.3 * (full - penalty) + penalty) @ v
    torch.testing.assert_close(op.matvec(v), expected, rtol=0, atol=1e-12 * full.abs().max())
    assert not torch.allclose(op.matvec(v), full @ v, atol=1e-3)


def test_gauss_newton_is_positive_semidefinite_where_the_hessian_is_not(mlp_stage):
    """At the untrained MLP the Hessian has negative eigenvalues; G + ∇²R never goes below the L2 weight."""
    h = HessianOperator(mlp_stage).dense()
    g = HessianOperator(mlp_stage, curvature="gauss-newton").dense()
    assert torch.linalg.eigvalsh(h).min() < -1e-3
    assert torch.linalg.eigvalsh(g).min() >= 1e-3 - 1e-12  # l2(1e-3): ∇²R = 1e-3·I


def test_gauss_newton_equals_the_hessian_for_a_linear_model():
    """f linear in θ: the dropped term Σ ∂ℓ/∂f ∇²f vanishes, so G = H exactly (softmax cross-entropy)."""
    import influkit as ik
    from conftest import cross_entropy, l2

    gen = torch.Generator().manual_seed(4)
    x, y = torch.randn(25, 4, generator=gen), torch.randint(0, 3, (25,), generator=gen)
    torch.manual_seed(4)
    stage = ik.Stage(torch.nn.Linear(4, 3).double(), cross_entropy, (x, y), regularizer=l2(0.05))
    g = HessianOperator(stage, curvature="gauss-newton").dense()
    torch.testing.assert_close(g, explicit_hessian(stage), rtol=0, atol=1e-12)


def test_unknown_curvature_is_refused(mlp_stage):
    import influkit as ik

    with pytest.raises(ik.InputError, match="curvature"):
        HessianOperator(mlp_stage, curvature="fisher")


def test_more_hessian_samples_than_examples_is_refused(mlp_stage):
    """40 examples: 40 samples is all of them; 41 names the bound instead of silently using all 40."""
    import influkit as ik

    assert HessianOperator(mlp_stage, samples=40).indices is None
    with pytest.raises(ik.InputError, match=r"hessian_samples=41 .*n = 40.*<= 40"):
        HessianOperator(mlp_stage, samples=41)
    with pytest.raises(ik.InputError, match=r"n = 40"):
        ik.influence(mlp_stage, torch.arange(3), torch.arange(2), solve=ik.SolveConfig(solver="direct"),
                     curvature=ik.CurvatureConfig(hessian_samples=1000), progress=False)


def test_a_dense_hessian_larger_than_free_memory_is_refused_before_it_is_allocated(mlp_stage, monkeypatch):
    """solver='direct' on a stage whose p×p Hessian cannot fit: a MemoryBudgetError naming the size and the fix, not
    the allocator's failure (on the 9.6 M-parameter BERT stage it tried to allocate 370 TB)."""
    from influkit import curvature

    op = HessianOperator(mlp_stage)
    needed = curvature.DENSE_COPIES * op.dim ** 2 * 8
    monkeypatch.setattr(curvature, "available_bytes", lambda device: needed - 1)
    chain = ik.Chain([mlp_stage], solve=ik.SolveConfig(solver="direct", damping=1e-3))
    with pytest.raises(ik.MemoryBudgetError, match=f"dense Hessian of {op.dim:,} parameters.*solver='minres'"):
        chain.fit()
    monkeypatch.setattr(curvature, "available_bytes", lambda device: needed)
    assert torch.allclose(HessianOperator(mlp_stage).dense(), op.matvec(torch.eye(op.dim, dtype=op.dtype)))
