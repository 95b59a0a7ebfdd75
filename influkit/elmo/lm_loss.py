"""The biLM pretraining loss g(z): per-sentence mean next-token NLL of the forward and backward LMs.

For a sentence z = w_1..w_n with markers w_0 = ``<S>`` and w_{n+1} = ``</S>``, the top LSTM layer gives
forward states →h_i and backward states ←h_i (i = 0..n+1), and one softmax head U (``nn.Linear``, shared
by both directions as in bilm-tf) gives p(w | h) = softmax(U h)_w. Then

    g(z) = 1 / (2(n+1)) · [ Σ_{i=0..n} −log p(w_{i+1} | →h_i) + Σ_{i=1..n+1} −log p(w_{i−1} | ←h_i) ],

the mean token NLL of both directions (each predicts n + 1 tokens). The LSTM starts from the zero state
for every sentence, so g(z) depends on z alone.

Usage with influkit: ``Stage(BiLMWithSoftmax(bilm, len(vocab)).eval(), bilm_lm_loss, (char_ids, token_ids))``
with ``char_ids, token_ids, _ = batch_sentences(sentences, vocab)``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import InputError
from .bilm import ElmoBiLM
from .characters import BOS_TOKEN, EOS_TOKEN, batch_to_char_ids

UNK_TOKEN = "<UNK>"
BOS_ID, EOS_ID, UNK_ID = 0, 1, 2
PAD_ID = -1


class Vocabulary:
    """Token ↔ id map of the softmax: ids 0, 1, 2 are ``<S>``, ``</S>``, ``<UNK>``, then ``tokens`` in order.

    Duplicates and the three special tokens in ``tokens`` are skipped; unknown tokens map to ``<UNK>``.
    """

    def __init__(self, tokens: Iterable[str]):
        specials = (BOS_TOKEN, EOS_TOKEN, UNK_TOKEN)
        self.tokens: list[str] = list(specials)
        self._ids = {t: i for i, t in enumerate(specials)}
        for token in tokens:
            if not isinstance(token, str):
                raise InputError(f"vocabulary tokens must be str, got {type(token).__name__} ({token!r}).")
            if token not in self._ids:
                self._ids[token] = len(self.tokens)
                self.tokens.append(token)

    def __len__(self) -> int:
        return len(self.tokens)

    def index(self, token: str) -> int:
        """Id of ``token`` (``UNK_ID`` if it is not in the vocabulary)."""
        return self._ids.get(token, UNK_ID)


def batch_sentences(
    sentences: Sequence[Sequence[str]], vocab: Vocabulary, length: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(char_ids (B, T, 50), token_ids (B, T), mask (B, T)) for a list of token lists, without markers.

    ``token_ids`` holds vocabulary ids padded with ``PAD_ID`` = −1 and ``mask`` is True on real tokens;
    ``char_ids`` is zero on padding (see :func:`~influkit.elmo.characters.batch_to_char_ids`). T is the
    longest sentence, or ``length`` to give several batches a common width.
    """
    char_ids = batch_to_char_ids(sentences, length)
    token_ids = torch.full(char_ids.shape[:2], PAD_ID, dtype=torch.long)
    for i, sentence in enumerate(sentences):
        token_ids[i, : len(sentence)] = torch.tensor([vocab.index(t) for t in sentence], dtype=torch.long)
    return char_ids, token_ids, token_ids != PAD_ID


class BiLMWithSoftmax(nn.Module):
    """ELMo biLM plus a full-softmax head U; ``forward(char_ids)`` returns logits (B, 2, T + 2, V).

    Axis 1 is the direction (0: forward LM scores of U →h_i, 1: backward LM scores of U ←h_i) and axis 2
    the positions ``<S>``, w_1, …, w_n, ``</S>``, padding. Pair with :func:`bilm_lm_loss`. The logits hold
    B·2·(T+2)·V numbers, so keep batches small for large vocabularies.
    """

    def __init__(self, bilm: ElmoBiLM, vocab_size: int):
        super().__init__()
        if bilm.stateful:
            raise InputError("the LM loss needs a stateless biLM (g(z) must depend on z only); use stateful=False.")
        if vocab_size < 3:
            raise InputError(f"vocab_size={vocab_size} cannot hold <S>, </S>, <UNK>; use len(Vocabulary(...)).")
        ref = bilm.char_cnn.W_proj
        self.bilm = bilm
        self.softmax = nn.Linear(bilm.options.projection_dim, vocab_size, device=ref.device, dtype=ref.dtype)

    def forward(self, char_ids: torch.Tensor) -> torch.Tensor:
        """(B, 2, T + 2, V) next-token logits of the forward and backward LMs for (B, T, 50) ``char_ids``."""
        top = self.bilm(char_ids).activations[-1]
        directions = torch.stack(top.chunk(2, dim=-1), dim=1)
        return self.softmax(directions)


def bilm_lm_loss(logits: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """(B,) per-sentence biLM loss g(z): mean NLL of both directions' n + 1 next-token predictions.

    ``logits`` (B, 2, T + 2, V) from :class:`BiLMWithSoftmax`; ``token_ids`` (B, T) vocabulary ids of the
    sentences, left-aligned and padded with ``PAD_ID`` (from :func:`batch_sentences`). The forward LM at
    position i predicts token i + 1 and the backward LM at position i + 1 predicts token i, over the
    sequence ``<S>`` w_1 … w_n ``</S>``.
    """
    if logits.dim() != 4 or logits.shape[1] != 2 or token_ids.dim() != 2 or logits.shape[2] != token_ids.shape[1] + 2:
        raise InputError(
            f"logits {tuple(logits.shape)} and token_ids {tuple(token_ids.shape)} do not match: expected "
            "logits (B, 2, T + 2, V) from BiLMWithSoftmax and token_ids (B, T) from batch_sentences."
        )
    lengths = (token_ids != PAD_ID).sum(dim=1, keepdim=True)
    positions = torch.arange(token_ids.shape[1] + 2, device=token_ids.device)
    full = F.pad(token_ids, (1, 1), value=PAD_ID)
    full = torch.where(positions == 0, BOS_ID, full)
    full = torch.where(positions == lengths + 1, EOS_ID, full)
    predicted = full[:, 1:] != PAD_ID  # forward predictor i and backward predictor i + 1 are both real
    vocab_size = logits.shape[-1]

    def nll(scores: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        flat = F.cross_entropy(scores.reshape(-1, vocab_size), targets.clamp(min=0).reshape(-1), reduction="none")
        return (flat.reshape(targets.shape) * predicted.to(flat.dtype)).sum(dim=1)

    total = nll(logits[:, 0, :-1], full[:, 1:]) + nll(logits[:, 1, 1:], full[:, :-1])
    return total / (2 * predicted.sum(dim=1)).to(total.dtype)
