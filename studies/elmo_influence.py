"""Multi-stage influence of ELMo *pretraining* sentences on a finetuned sentiment classifier (paper's Table 1).

Chen et al. (NeurIPS 2020), §5: pretrain an ELMo biLM, finetune a classifier on top with ELMo fixed
(Case 1), and rank the pretraining sentences by their influence on the classifier's test loss.

Data (real English text, from PyPI — no apt package needed): the source archive of
``vaderSentiment==3.3.2`` holds Hutto & Gilbert's (ICWSM 2014) human-rated sentence sets
(see :mod:`influkit.elmo.corpora`). It is fetched once with

    python -m pip download --no-deps --no-binary :all: vaderSentiment==3.3.2 -d ~/.cache/influkit

(the script runs exactly this itself when the archive is missing; ``$INFLUKIT_CACHE`` overrides the folder).
If the archive is absent and PyPI cannot be reached, the script prints that command and exits with status 2.
``--corpus fortunes`` pretrains on Debian's fortune cookies instead (``apt-get install -y fortunes``; the
script prints this command and exits 2 when they are missing).

- Pretraining corpus: the 5,190 NYT-editorial and 3,708 Amazon-review sentences (ratings unused),
  lower-cased word tokens, sentences of 3–16 tokens; vocabulary = the 2,000 most frequent tokens
  (others → ``<UNK>``); 5 % held out for perplexity.
- Pretrained model: char CNN + 2-layer biLSTM ELMo (projection 16, cell 64) with a softmax head
  (``BiLMWithSoftmax``), g(z) = per-sentence biLM NLL, Adam. Saved in the allennlp format
  (``elmo_options.json`` + ``elmo_weights.hdf5``), reloaded with ``load_elmo`` and checked bit-identical.
- Finetuning: the 4,200 rated tweets, label = sign of the mean rating, |rating| < 0.5 dropped, tokens
  truncated to 24; mean over tokens of the equal-weight mix of the three ELMo layers, standardized with
  fixed training-set statistics → Linear(32, 64)-tanh-Linear(64, 2), L2 1e-2, L-BFGS; ELMo fixed (Case 1).
- Influence: an ``influkit.Chain([pretrain, finetune], [Link("bilm", case=1)])``, fitted once, queried with the
  test set (and, with ``tweet_query``, the test tweet with the largest loss). The finetune block (Θ, 2,242
  values) is solved exactly (``direct``, damping 1e-8); the pretraining block by MINRES preconditioned with
  EK-FAC (``SolveConfig(solver="minres", preconditioner="ekfac")``, ``CurvatureConfig(fisher="empirical")``) on a seeded sample of
  ``hessian_samples`` = 1,500 sentences, damping 1.0, to the float32 tolerance 1e-4 (``--max-iter`` caps it at
  40). The biLM's only ``nn.Linear`` is the softmax, which gets Kronecker factors; the LSTM cells, char CNN,
  highway and projection hold raw parameters and get diagonal blocks. The Fisher is the empirical one because
  the biLM loss (a masked per-sentence mean of two directions' cross-entropies) is not a form the sampled-label
  Fisher recognises. Damping 1e-2 (the earlier setting) and 0.1 did not converge within 30 preconditioned
  iterations (README). ``--hessian-samples/--damping/--max-iter/--tol/--preconditioner`` override these. The
  identity ablation (every H⁻¹ := I) is scored beside it.
- Leave-one-out check: for half top-|score| and half random sentences, continue pretraining from the
  pretrained weights with seeded SGD (the same batches, the removed sentence dropped from its batch),
  refit the head from its fitted weights by L-BFGS, and compare the change of the summed test loss with
  ``res.removal``; a rerun without removal (same seed: determinism; another seed: batch-order noise) gives
  the noise floor.

Run: ``python studies/elmo_influence.py`` (about 35–45 minutes on 2 busy cores: 10 pretraining, ~15
influence, ~12 LOO; results in studies/results/elmo/) or ``--quick`` (tiny corpus/model, ~80 s; writes to
a temporary directory unless ``--out`` is given). ``--reuse`` skips pretraining when ``--out`` already holds the saved biLM.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from scipy.stats import pearsonr, spearmanr  # noqa: E402
from torch import nn  # noqa: E402

import influkit as ik  # noqa: E402
from influkit.apps.objectives import cross_entropy as ce, l2  # noqa: E402
from influkit.elmo import (  # noqa: E402
    BiLMWithSoftmax,
    ElmoBiLM,
    ElmoOptions,
    Vocabulary,
    batch_sentences,
    bilm_lm_loss,
    load_elmo,
    save_weights,
    write_options,
)
from influkit.elmo.corpora import (  # noqa: E402
    DataUnavailable,
    build_vocabulary,
    fortunes_sentences,
    sentiment_data,
    tokenize,
    vader_corpus,
)
from influkit.elmo.models import SentenceClassifier  # noqa: E402
from influkit.training import fit_lbfgs, gradient_norm, train_adam  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "elmo"


@dataclass(frozen=True)
class Config:
    max_len: int = 16  # pretraining sentences of 3..max_len tokens
    n_corpus: int | None = None  # cap on pretraining sentences (None: all)
    heldout: float = 0.05
    vocab: int = 2000
    char_dim: int = 8
    filters: tuple = ((1, 8), (2, 8), (3, 16), (4, 16), (5, 16))
    proj: int = 16
    cell: int = 64
    adam_steps: tuple = (1500, 500)  # Adam steps at lr, then at lr / 10
    adam_lr: float = 3e-3
    adam_batch: int = 32
    tweet_len: int = 24
    n_tweets: int | None = None
    test_frac: float = 0.25
    hidden: int = 64
    weight_decay: float = 1e-2
    hessian_samples: int | None = 1500  # pretraining Hessian on this many seeded sentences (None: all 3,525)
    pre_solver: str = "minres"
    fin_solver: str = "direct"
    pre_preconditioner: str | None = "ekfac"  # MINRES preconditioned by EK-FAC (None: unpreconditioned)
    fisher: str = "empirical"  # the biLM loss is a masked per-sentence mean: no sampled-label Fisher for it
    damping: tuple = (1.0, 1e-8)  # (pretraining, finetuning); see studies/results/elmo/README.md for 1e-2 and 0.1
    tol: float | None = None  # pretraining solve: None = the float32 default (1e-4 relative residual)
    max_iter: int = 40
    tweet_query: bool = False  # also score the single test tweet (one more pretraining solve)
    n_loo_top: int = 10
    n_loo_random: int = 10
    loo_epochs: int = 1
    loo_lr: float = 0.1
    loo_batch: int = 32
    k_table: int = 10
    stage_batch: int = 250
    seed: int = 0


QUICK = Config(
    max_len=10, n_corpus=240, vocab=150, filters=((1, 4), (2, 4), (3, 8)), proj=8, cell=16,
    adam_steps=(100, 30), adam_lr=1e-2, tweet_len=12, n_tweets=160, hessian_samples=64, max_iter=6,
    damping=(1e-2, 1e-8), tweet_query=True, n_loo_top=2, n_loo_random=2, k_table=5, stage_batch=128,
)  # fmt: skip


# ---------------------------------------------------------------------------------------------- data


def load_corpus(cfg: Config, which: str):
    """(train token lists, held-out token lists, vocabulary) of the pretraining corpus."""
    raw = vader_corpus() if which == "vader" else fortunes_sentences()
    seen, sentences = set(), []
    for text in raw:
        tokens = tokenize(text)
        key = " ".join(tokens)
        if 3 <= len(tokens) <= cfg.max_len and key not in seen:
            seen.add(key)
            sentences.append(tokens)
    order = np.random.default_rng(cfg.seed).permutation(len(sentences))
    sentences = [sentences[i] for i in order]
    if cfg.n_corpus is not None:
        sentences = sentences[: cfg.n_corpus]
    n_held = max(10, int(cfg.heldout * len(sentences)))
    train, held = sentences[n_held:], sentences[:n_held]
    return train, held, Vocabulary(build_vocabulary(train, cfg.vocab))


def load_tweets(cfg: Config):
    """((train texts, tokens, labels), (test texts, tokens, labels)) of the rated tweets."""
    texts, labels = sentiment_data("tweets", min_abs_rating=0.5)
    rows = [(t, tokenize(t)[: cfg.tweet_len], y) for t, y in zip(texts, labels)]
    rows = [r for r in rows if r[1]]
    order = np.random.default_rng(cfg.seed + 1).permutation(len(rows))
    rows = [rows[i] for i in order]
    if cfg.n_tweets is not None:
        rows = rows[: cfg.n_tweets]
    n_test = int(cfg.test_frac * len(rows))
    split = rows[n_test:], rows[:n_test]
    return tuple(([r[0] for r in part], [r[1] for r in part], torch.tensor([r[2] for r in part])) for part in split)


# ---------------------------------------------------------------------------------------------- models


def elmo_options(cfg: Config) -> ElmoOptions:
    return ElmoOptions(
        char_embed_dim=cfg.char_dim, filters=cfg.filters, n_highway=1, projection_dim=cfg.proj,
        cell_dim=cfg.cell, n_layers=2, cell_clip=3.0, proj_clip=3.0, n_characters=262,
    )  # fmt: skip


@torch.no_grad()
def sentence_losses(lm: nn.Module, char_ids, token_ids, batch: int = 250) -> torch.Tensor:
    return torch.cat([bilm_lm_loss(lm(char_ids[s : s + batch]), token_ids[s : s + batch]) for s in range(0, len(char_ids), batch)])


def perplexity(lm: nn.Module, char_ids, token_ids) -> float:
    """exp of the token-weighted mean NLL of both directions."""
    g = sentence_losses(lm, char_ids, token_ids).double()
    weight = ((token_ids != -1).sum(dim=1) + 1).double()
    return float(torch.exp((g * weight).sum() / weight.sum()))


def fit_head(clf: SentenceClassifier, feats, labels, cfg: Config, init: dict | None = None) -> float:
    """Fit ``clf.head`` on precomputed features (from ``init`` if given) by L-BFGS; returns ‖∇‖."""
    if init is not None:
        clf.head.load_state_dict(init)
    stage = ik.Stage(clf.head, ce, (feats, labels), regularizer=l2(cfg.weight_decay))
    return fit_lbfgs(stage, max_iter=400, tol=1e-6, restarts=2)


@torch.no_grad()
def test_loss(clf: SentenceClassifier, feats, labels) -> float:
    """The summed test cross-entropy f(T) (what influence is computed for)."""
    return float(ce(clf.head(feats), labels).double().sum())


def continue_pretraining(lm: nn.Module, char_ids, token_ids, cfg: Config, *, exclude: int | None, seed: int) -> nn.Module:
    """A copy of ``lm`` after ``loo_epochs`` of seeded SGD; ``exclude`` is dropped from its batch only.

    Each batch's loss is its summed g(z) over the nominal batch size, so removing z removes exactly its
    gradient term and every other batch is unchanged.
    """
    model = copy.deepcopy(lm)
    opt = torch.optim.SGD(model.parameters(), lr=cfg.loo_lr)
    gen = torch.Generator().manual_seed(seed)
    n = len(char_ids)
    for _ in range(cfg.loo_epochs):
        perm = torch.randperm(n, generator=gen)
        for s in range(0, n, cfg.loo_batch):
            idx = perm[s : s + cfg.loo_batch]
            if exclude is not None:
                idx = idx[idx != exclude]
            opt.zero_grad()
            (bilm_lm_loss(model(char_ids[idx]), token_ids[idx]).sum() / cfg.loo_batch).backward()
            opt.step()
    return model


# ---------------------------------------------------------------------------------------------- run


def table(res: ik.InfluenceResult, sentences, k: int, label: str) -> pd.DataFrame:
    rows = []
    for kind, harmful in (("largest (harmful: removal lowers the loss)", True), ("smallest (helpful)", False)):
        for rank, row in res.top(k, harmful=harmful).iterrows():
            i = int(row["example"])
            rows.append({"test": label, "kind": kind, "rank": rank + 1, "index": i, "influence": row["score"],
                         "removal": row["removal"], "sentence": " ".join(sentences[i])})  # fmt: skip
    return pd.DataFrame(rows)


def run(cfg: Config, out: Path, corpus: str = "vader", reuse: bool = False, log=print) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    summary: dict = {"config": asdict(cfg), "corpus": corpus}
    t0 = time.perf_counter()

    train_tok, held_tok, vocab = load_corpus(cfg, corpus)
    (tr_text, tr_tok, y_tr), (te_text, te_tok, y_te) = load_tweets(cfg)
    char, tid, _ = batch_sentences(train_tok, vocab, length=cfg.max_len)
    h_char, h_tid, _ = batch_sentences(held_tok, vocab, length=cfg.max_len)
    c_tr, _, _ = batch_sentences(tr_tok, vocab, length=cfg.tweet_len)
    c_te, _, _ = batch_sentences(te_tok, vocab, length=cfg.tweet_len)
    unk = float((tid == 2).sum() / (tid != -1).sum())
    summary["data"] = {"pretrain_sentences": len(train_tok), "heldout_sentences": len(held_tok),
                       "vocabulary": len(vocab), "unk_rate": unk, "tweets_train": len(tr_tok),
                       "tweets_test": len(te_tok), "positive_rate_test": float(y_te.float().mean())}  # fmt: skip
    log(f"data: {summary['data']}")

    # -- pretraining, saved in the allennlp format and reloaded
    options_file, weight_file = out / "elmo_options.json", out / "elmo_weights.hdf5"
    softmax_file, vocab_file = out / "softmax.safetensors", out / "vocab.txt"  # safetensors: never pickle
    options = elmo_options(cfg)
    torch.manual_seed(cfg.seed)
    lm = BiLMWithSoftmax(ElmoBiLM(options, dtype=torch.float32), len(vocab)).eval()
    pre = ik.Stage(lm, bilm_lm_loss, (char, tid), batch_size=cfg.stage_batch)
    start = time.perf_counter()
    files = (options_file, weight_file, softmax_file, vocab_file)
    reused = reuse and all(f.exists() for f in files) and vocab_file.read_text().split("\n") == vocab.tokens
    if reused:
        lm.bilm.load_state_dict(load_elmo(options_file, weight_file).state_dict())
        lm.softmax.load_state_dict(load_file(softmax_file))
        log("reusing the saved pretrained biLM")
    else:
        for j, steps in enumerate(cfg.adam_steps):
            train_adam(pre, steps=steps, lr=cfg.adam_lr / 10**j, batch_size=cfg.adam_batch, seed=cfg.seed + j)
        write_options(options, options_file)
        save_weights(lm.bilm, weight_file)
        save_file({k: v.contiguous() for k, v in lm.softmax.state_dict().items()}, softmax_file)
        vocab_file.write_text("\n".join(vocab.tokens))
    pretrain_seconds = time.perf_counter() - start
    info_file = out / "pretraining_info.json"
    if not reused:
        info_file.write_text(json.dumps({"seconds": pretrain_seconds, "adam_steps": cfg.adam_steps}))
    original_seconds = json.loads(info_file.read_text())["seconds"] if info_file.exists() else pretrain_seconds
    reloaded = load_elmo(options_file, weight_file).eval()
    with torch.no_grad():
        a, b = lm.bilm(char[:64]).activations, reloaded(char[:64]).activations
    identical = bool(torch.equal(a, b))
    if not identical:
        raise RuntimeError(f"reloaded biLM differs from the trained one by {float((a - b).abs().max()):.3e}")
    summary["pretraining"] = {
        "seconds": original_seconds, "seconds_this_run": pretrain_seconds, "reused": reused,
        "perplexity_train": perplexity(lm, char, tid), "perplexity_heldout": perplexity(lm, h_char, h_tid),
        "gradient_norm": gradient_norm(pre), "reload_identical": identical,
        "parameters": pre.num_trained,
    }  # fmt: skip
    log(f"pretraining: {summary['pretraining']}")

    # -- finetuning (Case 1: ELMo fixed)
    clf = SentenceClassifier(lm.bilm, 2, cfg.hidden, seed=cfg.seed).eval()
    f_tr = clf.fit_standardization(c_tr)
    f_te = clf.features(c_te)
    head_grad = fit_head(clf, f_tr, y_tr, cfg)
    head0 = copy.deepcopy(clf.head.state_dict())
    with torch.no_grad():
        pred_te = clf.head(f_te).argmax(dim=1)
        acc_tr = float((clf.head(f_tr).argmax(dim=1) == y_tr).float().mean())
    losses_te = ce(clf.head(f_te), y_te).detach()
    base_loss = test_loss(clf, f_te, y_te)
    summary["finetuning"] = {
        "accuracy_test": float((pred_te == y_te).float().mean()), "accuracy_train": acc_tr,
        "majority_baseline_test": float(max(y_te.float().mean(), 1 - y_te.float().mean())),
        "test_loss_sum": base_loss, "head_gradient_norm": head_grad,
    }  # fmt: skip
    log(f"finetuning: {summary['finetuning']}")
    fin = ik.Stage(clf, ce, (c_tr, y_tr), params="head", regularizer=l2(cfg.weight_decay),
                   batch_size=cfg.stage_batch)  # fmt: skip

    # -- influence of every pretraining sentence: one Chain, fitted once (EK-FAC factors of the pretraining Hessian,
    #    the dense finetuning Hessian), then one query (= one pretraining solve) per test set
    pre_config = ik.SolveConfig(solver=cfg.pre_solver, damping=cfg.damping[0], tol=cfg.tol, max_iter=cfg.max_iter,
                                preconditioner=cfg.pre_preconditioner)
    fin_config = ik.SolveConfig(solver=cfg.fin_solver, damping=cfg.damping[1])
    curvature = [ik.CurvatureConfig(hessian_samples=cfg.hessian_samples, fisher=cfg.fisher, seed=cfg.seed),
                 ik.CurvatureConfig(seed=cfg.seed)]
    link = [ik.Link("bilm", case=1)]
    chain = ik.Chain([pre, fin], link, solve=[pre_config, fin_config], curvature=curvature)
    start = time.perf_counter()
    chain.fit()
    fit_seconds = time.perf_counter() - start
    curvature = next((a for a in chain.curvature(0).approximations.values() if hasattr(a, "blocks")), None)
    summary["influence_fit"] = {"seconds": fit_seconds, "pretrain_solve_config": pre_config.summary(),
                                "finetune_solve_config": fin_config.summary(),
                                "curvature_configs": [c.summary() for c in chain.curvature_configs]}  # fmt: skip
    if curvature is not None:
        info = curvature.info
        summary["influence_fit"]["preconditioner"] = {
            "kind": info["kind"], "fisher": info["fisher"], "examples": info["examples"],
            "kronecker_layers": [layer["module"] for layer in info["layers"]],
            "diagonal_parameters": len(info.get("diagonal", {})), "seconds": info["seconds"],
        }  # fmt: skip
    log(f"chain fitted in {fit_seconds:.1f} s: {summary['influence_fit']}")
    z = torch.arange(len(pre))
    results, tables = {}, []
    one = int(losses_te.argmax())
    queries = [("test_set", (c_te, y_te))]
    if cfg.tweet_query:
        queries.append(("test_sentence", (c_te[one : one + 1], y_te[one : one + 1])))
    for name, x_test in queries:
        start = time.perf_counter()
        res = chain.query(x_test).scores(z)
        seconds = time.perf_counter() - start
        results[name] = res
        d = res.diagnostics
        summary[f"influence_{name}"] = {
            "seconds_total": seconds, "seconds_with_fit": seconds + fit_seconds,
            "seconds_per_pretraining_sentence": (seconds + fit_seconds) / len(pre),
            "seconds_per_sentence_gradients_only": d["seconds"]["example_gradients"] / len(pre),
            "seconds": d["seconds"], "pretrain_solve": d["solves"][0], "finetune_solve": d["solves"][1],
            "finite": bool(torch.isfinite(res.values).all()),
        }  # fmt: skip
        log(f"influence {name}: {summary[f'influence_{name}']}")
        label = "test set" if name == "test_set" else f"tweet: {te_text[one]} (label {int(y_te[one])})"
        tables.append(table(res, train_tok, cfg.k_table, label))
    # the paper's ablation: every inverse Hessian replaced by the identity (no solve, same gradients)
    start = time.perf_counter()
    identity = ik.Chain([pre, fin], link, solve=ik.SolveConfig(solver="identity")).query((c_te, y_te)).scores(z)
    summary["influence_identity"] = {"seconds_total": time.perf_counter() - start}
    summary["test_sentence"] = {"text": te_text[one], "label": int(y_te[one]), "predicted": int(pred_te[one]),
                                "loss": float(losses_te[one])}  # fmt: skip
    pd.concat(tables).to_csv(out / "table1_top_bottom.csv", index=False)
    columns = {"index": z.numpy(), "sentence": [" ".join(s) for s in train_tok],
               "influence_test_set": results["test_set"].values.double().numpy(),
               "removal_test_set": results["test_set"].removal.double().numpy(),
               "removal_test_set_identity": identity.removal.double().numpy()}  # fmt: skip
    if "test_sentence" in results:
        columns["influence_test_sentence"] = results["test_sentence"].values.double().numpy()
    pd.DataFrame(columns).to_csv(out / "scores.csv", index=False, float_format="%.6g")

    # -- leave-one-out validation on the test-set scores
    res = results["test_set"]
    rng = np.random.default_rng(cfg.seed)
    by_abs = np.argsort(-res.values.abs().numpy())
    top = [int(i) for i in by_abs[: cfg.n_loo_top]]
    rest = np.setdiff1d(np.arange(len(pre)), top)
    picks = [(i, "top |score|") for i in top] + [(int(i), "random") for i in rng.choice(rest, cfg.n_loo_random, replace=False)]

    def retrain(exclude, seed):
        model = continue_pretraining(lm, char, tid, cfg, exclude=exclude, seed=seed)
        c2 = SentenceClassifier(model.bilm, 2, cfg.hidden).eval()
        c2.feature_mean.copy_(clf.feature_mean)
        c2.feature_scale.copy_(clf.feature_scale)
        tr2, te2 = c2.features(c_tr), c2.features(c_te)
        fit_head(c2, tr2, y_tr, cfg, init=head0)
        return test_loss(c2, te2, y_te)

    start = time.perf_counter()
    loo_seed = cfg.seed + 100
    base = retrain(None, loo_seed)
    rerun_same = retrain(None, loo_seed)
    rerun_order = retrain(None, loo_seed + 1)
    one_run = (time.perf_counter() - start) / 3
    log(f"LOO base test loss {base:.6f} (before continuation {base_loss:.6f}); rerun diffs "
        f"{rerun_same - base:.3e} (same seed), {rerun_order - base:.3e} (other batch order); {one_run:.1f}s/run")  # fmt: skip
    rows = []
    for i, kind in picks:
        actual = retrain(i, loo_seed) - base
        rows.append({"index": i, "kind": kind, "predicted_removal": float(res.removal[i]), "actual_change": actual,
                     "predicted_identity": float(identity.removal[i]), "influence": float(res.values[i]),
                     "sentence": " ".join(train_tok[i])})  # fmt: skip
        log(f"  LOO {i:5d} ({kind}): predicted {rows[-1]['predicted_removal']:+.3e} actual {actual:+.3e}")
    loo = pd.DataFrame(rows)
    loo.to_csv(out / "loo.csv", index=False, float_format="%.6g")
    pred, act = loo["predicted_removal"].to_numpy(), loo["actual_change"].to_numpy()
    stats = lambda f, a, b: float(f(a, b)[0]) if len(a) > 2 and np.std(a) > 0 and np.std(b) > 0 else float("nan")  # noqa: E731
    summary["loo"] = {
        "n": len(loo), "pearson": stats(pearsonr, pred, act), "spearman": stats(spearmanr, pred, act),
        "pearson_top": stats(pearsonr, pred[: len(top)], act[: len(top)]),
        "pearson_random": stats(pearsonr, pred[len(top) :], act[len(top) :]),
        "base_test_loss_after_continuation": base, "test_loss_before_continuation": base_loss,
        "noise_rerun_same_seed": rerun_same - base, "noise_rerun_other_order": rerun_order - base,
        "mean_abs_actual": float(np.abs(act).mean()), "mean_abs_predicted": float(np.abs(pred).mean()),
        "seconds_per_retrain": one_run,
        "identity": {"pearson": stats(pearsonr, loo["predicted_identity"].to_numpy(), act),
                     "spearman": stats(spearmanr, loo["predicted_identity"].to_numpy(), act)},
    }  # fmt: skip
    log(f"LOO: {summary['loo']}")

    fig, axes = plt.subplots(1, 2, figsize=(11, 5))
    noise = abs(rerun_order - base)
    panels = (("predicted_removal", f"{cfg.pre_solver}" + (f" + {cfg.pre_preconditioner}" if cfg.pre_preconditioner else ""),
               summary["loo"]["pearson"], summary["loo"]["spearman"]),
              ("predicted_identity", "identity (every H⁻¹ := I)", summary["loo"]["identity"]["pearson"],
               summary["loo"]["identity"]["spearman"]))  # fmt: skip
    for ax, (column, title, r, rho) in zip(axes, panels):
        x = loo[column].to_numpy()
        for kind, marker in (("top |score|", "o"), ("random", "s")):
            sel = (loo["kind"] == kind).to_numpy()
            ax.scatter(x[sel], act[sel], marker=marker, label=kind, alpha=0.8)
        if column == "predicted_removal":
            lim = float(max(np.abs(x).max(), np.abs(act).max(), 1e-12)) * 1.1
            ax.plot([-lim, lim], [-lim, lim], "k--", lw=0.8, label="y = x")
        ax.axhspan(-noise, noise, color="grey", alpha=0.2, label="batch-order noise (no removal)")
        ax.set_xlabel(f"predicted change of the summed test loss ({title})")
        ax.set_ylabel("actual change after leave-one-out continuation")
        ax.set_title(f"{title}: Pearson r = {r:.2f}, Spearman = {rho:.2f}", fontsize=9)
        ax.legend(fontsize=7)
    fig.suptitle(f"ELMo pretraining sentences, leave-one-out ({len(loo)} sentences)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "loo_scatter.png", dpi=120)
    plt.close(fig)

    summary["seconds_total"] = time.perf_counter() - t0
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny CI-sized configuration (~1 minute)")
    parser.add_argument("--out", type=Path, default=None, help="output folder (default: studies/results/elmo)")
    parser.add_argument("--corpus", choices=("vader", "fortunes"), default="vader")
    parser.add_argument("--reuse", action="store_true", help="reuse the pretrained biLM saved in --out")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on shared cores)")
    parser.add_argument("--max-iter", type=int, default=None, help="cap on the pretraining solver's iterations")
    parser.add_argument("--hessian-samples", type=int, default=None,
                        help="pretraining sentences the Hessian is estimated on (0: all)")
    parser.add_argument("--damping", type=float, default=None, help="damping of the pretraining solve")
    parser.add_argument("--tol", type=float, default=None, help="relative-residual tolerance of the pretraining solve")
    parser.add_argument("--preconditioner", default=None, help="ekfac, kfac, diagonal or none")
    parser.add_argument("--tweet", action="store_true", help="also score the single test tweet (one more pretraining solve)")
    parser.add_argument("--no-tweet", action="store_true", help="skip the single-tweet query (one pretraining solve less)")
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else Config()
    if args.max_iter is not None:
        cfg = replace(cfg, max_iter=args.max_iter)
    if args.hessian_samples is not None:
        cfg = replace(cfg, hessian_samples=args.hessian_samples or None)
    if args.damping is not None:
        cfg = replace(cfg, damping=(args.damping, cfg.damping[1]))
    if args.tol is not None:
        cfg = replace(cfg, tol=args.tol)
    if args.preconditioner is not None:
        cfg = replace(cfg, pre_preconditioner=None if args.preconditioner == "none" else args.preconditioner)
    if args.tweet or args.no_tweet:
        cfg = replace(cfg, tweet_query=args.tweet and not args.no_tweet)
    out = args.out or (Path(tempfile.mkdtemp(prefix="elmo_quick_")) if args.quick else RESULTS)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        summary = run(cfg, out, corpus=args.corpus, reuse=args.reuse)
    except DataUnavailable as exc:
        print(f"elmo_influence: {exc}", file=sys.stderr)
        return 2
    finally:
        torch.set_num_threads(threads)
    print(f"results in {out} ({summary['seconds_total']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
