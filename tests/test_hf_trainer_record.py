"""A Hugging Face Trainer run recorded by ``hf.RecordCallback``: the record replays the Trainer's own final weights bit
for bit (random masked-LM masks from DataCollatorForLanguageModeling, dropout, linear warmup and decay, clipping), the
callback does not change the run, the exact metagradient equals central finite differences of the re-run training
(one stage and masked-LM pretraining → Case 1 classification), and what replay cannot repeat is refused before the
first step."""

from __future__ import annotations

import tempfile
import warnings

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
from transformers import (BertConfig, BertForMaskedLM, BertForSequenceClassification,  # noqa: E402
                          DataCollatorForLanguageModeling, DataCollatorWithPadding, Trainer, TrainingArguments)

import influkit as ik  # noqa: E402
from influkit import hf  # noqa: E402
from influkit.gradients import per_example_grads, per_example_grads_serial  # noqa: E402

TEXTS = ["the movie was good", "a bad film indeed", "great acting and story", "boring plot, weak ending",
         "i loved the music", "the worst movie ever", "fine but too long", "what a wonderful surprise"]
LABELS = [1, 0, 1, 0, 1, 0, 0, 1]
EPS = 1e-6


# A vocabulary hf.train_wordpiece(TEXTS * 2, vocab_size=60) learned, fixed: tokenizers breaks ties between equally
# frequent merges arbitrarily on every call, and each other vocabulary is another recorded run.
VOCAB = [*hf.SPECIAL_TOKENS, ",", *"abcdefghiklmnoprstuvwy", *(f"##{c}" for c in "acdefghiklmnoprstuvy"), "##in", "##nd",
         "th", "##ov", "##or", "##ing", "the", "mov", "##oo", "##ed", "##er", "##ea"]


@pytest.fixture(scope="module")
def tokenizer():
    return hf.wordpiece_tokenizer(VOCAB)


def examples(tokenizer, texts, labels=None):
    enc = tokenizer(texts, truncation=True, max_length=10)  # unpadded: the collator pads each batch
    rows = [{k: enc[k][i] for k in ("input_ids", "attention_mask")} for i in range(len(texts))]
    return rows if labels is None else [row | {"labels": y} for row, y in zip(rows, labels)]


def config(tokenizer, **kwargs):
    return BertConfig(vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                      intermediate_size=32, max_position_embeddings=16, **({"attn_implementation": "eager"} | kwargs))


def arguments(**kwargs):
    base = dict(per_device_train_batch_size=4, num_train_epochs=2, learning_rate=5e-3, warmup_steps=2,
                lr_scheduler_type="linear", optim="adamw_torch", max_grad_norm=0.5, report_to=[], save_strategy="no",
                logging_strategy="no", use_cpu=True, seed=3, disable_tqdm=True)
    return TrainingArguments(tempfile.mkdtemp(), **(base | kwargs))


def pretrain(tokenizer, callbacks=(), **kwargs):
    torch.manual_seed(0)
    model = BertForMaskedLM(config(tokenizer)).double()
    collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.3)  # 80 % [MASK], 10 % random tokens
    trainer = Trainer(model, arguments(**kwargs), train_dataset=examples(tokenizer, TEXTS * 2),
                      data_collator=collator, callbacks=list(callbacks))
    trainer.train()
    return model


def test_a_recorded_trainer_run_is_the_trainers_own_bit_for_bit(tokenizer):
    record = ik.unrolled.Record()
    recorded = pretrain(tokenizer, [hf.RecordCallback(record)])
    plain = pretrain(tokenizer)
    for (n, a), b in zip(recorded.named_parameters(), plain.parameters()):
        assert torch.equal(a, b), n
    run = record.runs[0]
    assert run.steps == 8 and run.lrs[0] == (0.0, 0.0) and run.clips[0] == (0.5, 2.0)
    masked = [int((y != -100).sum()) for _, y in run.inputs]
    assert len(set(masked)) > 1  # the collator drew other masks for every batch
    assert ik.unrolled.verify(record) == 0.0
    final = ik.unrolled.replay(record)[0]
    for n, p in recorded.named_parameters():
        assert torch.equal(final[n], p), n


def replayed(record, test, stage: int, z: int, eps: float) -> float:
    weights = [torch.ones(len(run.stage), dtype=torch.float64) for run in record.runs]
    weights[stage][z] += eps
    return float(ik.unrolled.outputs(record, test, weights).sum())


def central_difference(record, test, stage: int, z: int) -> tuple[float, float]:
    """(d measure / d w_z by central differences at ε = EPS, its rounding error bound): each float64 measure is
    rounded to a few ulps of its size after a long replay, and that error is divided by 2ε."""
    plus, minus = replayed(record, test, stage, z, EPS), replayed(record, test, stage, z, -EPS)
    return (plus - minus) / (2 * EPS), 16 * torch.finfo(torch.float64).eps * max(abs(plus), abs(minus)) / (2 * EPS)


