"""K-FAC / EK-FAC / diagonal / Arnoldi curvature against explicitly computed Gauss-Newton blocks, and their use
as approximate inverses, as preconditioners of exact solves, and through Chain.fit / save / load."""

import copy
import warnings

import pytest
import torch
from torch import nn
from torch.func import hessian, jacrev, vmap

import influkit as ik
from influkit import auto
from influkit.curvature import HessianOperator
from influkit.factored import FactoredCurvatureError, fit_curvature, lanczos, plan_layers
from influkit.params import ParamSpace
from conftest import cross_entropy, digits, explicit_hessian, l2


def mse(outputs, targets):
    return ((outputs - targets) ** 2).sum(1)


# ---------------------------------------------------------------- ground truth by Jacobians (independent route)

def output_hessians(loss, outputs, targets):
    """(B, D, D) ∇²_f ℓ(f_i, y_i) per example, by torch.func.hessian."""
    return vmap(hessian(lambda o, t: loss(o[None], t[None])[0]))(outputs, targets)


def exact_ggn(stage):
    """(p, p) (1/n) Σ_i J_iᵀ H_i J_i over the stage's trained parameters (J by jacrev, per example)."""
    names = stage.param_names
    params = {n: stage.state()[n] for n in names}
    space = ParamSpace(params)
    x, y = stage.data.take(torch.arange(len(stage)))

    def f(flat, xi):
        return stage.outputs(space.unflatten(flat), xi[None])[0].reshape(-1)

    jac = vmap(jacrev(f), in_dims=(None, 0))(space.flatten(params), x)  # (B, D, p)
    h = output_hessians(stage.loss, stage.outputs(params, x).detach(), y)
    return torch.einsum("bdp,bde,beq->pq", jac, h, jac) / len(stage)


def layer_positions(space: ParamSpace, weight: str, bias: str | None, rows: int) -> torch.Tensor:
    """Flat positions of M = [W.reshape(rows, -1) | b] in row-major order, from the ParamSpace offsets."""
    offsets = dict(zip(space.names, torch.tensor([0] + space.sizes[:-1]).cumsum(0).tolist()))
    size = space.sizes[space.names.index(weight)]
    w = torch.arange(offsets[weight], offsets[weight] + size).reshape(rows, -1)
    if bias is None:
        return w.reshape(-1)
    return torch.cat([w, torch.arange(offsets[bias], offsets[bias] + rows)[:, None]], 1).reshape(-1)


