"""Multi-stage influence against explicit-Hessian formulas (docs/conventions.md §1) and re-optimization."""

import pytest
import torch
from torch import nn

import influkit as ik
from influkit.validation.reference import explicit_gauss_newton, explicit_hessian, explicit_measure_grads
from influkit.gradients import per_example_grads_serial
from influkit.training import fit_lbfgs, newton_refine
from conftest import cross_entropy, l2

ALPHA = 0.05


class EmbedHead(nn.Module):
    def __init__(self, d_in=5, d_emb=4, n_out=3):
        super().__init__()
        self.embedding = nn.Sequential(nn.Linear(d_in, d_emb), nn.Tanh())
        self.head = nn.Linear(d_emb, n_out)

    def forward(self, x):
        return self.head(self.embedding(x))


def _data(n, n_classes, seed, teacher=False):
    """n points in 5-d; labels random, or from a fixed random tanh teacher (structure to learn)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 5, generator=gen)
    if teacher:
        w = torch.randn(5, n_classes, generator=torch.Generator().manual_seed(100 + n_classes))
        return x, torch.tanh(x @ w).argmax(1)
    return x, torch.randint(0, n_classes, (n,), generator=gen)


def _fit(stage):
    fit_lbfgs(stage, max_iter=500)
    assert newton_refine(stage, steps=5) < 1e-11


def _proximal(centre):
    return lambda p: ALPHA * sum(((p[n] - centre[n]) ** 2).sum() for n in centre)


def build(case: int, n_pretrain: int = 60, teacher: bool = False):
    """Pretrain on 3 classes, finetune a new 2-class head (Case 1) or the whole model (Case 2), to optimality."""
    torch.manual_seed(0)
    pre_model = EmbedHead(n_out=3).double()
    pre = ik.Stage(pre_model, cross_entropy, _data(n_pretrain, 3, 1, teacher), regularizer=l2(1e-2), batch_size=25)
    _fit(pre)
    fin_model = EmbedHead(n_out=2).double()
    fin_model.embedding.load_state_dict(pre_model.embedding.state_dict())
    if case == 1:
        fin = ik.Stage(fin_model, cross_entropy, _data(40, 2, 2, teacher), params="head", regularizer=l2(1e-2))
        _fit(fin)
    else:
        fin = ik.Stage(fin_model, cross_entropy, _data(40, 2, 2, teacher), regularizer=l2(1e-2))
        centre = {n: t.clone() for n, t in pre.state().items() if n.startswith("embedding")}
        reoptimize = ik.Stage(fin_model, cross_entropy, fin.data._tensors, regularizer=_with(l2(1e-2), _proximal(centre)))
        _fit(reoptimize)
    test = _data(15, 2, 3, teacher)
    return pre, fin, test


def _with(*terms):
    return lambda p: sum(t(p) for t in terms)


def explicit_scores(pre, fin, z, test, case, curvature=explicit_hessian, measure=None):
    """(len(z), len(test)) from explicit dense matrices, following Theorem 1 / eq. 14-15: ``curvature`` gives the
    matrices that are inverted (Hessians, or Gauss-Newton matrices); the cross derivative H_ΘW is always exact.
    measure: the test function per example (default: the finetuning loss), its gradients by ``jacrev``."""
    h_g = curvature(pre)
    g_z = per_example_grads_serial(pre, *pre.data.take(z))  # (N, p_pre), W first (embedding.*)
    i_w_full = -torch.linalg.solve(h_g, g_z.T)  # (p_pre, N)
    w_names = [n for n in pre.param_names if n.startswith("embedding")]
    p_w = sum(pre.state()[n].numel() for n in w_names)
    i_w = i_w_full[:p_w]
    names = w_names + ["head.weight", "head.bias"]
    h_f = curvature(fin, names)
    if measure is None:
        g_t = per_example_grads_serial(fin, *test, names)  # (T, p_fin), W then Θ
    else:
        g_t = explicit_measure_grads(fin, measure, *test, names)
    if case == 1:
        h_tt, h_tw = h_f[p_w:, p_w:], explicit_hessian(fin, names)[p_w:, :p_w]
        i_theta = -torch.linalg.solve(h_tt, h_tw @ i_w)
        return (g_t[:, :p_w] @ i_w + g_t[:, p_w:] @ i_theta).T
    h_pp = h_f.clone()
    h_pp[:p_w, :p_w] += 2 * ALPHA * torch.eye(p_w)
    d_phi = 2 * ALPHA * torch.linalg.solve(h_pp, torch.eye(h_f.shape[0])[:, :p_w]) @ i_w
    return (g_t @ d_phi).T


@pytest.fixture(scope="module", params=[1, 2])
def problem(request):
    case = request.param
    pre, fin, test = build(case)
    z = torch.arange(0, 60, 3)
    return case, pre, fin, test, z, explicit_scores(pre, fin, z, test, case)


@pytest.mark.parametrize("solver,rtol", [("direct", 1e-6), ("cg", 1e-5), ("minres", 1e-5)])
def test_scores_match_explicit_hessian_formulas(problem, solver, rtol):
    case, pre, fin, test, z, expected = problem
    kw = dict(shared="embedding", case=case, alpha=ALPHA, solve=ik.SolveConfig(solver=solver, damping=0.0), progress=False)
    summed = ik.score(pre, fin, z, test, **kw)
    assert summed.values.shape == (len(z),)
    assert (summed.values - expected.sum(1)).norm() / expected.sum(1).norm() <= rtol
    per = ik.score(pre, fin, z, test, per_test=True, **kw)
    assert per.values.shape == (len(z), len(test[0]))
    assert (per.values - expected).norm() / expected.norm() <= rtol
    # relative to the largest score: each solve is accurate to its tolerance, not each small entry to 1e-8
    assert (per.values.sum(1) - summed.values).abs().max() <= 1e-8 * summed.values.abs().max()
    assert torch.allclose(summed.removal, -summed.values / 60)
    assert all(solve["converged"] for solve in summed.diagnostics["solves"])


def test_gauss_newton_chain_matches_the_explicit_formula(problem):
    """CurvatureConfig(matrix="gauss-newton"): every stage's solve uses its Gauss-Newton matrix, the links stay exact."""
    case, pre, fin, test, z, _ = problem
    expected = explicit_scores(pre, fin, z, test, case, curvature=explicit_gauss_newton)
    chain = ik.Chain([pre, fin], [ik.Link("embedding", case=case, alpha=ALPHA)],
                     solve=ik.SolveConfig(solver="direct"), curvature=ik.CurvatureConfig(matrix="gauss-newton"))
    got = chain.query(test, per_test=True).scores(z).values
    assert (got - expected).norm() / expected.norm() <= 1e-8
    minres = ik.Chain([pre, fin], [ik.Link("embedding", case=case, alpha=ALPHA)],
                      solve=ik.SolveConfig(solver="cg_spd", tol=1e-12, preconditioner="kfac"),
                      curvature=ik.CurvatureConfig(matrix="gauss-newton"))
    assert (minres.query(test, per_test=True).scores(z).values - expected).norm() / expected.norm() <= 1e-7
    assert (expected - problem[5]).norm() / problem[5].norm() > 1e-3  # G ≠ H here: the test can tell them apart