def test_the_metagradient_of_a_trainer_run_equals_central_differences(tokenizer):
    record = ik.unrolled.Record()
    pretrain(tokenizer, [hf.RecordCallback(record)])
    stage = record.runs[0].stage
    test = stage.data.take(torch.tensor([0, 3]))
    scores = ik.unrolled.metagradients(record, test)[0]
    assert scores.diagnostics["replay"]["max_error"] == 0.0
    for z in (1, 6, 12):
        fd, rounding = central_difference(record, test, 0, z)
        assert float(scores.values[z]) == pytest.approx(fd, rel=1e-6, abs=rounding), z


def test_pretraining_then_case_1_finetuning_by_the_trainer_is_attributed_across_the_boundary(tokenizer):
    record = ik.unrolled.Record()
    mlm = pretrain(tokenizer, [hf.RecordCallback(record)], num_train_epochs=1)
    torch.manual_seed(1)
    clf = BertForSequenceClassification(config(tokenizer, num_labels=2)).double()
    clf.bert.load_state_dict(mlm.bert.state_dict(), strict=False)
    shared = {f"bert.{n}": f"bert.{n}" for n, _ in mlm.bert.named_parameters()}
    for n, p in clf.named_parameters():
        p.requires_grad_(n not in shared)  # the pretrained encoder fixed: Case 1
    callback = hf.RecordCallback(record, link=ik.Link(shared, case=1))
    Trainer(clf, arguments(num_train_epochs=3), train_dataset=examples(tokenizer, TEXTS, LABELS),
            data_collator=DataCollatorWithPadding(tokenizer), callbacks=[callback]).train()
    assert len(record) == 2 and set(record.runs[1].frozen) == set(shared)
    assert ik.unrolled.verify(record) == 0.0
    test = record.runs[1].stage.data.take(torch.tensor([0, 1]))
    results = ik.unrolled.metagradients(record, test)
    for k, z in ((0, 2), (0, 9), (1, 5)):
        fd, rounding = central_difference(record, test, k, z)
        assert float(results[k].values[z]) == pytest.approx(fd, rel=1e-6, abs=rounding), (k, z)


def test_pretraining_then_finetuning_every_weight_by_the_trainer_is_attributed_through_the_start(tokenizer):
    record = ik.unrolled.Record()
    mlm = pretrain(tokenizer, [hf.RecordCallback(record)], num_train_epochs=1)
    torch.manual_seed(1)
    clf = BertForSequenceClassification(config(tokenizer, num_labels=2)).double()  # every weight trained
    shared = {f"bert.{n}": f"bert.{n}" for n, _ in mlm.bert.named_parameters()}
    callback = hf.RecordCallback(record, link=ik.Link.finetune(shared))  # the callback starts it from mlm's values
    Trainer(clf, arguments(num_train_epochs=3), train_dataset=examples(tokenizer, TEXTS, LABELS),
            data_collator=DataCollatorWithPadding(tokenizer), callbacks=[callback]).train()
    run = record.runs[1]
    assert set(shared) <= set(run.trained) and not run.frozen and run.alpha == 0.0
    assert ik.unrolled.verify(record) == 0.0
    moved = max(float((dict(clf.named_parameters())[n] - dict(mlm.named_parameters())[m]).detach().abs().max())
                for n, m in shared.items())
    assert moved > 1e-4  # the encoder was finetuned
    test = run.stage.data.take(torch.tensor([0, 1]))
    results = ik.unrolled.metagradients(record, test)
    assert float(results[0].values.abs().max()) > 0  # pretraining examples reach the test loss through the start
    for k, z in ((0, 2), (0, 9), (1, 5)):
        fd, rounding = central_difference(record, test, k, z)
        assert float(results[k].values[z]) == pytest.approx(fd, rel=1e-6, abs=rounding), (k, z)


def fed_padding(record, pad: int) -> list[int]:
    """The examples whose recorded batch fed the padding token at an attended position."""
    run = record.runs[0]
    return [int(run.batches[t][r]) for t, (x, _) in enumerate(run.inputs) for r in range(x.shape[0])
            if bool(((x[r, 0] == pad) & (x[r, 1] == 1)).any())]


