"""Tokenizers trained locally on a corpus (nothing downloaded), as transformers tokenizers: WordPiece (BERT) and
byte-level BPE (GPT-2)."""

from __future__ import annotations

from collections.abc import Iterable

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def train_wordpiece(texts: Iterable[str], vocab_size: int = 2000, *, min_frequency: int = 2, lowercase: bool = True):
    """A ``transformers.PreTrainedTokenizerFast`` with a BERT-style WordPiece vocabulary learned from ``texts``.

    BERT normalization (``lowercase``, accents stripped) and pre-tokenization, at most ``vocab_size`` entries
    including the specials ``[PAD] [UNK] [CLS] [SEP] [MASK]`` (ids 0–4), sub-words seen at least
    ``min_frequency`` times; single sentences are encoded as ``[CLS] … [SEP]``. Calling it on a list of texts
    with ``padding="max_length", truncation=True, max_length=L, return_tensors="pt"`` gives the dict batch the
    stages take. ``tokenizers`` breaks ties between equally frequent merges arbitrarily, so two trainings on
    the same texts can differ in a few entries: keep the tokenizer with the model (``save_pretrained``) rather
    than retraining it. Needs the ``hf`` extra (``pip install influkit[hf]``).
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=lowercase, strip_accents=lowercase)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                        special_tokens=list(SPECIAL_TOKENS), show_progress=False)  # fmt: skip
    tok.train_from_iterator(list(texts), trainer=trainer)
    cls, sep = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    tok.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]",
        mask_token="[MASK]",
    )  # fmt: skip


BPE_SPECIAL_TOKENS = ("<|endoftext|>", "<pad>")


def train_bpe(texts: Iterable[str], vocab_size: int = 2000, *, min_frequency: int = 2):
    """A ``transformers.PreTrainedTokenizerFast`` with a GPT-2-style byte-level BPE vocabulary learned from ``texts``.

    Byte-level pre-tokenization (every string is encodable, no unknown token), at most ``vocab_size`` entries
    including the specials ``<|endoftext|>`` (id 0: beginning and end of text) and ``<pad>`` (id 1); each text
    is encoded as ``<|endoftext|> …`` so its first word is predicted too. Padding ``<pad>`` on the right, as
    :func:`influkit.hf.causal_lm_batch` and :func:`influkit.hf.completion_batch` expect. Ties between equally
    frequent merges are broken arbitrarily by ``tokenizers``: keep the tokenizer with the model.
    Needs the ``hf`` extra.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, show_progress=False,
                                  special_tokens=list(BPE_SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator(list(texts), trainer=trainer)
    bos = tok.token_to_id(BPE_SPECIAL_TOKENS[0])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BPE_SPECIAL_TOKENS[0]} $A", pair=f"{BPE_SPECIAL_TOKENS[0]} $A $B:1",
        special_tokens=[(BPE_SPECIAL_TOKENS[0], bos)],
    )  # fmt: skip
    tok.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BPE_SPECIAL_TOKENS[0], eos_token=BPE_SPECIAL_TOKENS[0],
        pad_token=BPE_SPECIAL_TOKENS[1], padding_side="right",
    )  # fmt: skip
