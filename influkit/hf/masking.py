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

The random token is uniform over the *non-special* ids (never ``[PAD]``, ``[MASK]``, ``[CLS]``…). A ``[PAD]``
input would be wrong twice: BERT's word embedding treats the pad id as ``padding_idx``, so autograd drops that
lookup from the gradient (the gradient along the [PAD] row is then not the derivative of the loss, training never
reaches a stationary point of it, and influence, which assumes one, is off). It is drawn by rejection: a first
draw that is not special is kept, so masks that never drew a special id are the same as before this rule.
The uniforms are float32 whatever ``torch.get_default_dtype()`` is (a float64 default used to change every mask).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import InputError, warn

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
    gets at least one chosen position (else its loss would be empty). Random replacements are drawn uniformly
    from the ids in [0, vocab_size) other than ``special_token_ids`` and ``mask_token_id``: give every special
    id of the tokenizer (``tokenizer.all_special_ids``), [PAD] above all.
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
    if not len(special_token_ids):
        warn("mask_tokens got no special_token_ids, so random replacements may draw [PAD] (whose embedding "
                      "gradient BERT drops) or [CLS]/[SEP]: pass special_token_ids=tokenizer.all_special_ids "
                      "(masked_lm_stage(..., tokenizer=tok) does).")
    special = torch.as_tensor(sorted({int(i) for i in special_token_ids} | {int(mask_token_id)}), dtype=torch.long)
    if (special < vocab_size).sum() >= vocab_size:
        raise InputError(f"every id below vocab_size={vocab_size} is special: no token is left to draw as a random "
                         "replacement; check vocab_size and special_token_ids.")
    eligible = attend & ~torch.isin(ids, torch.as_tensor(list(special_token_ids), dtype=ids.dtype))
    masked, labels = ids.clone(), torch.full_like(ids, IGNORE)
    length = ids.shape[1]
    for b in range(ids.shape[0]):
        gen = torch.Generator().manual_seed(example_seed(seed, int(idx[b])))
        u = torch.rand(length, generator=gen, dtype=torch.float32)  # float32 whatever the default dtype:
        action = torch.rand(length, generator=gen, dtype=torch.float32)  # the draws consume the stream alike
        replacement = _draw_non_special(vocab_size, special, length, gen)
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


def _draw_non_special(vocab_size: int, special: torch.Tensor, length: int, gen: torch.Generator) -> torch.Tensor:
    """(length,) ids uniform over [0, vocab_size) minus ``special``: draws of a special id are drawn again."""
    draw = torch.randint(vocab_size, (length,), generator=gen)
    redo = torch.isin(draw, special)
    while redo.any():
        draw[redo] = torch.randint(vocab_size, (int(redo.sum()),), generator=gen)
        redo = torch.isin(draw, special)
    return draw