def test_a_padding_token_drawn_by_the_collator_keeps_the_metagradient_exact(tokenizer):
    """DataCollatorForLanguageModeling's random replacement draws [PAD] from the whole vocabulary; the embedding
    gives its row no gradient from that position while the tied decoder trains the row, so the step's gradient holds
    the fed row fixed: the metagradient must differentiate through it (influkit.unrolled.padding)."""
    for seed in range(3, 60):  # the collator's default probabilities; the first seed whose masks feed [PAD]
        record = ik.unrolled.Record()
        pretrain(tokenizer, [hf.RecordCallback(record)], seed=seed)
        fed = fed_padding(record, tokenizer.pad_token_id)
        if fed:
            break
    assert fed, "no seed drew the padding token"
    assert record.runs[0].padding is not None and ik.unrolled.verify(record) == 0.0
    test = record.runs[0].stage.data.take(torch.tensor([0, 3]))
    scores = ik.unrolled.metagradients(record, test)[0]
    for z in sorted({fed[0], 1, 6, 12}):
        fd, rounding = central_difference(record, test, 0, z)
        assert float(scores.values[z]) == pytest.approx(fd, rel=1e-6, abs=rounding), z


def at_defaults(tokenizer, callbacks=(), loss_kwargs: bool = True, dtype=torch.float64, **kwargs):
    """Masked-LM pretraining by a Trainer at transformers' defaults (fused AdamW, sdpa attention, clipping at 1,
    linear decay) with gradient accumulation 2: only what a script sets besides is given. loss_kwargs: False makes
    the Trainer treat the model as one that takes no num_items_in_batch, so it divides each micro-batch's loss by
    the accumulation steps itself. dtype: the model's (float32 for a bf16 run: autocast leaves float64 alone)."""
    torch.manual_seed(0)
    model = BertForMaskedLM(config(tokenizer, attn_implementation=None)).to(dtype)  # transformers' default
    assert model.config._attn_implementation == "sdpa"
    if not loss_kwargs:
        model.accepts_loss_kwargs = False
    args = TrainingArguments(tempfile.mkdtemp(), **(dict(per_device_train_batch_size=2, gradient_accumulation_steps=2,
                                                         num_train_epochs=2, learning_rate=5e-3, report_to=[],
                                                         save_strategy="no", logging_strategy="no", use_cpu=True,
                                                         seed=3, disable_tqdm=True) | kwargs))
    assert args.optim == "adamw_torch_fused" and args.max_grad_norm == 1.0
    texts = ["so good", "bad", "great film", "dull"] + TEXTS * 2  # short ones: the collator pads to other lengths
    trainer = Trainer(model, args, train_dataset=examples(tokenizer, texts),
                      data_collator=DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.5),
                      callbacks=list(callbacks))
    trainer.train()
    return model


def test_a_trainer_at_its_defaults_with_accumulation_replays_its_own_final_weights_bit_for_bit(tokenizer):
    record = ik.unrolled.Record()
    recorded = at_defaults(tokenizer, [hf.RecordCallback(record)])
    run = record.runs[0]
    assert run.optimizer.rules[0].fused and run.steps == 10  # 20 examples, 2 a micro-batch, 2 micro-batches a step
    assert run.parts == [[2, 2]] * 10
    assert any(w is not None for w in run.widths)  # the collator padded micro-batches of one step to other lengths
    assert ik.unrolled.verify(record) == 0.0
    final = ik.unrolled.replay(record)[0]
    for n, p in recorded.named_parameters():
        assert torch.equal(final[n], p), n
    # the recording forced sdpa's MATH backend, which rounds otherwise than the default kernel: the plain run
    # agrees to float64 rounding, not bit for bit
    plain = at_defaults(tokenizer)
    gap = max(float((a - b).detach().abs().max()) for a, b in zip(recorded.parameters(), plain.parameters()))
    assert gap < 1e-10


def test_the_stage_of_an_sdpa_trainer_run_vectorizes_its_per_example_gradients(tokenizer):
    # transformers' own 2-D → 4-D sdpa mask branches on mask.all(), which vmap cannot trace; the recorded stage's
    # model passes a ready 4-D mask under vmap instead, so per-example gradients (factored fits, first-order terms)
    # are vectorized on padded batches and equal the one-example-at-a-time reference
    record = ik.unrolled.Record()
    at_defaults(tokenizer, [hf.RecordCallback(record)], num_train_epochs=1).eval()  # dropout off
    stage = record.runs[0].stage
    inputs, targets = stage.data.take(torch.arange(len(stage.data)))
    assert (inputs[:, 1] == 0).any()  # padded examples
    with warnings.catch_warnings():
        warnings.simplefilter("error", ik.VectorizationWarning)
        rows = per_example_grads(stage, inputs, targets)
    assert torch.allclose(rows, per_example_grads_serial(stage, inputs, targets), rtol=0, atol=1e-12)


