"""Which pretraining snippets — and which of their tokens — made a LoRA-finetuned GPT-2 rate a review the way it does?

A worked example of per-token exact unrolled scores on real text, recorded end to end:

- Pretraining corpus: real movie-review snippets of the vaderSentiment 3.3.2 sdist (``hf.rated_snippets``), a seeded
  sample of those of at most ``max_len`` tokens. A byte-level BPE vocabulary is trained on them locally.
- Pretraining: a GPT-2-architecture decoder (``GPT2Config``: ``layers`` layers, width ``width``, 2 heads) built here
  and trained by next-token prediction (``hf.causal_lm_stage``) with influkit's SGD with momentum, recorded
  (``record.train``). (A first run with Adam in both stages gave a replay LDS of −0.02 at 10 % drops: Adam's
  response to whole-snippet drops was far from linear there.)
- Finetuning, instruction style: other rated snippets as prompts ``"Review: <text>\\nSentiment:"`` and the rated
  sentiment word as the completion (`` positive`` for a mean rating ≥ 1, `` negative`` for ≤ −1); LoRA adapters
  (``peft``, rank 4 on ``c_attn``) on the frozen pretrained model (a Case 1 link, ``hf.lora_link``), recorded too.
- Queries: ``n_test`` held-out prompts; the measure is each completion's mean log-probability.
- Scores: ``ik.unrolled.metagradients(record, test, per_test=True, per_token=True)`` — exact, through every
  recorded step of both stages; each pretraining snippet's score split over its tokens (every token term has its
  own data weight). A snippet's score is the sum of its tokens' (checked).
- Validation (replay LDS of the per-token sums): ``subsets`` random sets of a fraction ``drop`` of the pretraining
  snippets are dropped (weight 0) and the recorded two-stage training replayed (same batches, same steps); per query
  the Spearman correlation over the subsets between the predicted Σ_{kept} score and the replayed measure, averaged.
- Output (``studies/results/lm_tokens/``): ``summary.json`` (sizes, seconds, the LDS, the token-sum check),
  ``top.csv`` (each query's top 5 snippets by score), ``tokens.html`` (the page: each query with its top snippets,
  tokens shaded by their per-token score) and ``tokens.png`` (headless Chromium's screenshot of it).

Run: ``python -m studies.lm_tokens_lora`` (1 core); ``--quick`` for a smoke run into a temporary directory. Needs the
sdist (``pip download --no-binary :all: --no-deps vaderSentiment==3.3.2 -d ~/.cache/influkit``) and ``influkit[lora]``.
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch

import influkit as ik
from influkit import hf
from influkit.hf.texts import TextAttribution, completion_log_probability
from influkit.validation.lds import lds_per_query

RESULTS = Path(__file__).resolve().parent / "results" / "lm_tokens"


@dataclass(frozen=True)
class Config:
    n_pretrain: int = 240
    n_finetune: int = 160
    n_test: int = 20
    max_len: int = 32  # tokens of a pretraining snippet (longer ones are cut)
    words: int = 12  # snippets of at most this many words
    context: int = 64
    vocab: int = 600
    width: int = 32
    layers: int = 2
    pre_steps: int = 100
    fin_steps: int = 40
    batch: int = 16
    pre_lr: float = 0.5  # SGD with momentum 0.9 in both stages
    fin_lr: float = 0.5
    subsets: int = 20
    drop: float = 0.05
    top: int = 5
    seed: int = 0


QUICK = Config(n_pretrain=48, n_finetune=32, n_test=4, pre_steps=10, fin_steps=6, subsets=6, vocab=400)


def data(config: Config):
    """(pretraining texts, finetuning (prompts, words), test (prompts, words), tokenizer), all from the movie set."""
    snippets = [s for s in hf.rated_snippets(["movie"])]
    order = torch.randperm(len(snippets), generator=torch.Generator().manual_seed(config.seed)).tolist()
    rated = [snippets[i] for i in order]
    short = [s for s in rated if len(s.text.split()) <= config.words]
    pretrain = [s.text for s in short[: config.n_pretrain]]
    polar = [s for s in short[config.n_pretrain:] if abs(s.rating) >= 1]
    pairs = [(f"Review: {s.text}\nSentiment:", " positive" if s.rating > 0 else " negative") for s in polar]
    tok = hf.train_bpe(pretrain + [p + w for p, w in pairs], vocab_size=config.vocab, min_frequency=2)
    pairs = [(p, w) for p, w in pairs if len(tok(p)["input_ids"]) + 1 <= config.context]  # fits the context
    finetune, test = pairs[: config.n_finetune], pairs[config.n_finetune : config.n_finetune + config.n_test]
    return pretrain, finetune, test, tok


def build(config: Config):
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    pretrain, finetune, test, tok = data(config)
    gpt = GPT2Config(vocab_size=len(tok), n_positions=config.context, n_embd=config.width, n_layer=config.layers,
                     n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager",
                     bos_token_id=0, eos_token_id=0, pad_token_id=tok.pad_token_id)
    torch.manual_seed(config.seed)
    base = GPT2LMHeadModel(gpt).double().eval()
    pre = hf.causal_lm_stage(base, hf.causal_lm_batch(tok, pretrain, config.max_len))
    record = ik.unrolled.Record()
    record.train(pre, ik.unrolled.SGD(lr=config.pre_lr, momentum=0.9), steps=config.pre_steps, batch_size=config.batch,
                 seed=config.seed)
    lora = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn"],
                                                         fan_in_fan_out=True, lora_dropout=0.0)).double().eval()
    fin = hf.causal_lm_stage(lora, hf.completion_batch(tok, *zip(*finetune), config.context))
    record.train(fin, ik.unrolled.SGD(lr=config.fin_lr, momentum=0.9), steps=config.fin_steps, batch_size=config.batch,
                 seed=config.seed + 1, link=hf.lora_link(pre, fin, case=1))
    queries = hf.pack(hf.completion_batch(tok, *zip(*test), config.context))
    return record, pre, fin, queries, pretrain, test, tok


def replay_lds(record, queries, scores: torch.Tensor, config: Config) -> tuple[float, np.ndarray, np.ndarray]:
    """(mean LDS, per-query LDS, kept masks): drop sets of a fraction ``drop`` replayed through both stages."""
    n = scores.shape[0]
    gen = torch.Generator().manual_seed(config.seed + 7)
    masks = torch.stack([torch.randperm(n, generator=gen) >= int(config.drop * n) for _ in range(config.subsets)])
    masks = masks[:, torch.argsort(torch.randperm(n, generator=gen))]  # which rows are dropped: a random set
    fin = record.runs[-1].stage
    outputs = []
    for keep in masks:
        final = ik.unrolled.replay(record, [keep.to(torch.float64)])[-1]
        with torch.no_grad():
            outputs.append(completion_log_probability(fin.outputs(final, queries[0]), queries[1]))
    per_query = lds_per_query(scores.numpy(), masks.numpy(), torch.stack(outputs).numpy())
    return float(np.nanmean(per_query)), per_query, masks.numpy()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    config = QUICK if args.quick else Config()
    out = args.out or (Path(tempfile.mkdtemp()) if args.quick else RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    seconds = {}
    start = time.perf_counter()
    record, pre, fin, queries, pretrain, test, tok = build(config)
    seconds["training (both stages, recorded)"] = time.perf_counter() - start
    start = time.perf_counter()
    results = ik.unrolled.metagradients(record, queries, measure=completion_log_probability, per_test=True,
                                        per_token=True)
    seconds["metagradient (per token, both stages)"] = time.perf_counter() - start
    tokens = results[0].values  # (n_pretrain, max_len, n_test): d log p(completion) / d w_{z,t}
    # the check, on the queries' summed measure (one reverse pass): per-example scores against the tokens' sums
    sequence = ik.unrolled.metagradients(record, queries, measure=completion_log_probability)[0].values
    gap = float((tokens.sum((1, 2)) - sequence).abs().max() / sequence.abs().max())
    start = time.perf_counter()
    lds_mean, lds_queries, _ = replay_lds(record, queries, tokens.sum(1), config)
    seconds["replay LDS"] = time.perf_counter() - start

    scores = tokens.sum(1)
    top = scores.argsort(dim=0, descending=True, stable=True)[: config.top]
    ids, keep = pre.data.take(torch.arange(len(pretrain)))[0][:, 0], pre.data.take(torch.arange(len(pretrain)))[0][:, 1]
    records, shaded = [], []
    for q, (prompt, word) in enumerate(test):
        shaded.append([])
        for rank, row in enumerate(top[:, q].tolist(), 1):
            kept = ids[row][keep[row].bool()].tolist()
            shaded[-1].append([(tok.decode([t]), float(s)) for t, s in zip(kept, tokens[row, : len(kept), q])])
            records.append({"query": q, "prompt": prompt, "completion": word, "rank": rank, "row": row,
                            "score": float(scores[row, q]), "text": pretrain[row]})
    page = TextAttribution(pd.DataFrame.from_records(records), shaded, list(test))
    page.table.to_csv(out / "top.csv", index=False)
    html_path = page.write_html(out / "tokens.html", title="Pretraining snippets behind a LoRA finetune's ratings "
                                "(exact unrolled, per token)",
                                legend="Score of a snippet: d log p(completion) / d w, its weight in every recorded "
                                       "step of pretraining, through the LoRA finetune (exact metagradient).")
    try:
        from influkit.report import screenshot

        screenshot(html_path, out / "tokens.png", size=(1100, 1600))
        shot = "tokens.png"
    except (ik.InputError, RuntimeError) as error:
        shot = f"not taken: {error}"
    summary = {"config": asdict(config), "seconds": seconds, "token_sum_relative_gap": gap,
               "replay_lds_mean": lds_mean, "replay_lds_per_query": lds_queries.tolist(),
               "finetune_accuracy_test": _accuracy(record, queries, tok),
               "trained_tensors": [len(run.trained) for run in record.runs], "screenshot": shot,
               "replay_max_error": results[0].diagnostics["replay"]["max_error"]}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    if not args.quick:
        from benchmarks.manifest import record as manifest

        manifest(out, ["summary.json", "top.csv", "tokens.html", "tokens.png"], note="1 torch thread")
    print(json.dumps({k: v for k, v in summary.items() if k != "replay_lds_per_query"}, indent=1))
    print(f"wrote {out}")
    return 0


def _accuracy(record, queries, tok) -> float:
    """The share of test prompts whose completion word is the likelier of `` positive`` / `` negative``."""
    fin = record.runs[-1].stage
    final = record.runs[-1].final
    inputs, labels = queries
    with torch.no_grad():
        logits = fin.outputs(final, inputs)
    words = [tok(" positive", add_special_tokens=False)["input_ids"][0], tok(" negative", add_special_tokens=False)["input_ids"][0]]
    position = (labels != -100).float().argmax(1) - 1  # the position predicting the word's first token
    picked = logits[torch.arange(len(labels)), position][:, words]
    truth = labels[torch.arange(len(labels)), position + 1]
    return float(((picked.argmax(1) == 0) == (truth == words[0])).float().mean())


if __name__ == "__main__":
    raise SystemExit(main())