def kron(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.kron of contiguous copies: with opt_einsum installed (as in the bench venv) einsum can return a
    transposed view, which torch.kron rejects."""
    return torch.kron(a.contiguous(), b.contiguous())


def block(curvature, positions):
    dense = curvature.dense()
    return dense[positions[:, None], positions[None, :]]


# ---------------------------------------------------------------- models

class ConvNet(nn.Module):
    """Conv2d(2→3, 3×3, stride 2, padding 1) → tanh → Linear(27 → 4) on 2×5×5 inputs."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, stride=2, padding=1)
        self.lin = nn.Linear(27, 4)

    def forward(self, x):
        return self.lin(torch.tanh(self.conv(x)).flatten(1))


class SeqNet(nn.Module):
    """Embedding (padding_idx 0) → a Linear called twice per forward → mean over tokens → Linear, times a free scale."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 4, padding_idx=0)
        self.shared = nn.Linear(4, 4)
        self.out = nn.Linear(4, 3)
        self.scale = nn.Parameter(torch.tensor([1.3, 0.7, 1.0]))

    def forward(self, ids):
        h = self.emb(ids)
        h = torch.tanh(self.shared(h))
        h = torch.tanh(self.shared(h))
        return self.out(h.mean(1)) * self.scale


@pytest.fixture
def conv_stage():
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(30, 2, 5, 5, generator=gen)
    y = torch.randint(0, 4, (30,), generator=gen)
    return ik.Stage(ConvNet().double().eval(), cross_entropy, (x, y), batch_size=12)


@pytest.fixture
def seq_stage():
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 7, (25, 5), generator=gen)
    ids[:, -1] = 0  # padding positions
    y = torch.randint(0, 3, (25,), generator=gen)
    return ik.Stage(SeqNet().double().eval(), cross_entropy, (ids, y), batch_size=10)


# ---------------------------------------------------------------- K-FAC equals the explicit Kronecker-factored GGN

def test_kfac_blocks_equal_explicit_kronecker_factors_of_linear_and_conv(conv_stage):
    stage, model = conv_stage, conv_stage.model
    x, y = stage.data.take(torch.arange(len(stage)))
    n = x.shape[0]
    h_out = output_hessians(stage.loss, model(x).detach(), y)  # (n, 4, 4)
    # conv: patches cut out by hand (stride 2, padding 1), G from the Jacobian of f w.r.t. each output position
    padded = nn.functional.pad(x, (1, 1, 1, 1))
    patches = torch.stack([padded[:, :, 2 * r : 2 * r + 3, 2 * c : 2 * c + 3].reshape(n, -1)
                           for r in range(3) for c in range(3)], 1)  # (n, 9, 18)
    patches = torch.cat([patches, torch.ones(n, 9, 1)], 2)
    a_conv = torch.einsum("nti,ntj->ij", patches, patches) / (n * 9)
    pre = model.conv(x).detach()
    j_conv = vmap(jacrev(lambda s: model.lin(torch.tanh(s).reshape(-1))))(pre)  # (n, 4, 3, 3, 3)
    j_conv = j_conv.reshape(n, 4, 3, 9)
    g_conv = torch.einsum("ndct,nde,newt->cw", j_conv, h_out, j_conv) / n
    # linear: inputs are the flattened conv features, its output is the model output (J = I)
    feats = torch.cat([torch.tanh(pre).flatten(1), torch.ones(n, 1)], 1)
    a_lin, g_lin = feats.T @ feats / n, h_out.mean(0)

    curvature = fit_curvature(stage, kind="kfac", fisher="exact")
    space = ParamSpace(stage.trained())
    conv_pos = layer_positions(space, "conv.weight", "conv.bias", 3)
    lin_pos = layer_positions(space, "lin.weight", "lin.bias", 4)
    torch.testing.assert_close(block(curvature, conv_pos), kron(g_conv, a_conv), rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(block(curvature, lin_pos), kron(g_lin, a_lin), rtol=1e-10, atol=1e-13)
    cross = curvature.dense()[conv_pos[:, None], lin_pos[None, :]]
    assert torch.equal(cross, torch.zeros_like(cross))  # block-diagonal over layers
    assert curvature.info["diagonal"] == {} and [l["module"] for l in curvature.info["layers"]] == ["conv", "lin"]


@pytest.mark.parametrize("fixture", ["conv_stage", "seq_stage"])
def test_ekfac_eigenvalues_are_the_ggn_diagonal_in_the_kfac_eigenbasis(fixture, request):
    """Λ = diag(Qᵀ GGN_M Q) for the exact per-example gradients (embedding, a module called twice, conv, linear)."""
    stage = request.getfixturevalue(fixture)
    ggn = exact_ggn(stage)
    ekfac = fit_curvature(stage, kind="ekfac", fisher="exact")
    kfac = fit_curvature(stage, kind="kfac", fisher="exact")
    space = ParamSpace(stage.trained())
    for eb, kb in zip(ekfac.blocks, kfac.blocks):
        if not hasattr(eb, "eigenvalues"):
            continue
        assert torch.equal(eb.right, kb.right)  # the same eigenbasis
        pos = layer_positions(space, eb.weight, eb.bias, eb.rows)
        left = eb.left if eb.left is not None else torch.eye(eb.rows)
        basis = kron(left, eb.right)
        expected = torch.diagonal(basis.T @ ggn[pos[:, None], pos[None, :]] @ basis)
        torch.testing.assert_close(eb.eigenvalues.reshape(-1), expected, rtol=1e-9, atol=1e-13)


def test_ekfac_from_the_cached_first_pass_equals_a_second_streamed_pass(conv_stage):
    one = fit_curvature(conv_stage, kind="ekfac", seed=3)
    two = fit_curvature(conv_stage, kind="ekfac", seed=3, cache_bytes=0)
    assert one.info["passes"] == 1 and two.info["passes"] == 2
    for a, b in zip(one.blocks, two.blocks):
        torch.testing.assert_close(a.eigenvalues, b.eigenvalues, rtol=1e-12, atol=0)


def test_embedding_and_shared_layer_factors_pool_tokens_and_calls(seq_stage):
    stage, model = seq_stage, seq_stage.model
    ids, y = stage.data.take(torch.arange(len(stage)))
    n = ids.shape[0]
    kfac = fit_curvature(stage, kind="kfac", fisher="exact")
    blocks = {b.layer: b for b in kfac.blocks if hasattr(b, "layer")}
    # embedding: A = token frequencies (padding left out), G = Σ_t J_tᵀ H J_t over non-padding tokens
    keep = ids != 0
    counts = torch.bincount(ids[keep], minlength=7).double() / keep.sum()
    h_out = output_hessians(stage.loss, model(ids).detach(), y)
    emb = model.emb(ids).detach()

    def after_embedding(e):
        h = torch.tanh(model.shared(torch.tanh(model.shared(e))))
        return model.out(h.mean(0)) * model.scale

    j = vmap(jacrev(after_embedding))(emb)  # (n, 3, T, 4)
    g_emb = torch.einsum("ndtc,nde,netw,nt->cw", j, h_out, j, keep.double()) / n
    expected = kron(torch.diag(counts), g_emb)
    emb_block = blocks["emb"]
    torch.testing.assert_close(emb_block.dense(), expected, rtol=1e-10, atol=1e-13)
    # shared layer: inputs of both calls pooled (2·n·T tokens), gradients of both calls summed per example
    h0 = emb
    s1 = model.shared(h0).detach()
    h1 = torch.tanh(s1)
    inputs = torch.cat([h0, h1], 1).reshape(-1, 4)
    inputs = torch.cat([inputs, torch.ones(inputs.shape[0], 1)], 1)
    a_shared = inputs.T @ inputs / inputs.shape[0]
    j1 = vmap(jacrev(lambda s: model.out(torch.tanh(model.shared(torch.tanh(s))).mean(0)) * model.scale))(s1)
    j2 = vmap(jacrev(lambda s: model.out(torch.tanh(s).mean(0)) * model.scale))(model.shared(h1).detach())
    g_shared = sum(torch.einsum("ndtc,nde,netw->cw", jj, h_out, jj) for jj in (j1, j2)) / n
    torch.testing.assert_close(blocks["shared"].dense(), kron(g_shared, a_shared), rtol=1e-10, atol=1e-13)


def test_other_parameters_get_the_exact_ggn_diagonal_and_are_listed(seq_stage):
    ggn = exact_ggn(seq_stage)
    space = ParamSpace(seq_stage.trained())
    for kind in ("ekfac", "diagonal"):
        curvature = fit_curvature(seq_stage, kind=kind, fisher="exact")
        assert list(curvature.info["diagonal"]) == ["scale"] and "SeqNet" in curvature.info["diagonal"]["scale"]
        if kind == "diagonal":
            torch.testing.assert_close(torch.diagonal(curvature.dense()), torch.diagonal(ggn), rtol=1e-9, atol=1e-13)
    pos = torch.arange(space.dim - 3, space.dim)
    torch.testing.assert_close(torch.diagonal(block(curvature, pos)), torch.diagonal(ggn)[pos], rtol=1e-9, atol=1e-13)


def test_ekfac_is_exact_for_one_linear_layer_with_squared_error():
    """GGN = Hessian = 2·I ⊗ E[x̄x̄ᵀ] is Kronecker and diagonal in the K-FAC basis: K-FAC and EK-FAC are exact, and
    with an L2 regularizer so is the added curvature."""
    gen = torch.Generator().manual_seed(3)
    x, y = torch.randn(40, 5, generator=gen), torch.randn(40, 3, generator=gen)
    torch.manual_seed(0)
    stage = ik.Stage(nn.Linear(5, 3).double(), mse, (x, y), regularizer=l2(0.3), batch_size=16)
    h = explicit_hessian(stage)
    b = torch.randn(h.shape[0], 2, generator=gen)
    expected = torch.linalg.solve(h + 0.05 * torch.eye(h.shape[0]), b)
    for kind in ("kfac", "ekfac"):
        curvature = fit_curvature(stage, kind=kind, fisher="exact")
        torch.testing.assert_close(curvature.dense(), h, rtol=1e-12, atol=1e-13)
        torch.testing.assert_close(curvature.solve(b, 0.05), expected, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(curvature.inverse(0.05).matvec(b), expected, rtol=1e-10, atol=1e-12)


def test_sampled_fisher_is_unbiased_for_cross_entropy():
    """With many examples the sampled-label K-FAC factors approach the exact ones (1/√n noise)."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3000, 4, generator=gen)
    torch.manual_seed(0)
    model = nn.Linear(4, 3).double()
    with torch.no_grad():
        y = torch.distributions.Categorical(logits=model(x)).sample()
    stage = ik.Stage(model, cross_entropy, (x, y), batch_size=1000)
    exact = fit_curvature(stage, kind="kfac", fisher="exact").dense()
    sampled = fit_curvature(stage, kind="kfac", fisher="sampled", seed=1).dense()
    other = fit_curvature(stage, kind="kfac", fisher="sampled", seed=2).dense()
    assert (sampled - exact).norm() / exact.norm() < 0.05
    assert not torch.equal(sampled, other)  # different labels per seed
    assert torch.equal(sampled, fit_curvature(stage, kind="kfac", fisher="sampled", seed=1).dense())


@pytest.mark.parametrize("loss,targets", [
    (lambda o, t: 2.5 * nn.functional.cross_entropy(o, t, reduction="none"), "class"),
    (lambda o, t: ((o - t) ** 2).mean(1), "real"),
])
def test_sampled_fisher_recognises_scaled_cross_entropy_and_mean_squared_error(loss, targets):
    """A constant factor c in the loss scales the Gauss-Newton matrix by c; the sampled Fisher follows it."""
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(4000, 3, generator=gen)
    torch.manual_seed(0)
    model = nn.Linear(3, 2).double()
    y = torch.randint(0, 2, (4000,), generator=gen) if targets == "class" else torch.randn(4000, 2, generator=gen)
    stage = ik.Stage(model, loss, (x, y), batch_size=2000)
    exact = fit_curvature(stage, kind="kfac", fisher="exact").dense()
    sampled = fit_curvature(stage, kind="kfac", fisher="sampled").dense()
    assert (sampled - exact).norm() / exact.norm() < 0.05


def test_unrecognised_loss_needs_empirical_or_exact_fisher():
    gen = torch.Generator().manual_seed(6)
    x, y = torch.randn(20, 3, generator=gen), torch.randint(0, 2, (20, 2), generator=gen).double()
    bce = lambda o, t: nn.functional.binary_cross_entropy_with_logits(o, t, reduction="none").sum(1)  # noqa: E731
    stage = ik.Stage(nn.Linear(3, 2).double(), bce, (x, y))
    with pytest.raises(FactoredCurvatureError, match="fisher='empirical'"):
        fit_curvature(stage, fisher="sampled")
    assert isinstance(FactoredCurvatureError("x"), ik.InfluenceError)
    empirical = fit_curvature(stage, kind="diagonal", fisher="empirical")
    g = torch.func.vmap(torch.func.grad(lambda p, xi, yi: stage.losses(p, xi[None], yi[None])[0]), (None, 0, 0))(
        stage.trained(), x, y)
    expected = ParamSpace(stage.trained()).flatten(g, batched=True) ** 2
    torch.testing.assert_close(torch.diagonal(empirical.dense()), expected.mean(1), rtol=1e-10, atol=1e-14)
    fit_curvature(stage, kind="ekfac", fisher="exact")  # any loss with a small output


def test_unsupported_layers_fall_back_to_diagonal_with_reasons():
    model = nn.Sequential(nn.Conv2d(2, 4, 3, groups=2), nn.Flatten(), nn.LayerNorm(4), nn.Linear(4, 2))
    layers, reasons = plan_layers(model, [n for n, _ in model.named_parameters()])
    assert [layer.name for layer in layers] == ["3"]
    assert "grouped" in reasons["0.weight"] and "without its layer's weight" in reasons["0.bias"]
    assert "LayerNorm" in reasons["2.weight"]
    tied = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 5, bias=False))
    tied[1].weight = tied[0].weight
    layers, reasons = plan_layers(tied, [n for n, _ in tied.named_parameters()])
    assert layers == [] and "shared by several modules" in reasons["0.weight"]


