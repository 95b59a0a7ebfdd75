"""The explicit-Hessian reference (influkit.validation.reference) against closed forms."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import influkit as ik
from influkit.validation.reference import explicit_gauss_newton, explicit_hessian
from conftest import cross_entropy, l2

LAMBDA = 0.3


def squared_error(outputs, targets):
    return 0.5 * ((outputs - targets) ** 2).sum(-1)


@pytest.fixture
def least_squares():
    """A 5→3 linear model under ½‖Wx + b − y‖² per example and (λ/2)‖θ‖²: H = I_3 ⊗ [[XᵀX, Σx], [Σxᵀ, n]]/n + λI."""
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(23, 5, generator=gen), torch.randn(23, 3, generator=gen)
    torch.manual_seed(0)
    model = nn.Linear(5, 3).double()
    return ik.Stage(model, squared_error, (x, y), regularizer=l2(LAMBDA), batch_size=4), x


def closed_form(x: torch.Tensor, weight_only: bool = False) -> torch.Tensor:
    """H over (weight (3, 5) row-major, bias (3,)) of the least-squares objective on the rows of x."""
    n, d = x.shape
    eye = torch.eye(3, dtype=x.dtype)
    ww = torch.kron(eye, x.T @ x / n)
    if weight_only:
        return ww + LAMBDA * torch.eye(3 * d)
    wb = torch.kron(eye, x.mean(0)[:, None])  # (3d, 3): ∂²/∂W[o, j]∂b[o'] = δ_oo' mean x_j
    top = torch.cat([ww, wb], 1)
    bottom = torch.cat([wb.T, eye], 1)
    return torch.cat([top, bottom], 0) + LAMBDA * torch.eye(3 * d + 3)


def test_matches_the_closed_form_hessian(least_squares):
    stage, x = least_squares
    torch.testing.assert_close(explicit_hessian(stage), closed_form(x), rtol=1e-12, atol=1e-12)


def test_names_indices_and_chunks(least_squares):
    stage, x = least_squares
    idx = torch.tensor([0, 3, 4, 9, 17, 22])
    torch.testing.assert_close(explicit_hessian(stage, indices=idx), closed_form(x[idx]), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(explicit_hessian(stage, ["weight"]), closed_form(x, weight_only=True), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(explicit_hessian(stage, chunk_size=5), explicit_hessian(stage, chunk_size=None), rtol=1e-13, atol=1e-14)


def test_extra_term_adds_its_hessian(least_squares):
    stage, x = least_squares
    proximal = lambda p: 0.7 * (p["bias"] ** 2).sum()  # noqa: E731  (Hessian 1.4 on the bias block)
    expected = closed_form(x)
    expected[15:, 15:] += 1.4 * torch.eye(3)
    torch.testing.assert_close(explicit_hessian(stage, extra=proximal), expected, rtol=1e-12, atol=1e-12)


def test_cross_entropy_hessian_is_the_softmax_kronecker_form():
    """Multinomial logistic regression without bias: H = (1/n) Σ_i (diag(π_i) − π_i π_iᵀ) ⊗ x_i x_iᵀ."""
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(17, 4, generator=gen), torch.randint(0, 3, (17,), generator=gen)
    torch.manual_seed(1)
    model = nn.Linear(4, 3, bias=False).double()
    stage = ik.Stage(model, cross_entropy, (x, y))
    probs = torch.softmax(x @ model.weight.detach().T, dim=1)
    expected = sum(torch.kron(torch.diag(pi) - torch.outer(pi, pi), torch.outer(xi, xi)) for pi, xi in zip(probs, x)) / 17
    torch.testing.assert_close(explicit_hessian(stage), expected, rtol=1e-12, atol=1e-13)


def test_layer_norm_network_matches_central_differences_of_the_gradient():
    """Linear → LayerNorm → tanh → Linear, the LayerNorm's affine weights trained: the network where
    ``torch.func.hessian`` (jacfwd of jacrev) is wrong in torch 2.13. Every column of the reference must equal
    a central difference of the autograd gradient, and the matrix must be symmetric."""
    gen = torch.Generator().manual_seed(2)
    x, y = torch.randn(10, 5, generator=gen), torch.randint(0, 3, (10,), generator=gen)
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(5, 6), nn.LayerNorm(6), nn.Tanh(), nn.Linear(6, 3)).double()
    with torch.no_grad():
        model[1].weight.normal_()
        model[1].bias.normal_()
    stage = ik.Stage(model, cross_entropy, (x, y), regularizer=l2(LAMBDA))
    h = explicit_hessian(stage)
    names = list(stage.param_names)
    shapes = [stage.state()[n].shape for n in names]
    flat = torch.cat([stage.state()[n].reshape(-1) for n in names])

    def gradient(v: torch.Tensor) -> torch.Tensor:
        params = dict(zip(names, (t.reshape(s) for t, s in zip(torch.split(v, [s.numel() for s in shapes]), shapes))))
        return torch.func.grad(stage.objective)(params)

    def flat_gradient(v: torch.Tensor) -> torch.Tensor:
        return torch.cat([gradient(v)[n].reshape(-1) for n in names])

    eps = 1e-5
    columns = [(flat_gradient(flat + eps * e) - flat_gradient(flat - eps * e)) / (2 * eps) for e in torch.eye(len(flat))]
    torch.testing.assert_close(h, torch.stack(columns, 1), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(h, h.T, rtol=0, atol=1e-12)


def test_gauss_newton_of_least_squares_is_the_closed_form(least_squares):
    """A linear model under squared error: G = H, the closed form, on all examples and on a subset."""
    stage, x = least_squares
    torch.testing.assert_close(explicit_gauss_newton(stage), closed_form(x), rtol=1e-12, atol=1e-12)
    idx = torch.tensor([0, 3, 4, 9, 17])
    torch.testing.assert_close(explicit_gauss_newton(stage, indices=idx), closed_form(x[idx]), rtol=1e-12, atol=1e-12)


def test_refuses_bad_arguments(least_squares):
    stage, _ = least_squares
    with pytest.raises(ik.InputError, match="chunk_size"):
        explicit_hessian(stage, chunk_size=0)
    with pytest.raises(ik.InputError, match="no examples"):
        explicit_hessian(stage, indices=torch.tensor([], dtype=torch.long))
