"""Causal-LM batches: documents and prompt → completion pairs, labelled with −100 where no loss is taken.

Labels are aligned with ``input_ids`` as transformers does (the loss shifts them, :func:`~influkit.hf.causal_lm_losses`):

- a document z: ``labels = input_ids`` on its tokens, −100 on padding, so g(z) is its mean next-token NLL;
- a completion query: ``input_ids = prompt + completion``, ``labels = −100`` on the prompt and padding and the
  token ids on the completion, so f(x) = −log p(completion | prompt) / |completion| (mean over the completion's
  tokens); a test set's f(T) sums these over the queries, ``per_test=True`` keeps one column per query.

Sequences are padded on the right with the tokenizer's pad token (position ids stay 0, 1, … for the text).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..errors import InputError
from .masking import IGNORE


def context_length(model: nn.Module) -> int | None:
    """The longest sequence a transformers decoder takes: ``config.n_positions`` (GPT-2) or
    ``config.max_position_embeddings`` (Llama, Qwen, ...); None when the config names neither."""
    config = getattr(model, "config", None)
    for key in ("n_positions", "max_position_embeddings"):
        value = getattr(config, key, None)
        if isinstance(value, int):
            return value
    return None


def check_context(model: nn.Module, length: int) -> None:
    """Raise :class:`~influkit.errors.InputError` if sequences of ``length`` tokens exceed the model's context."""
    limit = context_length(model)
    if limit is not None and length > limit:
        raise InputError(
            f"sequences of {length} tokens are longer than the model's context of {limit} positions "
            f"({type(model).__name__} config n_positions / max_position_embeddings); pass max_length <= {limit} "
            "to the batch builder, or build the model with a longer context."
        )


def pad_token_id(tokenizer) -> int:
    """The tokenizer's pad token id; :class:`~influkit.errors.InputError` if it has none (GPT-2's own has none)."""
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        raise InputError(
            f"the tokenizer ({type(tokenizer).__name__}) has no pad token, so documents of different lengths cannot "
            "be batched; set one (tokenizer.pad_token = tokenizer.eos_token, or add a '<pad>' special token) or "
            "train one with influkit.hf.train_bpe, which has '<pad>'."
        )
    return int(pad)


def _check_max_length(max_length: int) -> None:
    if not isinstance(max_length, int) or max_length < 2:
        raise InputError(f"max_length must be an integer >= 2 (a token and its successor), got {max_length!r}.")


def causal_lm_batch(tokenizer, texts: Sequence[str], max_length: int, *, truncation: bool = True) -> dict[str, torch.Tensor]:
    """The dict batch (``input_ids``, ``attention_mask``, ``labels``) of documents, padded on the right to ``max_length``.

    labels = input_ids on every token, −100 on padding. With ``truncation=False`` a document longer than
    ``max_length`` tokens raises instead of being cut.
    """
    _check_max_length(max_length)
    pad = pad_token_id(tokenizer)
    texts = list(texts)
    if not texts or not all(isinstance(t, str) for t in texts):
        raise InputError("texts must be a non-empty list of strings.")
    if not truncation:
        lengths = [len(ids) for ids in tokenizer(texts)["input_ids"]]
        longest = max(range(len(texts)), key=lengths.__getitem__)
        if lengths[longest] > max_length:
            raise InputError(
                f"document {longest} has {lengths[longest]} tokens, more than max_length={max_length}; raise "
                "max_length or pass truncation=True."
            )
    enc = tokenizer(texts, padding="max_length", truncation=True, max_length=max_length, return_tensors="pt")
    ids, keep = enc["input_ids"], enc["attention_mask"]
    if getattr(tokenizer, "padding_side", "right") != "right" and bool((keep[:, 0] == 0).any()):
        raise InputError(
            "the tokenizer pads on the left; set tokenizer.padding_side = 'right' (positions count from the text's start)."
        )
    ids = torch.where(keep.bool(), ids, torch.full_like(ids, pad))
    return {"input_ids": ids, "attention_mask": keep, "labels": torch.where(keep.bool(), ids, torch.full_like(ids, IGNORE))}


def completion_batch(
    tokenizer, prompts: Sequence[str], completions: Sequence[str], max_length: int
) -> dict[str, torch.Tensor]:
    """The dict batch of prompt + completion sequences, labels −100 on the prompt and padding (module docstring).

    The prompt is encoded with the tokenizer's special tokens (e.g. a leading ``<|endoftext|>``), the completion
    without, and the two are concatenated: put the separating space in the completion (``" great movie"``).
    A pair longer than ``max_length`` (set it to the model's context, :func:`context_length`, or less) raises
    :class:`~influkit.errors.InputError` — a truncated completion would silently change the query.
    """
    _check_max_length(max_length)
    pad = pad_token_id(tokenizer)
    prompts, completions = list(prompts), list(completions)
    if len(prompts) != len(completions) or not prompts:
        raise InputError(f"need one completion per prompt, got {len(prompts)} prompts and {len(completions)} completions.")
    rows = []
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        head = tokenizer(prompt)["input_ids"]
        tail = tokenizer(completion, add_special_tokens=False)["input_ids"]
        if not head or not tail:
            raise InputError(
                f"pair {i}: the prompt and the completion must each have at least one token ({prompt!r}, {completion!r})."
            )
        if len(head) + len(tail) > max_length:
            raise InputError(
                f"pair {i}: prompt ({len(head)} tokens) + completion ({len(tail)} tokens) is longer than max_length="
                f"{max_length} (the model's context); shorten the prompt, or use a model with a longer context."
            )
        rows.append((head, tail))
    n = len(rows)
    ids = torch.full((n, max_length), pad, dtype=torch.long)
    keep = torch.zeros((n, max_length), dtype=torch.long)
    labels = torch.full((n, max_length), IGNORE, dtype=torch.long)
    for i, (head, tail) in enumerate(rows):
        a, b = len(head), len(head) + len(tail)
        ids[i, :b] = torch.tensor(head + tail)
        keep[i, :b] = 1
        labels[i, a:b] = torch.tensor(tail)
    return {"input_ids": ids, "attention_mask": keep, "labels": labels}
