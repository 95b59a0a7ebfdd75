"""The summed test gradient with Kronecker blocks kept as token factors (influkit/factored/tokens.py): in float64
it is the autograd gradient, and the EK-FAC query solved from the factors is (C + λI)⁻¹ b from the dense C."""

import warnings

import pytest
import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

import influkit as ik
import influkit.hf  # noqa: F401  registers transformers' Conv1D as a layer
from influkit.factored.tokens import token_gradient
from influkit.gradients import total_grad
from conftest import cross_entropy


class TokenNet(nn.Module):
    """Embedding → Linear → GPT-2 Conv1D (weight stored (in, out)) → a bias-free Linear called twice → mean over
    tokens → Linear, times a free scale: factored blocks of both orientations, one formed from its factors (two
    calls, more tokens than its dimensions), an embedding and a diagonal block."""

    def __init__(self, leak: bool = False):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.up = nn.Linear(6, 16)
        self.conv = Conv1D(6, 16)
        self.shared = nn.Linear(6, 6, bias=False)
        self.head = nn.Linear(6, 3)
        self.scale = nn.Parameter(torch.tensor([1.3, 0.7, 1.0]))
        self.leak = leak

    def forward(self, ids):
        h = torch.tanh(self.up(self.emb(ids)))
        h = torch.tanh(self.conv(h))
        h = self.shared(torch.tanh(self.shared(h)))
        if self.leak:  # the shared weight also used outside its module's forward: hooks miss this term
            h = h + 0.3 * nn.functional.linear(h, self.shared.weight)
        return self.head(h.mean(1)) * self.scale


def fitted(leak: bool = False):
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 11, (40, 3), generator=gen)
    y = torch.randint(0, 3, (40,), generator=gen)
    stage = ik.Stage(TokenNet(leak).double().eval(), cross_entropy, (ids, y), batch_size=16)
    chain = ik.Chain([stage], solve=ik.SolveConfig(solver="ekfac", damping=0.1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # not at a minimum (random weights): the solve is what is tested
        chain.fit()
    test = (torch.randint(0, 11, (2, 3), generator=gen), torch.randint(0, 3, (2,), generator=gen))
    return stage, chain, test


@pytest.mark.parametrize("chunk_size", [None, 1])
def test_token_gradient_is_the_autograd_gradient(chunk_size):
    stage, chain, (tx, ty) = fitted()
    curvature = chain.curvature(0).approximations["ekfac"]
    tokens = token_gradient(stage, tx, ty, stage.param_names, curvature, chunk_size=chunk_size)
    assert sorted(tokens.factors) == ["conv", "head", "up"]  # "shared": 12 tokens, cheaper formed
    u, v = tokens.factors["conv"]
    assert (u.shape, v.shape) == ((6, 17), (6, 6))  # inputs first: [a; 1] rows of M = [W; bᵀ]
    expected = total_grad(stage, tx, ty, stage.param_names)
    torch.testing.assert_close(tokens.dense(curvature), expected, rtol=1e-12, atol=1e-14)


def test_query_from_token_factors_equals_the_dense_ekfac_solve():
    stage, chain, (tx, ty) = fitted()
    curvature = chain.curvature(0).approximations["ekfac"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        query = chain.query((tx, ty))
    assert query.solves[0]["token_factors"] == ["conv", "head", "up"]
    b = total_grad(stage, tx, ty, stage.param_names)
    dense = torch.linalg.solve(curvature.dense() + 0.1 * torch.eye(curvature.dim, dtype=torch.float64), b)
    torch.testing.assert_close(query.s, dense, rtol=1e-10, atol=1e-13)


def test_a_weight_used_outside_its_module_falls_back_to_the_autograd_gradient():
    stage, chain, (tx, ty) = fitted(leak=True)
    curvature = chain.curvature(0).approximations["ekfac"]
    assert token_gradient(stage, tx, ty, stage.param_names, curvature) is None  # the rank-one check caught it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        query = chain.query((tx, ty))
    assert query.solves[0]["token_factors"] == []
    b = total_grad(stage, tx, ty, stage.param_names)
    torch.testing.assert_close(query.s, curvature.solve(b, 0.1), rtol=1e-12, atol=1e-14)


def test_factors_only_for_the_factored_inverse_without_residual():
    stage, chain, (tx, ty) = fitted()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        checked = chain.with_solve(ik.SolveConfig(solver="ekfac", damping=0.1, residual=True))
        plain, factored = checked.query((tx, ty)), chain.query((tx, ty))
    assert plain.solves[0]["token_factors"] == []
    with pytest.raises(ik.InfluenceError, match="dense right-hand side"):
        checked._query_solver(0, 1).solve(torch.zeros(plain.s.shape[0]),
                                          factors={"up": (torch.zeros(1, 16), torch.zeros(1, 7))})
    torch.testing.assert_close(factored.s, plain.s, rtol=1e-10, atol=1e-13)
    solver = chain._query_solver(0, 1)
    with pytest.raises(ik.InfluenceError, match="one right-hand side"):
        solver.approximation.solve(torch.zeros(solver.operator.dim, 2), 0.1,
                                   {"up": (torch.zeros(1, 16), torch.zeros(1, 7))})
