"""Character ids of tokens exactly as allennlp's ``ELMoCharacterMapper`` builds them.

A token becomes ``MAX_CHARS`` = 50 ids: its UTF-8 bytes (0–255), truncated to 48 bytes, wrapped in the
begin-of-word (258) and end-of-word (259) characters and padded with the padding character (260). The
sentence markers ``<S>`` and ``</S>`` are the three characters [258, 256, 259] and [258, 257, 259] padded
with 260. Every id is then shifted by +1 so that 0 is free to mean "no token here" (a padded position of
a batch), which is how the biLM finds the sentence lengths.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..errors import InputError

MAX_CHARS = 50
NUM_CHAR_IDS = 262  # ids 0 … 261 after the +1 shift; 0 embeds to zero, 1 … 261 index the 261-row table
BEGIN_OF_SENTENCE_CHAR = 256
END_OF_SENTENCE_CHAR = 257
BEGIN_OF_WORD_CHAR = 258
END_OF_WORD_CHAR = 259
PADDING_CHAR = 260
BOS_TOKEN = "<S>"
EOS_TOKEN = "</S>"


def _marker(char: int) -> list[int]:
    ids = [PADDING_CHAR] * MAX_CHARS
    ids[0], ids[1], ids[2] = BEGIN_OF_WORD_CHAR, char, END_OF_WORD_CHAR
    return [c + 1 for c in ids]


BOS_CHAR_IDS: tuple[int, ...] = tuple(_marker(BEGIN_OF_SENTENCE_CHAR))
EOS_CHAR_IDS: tuple[int, ...] = tuple(_marker(END_OF_SENTENCE_CHAR))


def token_to_char_ids(token: str) -> list[int]:
    """The 50 (+1-shifted) character ids of one token.

    ``"<S>"`` and ``"</S>"`` map to the sentence markers; any other string to
    [258, b_1, …, b_k, 259, 260, …] + 1 with b the UTF-8 bytes of the token (unencodable characters such
    as lone surrogates dropped) truncated to k ≤ 48 bytes — truncation may cut a multi-byte character,
    as in allennlp. The empty string gives [258, 259, 260, …] + 1, as in allennlp.
    """
    if not isinstance(token, str):
        raise InputError(f"tokens must be str, got {type(token).__name__} ({token!r}); split sentences first.")
    if token == BOS_TOKEN:
        return list(BOS_CHAR_IDS)
    if token == EOS_TOKEN:
        return list(EOS_CHAR_IDS)
    encoded = token.encode("utf-8", "ignore")[: MAX_CHARS - 2]
    ids = [PADDING_CHAR] * MAX_CHARS
    ids[0] = BEGIN_OF_WORD_CHAR
    ids[1 : len(encoded) + 1] = encoded
    ids[len(encoded) + 1] = END_OF_WORD_CHAR
    return [c + 1 for c in ids]


def batch_to_char_ids(sentences: Sequence[Sequence[str]], length: int | None = None) -> torch.Tensor:
    """(B, T, 50) long tensor of character ids, zero-padded after each sentence's last token.

    T is the longest sentence (or ``length`` if given, which must be at least that). Sentence markers are
    not added here: the biLM adds ``<S>``/``</S>`` itself, as allennlp's ``batch_to_ids`` expects.
    """
    if isinstance(sentences, str) or any(isinstance(s, str) for s in sentences):
        raise InputError("give a list of token lists, e.g. [['The', 'cat', '.']], not raw strings.")
    longest = max((len(s) for s in sentences), default=0)
    width = longest if length is None else length
    if width < longest:
        raise InputError(f"length={length} is shorter than the longest sentence ({longest} tokens); raise it.")
    ids = torch.zeros(len(sentences), width, MAX_CHARS, dtype=torch.long)
    for i, sentence in enumerate(sentences):
        if sentence:
            ids[i, : len(sentence)] = torch.tensor([token_to_char_ids(t) for t in sentence])
    return ids
