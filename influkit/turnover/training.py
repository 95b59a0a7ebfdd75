"""Training with turn-over dropout: batches carry example ids, which select each example's sub-network."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm

from ..errors import InputError, LossError
from .layers import model_with_ids, turnover_layers

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Data = tuple[torch.Tensor, torch.Tensor] | Dataset


class IndexedDataset(Dataset):
    """A dataset whose item i is ``(i, inputs_i, targets_i)``: the id turn-over dropout needs.

    data: an (inputs, targets) pair of tensors or a Dataset whose items are (inputs, targets).
    """

    def __init__(self, data: Data) -> None:
        self.data = data
        self._tensors = isinstance(data, (tuple, list))
        if self._tensors and (len(data) != 2 or data[0].shape[0] != data[1].shape[0]):
            raise InputError("tensor data must be a pair (inputs, targets) with the same first dimension.")

    def __len__(self) -> int:
        return self.data[0].shape[0] if self._tensors else len(self.data)

    def __getitem__(self, i: int) -> tuple[int, torch.Tensor, torch.Tensor]:
        x, y = (self.data[0][i], self.data[1][i]) if self._tensors else self.data[i]
        return i, x, y


def epoch_order(n: int, epoch: int, seed: int, exclude: Sequence[int] | torch.Tensor | None = None) -> torch.Tensor:
    """Returns the example ids visited in ``epoch``: a permutation of range(n) seeded by (seed, epoch), minus ``exclude``.

    Removing examples keeps the relative order of the others, so a leave-one-out run sees the same data
    order as the full run with the removed example skipped.
    """
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(n, generator=generator)
    if exclude is not None and len(exclude):
        drop = torch.zeros(n, dtype=torch.bool)
        drop[torch.as_tensor(exclude, dtype=torch.int64)] = True
        order = order[~drop[order]]
    return order


def _batches(data: IndexedDataset, order: torch.Tensor, batch_size: int) -> Iterator[tuple[torch.Tensor, ...]]:
    chunks = [chunk.tolist() for chunk in order.split(batch_size)]
    if data._tensors:
        inputs, targets = data.data
        for chunk in chunks:
            ids = torch.tensor(chunk)
            yield ids, inputs[ids], targets[ids]
    else:
        yield from DataLoader(data, batch_sampler=chunks)


def train_turnover(
    model: nn.Module,
    loss: LossFn,
    data: Data,
    *,
    epochs: int = 10,
    batch_size: int = 64,
    lr: float = 1e-3,
    weight_decay: float = 0.0,
    seed: int = 0,
    exclude: Sequence[int] | torch.Tensor | None = None,
    device: torch.device | str | None = None,
    progress: bool = True,
) -> list[float]:
    """Returns the mean training loss of each epoch after training ``model`` in place with turn-over dropout.

    Minimizes (1/B) Σ_{i∈batch} loss(f(x_i; m_i), y_i) with Adam, where every example i runs on its own
    sub-network m_i (routed by :func:`model_with_ids`), so only the weights its mask keeps see its gradient.
    The data order is :func:`epoch_order` (seeded); ``exclude`` drops examples (leave-one-out retraining
    from the same initial weights and order). The model's initial weights are the caller's to seed.
    loss(outputs, targets) must return per-example losses of shape (B,).
    """
    turnover_layers(model)
    dataset = IndexedDataset(data)
    if len(dataset) == 0:
        raise InputError("the training data is empty.")
    device = torch.device(device) if device is not None else next(model.parameters()).device
    model.to(device).train()
    optimizer = torch.optim.Adam(model.parameters(), lr=lr, weight_decay=weight_decay)
    history = []
    for epoch in tqdm(range(epochs), desc="turn-over training", disable=not progress):
        total, count = 0.0, 0
        for ids, x, y in _batches(dataset, epoch_order(len(dataset), epoch, seed, exclude), batch_size):
            x, y = x.to(device), y.to(device)
            with model_with_ids(model, ids):
                per_example = loss(model(x), y)
            if per_example.shape != (x.shape[0],):
                raise LossError(
                    f"loss returned shape {tuple(per_example.shape)}; it must return one loss per example, "
                    f"shape ({x.shape[0]},) (use reduction='none')."
                )
            optimizer.zero_grad()
            per_example.mean().backward()
            optimizer.step()
            total += float(per_example.detach().sum())
            count += x.shape[0]
        history.append(total / count)
    model.eval()
    return history
