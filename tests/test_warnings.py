"""Every warning influkit gives points at the caller's line and suggests remedies that work on the case that raised it.

Each test raises a warning on a small real case (digits models trained by a few Adam steps, so not at a minimum;
a singular logistic regression; a finetuning model whose encoder was never copied; ...), checks that the message
names the cause and that the warning is attributed to this file (``influkit.errors.warn``: the first frame outside
influkit, however deep the call), then applies each remedy the message suggests to the same case and checks that
it succeeds — converged to the tolerance, the warning gone.
"""

from __future__ import annotations

import re
import warnings

import numpy as np
import pytest
import torch
from torch import nn

import influkit as ik
from influkit.errors import ConvergenceWarning
from influkit.factored import fit_curvature
from influkit.training import fit_lbfgs, train_adam

from conftest import cross_entropy, digits, explicit_hessian, l2


def caught(fn, category=Warning):
    """(result of fn(), the warnings of ``category`` it gave), without the StationarityWarning every fit of these
    Adam-trained stages gives (where a stage stands is its own warning, tests/test_stationarity.py)."""
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        warnings.simplefilter("ignore", ik.StationarityWarning)
        out = fn()
    return out, [w for w in record if issubclass(w.category, category)]


def only(record, match: str):
    """The one warning of ``record`` that matches, all of them pointing at this file."""
    assert record and all(w.filename == __file__ for w in record), [(w.filename, str(w.message)) for w in record]
    hits = [str(w.message) for w in record if re.search(match, str(w.message))]
    assert len(hits) == 1, [str(w.message) for w in record]
    return hits[0]


def adam_mlp(decay: float | None) -> tuple[ik.Stage, tuple]:
    """A tanh MLP (p = 610) on 60 real digits after 30 full-batch Adam steps: not at a minimum, H indefinite."""
    x, y = digits(60, seed=1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 8), nn.Tanh(), nn.Linear(8, 10)).double()
    stage = ik.Stage(model, cross_entropy, (x, y), regularizer=None if decay is None else l2(decay))
    train_adam(stage, steps=30, lr=1e-2, batch_size=60)
    return stage, digits(8, seed=2)


@pytest.fixture(scope="module")
def unregularized():
    """Indefinite and (numerically) singular: MINRES stalls on it."""
    return adam_mlp(None)


@pytest.fixture(scope="module")
def regularized():
    """Indefinite and nonsingular (L2 1e-2): MINRES converges on it, plain CG meets negative curvature."""
    return adam_mlp(1e-2)


def solve(stage, test, matrix="hessian", **settings):
    curvature = ik.CurvatureConfig(matrix=matrix)
    return ik.Chain([stage], solve=ik.SolveConfig(**settings), curvature=curvature).query(test).solves[0]


def test_minres_stalled_by_an_indefinite_hessian_points_to_gauss_newton(unregularized):
    stage, test = unregularized
    sol, record = caught(lambda: solve(stage, test, solver="minres"), ConvergenceWarning)
    message = only(record, r"is indefinite .* not at a minimum")
    assert sol["residual"] > 1e-2 and "raise max_iter" not in message
    # remedy 1, as written in the message: the Gauss-Newton matrix with the damping it names
    damping = float(re.search(r"matrix='gauss-newton'\) with SolveConfig\(damping=([0-9.e+-]+)\)", message).group(1))
    norm = float(torch.linalg.eigvalsh(explicit_hessian(stage)).abs().max())
    assert damping == pytest.approx(1e-3 * norm, rel=0.05)  # "1e-3 of ‖H‖" is what it says
    fixed, record = caught(lambda: solve(stage, test, solver="minres", matrix="gauss-newton", damping=damping))
    assert not record and fixed["residual"] <= 1e-10
    # remedy 2: damping above |λ_min(H)|
    lowest = float(torch.linalg.eigvalsh(explicit_hessian(stage))[0])
    assert lowest < 0
    fixed, record = caught(lambda: solve(stage, test, solver="minres", damping=-1.5 * lowest))
    assert not record and fixed["residual"] <= 1e-10