def test_batched_equals_looped_and_mapping(problem):
    case, pre, fin, test, z, _ = problem
    kw = dict(case=case, alpha=ALPHA, solve=ik.SolveConfig(solver="direct", damping=0.0), progress=False)
    batched = ik.score(pre, fin, z, test, shared="embedding", **kw)
    looped = torch.cat([ik.score(pre, fin, z[i : i + 1], test, shared="embedding", **kw).values for i in range(4)])
    assert torch.allclose(batched.values[:4], looped, rtol=1e-10)
    mapping = {"embedding.0.weight": "embedding.0.weight", "embedding.0.bias": "embedding.0.bias"}
    assert torch.allclose(ik.score(pre, fin, z, test, shared=mapping, **kw).values, batched.values, rtol=1e-12)
    by_tensors = ik.score(pre, fin, pre.data.take(z), test, shared="embedding", **kw)
    assert torch.allclose(by_tensors.values, batched.values, rtol=1e-12)


def test_identity_ablation_differs_from_exact(problem):
    case, pre, fin, test, z, expected = problem
    ident = ik.score(pre, fin, z, test, shared="embedding", case=case, alpha=ALPHA, solve=ik.SolveConfig(solver="identity"), progress=False)
    assert ident.diagnostics["solves"][0]["solver"] == "identity"
    assert (ident.values - expected.sum(1)).norm() / expected.sum(1).norm() > 0.1


