"""Fixtures shared by the benchmark peers' tests."""
import pytest
import torch

import influkit as ik
from influkit import hf


def snippets(count: int) -> list[str]:
    """The first five words of the first ``count`` rated snippets (real text, a few tokens each: Bergson refuses a
    document longer than the model's positions)."""
    return [" ".join(s.text.split()[:5]) for s in hf.rated_snippets()][:count]


def gpt2_record(texts: list[str], steps: int = 6):
    """(record, tokenizer): a 2-layer GPT-2 on ``texts``, ``steps`` AdamW steps of 4 documents, a checkpoint every 2
    steps."""
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = hf.train_bpe(texts, vocab_size=120)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=32, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0)
    stage = hf.causal_lm_stage(GPT2LMHeadModel(config).eval(), hf.causal_lm_batch(tokenizer, texts, max_length=24))
    record = ik.unrolled.Record()
    record.train(stage, ik.unrolled.AdamW(lr=1e-2), steps=steps, batch_size=4, checkpoint_every=2)
    return record, tokenizer


@pytest.fixture(scope="module")
def recorded():
    """(record, tokenizer, training texts, test texts): :func:`gpt2_record` on 12 rated snippets, 2 held out."""
    texts = snippets(14)
    record, tokenizer = gpt2_record(texts[:12])
    return record, tokenizer, texts[:12], texts[12:]
