"""An embedding's padding row fed at used positions while training moves it (a tied decoder): the step's gradient
holds the fed row fixed, and the exact metagradient of a recorded torch.optim loop must still equal central finite
differences of the re-run training (influkit.unrolled.padding)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import influkit as ik

from conftest import cross_entropy

EPS = 1e-6


class TiedBag(nn.Module):
    """Mean of the token embeddings (padding row 0), a tanh layer, logits by the tied embedding matrix."""

    def __init__(self, vocabulary: int = 7, width: int = 3):
        super().__init__()
        self.embedding = nn.Embedding(vocabulary, width, padding_idx=0)
        self.mix = nn.Linear(width, width)

    def forward(self, ids):
        return torch.tanh(self.mix(self.embedding(ids).mean(1))) @ self.embedding.weight.T


def recorded() -> tuple[ik.unrolled.Record, tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 7, (12, 4), generator=gen)  # token 0, the padding row, fed at about one position in 7
    targets = torch.randint(1, 7, (12,), generator=gen)
    torch.manual_seed(0)
    model = TiedBag().double()
    with torch.no_grad():
        model.embedding.weight[0] = torch.randn(3, generator=gen, dtype=torch.float64)  # a row the output uses
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.05)
    loader = DataLoader(TensorDataset(ids, targets), batch_size=4, shuffle=True,
                        generator=torch.Generator().manual_seed(1))
    record = ik.unrolled.Record()
    with record.watch(model, optimizer, loader, cross_entropy, checkpoint_every=2):
        for _ in range(3):
            for x, y in loader:
                cross_entropy(model(x), y).mean().backward()
                optimizer.step()
                optimizer.zero_grad()
    assert bool((ids == 0).any(1).sum() >= 3)
    return record, (ids[:3], targets[:3])


def test_the_metagradient_through_a_fed_padding_row_equals_central_differences():
    record, test = recorded()
    assert record.runs[0].padding is not None
    scores = ik.unrolled.metagradients(record, test)[0]
    for z in range(12):
        values = []
        for eps in (EPS, -EPS):
            weights = torch.ones(12, dtype=torch.float64)
            weights[z] += eps
            values.append(float(ik.unrolled.outputs(record, test, [weights]).sum()))
        fd = (values[0] - values[1]) / (2 * EPS)
        rounding = 16 * torch.finfo(torch.float64).eps * max(map(abs, values)) / (2 * EPS)
        assert float(scores.values[z]) == pytest.approx(fd, rel=1e-6, abs=rounding), z


@pytest.mark.parametrize("pull", ["looped", "batched", "vmapped"])
def test_each_way_of_pulling_several_measures_carries_the_padding_row(pull):
    """q = 3 test points pulled each way: column j equals the one-measure metagradient of test point j alone (the
    path checked against finite differences above), with the fed padding row's cotangent in every way."""
    record, (x, y) = recorded()
    per_test = ik.unrolled.metagradients(record, (x, y), per_test=True, pull=pull)[0]
    assert per_test.diagnostics["pull"]["stages"] == [{"pull": pull, "trial": None}]
    for j in range(len(x)):
        alone = ik.unrolled.metagradients(record, (x[j:j + 1], y[j:j + 1]))[0]
        torch.testing.assert_close(per_test.values[:, j], alone.values, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_first_order_through_a_fed_padding_row_equals_the_exact_metagradient_of_one_step(optimizer):
    """One step from fixed initial weights has no curvature to drop: d f(θ_1) / d w_z is the step's pullback dotted
    with example z's gradient, whose padding row gets nothing from the positions that feed it. The first-order
    pass must follow the embedding's rule (it fails with a plain directional derivative of the loss)."""
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 7, (12, 4), generator=gen)
    targets = torch.randint(1, 7, (12,), generator=gen)
    torch.manual_seed(0)
    model = TiedBag().double()
    with torch.no_grad():
        model.embedding.weight[0] = torch.randn(3, generator=gen, dtype=torch.float64)
    opt = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if optimizer == "sgd"
           else torch.optim.AdamW(model.parameters(), lr=0.05))
    loader = DataLoader(TensorDataset(ids, targets), batch_size=12)
    record = ik.unrolled.Record()
    with record.watch(model, opt, loader, cross_entropy):
        for x, y in loader:
            cross_entropy(model(x), y).mean().backward()
            opt.step()
            opt.zero_grad()
    test = (ids[:3], targets[:3])
    exact = ik.unrolled.metagradients(record, test)[0].values
    first = ik.unrolled.first_order(record, test, progress=False)[0].values
    torch.testing.assert_close(first, exact, rtol=1e-10, atol=1e-14)