def _reoptimized_test_loss(pre, fin, test, z_index, eps, case):
    """Re-optimize pretraining with G + ε·g(z), then finetuning, exactly (Newton); return f(T)."""
    pre_model = EmbedHead(n_out=3).double()
    pre_model.load_state_dict(pre.model.state_dict())
    zx, zy = pre.data.take(torch.tensor([z_index]))
    extra = lambda p: eps * cross_entropy(torch.func.functional_call(pre_model, p, (zx,)), zy).sum()  # noqa: E731
    pert = ik.Stage(pre_model, cross_entropy, pre.data._tensors, regularizer=_with(pre.regularizer, extra))
    assert newton_refine(pert, steps=6) < 1e-12
    fin_model = EmbedHead(n_out=2).double()
    fin_model.load_state_dict(fin.model.state_dict())
    if case == 1:
        fin_model.embedding.load_state_dict(pre_model.embedding.state_dict())
        stage = ik.Stage(fin_model, cross_entropy, fin.data._tensors, params="head", regularizer=fin.regularizer)
    else:
        centre = {n: t.clone() for n, t in pert.state().items() if n.startswith("embedding")}
        stage = ik.Stage(fin_model, cross_entropy, fin.data._tensors, regularizer=_with(fin.regularizer, _proximal(centre)))
    assert newton_refine(stage, steps=6) < 1e-12
    return float(stage.losses(stage.trained(), *test).sum())


def test_finite_difference_of_reoptimized_test_loss(problem):
    case, pre, fin, test, z, _ = problem
    res = ik.score(pre, fin, z, test, shared="embedding", case=case, alpha=ALPHA, solve=ik.SolveConfig(solver="direct", damping=0.0), progress=False)
    eps = 1e-4
    for j in (0, 5):
        i = int(z[j])
        slope = (_reoptimized_test_loss(pre, fin, test, i, eps, case) - _reoptimized_test_loss(pre, fin, test, i, -eps, case)) / (2 * eps)
        assert abs(slope - float(res.values[j])) <= 1e-3 * abs(slope), (slope, float(res.values[j]))


def test_errors():
    pre, fin, test = build(1)
    z = torch.arange(5)
    with pytest.raises(ik.ParameterError, match="matches no parameter"):
        ik.score(pre, fin, z, test, shared="encoder", progress=False)
    with pytest.raises(ik.ParameterError, match="shape"):
        ik.score(pre, fin, z, test, shared={"head.weight": "head.weight"}, progress=False)
    with pytest.raises(ik.InputError, match="alpha"):
        ik.score(pre, fin, z, test, shared="embedding", case=2, alpha=-0.1, progress=False)
    with pytest.raises(ik.InputError, match="shape"):
        ik.score(pre, fin, z, (test[0][:, :3], test[1]), shared="embedding", progress=False)
    with pytest.raises(ik.InputError, match="shape"):
        ik.score(pre, fin, (pre.data._tensors[0][:4, :4], pre.data._tensors[1][:4]), test, shared="embedding", progress=False)
    with pytest.raises(ik.InputError, match="case"):
        ik.score(pre, fin, z, test, shared="embedding", case=3, progress=False)
    with pytest.raises(ik.InputError, match=r"pretrain must be an influkit.Stage.*influkit.Stage\(model, loss, data"):
        ik.score(pre.model, fin, z, test, shared="embedding", progress=False)
    with torch.no_grad():
        fin.model.embedding[0].weight.add_(0.01)
    with pytest.warns(UserWarning, match="pretrained weights were not copied"):
        ik.score(pre, fin, z, test, shared="embedding", solve=ik.SolveConfig(solver="direct"), progress=False)
