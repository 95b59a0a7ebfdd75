"""Tokenizers trained locally on a corpus (nothing downloaded), as transformers tokenizers: WordPiece (BERT) and
byte-level BPE (GPT-2)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ..errors import InputError

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


def train_wordpiece(texts: Iterable[str], vocab_size: int = 2000, *, min_frequency: int = 2, lowercase: bool = True):
    """A ``transformers.PreTrainedTokenizerFast`` with a BERT-style WordPiece vocabulary learned from ``texts``.

    At most ``vocab_size`` entries including the specials ``[PAD] [UNK] [CLS] [SEP] [MASK]`` (ids 0–4), sub-words
    seen at least ``min_frequency`` times, the tokenizer of :func:`wordpiece_tokenizer`. ``tokenizers`` breaks ties
    between equally frequent merges arbitrarily (each call, not only each process), so two trainings on the same
    texts can differ in a few entries and in their ids: keep the tokenizer with the model (``save_pretrained``), or
    its vocabulary (``convert_ids_to_tokens(range(len(tok)))``) for :func:`wordpiece_tokenizer`, rather than
    retraining it. Needs the ``hf`` extra (``pip install influkit[hf]``).
    """
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=lowercase, strip_accents=lowercase)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                        special_tokens=list(SPECIAL_TOKENS), show_progress=False)  # fmt: skip
    tok.train_from_iterator(list(texts), trainer=trainer)
    learned = tok.get_vocab()
    return wordpiece_tokenizer(sorted(learned, key=learned.get), lowercase=lowercase)


def wordpiece_tokenizer(vocabulary: Sequence[str], *, lowercase: bool = True):
    """A ``transformers.PreTrainedTokenizerFast`` for BERT-style WordPiece with exactly this vocabulary (token i has
    id i; continuation pieces start with ``##``): the same tokenizer every time, where :func:`train_wordpiece` may
    break ties otherwise.

    BERT normalization (``lowercase``, accents stripped) and pre-tokenization, greedy longest-match word pieces,
    single sentences encoded as ``[CLS] … [SEP]``. The vocabulary must hold the specials
    ``[PAD] [UNK] [CLS] [SEP] [MASK]`` (ids 0–4 in a trained one). Calling the tokenizer on a list of texts with
    ``padding="max_length", truncation=True, max_length=L, return_tensors="pt"`` gives the dict batch the stages
    take. Needs the ``hf`` extra.
    """
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    ids = {token: i for i, token in enumerate(vocabulary)}
    missing = [t for t in SPECIAL_TOKENS if t not in ids]
    if missing or len(ids) != len(vocabulary):
        raise InputError(f"a WordPiece vocabulary needs each of {list(SPECIAL_TOKENS)} once and no repeated token; "
                         f"missing {missing}, {len(vocabulary) - len(ids)} repeated: put the specials first, as "
                         "train_wordpiece does.")
    tok = Tokenizer(models.WordPiece(ids, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=lowercase, strip_accents=lowercase)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", ids["[CLS]"]), ("[SEP]", ids["[SEP]"])],
    )  # fmt: skip
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
