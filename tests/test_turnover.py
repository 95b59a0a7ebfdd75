"""Tests of influkit.turnover: masks (Philox, volatile, hashed), the layer's scaling, routing, influence."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import cross_entropy as ce
from conftest import need
from torch import nn

import influkit as ik
from influkit.errors import InputError, LossError, ModelModeError
from influkit.turnover import (
    HashedMasks,
    IndexedDataset,
    TurnOverDropout,
    VolatileMasks,
    epoch_order,
    influence,
    model_with_ids,
    self_influence,
    train_turnover,
    turnover_layers,
)


def mlp(p=0.5, masks=None, seed=0, d_in=5, hidden=16, classes=3):
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(d_in, hidden), nn.ReLU(), TurnOverDropout(p, masks=masks), nn.Linear(hidden, classes)
    ).double()


def toy_data(n=40, d_in=5, classes=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d_in, generator=g, dtype=torch.float64), torch.randint(classes, (n,), generator=g)


# ---------------------------------------------------------------- volatile masks (Philox words: test_philox.py)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("masks", [VolatileMasks(seed=3), HashedMasks(seed=3, codebook_size=64, n_hashes=2)])
def test_masks_identical_on_cpu_and_gpu(masks):
    ids = torch.arange(50)
    cpu = masks.keep(ids, 1, 100, 0.3)
    gpu = masks.keep(ids.cuda(), 1, 100, 0.3)
    assert torch.equal(cpu, gpu.cpu())


@pytest.mark.parametrize("make", [lambda: VolatileMasks(seed=5), lambda: HashedMasks(seed=5, codebook_size=96)])
def test_masks_deterministic_and_independent_of_the_batch(make):
    ids = torch.tensor([3, 900, 12, 3, 45])
    first = make().keep(ids, 2, 40, 0.5)
    again = make().keep(ids, 2, 40, 0.5)  # a fresh generator: nothing is stored between calls
    assert torch.equal(first, again)
    assert torch.equal(first[0], first[3])  # same example, same mask
    alone = make().keep(ids[[2]], 2, 40, 0.5)  # a mask does not depend on its batch-mates
    assert torch.equal(alone[0], first[2])


@pytest.mark.parametrize("make", [lambda: VolatileMasks(seed=1), lambda: HashedMasks(seed=1)])
def test_masks_distinct_across_examples_layers_and_seeds(make):
    gen = make()
    ids = torch.arange(300)
    keep = gen.keep(ids, 0, 128, 0.5)
    assert torch.unique(keep, dim=0).shape[0] == 300
    # two independent Bernoulli(1/2) masks agree on half their units on average
    agree = (keep[:150] == keep[150:]).double().mean()
    assert abs(float(agree) - 0.5) < 0.02
    assert not torch.equal(keep, gen.keep(ids, 1, 128, 0.5))
    other = VolatileMasks(seed=2) if isinstance(gen, VolatileMasks) else HashedMasks(seed=2)
    assert not torch.equal(keep, other.keep(ids, 0, 128, 0.5))


def assert_binomial_rate(successes: int, trials: int, rate: float) -> None:
    ci = need("scipy.stats").binomtest(successes, trials).proportion_ci(confidence_level=0.9999)
    assert ci.low <= rate <= ci.high, (successes / trials, rate, ci)


@pytest.mark.parametrize("keep_rate", [0.2, 0.5, 0.9])
def test_volatile_keep_rate_within_binomial_ci(keep_rate):
    keep = VolatileMasks(seed=11).keep(torch.arange(200), 0, 500, keep_rate)
    assert_binomial_rate(int(keep.sum()), keep.numel(), keep_rate)
    per_example = keep.double().mean(dim=1)  # every example's own rate too (500 trials each, 5 sigma)
    assert (per_example - keep_rate).abs().max() < 5 * math.sqrt(keep_rate * (1 - keep_rate) / 500)


@pytest.mark.parametrize("keep_rate,n_hashes", [(0.2, 3), (0.5, 2), (0.9, 4)])
def test_hashed_keep_rate_within_binomial_ci_and_memory_is_codebook_sized(keep_rate, n_hashes):
    gen = HashedMasks(seed=4, codebook_size=120, n_hashes=n_hashes)
    # Given the example's k distinct rows, its units are independent Bernoulli(q^(1/k))^k = Bernoulli(q).
    keep = gen.keep(torch.tensor([0, 1, 2, 3, 10**6]), 0, 20000, keep_rate)
    for row in keep:
        assert_binomial_rate(int(row.sum()), row.numel(), keep_rate)
    book = gen.codebook(20000, keep_rate)
    assert_binomial_rate(int(book.sum()), book.numel(), keep_rate ** (1 / n_hashes))
    assert gen.state_bytes() == 120 * 20000  # O(K·d) bytes, whatever the number of examples


def test_hashed_rows_are_distinct_per_example_and_within_their_blocks():
    gen = HashedMasks(seed=0, codebook_size=30, n_hashes=3)
    rows = gen.rows(torch.arange(1000), layer_id=0)
    block = torch.div(rows, 10, rounding_mode="floor")
    assert torch.equal(block, torch.arange(3).expand_as(block))
    assert rows.min() >= 0 and rows.max() < 30
    assert not torch.equal(rows, gen.rows(torch.arange(1000), layer_id=1))


def test_mask_ids_are_validated():
    with pytest.raises(InputError):
        VolatileMasks().keep(torch.tensor([-1, 2]), 0, 4, 0.5)
    with pytest.raises(InputError):
        VolatileMasks().keep(torch.tensor([0.5]), 0, 4, 0.5)
    with pytest.raises(InputError):
        VolatileMasks().keep(torch.tensor([1]), 0, 4, 1.0)


# ---------------------------------------------------------------- the layer: complement, scaling, routing


@pytest.mark.parametrize("masks", [VolatileMasks(seed=2), HashedMasks(seed=2, codebook_size=60)])
def test_flipped_mask_is_the_exact_complement(masks):
    layer = TurnOverDropout(0.3, masks=masks, layer_id=4).eval()
    x = torch.ones(50, 7, 3, dtype=torch.float64)
    ids = torch.arange(100, 150)
    with model_with_ids(layer, ids):
        own = layer(x)
    with model_with_ids(layer, ids, flip=True):
        flipped = layer(x)
    keep = layer.keep_mask(ids, 21).reshape(x.shape)
    assert torch.equal(own > 0, keep)
    assert torch.equal(flipped > 0, ~keep)
    assert torch.allclose(own * 0.7 + flipped * 0.3, x)  # m/q·q + (1−m)/p·p = 1 for every unit


@pytest.mark.parametrize("p", [0.1, 0.5, 0.8])
@pytest.mark.parametrize("flip", [False, True])
def test_mean_masked_output_matches_eval_output(p, flip):
    layer = TurnOverDropout(p, masks=VolatileMasks(seed=9)).eval()
    x = torch.linspace(-2.0, 3.0, 64, dtype=torch.float64)
    n = 20000
    with model_with_ids(layer, torch.arange(n), flip=flip):
        mean = layer(x.expand(n, 64)).mean(dim=0)
    full = layer(x)  # no ids: the full network
    assert torch.equal(full, x)
    kept = p if flip else 1 - p
    sigma = x.abs() * math.sqrt((1 - kept) / kept / n)
    assert ((mean - full).abs() <= 5 * sigma + 1e-12).all()
    if flip and p != 0.5:  # one factor 1/(1−p) for both masks would bias the flipped sub-network
        naive = mean * p / (1 - p)
        assert not ((naive - full).abs() <= 5 * sigma + 1e-12).all()


def test_routing_reaches_every_layer_and_is_undone():
    model = nn.Sequential(nn.Linear(4, 8), TurnOverDropout(0.5), nn.Linear(8, 8), TurnOverDropout(0.2, layer_id=0))
    layers = turnover_layers(model)
    assert [layer.layer_id for layer in layers] == [1, 0]  # unnumbered layers get free ids in module order
    ids = torch.tensor([3, 4])
    with model_with_ids(model, ids, flip=True):
        assert all(layer.ids is ids and layer.flip for layer in layers)
    assert all(layer.ids is None and not layer.flip for layer in layers)
    x = torch.randn(2, 4)
    model.eval()
    assert torch.equal(model(x), model[2](model[0](x)))  # without ids: identity
    model.train()
    with pytest.raises(ModelModeError):
        model(x)
    with pytest.raises(InputError), model_with_ids(model, torch.tensor([1, 2, 3])):
        model(x)


def test_own_training_step_only_touches_weights_in_its_mask():
    model = mlp(p=0.5, hidden=64)
    x, y = toy_data(n=1)
    with model_with_ids(model, torch.tensor([7])):
        ce(model(x), y).sum().backward()
    keep = model[2].keep_mask(torch.tensor([7]), 64)[0]
    grad_out, grad_in = model[3].weight.grad, model[0].weight.grad
    assert (grad_out[:, ~keep] == 0).all() and (grad_in[~keep] == 0).all()
    hidden = torch.relu(model[0](x))[0]
    assert (grad_out[:, keep & (hidden > 0)] != 0).all()

    # a full Adam step through train_turnover leaves the dropped columns untouched
    model = mlp(p=0.5, hidden=64)
    before = model[3].weight.detach().clone()
    data = toy_data(n=1)
    train_turnover(model, ce, data, epochs=1, batch_size=1, progress=False)
    keep = model[2].keep_mask(torch.tensor([0]), 64)[0]
    after = model[3].weight.detach()
    assert torch.equal(after[:, ~keep], before[:, ~keep])
    assert not torch.equal(after[:, keep], before[:, keep])


# ---------------------------------------------------------------- influence


def hand_losses(model, x, y, keep, p, flip):
    """Loss of the MLP on x with an explicit mask (or its complement), scaled by hand."""
    hidden = torch.relu(model[0](x))
    sub = (~keep).double() / p if flip else keep.double() / (1 - p)
    return ce(model[3](hidden * sub), y)


@pytest.mark.parametrize("masks", [VolatileMasks(seed=1), HashedMasks(seed=1, codebook_size=48)])
def test_influence_equals_loss_difference_by_hand(masks):
    model = mlp(p=0.4, masks=masks)
    x_train, y_train = toy_data(n=30)
    train_turnover(model, ce, (x_train, y_train), epochs=3, batch_size=8, progress=False)
    x_test, y_test = toy_data(n=6, seed=2)
    ids = torch.tensor([0, 5, 29, 11])
    res = influence(model, ids, (x_test, y_test), measure=ce, n_train=30, per_test=True, batch_size=5, progress=False)
    assert res.values.shape == (4, 6) and res.n_train == 30
    with torch.no_grad():
        for row, i in enumerate(ids):
            keep = model[2].keep_mask(i.reshape(1), 16).expand(6, 16)
            want = hand_losses(model, x_test, y_test, keep, 0.4, False) - hand_losses(model, x_test, y_test, keep, 0.4, True)
            assert torch.allclose(res.values[row], want, atol=1e-12)
    summed = influence(model, ids, (x_test, y_test), measure=ce, n_train=30, batch_size=1000, progress=False)
    assert torch.allclose(summed.values, res.values.sum(dim=1), atol=1e-12)  # batched == looped
    assert torch.allclose(summed.removal, -summed.values)
    assert torch.equal(summed.index, ids)


def test_self_influence_equals_loss_difference_by_hand():
    model = mlp(p=0.5)
    data = toy_data(n=25)
    train_turnover(model, ce, data, epochs=20, batch_size=5, progress=False)
    ids = torch.tensor([2, 3, 24])
    res = self_influence(model, ce, data, ids, batch_size=2, progress=False)
    with torch.no_grad():
        keep = model[2].keep_mask(ids, 16)
        x, y = data[0][ids], data[1][ids]
        want = hand_losses(model, x, y, keep, 0.5, False) - hand_losses(model, x, y, keep, 0.5, True)
    assert torch.allclose(res.values, want, atol=1e-12)
    every = self_influence(model, ce, IndexedDatasetPairs(data), progress=False)
    assert every.values.shape == (25,)
    assert (every.values < 0).double().mean() > 0.5  # training on an example mostly lowers its own loss


def test_removal_rule_diagnostics_and_round_trip_bit_identical(tmp_path):
    """removal = −values = L(x; 1 − m_i) − L(x; m_i): the loss without i minus the loss with i (removal_eps = −1)."""
    model = mlp(p=0.5)
    data = toy_data(n=30)
    train_turnover(model, ce, data, epochs=5, batch_size=6, progress=False)
    x_test = toy_data(n=5, seed=2)
    ids = torch.tensor([4, 0, 17])
    results = [
        influence(model, ids, x_test, measure=ce, n_train=30, per_test=True, batch_size=7, progress=False),
        influence(model, ids, x_test, measure=ce, n_train=30, batch_size=7, progress=False),
        self_influence(model, ce, data, ids, batch_size=2, progress=False),
    ]
    with torch.no_grad():
        keep = model[2].keep_mask(ids, 16)
        own = (data[0][ids], data[1][ids])
        without_minus_with = hand_losses(model, *own, keep, 0.5, True) - hand_losses(model, *own, keep, 0.5, False)
    assert torch.allclose(results[2].removal, without_minus_with, rtol=0, atol=1e-12)
    for res, forwards in zip(results, [2 * 3 * 5, 2 * 3 * 5, 2 * 3]):
        assert res.n_train == 30 and res.removal_eps == -1.0 and torch.equal(res.index, ids)
        assert torch.equal(res.removal, -res.values)
        assert torch.equal(torch.tensor(res.to_frame()["removal"].to_numpy()), -res.total)
        assert res.diagnostics["solves"] == [] and set(res.diagnostics["seconds"]) == {"forward"}
        assert res.diagnostics["settings"] == {"forward_examples": forwards, "batch_size": 7 if forwards > 6 else 2}
        back = ik.load(res.save(tmp_path / "turnover.result"))
        assert torch.equal(back.values, res.values) and torch.equal(back.index, res.index)
        assert torch.equal(back.removal, res.removal) and back.removal_eps == res.removal_eps
        assert (back.n_train, back.method, back.diagnostics) == (res.n_train, res.method, res.diagnostics)


class IndexedDatasetPairs(torch.utils.data.Dataset):
    """A plain Dataset of (x, y) pairs, to check Dataset inputs."""

    def __init__(self, data):
        self.data = data

    def __len__(self):
        return self.data[0].shape[0]

    def __getitem__(self, i):
        return self.data[0][i], self.data[1][i]


def test_influence_restores_model_mode_and_rejects_bad_input():
    model = mlp().train()
    x_test = toy_data(n=3, seed=5)
    influence(model, [0, 1], x_test, measure=ce, n_train=40, progress=False)
    assert model.training and model[2].training and model[2].ids is None
    with pytest.raises(InputError):
        influence(model, [], x_test, measure=ce, n_train=40, progress=False)
    with pytest.raises(InputError):
        influence(model, [0], (x_test[0], x_test[1][:2]), measure=ce, n_train=40, progress=False)
    bad = x_test[0].clone()
    bad[0, 0] = float("nan")
    with pytest.raises(InputError):
        influence(model, [0], (bad, x_test[1]), measure=ce, n_train=40, progress=False)
    with pytest.raises(InputError, match="index the training set"):
        self_influence(model, ce, x_test, [0, 3], progress=False)  # id out of range
    with pytest.raises(InputError, match="index the training set"):
        influence(model, [0, 40], x_test, measure=ce, n_train=40, progress=False)
    with pytest.raises(InputError, match="n_train"):
        influence(model, [0], x_test, measure=ce, n_train=0, progress=False)
    with pytest.raises(TypeError):
        influence(model, [0], x_test, measure=ce, progress=False)  # n_train is required
    with pytest.raises(LossError):
        influence(model, [0], x_test, measure=lambda o, t: ce(o, t).sum(), n_train=40, progress=False)
    with pytest.raises(ModelModeError):
        influence(nn.Linear(5, 3).double(), [0], x_test, measure=ce, n_train=40, progress=False)


# ---------------------------------------------------------------- training plumbing


def test_indexed_dataset_and_epoch_order_minus_excluded():
    data = toy_data(n=10)
    item = IndexedDataset(data)[4]
    assert item[0] == 4 and torch.equal(item[1], data[0][4])
    full = epoch_order(10, epoch=2, seed=3)
    loo = epoch_order(10, epoch=2, seed=3, exclude=[full[0].item(), 6])
    assert torch.equal(loo, full[(full != full[0]) & (full != 6)])


def test_training_is_seeded_and_lowers_the_loss():
    data = toy_data(n=60)
    runs = []
    for _ in range(2):
        model = mlp(seed=3)
        history = train_turnover(model, ce, IndexedDatasetPairs(data), epochs=15, batch_size=10, lr=1e-2, seed=1, progress=False)
        runs.append((history, model[3].weight.detach().clone()))
    assert runs[0][0] == runs[1][0] and torch.equal(runs[0][1], runs[1][1])
    assert runs[0][0][-1] < 0.7 * runs[0][0][0]
    assert not model.training
