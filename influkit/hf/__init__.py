"""Hugging Face ``transformers`` models as influkit stages: masked-LM pretraining and sequence classification.

    import influkit as ik
    from influkit import hf
    tokenizer = hf.train_wordpiece(sentences, vocab_size=2000)          # trained locally, nothing downloaded
    enc = lambda texts: tokenizer(texts, padding="max_length", truncation=True, max_length=32, return_tensors="pt")
    pre = hf.masked_lm_stage(BertForMaskedLM(config).eval(), enc(sentences), tokenizer=tokenizer)
    fin = hf.classification_stage(BertForSequenceClassification(config).eval(), enc(tweets) | {"labels": y})
    res = ik.score(pre, fin, z, hf.pack(enc(test) | {"labels": y_test}), shared="bert", case=1)

- dict batches are packed into the (inputs, targets) tensors influkit streams (:mod:`~influkit.hf.batches`);
- :class:`HFModel` calls the transformers model on them with the model's own parameter names, so the shared
  block is named by its prefix (``shared="bert"``; a pooler the classification model adds is its own);
- the masked-LM mask of each example is a deterministic function of its index (:mod:`~influkit.hf.masking`),
  so g(z) is a function, not a random variable;
- :func:`check_eval_mode` understands transformers dropout; float32 by default, ``model.double()`` for float64.

Needs ``pip install influkit[hf]`` (``transformers``, ``tokenizers``) only for the models and the tokenizer;
this package itself imports neither.
"""

from .batches import FIELDS, pack, unpack
from .losses import classification_losses, masked_lm_losses
from .masking import example_seed, mask_tokens
from .model import HFModel, check_eval_mode, dropout_probabilities
from .stages import classification_stage, masked_lm_batch, masked_lm_stage
from .tokenizer import SPECIAL_TOKENS, train_wordpiece

__all__ = [
    "FIELDS",
    "HFModel",
    "SPECIAL_TOKENS",
    "check_eval_mode",
    "classification_losses",
    "classification_stage",
    "dropout_probabilities",
    "example_seed",
    "mask_tokens",
    "masked_lm_batch",
    "masked_lm_losses",
    "masked_lm_stage",
    "pack",
    "train_wordpiece",
    "unpack",
]