# ---------------------------------------------------------------- preconditioned exact solves

@pytest.fixture(scope="module")
def ill_conditioned():
    """A 64→8→10 tanh MLP on 300 digits with features scaled over two decades, partly trained (indefinite H)."""
    x, y = digits(300)
    x = x * torch.logspace(-1, 1, 64)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 8), nn.Tanh(), nn.Linear(8, 10)).double()
    opt = torch.optim.Adam(model.parameters(), 1e-2)
    for _ in range(150):
        opt.zero_grad()
        cross_entropy(model(x), y).mean().backward()
        opt.step()
    stage = ik.Stage(model.eval(), cross_entropy, (x, y), batch_size=300)
    h = HessianOperator(stage).dense()
    return stage, h


@pytest.mark.parametrize("preconditioner", ["ekfac", "kfac", "diagonal"])
def test_preconditioned_minres_reaches_direct_in_fewer_iterations(ill_conditioned, preconditioner):
    stage, h = ill_conditioned
    damping = 2e-3
    assert float(torch.linalg.eigvalsh(h)[0]) + damping < 0  # an indefinite system: CG would fail, MINRES must not
    b = torch.randn(h.shape[0], 2, generator=torch.Generator().manual_seed(0))
    expected = torch.linalg.solve(h + damping * torch.eye(h.shape[0]), b)
    direct = ik.SolveConfig(solver="direct", damping=damping).solve(HessianOperator(stage), b)
    torch.testing.assert_close(direct.x, expected, rtol=1e-9, atol=1e-12)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ik.ConvergenceWarning)
        plain = ik.SolveConfig(solver="minres", damping=damping, tol=1e-11, max_iter=5000).solve(HessianOperator(stage), b)
        pre = ik.SolveConfig(solver="minres", damping=damping, tol=1e-11, max_iter=5000,
                             preconditioner=preconditioner).solve(HessianOperator(stage), b)
    for sol in (plain, pre):
        assert (sol.x - direct.x).norm() / direct.x.norm() <= 1e-8
    assert pre.iterations < plain.iterations
    assert pre.preconditioner.startswith(preconditioner)
    if preconditioner != "diagonal":
        assert pre.iterations < plain.iterations / 2


