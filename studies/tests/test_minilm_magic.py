"""The pieces ``studies.minilm_full_finetune_magic`` drives Bergson's Trainer with, on a tiny BERT (no Bergson)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")


def tiny_mlm():
    from transformers import BertConfig, BertForMaskedLM

    torch.manual_seed(0)
    config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=16)
    model = BertForMaskedLM(config).eval()
    with torch.no_grad():
        model.cls.predictions.bias.normal_()
    return model


def test_tied_decoder_same_logits_one_entry_per_tensor():
    from studies.minilm_full_finetune_magic import TiedDecoder

    model = tiny_mlm()
    ids = torch.randint(0, 50, (3, 7))
    before = model(input_ids=ids).logits
    model.cls.predictions.decoder = TiedDecoder(model)
    after = model(input_ids=ids).logits
    assert torch.equal(before, after)  # the tied nn.Linear's arithmetic, bit for bit
    names = [n for n, _ in model.named_parameters(remove_duplicate=False)]
    assert "bert.embeddings.word_embeddings.weight" in names and "cls.predictions.bias" in names
    assert not any(n.startswith("cls.predictions.decoder") for n in names)  # the tie held once
    # the decoder reads the embedding at call time: a new embedding value moves the logits
    with torch.no_grad():
        model.bert.embeddings.word_embeddings.weight.mul_(2.0)
    assert not torch.allclose(model(input_ids=ids).logits, after)


def test_recorded_steps_pairs_micro_batches_and_indexes_weights():
    from studies.minilm_full_finetune_magic import RecordedSteps

    batches = [torch.tensor([4, 0, 2, 1]), torch.tensor([3, 5, 6, 7])]
    stream = RecordedSteps(batches, torch.float32)
    stream.requires_grad = True
    step = stream[1]
    assert step["micro"].tolist() == [2, 3]
    assert step["example_weight"].shape == (2, 2) and step["shift_loss_mask"].sum() == 2
    (step["example_weight"] * torch.tensor([[1.0, 2.0], [3.0, 4.0]])).sum().backward()
    assert stream.weights.grad.tolist() == [0, 0, 0, 1, 0, 2, 3, 4]  # each example's own weight
    with pytest.raises(IndexError):
        stream[2]
