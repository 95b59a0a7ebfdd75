"""Training data as a re-iterable, indexable source of (inputs, targets) batches.

A data set can be given as an ``(inputs, targets)`` pair of tensors, a ``torch.utils.data.Dataset`` whose
items are ``(input, target)``, or a ``DataLoader`` over such a dataset. Batches are streamed so memory does
not grow with the data set.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch.utils.data import DataLoader, Dataset

from .errors import InputError

Batch = tuple[torch.Tensor, torch.Tensor]


class ExampleSource:
    """Indexable (inputs, targets) examples with batched, streamed access.

    ``batches(indices, batch_size)`` yields (inputs, targets) on ``device``; ``take(indices)`` returns one
    stacked batch. Indexing works for tensors and map-style datasets alike.
    """

    def __init__(self, data, device: torch.device | str | None = None, batch_size: int | None = None):
        self.device = torch.device(device) if device is not None else None
        self.batch_size = batch_size
        if isinstance(data, DataLoader):
            self.batch_size = self.batch_size or data.batch_size
            data = data.dataset
        if isinstance(data, (tuple, list)) and len(data) == 2 and all(torch.is_tensor(t) for t in data):
            inputs, targets = data
            if inputs.shape[0] != targets.shape[0]:
                raise InputError(
                    f"inputs have {inputs.shape[0]} rows but targets have {targets.shape[0]}; "
                    "pass one target per example."
                )
            self._tensors: Batch | None = (inputs, targets)
            self._dataset = None
            self._len = inputs.shape[0]
        elif isinstance(data, Dataset):
            self._tensors = None
            self._dataset = data
            try:
                self._len = len(data)  # type: ignore[arg-type]
            except TypeError as exc:
                raise InputError("iterable-style datasets are not supported: give a map-style Dataset") from exc
        else:
            raise InputError(
                f"cannot read data of type {type(data).__name__}: give (inputs, targets) tensors, "
                "a map-style Dataset of (input, target) pairs, or a DataLoader over one."
            )
        if self._len == 0:
            raise InputError("the data set is empty: give at least one (input, target) example.")
        self.batch_size = self.batch_size or 256

    def __len__(self) -> int:
        return self._len

    def _to_device(self, batch: Batch) -> Batch:
        if self.device is None:
            return batch
        return batch[0].to(self.device), batch[1].to(self.device)

    def take(self, indices: torch.Tensor | Sequence[int]) -> Batch:
        """The examples at ``indices`` stacked into one (inputs, targets) batch."""
        idx = torch.as_tensor(indices, dtype=torch.long).reshape(-1)
        if idx.numel() and (idx.min() < -self._len or idx.max() >= self._len):
            raise InputError(
                f"example index out of range for a data set of {self._len} examples "
                f"(got min {int(idx.min())}, max {int(idx.max())})."
            )
        if self._tensors is not None:
            inputs, targets = self._tensors
            cpu_idx = idx.to(inputs.device)
            return self._to_device((inputs[cpu_idx], targets[cpu_idx]))
        items = [self._dataset[int(i)] for i in idx]  # type: ignore[index]
        inputs = torch.stack([torch.as_tensor(item[0]) for item in items])
        targets = torch.stack([torch.as_tensor(item[1]) for item in items])
        return self._to_device((inputs, targets))

    def batches(
        self, indices: torch.Tensor | None = None, batch_size: int | None = None
    ) -> Iterator[Batch]:
        """Yield (inputs, targets) batches over ``indices`` (default: every example, in order)."""
        size = batch_size or self.batch_size
        idx = torch.arange(self._len) if indices is None else torch.as_tensor(indices).reshape(-1)
        for start in range(0, idx.numel(), size):
            yield self.take(idx[start : start + size])


def as_examples(data, source: ExampleSource | None = None, name: str = "data") -> tuple[Batch, torch.Tensor]:
    """Resolve ``data`` to one (inputs, targets) batch and the example ids of its rows.

    ``data`` is an (inputs, targets) pair, or a 1-D tensor/sequence of indices into ``source``.
    """
    if isinstance(data, (tuple, list)) and len(data) == 2 and all(torch.is_tensor(t) for t in data):
        inputs, targets = data
        if inputs.shape[0] != targets.shape[0]:
            raise InputError(
                f"{name}: inputs have {inputs.shape[0]} rows but targets have {targets.shape[0]}."
            )
        if inputs.shape[0] == 0:
            raise InputError(f"{name} is empty: give at least one example.")
        batch = (inputs, targets)
        if source is not None:
            batch = source._to_device(batch)
        return batch, torch.arange(inputs.shape[0])
    if source is None:
        raise InputError(f"{name} must be an (inputs, targets) pair of tensors.")
    try:
        idx = torch.as_tensor(data)
    except (TypeError, ValueError, RuntimeError) as exc:
        raise InputError(f"{name} must be (inputs, targets) tensors or a 1-D tensor of indices.") from exc
    if idx.dtype in (torch.bool,):
        idx = idx.nonzero().reshape(-1)
    if idx.dim() != 1 or idx.is_floating_point():
        raise InputError(
            f"{name} must be (inputs, targets) tensors or a 1-D integer tensor of indices, "
            f"got a {idx.dtype} tensor of shape {tuple(idx.shape)}."
        )
    if idx.numel() == 0:
        raise InputError(f"{name} is empty: give at least one example.")
    return source.take(idx), idx.long().cpu()
