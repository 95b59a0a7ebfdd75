"""Masked-LM masking that is a deterministic function of each example's index.

Masked-LM pretraining draws a random mask per sentence; the per-example loss g(z) then depends on the draw,
and "the gradient of g(z)" would be a random variable. influkit fixes the draw: the mask of example ``i``
comes from a random generator seeded by ``(seed, i)``, so g(z_i) is one function of the parameters, the same
every time it is evaluated (in pretraining, in the Hessian, in the per-example gradients, and in leave-out or
subset re-training, as long as each example keeps its index). This is static masking (one fixed mask per
sentence, as in the original BERT data pipeline) rather than the dynamic re-masking of RoBERTa; the influence
scores are those of the objective that was actually minimized only if pretraining used the same masks.

BERT's recipe per sentence: each non-special, non-padding token is chosen with probability ``mask_prob``
(at least one per sentence); a chosen token becomes ``[MASK]`` with probability 0.8, a random token with 0.1,
and stays itself with 0.1; the label is the original token at chosen positions and −100 elsewhere.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import InputError

IGNORE = -100
_MASK64 = (1 << 64) - 1


def example_seed(seed: int, index: int) -> int:
    """A 63-bit generator seed for example ``index`` under ``seed`` (a SplitMix64 hash: nearby indices give
    unrelated streams)."""
    x = (int(seed) * 0x9E3779B97F4A7C15 + int(index) + 1) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1


def mask_tokens(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    indices: torch.Tensor | Sequence[int],
    *,
    mask_token_id: int,
    vocab_size: int,
    special_token_ids: Sequence[int] = (),
    seed: int = 0,
    mask_prob: float = 0.15,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(masked input_ids, labels), both (B, L): row b masked by a generator seeded by (``seed``, ``indices[b]``).

    labels[b, t] = input_ids[b, t] where position t was chosen for prediction, −100 elsewhere. Padding
    (attention_mask 0) and ``special_token_ids`` are never chosen; every row with at least one eligible token
    gets at least one chosen position (else its loss would be empty).
    """
    ids = torch.as_tensor(input_ids)
    if ids.dim() != 2:
        raise InputError(f"input_ids must be (batch, length), got shape {tuple(ids.shape)}.")
    if not 0 < mask_prob <= 1:
        raise InputError(f"mask_prob must be in (0, 1], got {mask_prob}.")
    idx = torch.as_tensor(indices, dtype=torch.long).reshape(-1)
    if idx.numel() != ids.shape[0]:
        raise InputError(f"got {idx.numel()} example indices for {ids.shape[0]} rows; give one index per row.")
    attend = torch.ones_like(ids, dtype=torch.bool) if attention_mask is None else torch.as_tensor(attention_mask).bool()
    eligible = attend & ~torch.isin(ids, torch.as_tensor(list(special_token_ids), dtype=ids.dtype))
    masked, labels = ids.clone(), torch.full_like(ids, IGNORE)
    length = ids.shape[1]
    for b in range(ids.shape[0]):
        gen = torch.Generator().manual_seed(example_seed(seed, int(idx[b])))
        u = torch.rand(length, generator=gen)
        action = torch.rand(length, generator=gen)
        replacement = torch.randint(vocab_size, (length,), generator=gen)
        row_ok = eligible[b].cpu()
        if not row_ok.any():
            continue
        chosen = row_ok & (u < mask_prob)
        if not chosen.any():
            chosen[torch.where(row_ok, u, torch.inf).argmin()] = True
        chosen = chosen.to(ids.device)
        labels[b] = torch.where(chosen, ids[b], labels[b])
        to_mask = chosen & (action < 0.8).to(ids.device)
        to_random = chosen & ((action >= 0.8) & (action < 0.9)).to(ids.device)
        masked[b] = torch.where(to_mask, torch.full_like(ids[b], mask_token_id), masked[b])
        masked[b] = torch.where(to_random, replacement.to(ids.device, ids.dtype), masked[b])
    return masked, labels
