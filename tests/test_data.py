"""ExampleSource over tensors, Datasets and DataLoaders; take, batches; as_examples and its errors."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

import influkit as ik
from influkit.data import ExampleSource, as_examples


def tensors(n: int = 11):
    gen = torch.Generator().manual_seed(0)
    return torch.randn(n, 3, 2, generator=gen), torch.arange(n) % 4


class Pairs(Dataset):
    """A map-style Dataset returning (numpy-free) tuples, as user datasets do."""

    def __init__(self, data):
        self.data = data

    def __len__(self):
        return self.data[0].shape[0]

    def __getitem__(self, i):
        return self.data[0][i], int(self.data[1][i])  # an int target: stacked via torch.as_tensor


class Stream(IterableDataset):
    def __iter__(self):
        yield torch.zeros(2), 0


SOURCES = {
    "tensors": lambda d: d,
    "dataset": lambda d: Pairs(d),
    "tensor-dataset": lambda d: TensorDataset(*d),
    "dataloader": lambda d: DataLoader(Pairs(d), batch_size=3),
}


@pytest.mark.parametrize("kind", SOURCES)
def test_every_kind_gives_the_same_examples(kind):
    data = tensors()
    source = ExampleSource(SOURCES[kind](data))
    assert len(source) == 11
    idx = torch.tensor([7, 0, 10, 3, 3])
    x, y = source.take(idx)
    assert torch.equal(x, data[0][idx]) and torch.equal(y, data[1][idx])
    x, y = source.take([-1])  # Python-style negative indices
    assert torch.equal(x, data[0][[10]])


@pytest.mark.parametrize("kind", SOURCES)
def test_batches_cover_the_examples_in_order(kind):
    data = tensors()
    source = ExampleSource(SOURCES[kind](data), batch_size=4)
    batches = list(source.batches())
    assert [b[0].shape[0] for b in batches] == [4, 4, 3]
    assert torch.equal(torch.cat([b[0] for b in batches]), data[0])
    subset = torch.tensor([9, 2, 5])
    (x, y), = list(source.batches(subset, batch_size=8))
    assert torch.equal(y, data[1][subset])
    assert [b[0].shape[0] for b in source.batches(subset, batch_size=2)] == [2, 1]


def test_batch_size_defaults():
    data = tensors()
    assert ExampleSource(data).batch_size == 256
    assert ExampleSource(DataLoader(Pairs(data), batch_size=3)).batch_size == 3  # the loader's
    assert ExampleSource(DataLoader(Pairs(data), batch_size=3), batch_size=5).batch_size == 5  # the caller's wins


def test_device_placement():
    source = ExampleSource(tensors(), device="cpu")
    assert source.take([0])[0].device == torch.device("cpu")
    assert ExampleSource(tensors(), device="meta").take([1, 2])[0].device == torch.device("meta")


def test_bad_data_is_refused():
    x, y = tensors()
    with pytest.raises(ik.InputError, match="one target per example"):
        ExampleSource((x, y[:-1]))
    with pytest.raises(ik.InputError, match="empty"):
        ExampleSource((x[:0], y[:0]))
    with pytest.raises(ik.InputError, match="map-style"):
        ExampleSource(Stream())
    with pytest.raises(ik.InputError, match="cannot read data of type"):
        ExampleSource([x.numpy(), y.numpy()])
    with pytest.raises(ik.InputError, match="out of range"):
        ExampleSource((x, y)).take([11])
    with pytest.raises(ik.InputError, match="out of range"):
        ExampleSource((x, y)).take([-12])


# ---- as_examples: (inputs, targets) or indices into a source ----

def test_as_examples_pairs_and_indices():
    data = tensors()
    source = ExampleSource(data)
    (x, y), ids = as_examples((data[0][:3], data[1][:3]))
    assert torch.equal(ids, torch.arange(3)) and torch.equal(x, data[0][:3])
    (x, y), ids = as_examples([4, 1], source)
    assert ids.tolist() == [4, 1] and torch.equal(y, data[1][[4, 1]])
    mask = torch.zeros(11, dtype=torch.bool)
    mask[[2, 8]] = True
    (x, y), ids = as_examples(mask, source)  # a boolean mask selects its True rows
    assert ids.tolist() == [2, 8] and torch.equal(x, data[0][[2, 8]])


@pytest.mark.parametrize(
    "make,source,match",
    [
        (lambda x, y: (x[:3], y[:2]), True, "rows but targets have"),
        (lambda x, y: (x[:0], y[:0]), True, "empty"),
        (lambda x, y: [1, 2], False, r"\(inputs, targets\) pair"),
        (lambda x, y: torch.tensor([0.0, 1.0]), True, "integer tensor of indices"),
        (lambda x, y: torch.tensor([[0, 1]]), True, "integer tensor of indices"),
        (lambda x, y: torch.tensor([], dtype=torch.long), True, "empty"),
        (lambda x, y: "not indices", True, "indices"),
        (lambda x, y: [99], True, "out of range"),
    ],
    ids=["pair-mismatch", "empty-pair", "indices-without-source", "float", "2-d", "empty", "string", "range"],
)
def test_as_examples_errors(make, source, match):
    x, y = tensors()
    with pytest.raises(ik.InputError, match=match):
        as_examples(make(x, y), ExampleSource((x, y)) if source else None, "z")