def test_a_trainer_that_divides_by_its_accumulation_steps_is_replayed_bit_for_bit(tokenizer):
    record = ik.unrolled.Record()
    recorded = at_defaults(tokenizer, [hf.RecordCallback(record)], loss_kwargs=False, num_train_epochs=1)
    assert all(isinstance(d, tuple) and d[1] == 2 for step in record.runs[0].divisors for d in step)
    assert ik.unrolled.verify(record) == 0.0
    final = ik.unrolled.replay(record)[0]
    assert all(torch.equal(final[n], p) for n, p in recorded.named_parameters())


def test_the_metagradient_of_a_trainer_at_its_defaults_equals_central_differences(tokenizer):
    record = ik.unrolled.Record()
    at_defaults(tokenizer, [hf.RecordCallback(record)], num_train_epochs=1)
    test = record.runs[0].stage.data.take(torch.tensor([0, 3]))
    scores = ik.unrolled.metagradients(record, test)[0]
    for z in (1, 6, 12):
        fd, rounding = central_difference(record, test, 0, z)
        assert float(scores.values[z]) == pytest.approx(fd, rel=1e-6, abs=rounding), z


def test_a_bf16_trainer_replays_bit_for_bit_and_its_float32_derivative_is_the_float32_runs(tokenizer):
    """bf16=True (accelerate's CPU autocast around the model's forward): the record holds the autocast, the callback
    does not change the run and replay repeats its final weights bit for bit. The metagradient is the float32
    derivative along the bf16 trajectory; the float32 run of the same script took other steps (its weights differ
    by up to 1e-2, two learning rates: AdamW's first steps are ±lr per coordinate, and a coordinate whose gradient
    bf16 rounds across 0 steps the other way), so the two derivatives differ by what that gap moves them: measured
    9.0 % in norm (cosine 0.996), asserted below 20 % and cosine above 0.98; a sign or scaling error, or the
    update linearized at the bf16 gradient (10⁴ times off), fails. Central differences of the bf16 re-run do not
    resolve a derivative: each replay rounds its gradients to 8 bits, and at ε = 0.03 to 0.3 they scatter from
    -0.36 to +0.16 for an example whose derivative is -0.08."""
    record, exact = ik.unrolled.Record(), ik.unrolled.Record()
    recorded = at_defaults(tokenizer, [hf.RecordCallback(record)], dtype=torch.float32, num_train_epochs=1, bf16=True)
    plain = at_defaults(tokenizer, dtype=torch.float32, num_train_epochs=1, bf16=True)
    assert all(torch.equal(a, b) for a, b in zip(recorded.parameters(), plain.parameters()))
    assert record.runs[0].autocast == ("cpu", torch.bfloat16) and ik.unrolled.verify(record) == 0.0
    final = ik.unrolled.replay(record)[0]
    assert all(torch.equal(final[n], p) for n, p in recorded.named_parameters())
    full = at_defaults(tokenizer, [hf.RecordCallback(exact)], dtype=torch.float32, num_train_epochs=1)
    assert 1e-3 < max(float((a - b).detach().abs().max()) for a, b in zip(recorded.parameters(), full.parameters()))
    test = record.runs[0].stage.data.take(torch.tensor([0, 3]))
    mixed = ik.unrolled.metagradients(record, test)[0].values
    reference = ik.unrolled.metagradients(exact, test)[0].values
    assert mixed.dtype == torch.float32
    assert float((mixed - reference).norm() / reference.norm()) < 0.2
    assert float(mixed @ reference / (mixed.norm() * reference.norm())) > 0.98


def test_every_refusal_of_a_trainer_configuration_comes_at_once_before_the_first_step(tokenizer):
    torch.manual_seed(0)
    model = BertForMaskedLM(config(tokenizer)).double()
    model.config._attn_implementation = "flex_attention"
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    record = ik.unrolled.Record()
    pretrain(tokenizer, [hf.RecordCallback(record)], num_train_epochs=1)
    args = arguments(label_smoothing_factor=0.1, fp16=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, amsgrad=True)
    callback = hf.RecordCallback(record, link=ik.Link({"bert.embeddings.word_embeddings.weight":
                                                       "bert.embeddings.word_embeddings.weight"}, case=2, alpha=0.1))
    trainer = Trainer(model, args, train_dataset=examples(tokenizer, TEXTS), optimizers=(optimizer, None),
                      data_collator=DataCollatorForLanguageModeling(tokenizer), callbacks=[callback])
    with pytest.raises(ik.NotReplayable, match="5 things keep this run from being replayed") as refused:
        trainer.train()
    for fix in ("bf16=True", "label_smoothing_factor=0", "Link.finetune", "attn_implementation='sdpa'", "amsgrad=False"):
        assert fix in str(refused.value), fix
    assert all(torch.equal(p, start[n]) for n, p in model.named_parameters())
    assert trainer.state.global_step == 0 and len(record) == 1
