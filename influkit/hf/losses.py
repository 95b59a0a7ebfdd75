"""Per-example losses (B,) for transformers logits: masked-LM, causal-LM and sequence classification.

Both are written with tensor operations only (no ``.item()``, no branching on values), so per-example
gradients run under ``torch.func.vmap``.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from ..errors import LossError
from ..factored.fisher import declare_categorical
from ..per_token import declare_token_losses
from .masking import IGNORE


def masked_lm_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(B,): per sentence, the mean over its predicted positions of −log p(original token).

    g(z) = (1/|M_z|) Σ_{t∈M_z} −log softmax(logits[t])[labels[t]], M_z = {t : labels[t] ≠ −100}; a sentence
    with no predicted position has loss 0.
    """
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        raise LossError(
            f"masked-LM logits must be (B, L, V) and labels (B, L), got {tuple(logits.shape)} and {tuple(labels.shape)}."
        )
    keep = labels != IGNORE
    logp = torch.log_softmax(logits, dim=-1)
    picked = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    count = keep.sum(dim=1).clamp(min=1).to(logits.dtype)
    return -(picked * keep.to(logits.dtype)).sum(dim=1) / count


def _inverse_counts(labels: torch.Tensor) -> torch.Tensor:
    """(B,) 1/|M_z|: the weight of each position's cross-entropy in a per-sentence mean (1 where none)."""
    return 1.0 / (labels != IGNORE).sum(dim=1).clamp(min=1).to(torch.float64)


def _next_tokens(labels: torch.Tensor) -> torch.Tensor:
    """(B, L) the label position t predicts in a causal LM: labels[t + 1], −100 at the last position."""
    return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], IGNORE)], dim=1)


def masked_lm_token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(B, L): each predicted position's share −log softmax(logits[t])[labels[t]] / |M_z| of
    :func:`masked_lm_losses` (0 where labels are −100); the rows sum to it."""
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        raise LossError(
            f"masked-LM logits must be (B, L, V) and labels (B, L), got {tuple(logits.shape)} and {tuple(labels.shape)}."
        )
    keep = labels != IGNORE
    picked = torch.log_softmax(logits, dim=-1).gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    count = keep.sum(dim=1, keepdim=True).clamp(min=1).to(logits.dtype)
    return -(picked * keep.to(logits.dtype)) / count


# what fisher="sampled" needs (influkit.factored.fisher): mean cross-entropies over the labelled positions
declare_categorical(masked_lm_losses, weights=_inverse_counts)
declare_token_losses(masked_lm_losses, masked_lm_token_losses)


def causal_lm_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(B,): per document, the mean next-token negative log-likelihood over its labelled tokens.

    Labels are aligned with ``input_ids`` as in transformers (the model shifts them): position t predicts
    token t + 1, so g(z) = (1/|M_z|) Σ_{t+1∈M_z} −log softmax(logits[t])[labels[t+1]], M_z = {t : labels[t] ≠ −100}
    (padding, and a completion's prompt, carry −100); the first label is never predicted. A document with no
    labelled token after the first position has loss 0.
    """
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        raise LossError(
            f"causal-LM logits must be (B, L, V) and labels (B, L), got {tuple(logits.shape)} and {tuple(labels.shape)}."
        )
    return masked_lm_losses(logits[:, :-1], labels[:, 1:])


def causal_lm_token_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(B, L) aligned with ``input_ids``: at position t ≥ 1 the share −log p(labels[t] | tokens < t) / |M_z| of
    :func:`causal_lm_losses` (the prediction *of* token t), 0 at position 0 and where labels are −100; the rows sum
    to it."""
    if logits.dim() != 3 or labels.shape != logits.shape[:2]:
        raise LossError(
            f"causal-LM logits must be (B, L, V) and labels (B, L), got {tuple(logits.shape)} and {tuple(labels.shape)}."
        )
    shares = masked_lm_token_losses(logits[:, :-1], labels[:, 1:])
    return torch.cat([shares.new_zeros(shares.shape[0], 1), shares], dim=1)


declare_categorical(causal_lm_losses, targets=_next_tokens, weights=lambda labels: _inverse_counts(labels[:, 1:]))
declare_token_losses(causal_lm_losses, causal_lm_token_losses)


def classification_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(B,): cross-entropy −log softmax(logits)[label] of each sequence (single-label classification)."""
    if logits.dim() != 2 or labels.shape != logits.shape[:1]:
        raise LossError(
            f"classification logits must be (B, num_labels) and labels (B,), got {tuple(logits.shape)} and "
            f"{tuple(labels.shape)}."
        )
    return F.cross_entropy(logits, labels.long(), reduction="none")