def test_preconditioned_cg_reaches_direct_in_fewer_iterations():
    """Convex: L2 logistic regression (at its initialization) on digit features scaled over two decades, H + λI ≻ 0."""
    x, y = digits(300)
    x = x * torch.logspace(-1, 1, 64)
    torch.manual_seed(0)
    stage = ik.Stage(nn.Linear(64, 10).double(), cross_entropy, (x, y), regularizer=l2(1e-3), batch_size=300)
    h = explicit_hessian(stage)
    b = torch.randn(h.shape[0], generator=torch.Generator().manual_seed(1))
    expected = torch.linalg.solve(h + 1e-4 * torch.eye(h.shape[0]), b)
    runs = {pre: ik.SolveConfig(solver="cg_spd", damping=1e-4, tol=1e-11, max_iter=5000, preconditioner=pre)
            .solve(HessianOperator(stage), b) for pre in (None, "ekfac", "kfac")}
    for sol in runs.values():
        assert sol.converged and (sol.x - expected).norm() / expected.norm() <= 1e-8
    assert runs["ekfac"].iterations < runs[None].iterations / 3
    assert runs["kfac"].iterations < runs[None].iterations / 3


def test_deflated_preconditioner_reaches_direct(ill_conditioned):
    stage, h = ill_conditioned
    b = torch.randn(h.shape[0], generator=torch.Generator().manual_seed(2))
    expected = torch.linalg.solve(h + 2e-3 * torch.eye(h.shape[0]), b)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ik.ConvergenceWarning)
        base = ik.SolveConfig(solver="minres", damping=2e-3, tol=1e-11, max_iter=5000, preconditioner="ekfac")
        sol = ik.SolveConfig(solver="minres", damping=2e-3, tol=1e-11, max_iter=5000, preconditioner="ekfac",
                             deflate=True).solve(HessianOperator(stage), b, ik.CurvatureConfig(rank=20))
    assert (sol.x - expected).norm() / expected.norm() <= 1e-8
    assert "deflated by 20" in sol.preconditioner
    assert sol.iterations <= base.solve(HessianOperator(stage), b).iterations


