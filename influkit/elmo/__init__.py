"""ELMo biLM in plain PyTorch, compatible with allennlp/TensorFlow ELMo weight and embedding files.

- :mod:`~influkit.elmo.characters` — character ids of tokens (allennlp ``ELMoCharacterMapper``).
- :mod:`~influkit.elmo.bilm` — char CNN, biLSTM, :class:`ElmoBiLM`, :class:`ScalarMix`, sentence encoder.
- :mod:`~influkit.elmo.weights` — HDF5 weight files and ``options.json``.
- :mod:`~influkit.elmo.embeddings_file` — ``elmo`` command embedding files, streamed.
- :mod:`~influkit.elmo.lm_loss` — vocabulary, softmax head, per-sentence biLM loss g(z).
"""

from .bilm import (
    BiLMOutput,
    ElmoBiLM,
    ElmoOptions,
    ElmoSentenceEncoder,
    ScalarMix,
    add_sentence_boundaries,
    remove_sentence_boundaries,
)
from .characters import batch_to_char_ids, token_to_char_ids
from .embeddings_file import EmbeddingsFile, EmbeddingsWriter, embed_sentences, write_embeddings_file
from .lm_loss import PAD_ID, BiLMWithSoftmax, Vocabulary, batch_sentences, bilm_lm_loss
from .weights import load_elmo, load_weights, read_options, save_weights, write_options

__all__ = [
    "PAD_ID",
    "BiLMOutput",
    "BiLMWithSoftmax",
    "ElmoBiLM",
    "ElmoOptions",
    "ElmoSentenceEncoder",
    "EmbeddingsFile",
    "EmbeddingsWriter",
    "ScalarMix",
    "Vocabulary",
    "add_sentence_boundaries",
    "batch_sentences",
    "batch_to_char_ids",
    "bilm_lm_loss",
    "embed_sentences",
    "load_elmo",
    "load_weights",
    "read_options",
    "remove_sentence_boundaries",
    "save_weights",
    "token_to_char_ids",
    "write_embeddings_file",
    "write_options",
]
