"""Two Hugging Face Trainer runs, recorded by one callback each and attributed exactly across the boundary.

Domain adaptation: a tiny BERT (built from a config, tokenizer trained locally) continues masked-LM training on 240
real movie-review snippets (Trainer, DataCollatorForLanguageModeling's random masks, dropout 0.1, AdamW with linear
warmup and decay); then sentiment finetuning on 96 rated tweets (Trainer, the encoder frozen: a Case 1 link). Each
``trainer.train()`` is recorded by ``hf.RecordCallback``; ``ik.unrolled.metagradients`` gives every domain snippet and
every tweet its d (test loss) / d w_z through both runs, and one replayed drop checks a prediction (−score).

    python examples/unrolled/trainer.py          # needs the vaderSentiment 3.3.2 sdist (influkit.hf.rated_snippets)
"""

import tempfile

import torch
from transformers import (BertConfig, BertForMaskedLM, BertForSequenceClassification, DataCollatorForLanguageModeling,
                          DataCollatorWithPadding, Trainer, TrainingArguments)

import influkit as ik
from influkit import hf

torch.manual_seed(0)
torch.set_num_threads(1)
domain = [s.text for s in hf.rated_snippets(["movie"])[:240]]
tweets = hf.rated_snippets(["tweets"])[:128]
tokenizer = hf.train_wordpiece(domain + [t.text for t in tweets], vocab_size=600)


def rows(texts, labels=None):
    enc = tokenizer(texts, truncation=True, max_length=24)
    out = [{k: enc[k][i] for k in ("input_ids", "attention_mask")} for i in range(len(texts))]
    return out if labels is None else [r | {"labels": int(y)} for r, y in zip(out, labels)]


def arguments(epochs, lr):
    return TrainingArguments(tempfile.mkdtemp(), per_device_train_batch_size=16, num_train_epochs=epochs,
                             learning_rate=lr, warmup_steps=4, lr_scheduler_type="linear", optim="adamw_torch",
                             report_to=[], save_strategy="no", logging_strategy="no", use_cpu=True, seed=0,
                             disable_tqdm=True)


config = dict(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
              intermediate_size=64, max_position_embeddings=32, attn_implementation="eager")
record = ik.unrolled.Record()

# 1. domain adaptation: masked-LM on the review snippets (the collator masks anew every batch, at its defaults)
mlm = BertForMaskedLM(BertConfig(**config))
collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15)
Trainer(mlm, arguments(2, 2e-3), train_dataset=rows(domain), data_collator=collator,
        callbacks=[hf.RecordCallback(record)]).train()

# 2. sentiment finetuning on tweets, the adapted encoder frozen (Case 1)
clf = BertForSequenceClassification(BertConfig(**config, num_labels=2))
clf.bert.load_state_dict(mlm.bert.state_dict(), strict=False)
shared = {f"bert.{n}": f"bert.{n}" for n, _ in mlm.bert.named_parameters()}
for n, p in clf.named_parameters():
    p.requires_grad_(n not in shared)
train, test = tweets[:96], tweets[96:]
Trainer(clf, arguments(4, 5e-3), train_dataset=rows([t.text for t in train], [t.rating > 0 for t in train]),
        data_collator=DataCollatorWithPadding(tokenizer),
        callbacks=[hf.RecordCallback(record, link=ik.Link(shared, case=1))]).train()
print(f"recorded: {[run.steps for run in record.runs]} steps; replay vs the Trainer's weights: "
      f"max |difference| {ik.unrolled.verify(record)}")

# 3. exact metagradients of the summed test loss, both stages in one reverse pass
x_test, y_test = hf.pack(tokenizer([t.text for t in test], padding=True, truncation=True, max_length=24,
                                   return_tensors="pt"), labels=torch.tensor([int(t.rating > 0) for t in test]))
pre_scores, fin_scores = ik.unrolled.metagradients(record, (x_test, y_test))
print(f"metagradient: {pre_scores.diagnostics['seconds']['metagradient']:.1f} s, recorded training "
      f"{pre_scores.diagnostics['seconds']['training (recorded)']:.1f} s")
for name, scores, texts in (("domain snippets", pre_scores, domain), ("tweets", fin_scores, [t.text for t in train])):
    order = scores.values.argsort()
    print(f"most harmful {name} (removal lowers the test loss):")
    for z in order.flip(0)[:2].tolist():
        print(f"  {float(scores.values[z]):+.4f}  {texts[z][:70]!r}")
    print(f"most helpful {name}:")
    for z in order[:2].tolist():
        print(f"  {float(scores.values[z]):+.4f}  {texts[z][:70]!r}")

# 4. one prediction checked: drop the most harmful tweet from the recorded finetuning run and replay it
z = int(fin_scores.values.argmax())
keep = torch.ones(len(train))
keep[z] = 0
base = ik.unrolled.outputs(record, (x_test, y_test)).sum()
actual = float(ik.unrolled.outputs(record, (x_test, y_test), [None, keep]).sum() - base)
print(f"dropping tweet {z}: predicted change {float(fin_scores.removal[z]):+.5f}, replayed change {actual:+.5f}")
