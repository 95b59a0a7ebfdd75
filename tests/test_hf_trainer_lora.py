"""A peft LoRA finetune by the Hugging Face Trainer, recorded by ``hf.RecordCallback`` after a recorded masked-LM
Trainer run: the record replays both Trainers' own final weights bit for bit (LoRA dropout on), the callback does
not change the run, the exact metagradient across the boundary equals central finite differences of the re-run
training in float64 for examples of both stages, and what cannot be attributed exactly (a LoRA variant, a shared
block the first stage did not train, Case 2) is refused before the first step."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from test_hf_trainer_record import (LABELS, TEXTS, VOCAB, arguments, central_difference, config,  # noqa: E402
                                    examples, pretrain)
from transformers import (BertForMaskedLM, BertForSequenceClassification, DataCollatorForLanguageModeling,  # noqa: E402
                          DataCollatorWithPadding, Trainer)

import influkit as ik  # noqa: E402
from influkit import hf  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer():
    return hf.wordpiece_tokenizer(VOCAB)


def lora_classifier(tokenizer, mlm, **lora):
    """A classifier on the masked LM's encoder with LoRA on the attention's query and value (dropout 0.1) and the
    classification head trained (peft's SEQ_CLS task saves it); everything else frozen by peft."""
    torch.manual_seed(1)
    clf = BertForSequenceClassification(config(tokenizer, num_labels=2)).double()
    clf.bert.load_state_dict(mlm.bert.state_dict(), strict=False)
    settings = dict(r=2, lora_alpha=4, target_modules=["query", "value"], lora_dropout=0.1, task_type="SEQ_CLS")
    return peft.get_peft_model(clf, peft.LoraConfig(**(settings | lora)))


def finetune(tokenizer, model, callbacks=()):
    trainer = Trainer(model, arguments(num_train_epochs=3), train_dataset=examples(tokenizer, TEXTS, LABELS),
                      data_collator=DataCollatorWithPadding(tokenizer), callbacks=list(callbacks))
    trainer.train()
    return trainer


def test_a_lora_finetune_by_the_trainer_replays_bit_for_bit_and_is_attributed_across_the_boundary(tokenizer):
    record = ik.unrolled.Record()
    mlm = pretrain(tokenizer, [hf.RecordCallback(record)], num_train_epochs=1)
    model = lora_classifier(tokenizer, mlm)
    finetune(tokenizer, model, [hf.RecordCallback(record, link=hf.lora_link(mlm, model))])
    plain = lora_classifier(tokenizer, pretrain(tokenizer, num_train_epochs=1))
    finetune(tokenizer, plain)
    for (n, a), b in zip(model.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), n  # the callback does not change the run
    run = record.runs[1]
    assert all(hf.is_adapter(n) or ".modules_to_save." in n for n in run.trained)
    assert {hf.pretrained_name(n) for n in run.frozen} == {n for n, _ in mlm.bert.named_parameters(prefix="bert")}
    assert ik.unrolled.verify(record) == 0.0
    for final, trained in zip(ik.unrolled.replay(record), (mlm, model)):
        own = dict(trained.named_parameters())
        for n, value in final.items():
            assert torch.equal(value, own[n]), n
    test = run.stage.data.take(torch.tensor([0, 1]))
    results = ik.unrolled.metagradients(record, test)
    largest = [(k, int(z)) for k in (0, 1) for z in results[k].values.abs().topk(2).indices]  # visible to FD
    for k, z in largest + [(0, 6), (1, 5)]:
        fd, rounding = central_difference(record, test, k, z)
        assert abs(fd) > 100 * rounding or (k, z) not in largest, (k, z)  # a difference the check can see
        assert float(results[k].values[z]) == pytest.approx(fd, rel=1e-6, abs=rounding), (k, z)


def pretrain_encoder_only(tokenizer, record):
    """The masked LM trained by a recorded Trainer with its embeddings frozen (only the encoder and head train)."""
    torch.manual_seed(0)
    mlm = BertForMaskedLM(config(tokenizer)).double()
    for n, p in mlm.named_parameters():
        p.requires_grad_(not n.startswith("bert.embeddings"))
    Trainer(mlm, arguments(num_train_epochs=1), train_dataset=examples(tokenizer, TEXTS * 2),
            data_collator=DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.3),
            callbacks=[hf.RecordCallback(record)]).train()
    return mlm


@pytest.mark.parametrize("lora, link, error, fix", [
    ({"use_dora": True}, {"shared": "bert.encoder"}, ik.NotReplayable, "use_dora=False"),  # DoRA detaches its norm
    ({}, {}, ik.ParameterError, "shared=prefix"),  # the frozen embeddings carry no influence from stage 1
    ({}, {"case": 2, "shared": "bert.encoder"}, ik.NotReplayable, "Case 1"),  # the Trainer adds no proximal term
])
def test_what_cannot_be_attributed_exactly_is_refused_before_the_first_step(tokenizer, lora, link, error, fix):
    record = ik.unrolled.Record()
    mlm = pretrain_encoder_only(tokenizer, record)
    model = lora_classifier(tokenizer, mlm, **lora)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    callback = hf.RecordCallback(record, link=hf.lora_link(mlm, model, **link))
    with pytest.raises(error, match=fix):
        finetune(tokenizer, model, [callback])
    assert all(torch.equal(p, start[n]) for n, p in model.named_parameters())
    assert len(record) == 1


def test_the_shared_block_narrowed_to_what_the_first_stage_trained_is_recorded(tokenizer):
    record = ik.unrolled.Record()
    mlm = pretrain_encoder_only(tokenizer, record)
    model = lora_classifier(tokenizer, mlm)
    finetune(tokenizer, model, [hf.RecordCallback(record, link=hf.lora_link(mlm, model, shared="bert.encoder"))])
    assert {hf.pretrained_name(n) for n in record.runs[1].frozen} == {
        n for n, _ in mlm.named_parameters() if n.startswith("bert.encoder")}
    assert ik.unrolled.verify(record) == 0.0