# ---------------------------------------------------------------- approximate inverses

def test_lanczos_finds_the_largest_eigenpairs_and_full_rank_arnoldi_is_exact(ill_conditioned):
    stage, h = ill_conditioned
    evals = torch.linalg.eigvalsh(h)
    top = evals[evals.abs().argsort(descending=True)[:10]]
    theta, vectors, info = lanczos(HessianOperator(stage), 10, iterations=120)
    torch.testing.assert_close(theta, top, rtol=1e-8, atol=1e-10)
    torch.testing.assert_close(vectors.T @ vectors, torch.eye(10), atol=1e-10, rtol=0)
    torch.testing.assert_close(h @ vectors, vectors * theta, atol=1e-7, rtol=0)
    assert info["products"] == 120 and info["rank"] == 10
    # a diagonalizable 40×40 operator: rank 40 from 40 steps spans everything, so arnoldi is the exact inverse
    q, _ = torch.linalg.qr(torch.randn(40, 40, generator=torch.Generator().manual_seed(3)))
    dense = q @ torch.diag(torch.linspace(0.5, 5.0, 40)) @ q.T
    b = torch.randn(40, 2, generator=torch.Generator().manual_seed(4))
    sol = ik.SolveConfig(solver="arnoldi", damping=0.1, residual=True).solve(ik.DenseOperator(dense), b,
                                                                            ik.CurvatureConfig(rank=40))
    torch.testing.assert_close(sol.x, torch.linalg.solve(dense + 0.1 * torch.eye(40), b), rtol=1e-8, atol=1e-10)
    assert sol.residual < 1e-8 and sol.preconditioner == "arnoldi (rank 40)"