def test_negative_ritz_values_are_counted_by_inertia():
    """The indefiniteness MINRES reports: negative pivots of its Lanczos tridiagonal = its negative eigenvalues."""
    from influkit.krylov import negative_ritz_values

    gen = torch.Generator().manual_seed(0)
    for shift in torch.linspace(-1.0, 2.0, 13):
        alfa = torch.randn(2, 30, generator=gen, dtype=torch.float64) + shift
        beta = torch.rand(2, 30, generator=gen, dtype=torch.float64)
        steps = torch.tensor([30, 24])
        counts = [int((torch.linalg.eigvalsh(torch.diag(alfa[j, :k]) + torch.diag(beta[j, : k - 1], 1)
                                             + torch.diag(beta[j, : k - 1], -1)) < 0).sum())
                  for j, k in enumerate(steps.tolist())]
        assert negative_ritz_values((alfa, beta, steps)) == max(counts)


def test_plain_cg_meeting_negative_curvature_says_so_once_and_its_remedies_work(regularized):
    stage, test = regularized
    _, record = caught(lambda: solve(stage, test, solver="cg_spd"), ConvergenceWarning)
    message = only(record, r"negative curvature: H \+ λI \(λ = 0\) is not positive definite")
    assert "raise max_iter" not in message
    for solver in ("minres", "cg"):  # "solver='minres' (or 'cg', on H²)"
        fixed, record = caught(lambda: solve(stage, test, solver=solver))
        assert not record and fixed["residual"] <= 1e-10, solver
    norm = float(torch.linalg.eigvalsh(explicit_hessian(stage)).abs().max())
    fixed, record = caught(lambda: solve(stage, test, solver="cg_spd", matrix="gauss-newton", damping=1e-3 * norm))
    assert not record and fixed["residual"] <= 1e-10


def test_positive_definite_stall_asks_only_for_more_iterations(regularized):
    """At a minimum (L-BFGS to convergence, L2): nothing indefinite to report; raising max_iter converges."""
    stage, test = regularized
    stage = stage.with_(model=nn.Sequential(nn.Linear(64, 8), nn.Tanh(), nn.Linear(8, 10)).double())
    stage.model.load_state_dict(regularized[0].model.state_dict())
    fit_lbfgs(stage, max_iter=2000)
    for solver in ("minres", "cg_spd"):
        _, record = caught(lambda: solve(stage, test, solver=solver, max_iter=20), ConvergenceWarning)
        only(record, r"raise max_iter \(no negative curvature was met\)")
        fixed, record = caught(lambda: solve(stage, test, solver=solver, max_iter=2000))
        assert not record and fixed["residual"] <= 1e-10
    _, record = caught(lambda: solve(stage, test, solver="cg", max_iter=20), ConvergenceWarning)
    only(record, r"raise max_iter, or use solver='minres'")
    _, record = caught(lambda: solve(stage, test, solver="lissa", max_iter=20), ConvergenceWarning)
    only(record, r"use solver='minres'")  # minres converging with the default max_iter is checked just above


def test_float32_floor_names_the_reachable_tol_and_float64():
    x, y = digits()
    torch.manual_seed(0)
    model = nn.Linear(64, 10).float()
    stage = ik.Stage(model, cross_entropy, (x[:300].float(), y[:300]), regularizer=l2(1e-2))
    fit_lbfgs(stage, max_iter=500)
    test = (x[300:310].float(), y[300:310])
    _, record = caught(lambda: solve(stage, test, solver="minres", tol=1e-9), ConvergenceWarning)
    message = only(record, r"floor float32 arithmetic can certify .* or compute in float64")
    tol = float(re.search(r"pass tol ≥ ([0-9.e+-]+)", message).group(1))
    fixed, record = caught(lambda: solve(stage, test, solver="minres", tol=tol))
    assert not record and fixed["residual"] <= tol
    wide = ik.Stage(model.double(), cross_entropy, (x[:300], y[:300]), regularizer=l2(1e-2))
    fixed, record = caught(lambda: solve(wide, (x[300:310], y[300:310]), solver="minres", tol=1e-9))
    assert not record and fixed["residual"] <= 1e-9


