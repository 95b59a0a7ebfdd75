"""Dict-style Hugging Face batches packed into the (inputs, targets) tensors every influkit stage streams.

A tokenizer returns ``{"input_ids": (B, L), "attention_mask": (B, L)[, "token_type_ids": (B, L)]}`` and the
task adds ``"labels"``. influkit's data, gradients and Hessian-vector products index, slice and ``vmap`` one
tensor of inputs and one of targets, so :func:`pack` stacks the token fields along a new dimension:

    inputs[:, c, :] = batch[fields[c]]   (B, C, L) integer tensor,     targets = batch["labels"].

:class:`~influkit.hf.model.HFModel` unpacks the same fields before calling the transformers model, so a
packed example is sliced and batched like any other row, and nothing else in influkit needs to know.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from ..errors import InputError

FIELDS = ("input_ids", "attention_mask", "token_type_ids")


def fields_of(batch: Mapping) -> tuple[str, ...]:
    """The token fields of ``batch`` in packing order: ``input_ids``, then ``attention_mask`` and
    ``token_type_ids`` when present."""
    if "input_ids" not in batch:
        raise InputError(
            f"the batch has keys {sorted(batch)} but no 'input_ids'; pass the tokenizer's output "
            "(a dict with input_ids and attention_mask) plus 'labels'."
        )
    return tuple(f for f in FIELDS if f in batch)


def pack(batch: Mapping, fields: Sequence[str] | None = None, labels: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs (B, C, L), targets): the token fields of a dict batch stacked, and its labels.

    fields: which keys to stack, in order (default :func:`fields_of`); a missing ``attention_mask`` is all ones.
    labels: the targets (default ``batch["labels"]``): (B,) class ids, or (B, L) token ids with −100 where
    no loss is taken (masked-LM).
    """
    fields = tuple(fields_of(batch) if fields is None else fields)
    if fields[:1] != ("input_ids",) or len(set(fields)) != len(fields) or not set(fields) <= set(FIELDS):
        raise InputError(f"fields must start with 'input_ids' and be distinct names among {FIELDS}, got {fields}.")
    ids = torch.as_tensor(batch["input_ids"])
    if ids.dim() != 2:
        raise InputError(f"input_ids must be (batch, length), got shape {tuple(ids.shape)}; pad the sequences to one length.")
    columns = []
    for f in fields:
        if f == "attention_mask" and f not in batch:
            columns.append(torch.ones_like(ids))
            continue
        if f not in batch:
            raise InputError(f"the batch has no {f!r}; it has {sorted(batch)}.")
        t = torch.as_tensor(batch[f]).to(ids.device)
        if t.shape != ids.shape:
            raise InputError(f"{f} has shape {tuple(t.shape)} but input_ids has {tuple(ids.shape)}.")
        columns.append(t.long())
    inputs = torch.stack([ids.long()] + columns[1:], dim=1)
    if labels is None:
        if "labels" not in batch:
            raise InputError("the batch has no 'labels'; add them (class ids, or masked-LM token ids with -100).")
        labels = batch["labels"]
    targets = torch.as_tensor(labels).to(ids.device)
    if targets.shape[0] != ids.shape[0]:
        raise InputError(f"labels have {targets.shape[0]} rows but input_ids has {ids.shape[0]}.")
    return inputs, targets


def unpack(inputs: torch.Tensor, fields: Sequence[str]) -> dict[str, torch.Tensor]:
    """The dict of token fields from packed ``inputs`` (B, C, L) — the inverse of :func:`pack` without labels."""
    if inputs.dim() != 3 or inputs.shape[1] != len(fields):
        raise InputError(
            f"packed inputs must have shape (batch, {len(fields)}, length) for the fields {tuple(fields)}, got "
            f"{tuple(inputs.shape)}; build them with influkit.hf.pack."
        )
    return {f: inputs[:, c] for c, f in enumerate(fields)}