@pytest.mark.parametrize("solver", ["kfac", "ekfac"])
def test_factored_approximate_inverse_is_the_fitted_curvature_inverse(conv_stage, solver):
    op = HessianOperator(conv_stage)
    b = torch.randn(op.dim, 3, generator=torch.Generator().manual_seed(5))
    solver_ = ik.SolveConfig(solver=solver, damping=0.1, residual=True).prepare(op)
    sol = solver_.solve(b)
    curvature = solver_.curvature.approximations[solver]
    assert curvature.kind == solver
    torch.testing.assert_close(sol.x, torch.linalg.solve(curvature.dense() + 0.1 * torch.eye(op.dim), b),
                               rtol=1e-9, atol=1e-12)
    h = explicit_hessian(conv_stage)
    true = ((h + 0.1 * torch.eye(op.dim)) @ sol.x - b).norm(dim=0) / b.norm(dim=0)
    assert sol.residual == pytest.approx(float(true.max()), rel=1e-8)


def test_approximate_inverse_skips_the_residual_product_by_default(conv_stage):
    op = HessianOperator(conv_stage)
    b = torch.randn(op.dim, 2, generator=torch.Generator().manual_seed(5))
    checked = ik.SolveConfig(solver="ekfac", damping=0.1, residual=True).solve(op, b)
    before = op.products
    unchecked = ik.SolveConfig(solver="ekfac", damping=0.1).solve(op, b)
    assert op.products == before  # no exact Hessian-vector product spent
    assert unchecked.products == 0 and checked.products > 0
    assert torch.isnan(torch.tensor(unchecked.residual)) and unchecked.converged is None  # not checked
    torch.testing.assert_close(unchecked.x, checked.x, rtol=0, atol=0)


