"""ELMo embedding files in the layout of allennlp's ``elmo --all`` command, written and read one sentence at a time.

An HDF5 file holds one float32 dataset per sentence, named by the sentence's index "0", "1", …, of shape
(n_layers + 1, n_tokens, 2·proj): layer 0 is the char-CNN token vector duplicated to 2·proj, layers 1..
are the biLSTM layers [forward; backward], sentence markers removed. A dataset ``sentence_to_index`` of
shape (1,) holds a JSON string mapping each sentence (its tokens joined by single spaces) to its key.
Only one batch of embeddings is in memory at a time, whatever the number of sentences.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from ..errors import InputError
from ..extras import require
from .bilm import ElmoBiLM, remove_sentence_boundaries
from .characters import batch_to_char_ids

h5py = require("h5py", "influkit.elmo (allennlp weight and embedding files)")

SENTENCE_TO_INDEX = "sentence_to_index"


def embed_sentences(
    bilm: ElmoBiLM, sentences: Iterable[Sequence[str]], batch_size: int = 64
) -> Iterator[tuple[Sequence[str], np.ndarray]]:
    """Yield (sentence, its (n_layers + 1, n_tokens, 2·proj) float32 ELMo layers) for each sentence, in order.

    Sentences are run through ``bilm`` ``batch_size`` at a time without gradients; a stateful biLM
    carries its state from batch to batch as allennlp's ``ElmoEmbedder`` does.
    """
    if batch_size < 1:
        raise InputError(f"batch_size must be at least 1, got {batch_size}.")
    device = bilm.char_cnn.W_proj.device
    batch: list[Sequence[str]] = []
    for sentence in sentences:
        batch.append(sentence)
        if len(batch) == batch_size:
            yield from _embed_batch(bilm, batch, device)
            batch = []
    if batch:
        yield from _embed_batch(bilm, batch, device)


def _embed_batch(
    bilm: ElmoBiLM, batch: list[Sequence[str]], device: torch.device
) -> Iterator[tuple[Sequence[str], np.ndarray]]:
    with torch.no_grad():
        out = bilm(batch_to_char_ids(batch).to(device))
        layers, _ = remove_sentence_boundaries(out.activations.permute(1, 2, 0, 3), out.mask)  # (B, T, L, D)
        layers = layers.transpose(1, 2).to("cpu", torch.float32).numpy()
    for row, sentence in zip(layers, batch):
        yield sentence, row[:, : len(sentence)].copy()


class EmbeddingsWriter:
    """Writes an ELMo embedding file sentence by sentence; use as a context manager.

    ``write(embedding, sentence)`` stores a (n_layers + 1, n_tokens, dim) array under the next key "0",
    "1", …; on close, ``sentence_to_index`` is written unless ``sentence_to_index=False`` (allennlp's
    ``--forget-sentences``).
    """

    def __init__(self, path: str | Path, sentence_to_index: bool = True):
        self._file = h5py.File(path, "w")
        self._count = 0
        self._index: dict[str, str] | None = {} if sentence_to_index else None

    def __enter__(self) -> EmbeddingsWriter:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def write(self, embedding: np.ndarray, sentence: Sequence[str]) -> str:
        """The key under which the (n_layers + 1, len(sentence), dim) ``embedding`` of ``sentence`` was stored."""
        embedding = np.asarray(embedding)
        if embedding.ndim != 3 or embedding.shape[1] != len(sentence):
            raise InputError(
                f"embedding of shape {embedding.shape} does not fit a sentence of {len(sentence)} tokens; "
                "give an array (n_layers + 1, n_tokens, dim) as yielded by embed_sentences."
            )
        key = str(self._count)
        self._file.create_dataset(key, data=embedding.astype(np.float32))
        if self._index is not None:
            self._index[" ".join(sentence)] = key
        self._count += 1
        return key

    def close(self) -> None:
        """Write ``sentence_to_index`` (if kept) and close the file; calling it again does nothing."""
        if not self._file:
            return
        if self._index is not None:
            dataset = self._file.create_dataset(SENTENCE_TO_INDEX, (1,), dtype=h5py.string_dtype())
            dataset[0] = json.dumps(self._index)
        self._file.close()


def write_embeddings_file(
    path: str | Path,
    bilm: ElmoBiLM,
    sentences: Iterable[Sequence[str]],
    batch_size: int = 64,
    sentence_to_index: bool = True,
) -> int:
    """Number of sentences embedded by ``bilm`` and streamed into the ELMo embedding file ``path``."""
    with EmbeddingsWriter(path, sentence_to_index) as writer:
        count = 0
        for sentence, embedding in embed_sentences(bilm, sentences, batch_size):
            writer.write(embedding, sentence)
            count += 1
    return count


class EmbeddingsFile:
    """Read-only view of an ELMo embedding file; iterating yields (key, array) in key order, one at a time."""

    def __init__(self, path: str | Path):
        path = Path(path)
        if not path.is_file():
            raise InputError(f"ELMo embedding file {str(path)!r} does not exist; give the path of an existing file.")
        self._file = h5py.File(path, "r")
        keys = [k for k in self._file.keys() if k != SENTENCE_TO_INDEX]
        if not all(k.isdigit() for k in keys):
            raise InputError(
                f"{str(path)!r} has datasets not named by sentence index ({[k for k in keys if not k.isdigit()][:3]}); "
                "it was not written by the elmo command or EmbeddingsWriter (sentence keys are not supported)."
            )
        self._keys = sorted(keys, key=int)

    def __enter__(self) -> EmbeddingsFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Close the underlying HDF5 file."""
        self._file.close()

    def __len__(self) -> int:
        return len(self._keys)

    def __getitem__(self, key: str | int) -> np.ndarray:
        """The (n_layers + 1, n_tokens, dim) array of the sentence with index ``key``."""
        if str(key) not in self._keys:
            raise InputError(f"no sentence with index {key!r}; indices run from 0 to {len(self) - 1}.")
        return self._file[str(key)][...]

    def __iter__(self) -> Iterator[tuple[str, np.ndarray]]:
        for key in self._keys:
            yield key, self._file[key][...]

    def sentence_to_index(self) -> dict[str, str]:
        """The sentence → key map stored in the file (empty if it was written without one)."""
        if SENTENCE_TO_INDEX not in self._file:
            return {}
        raw = self._file[SENTENCE_TO_INDEX][0]
        return json.loads(raw.decode("utf-8") if isinstance(raw, bytes) else raw)