def test_singular_hessian_warning_asks_for_damping_only_when_there_is_none():
    """2 examples, 18 parameters: H ⪰ 0 of rank ≤ 2 — singular without damping; the damping it names fixes it."""
    gen = torch.Generator().manual_seed(0)
    stage = ik.Stage(nn.Linear(8, 2).double(), cross_entropy, (torch.randn(2, 8, generator=gen), torch.tensor([0, 1])))
    test = (torch.randn(3, 8, generator=gen), torch.tensor([0, 1, 1]))
    _, record = caught(lambda: solve(stage, test, solver="direct"), ConvergenceWarning)
    message = only(record, r"the Hessian is singular: .* add damping")
    damping = float(re.search(r"damping=([0-9.e+-]+),", message).group(1))
    fixed, record = caught(lambda: solve(stage, test, solver="direct", damping=damping))
    assert not record and fixed["residual"] <= 1e-12


def test_eigenvalues_at_minus_the_damping_are_blamed_on_the_indefinite_hessian(unregularized):
    stage, test = unregularized
    evals = torch.linalg.eigvalsh(explicit_hessian(stage))
    damping = -float(evals[3])  # H + λI has an exact zero eigenvalue although λ > 0
    _, record = caught(lambda: solve(stage, test, solver="direct", damping=damping), ConvergenceWarning)
    message = only(record, r"the Hessian is indefinite: .* not at a minimum")
    assert not any("singular" in str(w.message) or "dd damping" in str(w.message) for w in record)
    gauss_newton = float(re.search(r"matrix='gauss-newton'\) with SolveConfig\(damping=([0-9.e+-]+)\)", message).group(1))
    fixed, record = caught(lambda: solve(stage, test, solver="direct", matrix="gauss-newton", damping=gauss_newton))
    assert not record and fixed["residual"] <= 1e-12
    above = float(re.search(r"damping > ([0-9.e+-]+)", message).group(1))
    assert above == pytest.approx(-float(evals[0]), rel=1e-2)
    fixed, record = caught(lambda: solve(stage, test, solver="direct", damping=1.01 * above))
    assert not record and fixed["residual"] <= 1e-12


class Net(nn.Module):
    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.enc = nn.Linear(5, 4)
        self.head = nn.Linear(4, 10)

    def forward(self, x):
        return self.head(torch.tanh(self.enc(x)))


def test_case1_block_that_differs_names_the_uncopied_encoder_first():
    x, y = digits(40)
    x = x[:, :5]
    pre = ik.Stage(Net(0).double(), cross_entropy, (x, y), regularizer=l2(1e-2))
    fin_model = Net(1).double()  # its encoder was never loaded from the pretrained one
    fin = ik.Stage(fin_model, cross_entropy, (x, y), params="head", regularizer=l2(1e-2))
    _, record = caught(lambda: ik.Chain([pre, fin], [ik.Link("enc", case=1)]), UserWarning)
    message = only(record, r"pretrained weights were not copied")
    assert message.index("not copied") < message.index("case=2")
    fin_model.enc.load_state_dict(pre.model.enc.state_dict())  # the remedy it names first
    _, record = caught(lambda: ik.Chain([pre, fin], [ik.Link("enc", case=1)]))
    assert not record
    fin_model.enc.weight.data.add_(0.01)  # finetuned on purpose: the other remedy
    _, record = caught(lambda: ik.Chain([pre, fin], [ik.Link("enc", case=2, alpha=0.1)]))
    assert not record