def test_float32_model_accumulates_factors_in_float32_and_matches_float64(conv_stage):
    """A float32 model's covariances are summed in float32 (half the accumulator memory, as kronfluence); its
    factors agree with the float64 model's to float32 precision."""
    wide = fit_curvature(conv_stage, kind="ekfac", fisher="exact")
    x, y = conv_stage._data
    narrow = fit_curvature(ik.Stage(copy.deepcopy(conv_stage.model).float(), cross_entropy, (x.float(), y), batch_size=12),
                           kind="ekfac", fisher="exact")
    assert narrow.dtype == torch.float32
    dense64, dense32 = wide.dense(), narrow.dense()
    assert float((dense32 - dense64).norm() / dense64.norm()) < 1e-5


def test_solve_needs_the_fitted_approximation():
    with pytest.raises(ik.InputError, match="fitted approximation"):
        ik.solve(torch.eye(3), torch.ones(3), "ekfac")
    with pytest.raises(ik.InputError, match="Stage"):
        ik.SolveConfig(solver="ekfac").solve(ik.DenseOperator(torch.eye(3)), torch.ones(3))
    with pytest.raises(ik.InputError, match="preconditioner"):
        ik.SolveConfig(solver="cg", preconditioner="ekfac")
    with pytest.raises(ik.InputError, match="unknown preconditioner"):
        ik.SolveConfig(solver="minres", preconditioner="lu")
    with pytest.raises(ik.InputError, match="fisher"):
        ik.CurvatureConfig(fisher="true")


# ---------------------------------------------------------------- Chain: fit, auto, save / load

def two_stage(case):
    """A digits encoder + head pretrained on 0-4 and finetuned on 5-9 (Case 1 or Case 2), float64."""
    x, y = digits(240)
    pre_rows, fin_rows = y < 5, y >= 5
    torch.manual_seed(0)

    def model():
        return nn.Sequential(nn.Sequential(nn.Linear(64, 6), nn.Tanh()), nn.Linear(6, 5)).double()

    pre_model, fin_model = model(), model()
    fin_model[0].load_state_dict(pre_model[0].state_dict())
    pre = ik.Stage(pre_model.eval(), cross_entropy, (x[pre_rows], y[pre_rows]), regularizer=l2(1e-2))
    fin = ik.Stage(fin_model.eval(), cross_entropy, (x[fin_rows], y[fin_rows] - 5), regularizer=l2(1e-2),
                   params=None if case == 2 else "1")
    test = (x[fin_rows][:6], y[fin_rows][:6] - 5)
    return [pre, fin], [ik.Link("0", case=case, alpha=0.05)], test


@pytest.mark.parametrize("case", [1, 2])
def test_chain_with_preconditioned_minres_equals_direct(case):
    stages, links, test = two_stage(case)
    direct = ik.Chain(stages, links, solve=ik.SolveConfig(solver="direct", damping=1e-3)).query(test).scores()
    config = ik.SolveConfig(solver="minres", preconditioner="ekfac", damping=1e-3, tol=1e-12)
    chain = ik.Chain(stages, links, solve=config).fit()
    assert all("ekfac" in chain.curvature(k).approximations for k in range(2))
    result = chain.query(test).scores()
    torch.testing.assert_close(result.values, direct.values, rtol=1e-8, atol=1e-12)
    assert all(s["preconditioner"].startswith("ekfac") for s in result.diagnostics["solves"])