def test_wide_layer_warning_remedies_factor_it():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 64), nn.Tanh(), nn.Linear(64, 8), nn.Tanh(), nn.Linear(8, 3)).double().eval()
    stage = ik.Stage(model, nn.CrossEntropyLoss(reduction="none"),
                     (torch.randn(30, 6, dtype=torch.float64), torch.randint(0, 3, (30,))))
    budget = 400_000  # an eighth of it is less than the 64-wide layers' factors (66 and 69 kB)
    _, record = caught(lambda: fit_curvature(stage, kind="ekfac", memory=budget), UserWarning)
    assert {str(w.message).split(" ")[1] for w in record} == {"0", "2"}
    assert all("raise memory= or max_factor_bytes=" in str(w.message) and w.filename == __file__ for w in record)
    for remedy in ({"memory": 64 * budget}, {"memory": budget, "max_factor_bytes": 10**7}):
        curvature, record = caught(lambda: fit_curvature(stage, kind="ekfac", **remedy))
        assert not record and curvature.info["memory"]["diagonal_layers"] == [], remedy


def test_unvectorizable_loss_warning_points_here_and_the_rewrite_vectorizes(mlp_stage):
    from influkit.gradients import per_example_grads

    def branching(outputs, targets):
        scale = 2.0 if outputs.abs().max().item() > 1e9 else 1.0
        return nn.functional.cross_entropy(outputs * scale, targets, reduction="none")

    def rewritten(outputs, targets):  # "torch.where instead of if"
        scale = torch.where(outputs.abs().max() > 1e9, 2.0, 1.0)
        return nn.functional.cross_entropy(outputs * scale, targets, reduction="none")

    x, y = mlp_stage.data.take(torch.arange(6))
    slow, record = caught(lambda: per_example_grads(ik.Stage(mlp_stage.model, branching, (x, y)), x, y), ik.VectorizationWarning)
    only(record, r"torch.where instead of if")
    fast, record = caught(lambda: per_example_grads(ik.Stage(mlp_stage.model, rewritten, (x, y)), x, y))
    assert not record
    torch.testing.assert_close(fast, slow, rtol=1e-12, atol=1e-14)


def test_masking_without_special_tokens_warns_here_and_the_named_argument_fixes_it():
    from influkit.hf.masking import mask_tokens

    ids = torch.randint(5, 30, (4, 10), generator=torch.Generator().manual_seed(0))
    common = dict(mask_token_id=4, vocab_size=30)
    _, record = caught(lambda: mask_tokens(ids, None, torch.arange(4), **common), UserWarning)
    only(record, r"pass special_token_ids=")
    _, record = caught(lambda: mask_tokens(ids, None, torch.arange(4), special_token_ids=(0, 1, 2, 3, 4), **common))
    assert not record


def test_lds_and_contraction_warnings_point_here():
    from influkit.contraction import ContractionWarning, Contractor
    from influkit.validation.lds import lds

    subsets = torch.rand(6, 10, generator=torch.Generator().manual_seed(0)) < 0.5
    outputs = np.stack([np.linspace(0, 1, 6), np.ones(6)], axis=1)  # the second query is constant over subsets
    _, record = caught(lambda: lds(np.random.default_rng(0).normal(size=(10, 2)), subsets, outputs), UserWarning)
    only(record, r"1 of 2 queries have constant outputs")

    class Untracked(nn.Module):  # a parameter used through F.linear, outside its module's forward
        def __init__(self):
            super().__init__()
            self.inner = nn.Linear(3, 2)

        def forward(self, x):
            return self.inner(x) + nn.functional.linear(x, self.inner.weight)

    torch.manual_seed(0)
    stage = ik.Stage(Untracked().double(), cross_entropy, (torch.randn(6, 3), torch.randint(0, 2, (6,))))
    x, y = stage.data.take(torch.arange(6))
    _, record = caught(lambda: Contractor(stage)(x, y, torch.randn(stage.num_trained, 1)), ContractionWarning)
    only(record, r"outside its module's forward")