def test_auto_runs_an_unpreconditioned_krylov_solve_above_the_direct_limit_and_honours_a_preconditioner(monkeypatch):
    monkeypatch.setattr(auto, "DIRECT_MAX", 100)
    stages, links, test = two_stage(2)  # untrained: auto solves with the Gauss-Newton matrix (influkit.auto)
    exact = ik.SolveConfig(solver="direct", damping=1e-3)
    direct = ik.Chain(stages, links, solve=exact, curvature=ik.CurvatureConfig(matrix="gauss-newton")).query(test)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ik.StationarityWarning)
        auto_query = ik.Chain(stages, links, solve=ik.SolveConfig(damping=1e-3)).query(test)
    for solve in auto_query.solves:
        assert solve["solver"] == "minres" and solve["preconditioner"] == "" and solve["converged"]
        assert "Gauss-Newton" in solve["choice"] and solve["damping"] == 1e-3
    assert (auto_query.s - direct.s).norm() / direct.s.norm() <= 1e-8
    chain = ik.Chain(stages, links, solve=ik.SolveConfig(damping=1e-3, preconditioner="ekfac"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ik.StationarityWarning)
        auto_ekfac = chain.query(test)
    for k, solve in enumerate(auto_ekfac.solves):
        assert solve["solver"] == "minres" and "preconditioned by ekfac" in solve["choice"] and solve["converged"]
        assert "ekfac" in chain.curvature(k).approximations
    assert (auto_ekfac.s - direct.s).norm() / direct.s.norm() <= 1e-8


def test_factors_survive_save_and_load_bit_identically(tmp_path):
    stages, links, test = two_stage(2)
    configs = [ik.SolveConfig(solver="minres", preconditioner="ekfac", damping=1e-3, deflate=True),
               ik.SolveConfig(solver="kfac", damping=1e-2)]
    curvature = [ik.CurvatureConfig(rank=5), ik.CurvatureConfig()]
    chain = ik.Chain(stages, links, solve=configs, curvature=curvature).fit()
    chain.save(tmp_path / "fit.st")
    fresh = ik.Chain(stages, links, solve=configs, curvature=curvature).load(tmp_path / "fit.st")
    for k, kind in enumerate(("ekfac", "kfac")):
        old, new = chain.curvature(k).approximations, fresh.curvature(k).approximations
        assert set(old) == set(new)
        for a, b in zip(old[kind].blocks, new[kind].blocks):
            for key, tensor in a.tensors().items():
                assert torch.equal(tensor, b.tensors()[key]) and tensor.dtype == b.tensors()[key].dtype
            assert getattr(a, "shift", None) is None or a.shift == b.shift
        assert old[kind].info == new[kind].info
        if "arnoldi" in old:
            assert torch.equal(old["arnoldi"].eigenvectors, new["arnoldi"].eigenvectors)
            assert torch.equal(old["arnoldi"].eigenvalues, new["arnoldi"].eigenvalues)
    assert torch.equal(fresh.query(test).s, chain.query(test).s)


def test_several_functions_of_the_curvature_in_one_pass_overwriting_their_inputs(seq_stage, monkeypatch):
    """FactoredCurvature.functions: out_i = Σ_j f_ij(C)·x_j equals the same functions of the explicit matrix
    (f(C) = Q f(Λ) Qᵀ from the eigendecomposition of C.dense()), with the outputs written over the inputs and the
    diagonal block (``scale``) taken in slices."""
    from influkit.factored import blocks, operator

    monkeypatch.setattr(operator, "DIAGONAL_SLICE", 2)
    curvature = fit_curvature(seq_stage, kind="ekfac", fisher="exact")
    assert any(isinstance(b, blocks.DiagonalBlock) for b in curvature.blocks)  # `scale`: two slices
    gen = torch.Generator().manual_seed(4)
    x, y = (torch.randn(curvature.dim, 2, generator=gen, dtype=torch.float64) for _ in range(2))
    table = [[lambda e: e, lambda e: torch.exp(-e)], [lambda e: 1 / (1 + e), lambda e: e ** 2]]
    lam, q = torch.linalg.eigh(curvature.dense())
    expected = [sum(q @ (f(lam)[:, None] * (q.T @ v)) for f, v in zip(row, (x, y))) for row in table]
    a, b = x.clone(), y.clone()
    curvature.functions([a, b], lambda e: [[f(e) for f in row] for row in table], out=[a, b])
    torch.testing.assert_close(a, expected[0], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(b, expected[1], rtol=1e-9, atol=1e-12)
    assert (a - x).abs().max() > 1e-3
