"""Which *pretraining* sentences shaped a finetuned BERT's sentiment predictions? (multi-stage influence, Hugging Face)

Chen et al. (NeurIPS 2020) Table 1 with a transformers BERT instead of ELMo, built with ``influkit.hf`` and no
glue beyond naming the shared block (``shared="bert"``):

- Pretraining corpus (real English, from PyPI; see :mod:`influkit.elmo.corpora`): a seeded sample of the
  NYT-editorial and Amazon-review sentences of the ``vaderSentiment==3.3.2`` sdist, those of 5–24 WordPiece
  tokens (``[CLS]``/``[SEP]`` included), duplicates dropped. A WordPiece vocabulary is trained on them
  locally (``hf.train_wordpiece``; nothing is downloaded but the sdist, once, by pip).
- Pretrained model: ``BertForMaskedLM`` from a ``BertConfig`` (2 layers, hidden 64, 2 heads, intermediate 128;
  dropout probabilities 0, so the objective trained is the one differentiated), masked-LM with one mask per
  sentence seeded by its index (``hf.masked_lm_stage``; g(z) is a function, see :mod:`influkit.hf.masking`),
  G = mean_z g(z) + (λ_pre/2)‖θ‖², Adam with linearly decaying step.
- Finetuning: the human-rated tweets of the same sdist (label = sign of the mean rating, |rating| < 0.5
  dropped), ``BertForSequenceClassification`` whose ``bert`` block (embeddings + encoder) is the pretrained one;
  its pooler and classifier are new. F = mean cross-entropy + (λ_head/2)‖pooler, classifier‖².
  Case 1: encoder fixed, the head (pooler + classifier, 4,290 values) fitted to stationarity by L-BFGS.
  Case 2: everything finetuned from the Case 1 solution with the proximal term α‖W − W̄‖² (Adam).
- Influence: ``ik.Chain([pre, fin], [ik.Link("bert", case=c)])``; both stages solved by MINRES on Hessians
  estimated on seeded samples (``hessian_samples``), capped at ``max_iter`` iterations (the residuals are in
  summary.json). Queries: the summed loss of the whole test set, and ``n_queries`` random test tweets
  (``per_test=True``).
- Validation (1): leave-out re-training of groups of pretraining sentences (top harmful, top helpful, random)
  by the warm-start protocol of the ELMo example: continue pretraining one epoch from the pretrained weights
  with the group removed (fixed batches, each batch loss Σ g / B so removal drops exactly the group's terms),
  then refit the Case 1 head from its solution / continue Case 2 finetuning, and compare the change of the
  summed test loss with the group's summed ``res.removal``, against the same continuation without removal.
- Validation (2), ``--lds M``: the linear datamodeling score (``influkit.validation.lds``, harness ``influkit.apps.lds``): M random halves of
  the pretraining set, the whole chain re-trained from scratch on each (same initialization seed), per query
  the Spearman correlation between the re-trained test losses and the summed scores; resumable.

Run (2 shared CPU cores, nice'd): ``python studies/bert_pretrain_finetune.py`` (~25 min: pretraining ~4,
influence ~13, leave-out ~4; saves the model and tokenizer in ``--out``/pretrained); then, from that saved model
and tokenizer, ``--reuse`` (skip pretraining), ``--reuse --leaveout-only`` (redo the leave-out check, step
``--continue-lr``), ``--reuse --ablation identity|ekfac`` (other pretraining solves), ``--reuse --lds 24`` (LDS re-trainings,
resumable; ~1.7 min each) and ``--reuse --lds 24 --lds-report --lds-noise 3`` (score them; re-training noise).
``--quick``: tiny sizes, ~2 min, to a temporary directory unless ``--out`` is given. If the sdist is absent and
PyPI unreachable the script prints the pip command and exits with status 2. Needs ``pip install influkit[hf]``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402
from scipy.stats import pearsonr, spearmanr  # noqa: E402
from tqdm.auto import tqdm  # noqa: E402

import influkit as ik  # noqa: E402
from influkit import hf  # noqa: E402
from influkit.elmo.corpora import DataUnavailable, sentiment_data, vader_corpus  # noqa: E402

try:
    from transformers import BertConfig, BertForMaskedLM, BertForSequenceClassification, PreTrainedTokenizerFast
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
except ImportError:  # pragma: no cover
    sys.exit("this example needs the hf extra: pip install 'influkit[hf]'")

HEAD = ("bert.pooler", "classifier")


@dataclass(frozen=True)
class Config:
    n_pretrain: int = 2000
    max_len: int = 24
    vocab: int = 1000
    hidden: int = 64
    layers: int = 2
    heads: int = 2
    intermediate: int = 128
    pre_epochs: int = 30
    pre_batch: int = 64
    pre_lr: float = 2e-3
    pre_decay: float = 1e-4
    tweet_len: int = 32
    n_tweets: int | None = None
    test_frac: float = 0.25
    head_decay: float = 1e-2
    alpha: float = 0.01
    case2_epochs: int = 3
    case2_lr: float = 1e-4
    case2_batch: int = 64
    # pretraining stage; finetuning stage in Case 1 (head only) and in Case 2 (everything)
    hessian_samples: tuple[int, int, int] = (128, 500, 200)
    max_iter: tuple[int, int, int] = (20, 60, 20)
    damping: tuple[float, float, float] = (1e-2, 1e-4, 1e-3)
    n_queries: int = 4
    group_size: int = 50
    n_random_groups: int = 4
    seed: int = 0


QUICK = Config(n_pretrain=200, vocab=300, hidden=16, intermediate=32, pre_epochs=10, n_tweets=500, case2_epochs=1,
               hessian_samples=(64, 100, 100), max_iter=(5, 10, 5), n_queries=2, group_size=10, n_random_groups=2)  # fmt: skip

log = logging.getLogger("bert")


# ----------------------------------------------------------------------------------------------- data


def load_data(cfg: Config, tokenizer=None):
    """(pretraining sentences, tokenizer, encoded corpus, tweets {train, test, *_texts}, info).

    ``tokenizer``: a saved one to reuse — ``tokenizers`` breaks ties between equally frequent merges
    arbitrarily, so two trainings on the same text can differ in a few entries (and hence in the ids, the
    sentence lengths, the sampled corpus and the masks)."""
    sentences = list(dict.fromkeys(s.strip() for s in vader_corpus() if s.strip()))
    tweets, labels = sentiment_data("tweets")
    # a tokenizer trained on all candidate sentences, then the sentences of 5..max_len tokens sampled
    if tokenizer is None:
        tokenizer = hf.train_wordpiece(sentences, vocab_size=cfg.vocab)
    lengths = [len(ids) for ids in tokenizer(sentences)["input_ids"]]
    ok = [s for s, n in zip(sentences, lengths) if 5 <= n <= cfg.max_len]
    order = torch.randperm(len(ok), generator=torch.Generator().manual_seed(cfg.seed))[: cfg.n_pretrain]
    corpus = [ok[i] for i in order.tolist()]
    enc = tokenizer(corpus, padding="max_length", truncation=True, max_length=cfg.max_len, return_tensors="pt")

    perm = torch.randperm(len(tweets), generator=torch.Generator().manual_seed(cfg.seed + 1))
    if cfg.n_tweets is not None:
        perm = perm[: cfg.n_tweets]
    n_test = int(round(cfg.test_frac * len(perm)))
    splits = {"test": perm[:n_test], "train": perm[n_test:]}
    out = {}
    for name, idx in splits.items():
        texts = [tweets[i] for i in idx.tolist()]
        batch = tokenizer(texts, padding="max_length", truncation=True, max_length=cfg.tweet_len, return_tensors="pt")
        out[name] = dict(batch) | {"labels": torch.tensor([labels[i] for i in idx.tolist()])}
        out[name + "_texts"] = texts
    info = {"candidates": len(ok), "pretrain_sentences": len(corpus), "vocab": len(tokenizer),
            "unk_fraction_tweets": float((out["train"]["input_ids"] == tokenizer.unk_token_id).sum()
                                         / out["train"]["attention_mask"].sum()),
            "tweets_train": len(out["train_texts"]), "tweets_test": len(out["test_texts"]),
            "positive_fraction": float(out["train"]["labels"].float().mean()),
            "tweets_truncated": float((out["train"]["attention_mask"].sum(1) == cfg.tweet_len).float().mean())}  # fmt: skip
    return corpus, tokenizer, enc, out, info


def bert_config(cfg: Config, vocab: int) -> BertConfig:
    return BertConfig(vocab_size=vocab, hidden_size=cfg.hidden, num_hidden_layers=cfg.layers,
                      num_attention_heads=cfg.heads, intermediate_size=cfg.intermediate,
                      max_position_embeddings=max(cfg.max_len, cfg.tweet_len), hidden_dropout_prob=0.0,
                      attention_probs_dropout_prob=0.0, num_labels=2)  # fmt: skip


# ----------------------------------------------------------------------------------------------- objectives


def l2(weight: float, prefixes: tuple[str, ...] | None = None):
    """(weight/2)·‖θ‖² over the trained parameters (those under ``prefixes`` only, if given)."""

    def reg(params):
        chosen = [p for n, p in params.items() if prefixes is None or n.startswith(prefixes)]
        return 0.5 * weight * sum((p**2).sum() for p in chosen)

    return reg


def batch_order(n: int, batch: int, epochs: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [chunk for _ in range(epochs) for chunk in torch.randperm(n, generator=gen).split(batch)]


def pretrain(stage: ik.Stage, cfg: Config, *, keep: torch.Tensor | None = None, epochs: int | None = None,
             lr: float | None = None, seed: int = 0, progress: bool = False) -> float:
    """Adam on G restricted to ``keep`` (indices; default all); each step's loss is Σ_{batch∩keep} g / B + R,
    so a removed example drops exactly its own term. Returns the final full objective on ``keep``."""
    model = stage.model
    params = [p for n, p in model.named_parameters() if n in set(stage.param_names)]
    opt = torch.optim.Adam(params, lr=lr or cfg.pre_lr)
    n = len(stage) if keep is None else len(keep)
    ids = torch.arange(len(stage)) if keep is None else torch.as_tensor(keep)
    batches = batch_order(n, cfg.pre_batch, epochs or cfg.pre_epochs, seed)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1 - k / len(batches))
    reg = stage.regularizer
    for b in tqdm(batches, desc="pretraining", disable=not progress, leave=False):
        x, y = stage.data.take(ids[b])
        loss = hf.masked_lm_losses(model(x), y).sum() / cfg.pre_batch + reg(dict(model.named_parameters()))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    with torch.no_grad():
        return float(stage.objective(indices=ids))


def continue_pretraining(stage: ik.Stage, cfg: Config, removed: torch.Tensor | None, seed: int, lr: float) -> None:
    """One epoch of SGD over fixed full-set batches with ``removed`` dropped (loss Σ_kept g / B + R)."""
    model = stage.model
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    gone = set() if removed is None else set(torch.as_tensor(removed).tolist())
    for b in batch_order(len(stage), cfg.pre_batch, 1, seed):
        kept = torch.tensor([i for i in b.tolist() if i not in gone], dtype=torch.long)
        loss = stage.regularizer(dict(model.named_parameters()))
        if len(kept):
            x, y = stage.data.take(kept)
            loss = loss + hf.masked_lm_losses(model(x), y).sum() / cfg.pre_batch
        opt.zero_grad()
        loss.backward()
        opt.step()


def new_classifier(pre_model, cfg: Config, vocab: int, seed: int) -> BertForSequenceClassification:
    """A classifier with the pretrained ``bert`` block and a seeded new pooler/classifier, in eval mode."""
    torch.manual_seed(seed + 1000)
    model = BertForSequenceClassification(bert_config(cfg, vocab)).eval()
    shared = {n: p for n, p in pre_model.named_parameters() if n.startswith("bert.")}
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n in shared:
                p.copy_(shared[n])
    return model


def fit_head(stage: ik.Stage, cfg: Config, max_iter: int = 300) -> float:
    """Case 1: minimize F over the pooler and classifier with the encoder fixed (full-batch L-BFGS on the
    encoder's [CLS] states, computed once). Returns ‖∇F‖ over the head."""
    model = stage.model.hf_model
    x, y = stage.data.take(torch.arange(len(stage)))
    with torch.no_grad():
        ids, mask = x[:, 0], x[:, 1]
        hidden = model.bert(input_ids=ids, attention_mask=mask).last_hidden_state[:, :1]
    head = [p for n, p in model.named_parameters() if n.startswith(HEAD)]
    names = [n for n, _ in model.named_parameters() if n.startswith(HEAD)]
    reg = stage.regularizer
    opt = torch.optim.LBFGS(head, lr=1.0, max_iter=max_iter, history_size=50, tolerance_grad=1e-9,
                            tolerance_change=1e-14, line_search_fn="strong_wolfe")  # fmt: skip

    def closure():
        opt.zero_grad()
        logits = model.classifier(model.dropout(model.bert.pooler(hidden)))
        loss = hf.classification_losses(logits, y).mean() + reg(dict(zip(names, head)))
        loss.backward()
        return loss

    for _ in range(3):
        opt.step(closure)
    closure()
    return float(torch.cat([p.grad.reshape(-1) for p in head]).norm())


def finetune_case2(stage: ik.Stage, centre: dict[str, torch.Tensor], cfg: Config, *, epochs: int | None = None,
                   seed: int = 0, progress: bool = False) -> None:
    """Case 2: Adam on F + α‖W − W̄‖² over every parameter, from the model's current values."""
    model = stage.model
    named = dict(model.named_parameters())
    opt = torch.optim.Adam(named.values(), lr=cfg.case2_lr)
    for b in tqdm(batch_order(len(stage), cfg.case2_batch, epochs or cfg.case2_epochs, seed), desc="finetuning",
                  disable=not progress, leave=False):  # fmt: skip
        x, y = stage.data.take(b)
        loss = hf.classification_losses(model(x), y).mean() + stage.regularizer(named)
        loss = loss + cfg.alpha * sum(((named[n] - c) ** 2).sum() for n, c in centre.items())
        opt.zero_grad()
        loss.backward()
        opt.step()


def test_losses(stage: ik.Stage, test: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return stage.losses(stage.trained(), *test)


def accuracy(stage: ik.Stage, test) -> float:
    with torch.no_grad():
        return float((stage.model(test[0]).argmax(1) == test[1]).float().mean())


# ----------------------------------------------------------------------------------------------- the chain


@dataclass
class Trained:
    pre: ik.Stage
    fin1: ik.Stage
    fin2: ik.Stage
    info: dict


def train_chain(enc_pre, tweets, tokenizer, cfg: Config, *, keep: torch.Tensor | None = None, seed: int = 0,
                progress: bool = False, pre_model=None) -> Trained:
    """Pretrain (on ``keep`` only, from a ``seed`` initialization) then finetune Case 1 and Case 2."""
    info = {}
    start = time.perf_counter()
    if pre_model is None:
        torch.manual_seed(seed)
        pre_model = BertForMaskedLM(bert_config(cfg, len(tokenizer))).eval()
    pre = hf.masked_lm_stage(pre_model, enc_pre, tokenizer=tokenizer, seed=cfg.seed, regularizer=l2(cfg.pre_decay))
    if keep is not None or not getattr(pre_model, "_pretrained", False):
        info["pretrain_objective"] = pretrain(pre, cfg, keep=keep, seed=seed, progress=progress)
    info["pretrain_seconds"] = time.perf_counter() - start
    start = time.perf_counter()
    fin1 = hf.classification_stage(new_classifier(pre_model, cfg, len(tokenizer), seed), tweets,
                                   params=list(HEAD), regularizer=l2(cfg.head_decay, HEAD))  # fmt: skip
    info["case1_grad_norm"] = fit_head(fin1, cfg)
    info["case1_seconds"] = time.perf_counter() - start
    start = time.perf_counter()
    model2 = new_classifier(pre_model, cfg, len(tokenizer), seed)
    model2.load_state_dict(fin1.model.hf_model.state_dict())
    fin2 = hf.classification_stage(model2, tweets, regularizer=l2(cfg.head_decay, HEAD))
    centre = {n: p.detach().clone() for n, p in pre_model.named_parameters() if n.startswith("bert.")}
    finetune_case2(fin2, centre, cfg, seed=seed, progress=progress)
    info["case2_seconds"] = time.perf_counter() - start
    return Trained(pre, fin1, fin2, info)


# other pretraining-stage solves (the finetuning solve unchanged): H_G = I, a gradient dot product with the
# propagated test gradient; and influkit's EK-FAC approximate inverse (empirical Fisher; the tied decoder/word
# embedding gets a diagonal block), no Hessian-vector products at all.
ABLATIONS = {  # name: (result prefix, SolveConfig settings, CurvatureConfig settings)
    "identity": ("Iid", {"solver": "identity"}, {}),
    "ekfac": ("Iekfac", {"solver": "ekfac"}, {"fisher": "empirical"}),
    # the exact damped solve on the Gauss-Newton matrix G ⪰ 0 (H of this non-stationary G is indefinite)
    "gauss-newton": ("Ign", {"solver": "minres", "tol": 1e-3, "max_iter": 1000}, {"matrix": "gauss-newton"}),
}


def chain_for(t: Trained, case: int, cfg: Config, pre_solver: str = "minres") -> ik.Chain:
    """The Case ``case`` chain; ``pre_solver`` ``"minres"`` or one of :data:`ABLATIONS`."""
    _, pre, pre_curvature = ABLATIONS[pre_solver] if pre_solver in ABLATIONS else ("", {"solver": pre_solver}, {})
    solve = [ik.SolveConfig(**({"damping": cfg.damping[0], "max_iter": cfg.max_iter[0]} | pre)),
             ik.SolveConfig(solver="minres", damping=cfg.damping[case], max_iter=cfg.max_iter[case])]
    curvature = [ik.CurvatureConfig(**({"hessian_samples": cfg.hessian_samples[0], "seed": cfg.seed} | pre_curvature)),
                 ik.CurvatureConfig(hessian_samples=cfg.hessian_samples[case], seed=cfg.seed)]
    return ik.Chain([t.pre, t.fin1 if case == 1 else t.fin2], [ik.Link("bert", case=case, alpha=cfg.alpha)], solve=solve,
                    curvature=curvature)


def influence(t: Trained, case: int, cfg: Config, test, queries: torch.Tensor, progress: bool,
              pre_solver: str = "minres"):
    """(summed-test-set result, per-query result, seconds) for one case."""
    chain = chain_for(t, case, cfg, pre_solver)
    out = {}
    start = time.perf_counter()
    q_all = chain.query(test, progress=progress)
    out["set"] = q_all.scores(progress=progress)
    out["set_seconds"] = time.perf_counter() - start
    start = time.perf_counter()
    q_each = chain.query((test[0][queries], test[1][queries]), per_test=True, progress=progress)
    out["each"] = q_each.scores(progress=progress)
    out["each_seconds"] = time.perf_counter() - start
    return out


# ----------------------------------------------------------------------------------------------- reporting


def table1(values: np.ndarray, corpus: list[str], k: int = 10) -> pd.DataFrame:
    order = np.argsort(-values)
    top, bottom = order[:k], order[::-1][:k]
    return pd.DataFrame({
        "harmful_sentence": [corpus[i] for i in top], "harmful_I": values[top],
        "helpful_sentence": [corpus[i] for i in bottom], "helpful_I": values[bottom],
    })  # fmt: skip


def solves_summary(res: ik.InfluenceResult) -> list[dict]:
    return [{k: s[k] for k in ("stage", "solver", "iterations", "residual", "converged", "seconds", "damping")}
            for s in res.diagnostics["solves"]]  # fmt: skip


def leave_out(t: Trained, groups: dict[str, torch.Tensor], cfg: Config, test, progress: bool, lr: float) -> pd.DataFrame:
    """Actual change of the summed test loss (Case 1 and Case 2) when each group is removed, warm-start protocol,
    plus two noise-floor rows: the same continuation without removal but another batch order."""
    pre_state = {k: v.clone() for k, v in t.pre.model.state_dict().items()}
    fin1_state = {k: v.clone() for k, v in t.fin1.model.state_dict().items()}
    fin2_state = {k: v.clone() for k, v in t.fin2.model.state_dict().items()}

    def run(removed, seed=cfg.seed + 7):
        t.pre.model.load_state_dict(pre_state)
        t.fin1.model.load_state_dict(fin1_state)
        t.fin2.model.load_state_dict(fin2_state)
        continue_pretraining(t.pre, cfg, removed, seed=seed, lr=lr)
        bert = {n: p.detach().clone() for n, p in t.pre.model.named_parameters() if n.startswith("bert.")}
        with torch.no_grad():  # Case 1 inherits the new encoder; Case 2 keeps its own, pulled towards the new one
            for n, p in t.fin1.model.named_parameters():
                if n in bert:
                    p.copy_(bert[n])
        fit_head(t.fin1, cfg)
        finetune_case2(t.fin2, bert, cfg, epochs=1, seed=cfg.seed + 7)
        return float(test_losses(t.fin1, test).sum()), float(test_losses(t.fin2, test).sum())

    base = run(None)
    rows = []
    for name, idx in tqdm(groups.items(), desc="leave-out groups", disable=not progress):
        c1, c2 = run(idx)
        rows.append({"group": name, "size": len(idx), "actual_case1": c1 - base[0], "actual_case2": c2 - base[1]})
    for extra in (8, 9):
        c1, c2 = run(None, seed=cfg.seed + extra)
        rows.append({"group": f"noise: no removal, batch order {extra}", "size": 0, "actual_case1": c1 - base[0],
                     "actual_case2": c2 - base[1]})  # fmt: skip
    t.pre.model.load_state_dict(pre_state)
    t.fin1.model.load_state_dict(fin1_state)
    t.fin2.model.load_state_dict(fin2_state)
    frame = pd.DataFrame(rows)
    frame.attrs["control"] = base
    return frame


class Retrain:
    """LDS re-training: the whole chain from scratch (seeded init) on a subset; outputs = per-query test losses
    of Case 1 then Case 2 (queries: the chosen tweets, then the whole test set's summed loss)."""

    def __init__(self, enc, tweets, tokenizer, cfg: Config, test, queries):
        self.enc, self.tweets, self.tokenizer, self.cfg, self.test, self.queries = enc, tweets, tokenizer, cfg, test, queries
        self.setup = {"example": "bert_pretrain_finetune", "config": json.loads(json.dumps(asdict(cfg))),
                      "queries": queries.tolist()}  # fmt: skip

    def __call__(self, subset: torch.Tensor, seed: int) -> torch.Tensor:
        t = train_chain(self.enc, self.tweets, self.tokenizer, self.cfg, keep=subset, seed=seed)
        out = []
        for fin in (t.fin1, t.fin2):
            losses = test_losses(fin, self.test)
            out.append(torch.cat([losses[self.queries], losses.sum().reshape(1)]))
        return torch.cat(out)


# ----------------------------------------------------------------------------------------------- main


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (~3 min)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--reuse", action="store_true", help="load the pretrained model and scores from --out")
    parser.add_argument("--lds", type=int, default=0, help="number of LDS subsets M (0: skip)")
    parser.add_argument("--lds-seeds", type=int, default=1)
    parser.add_argument("--lds-report", action="store_true", help="only score the LDS subsets already re-trained")
    parser.add_argument("--lds-noise", type=int, default=0,
                        help="re-train the first K LDS subsets with another seed: re-training noise vs subset effect")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--ablation", choices=list(ABLATIONS), default=None,
                        help="add scores with another pretraining solve to scores.csv, scored on the stored leave-out changes")
    parser.add_argument("--leaveout-only", action="store_true", help="reuse scores.csv, redo only the leave-out check")
    parser.add_argument("--continue-lr", type=float, default=0.005, help="SGD step of the leave-out continuation")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    cfg = QUICK if args.quick else Config()
    out = args.out or (Path(tempfile.mkdtemp(prefix="bert-")) if args.quick else Path("studies/results/bert"))
    out.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s",
                        handlers=[logging.StreamHandler(), logging.FileHandler(out / ("lds.log" if args.lds else "run.log"))])  # fmt: skip
    progress = not args.no_progress
    pre_dir = out / "pretrained"
    saved = None
    if args.reuse:  # the tokenizer and the model this script saved in --out (local folders, nothing downloaded)
        saved = PreTrainedTokenizerFast.from_pretrained(pre_dir)
    try:
        corpus, tokenizer, enc, tweets, info = load_data(cfg, saved)
    except DataUnavailable as exc:
        print(exc, file=sys.stderr)
        return 2
    log.info("data: %s", info)
    train = tweets["train"]
    test = hf.pack(tweets["test"])
    queries = torch.randperm(test[0].shape[0], generator=torch.Generator().manual_seed(cfg.seed + 2))[: cfg.n_queries].sort().values

    if args.lds:
        return run_lds_phase(args, cfg, out, enc, train, tokenizer, test, queries, progress)
    pre_model = None
    if args.reuse:
        pre_model = BertForMaskedLM.from_pretrained(pre_dir).eval()
        pre_model._pretrained = True
    start = time.perf_counter()
    t = train_chain(enc, train, tokenizer, cfg, seed=cfg.seed, progress=progress, pre_model=pre_model)
    if not args.reuse:
        t.pre.model.hf_model.save_pretrained(pre_dir)  # safetensors + config.json
        tokenizer.save_pretrained(pre_dir)
        (pre_dir / "pretraining_info.json").write_text(json.dumps(
            {k: t.info[k] for k in ("pretrain_objective", "pretrain_seconds")}, indent=2))
    t.info["total_train_seconds"] = time.perf_counter() - start
    for name, fin in (("case1", t.fin1), ("case2", t.fin2)):
        t.info[f"{name}_test_accuracy"] = accuracy(fin, test)
        t.info[f"{name}_test_loss_sum"] = float(test_losses(fin, test).sum())
    t.info["majority_accuracy"] = float(max(test[1].float().mean(), 1 - test[1].float().mean()))
    t.info["pretrain_objective_full"] = float(t.pre.objective())
    log.info("trained: %s", t.info)

    if args.ablation:
        return ablation(args.ablation, cfg, out, t, test, queries, progress)
    if args.leaveout_only:
        summary = json.loads((out / "summary.json").read_text())
        scores = pd.read_csv(out / "scores.csv")
        return validate_leave_out(args, cfg, out, t, corpus, scores, summary, test, progress)
    results, summary = {}, {"config": asdict(cfg), "data": info, "training": t.info, "queries": {}}
    for case in (1, 2):
        r = influence(t, case, cfg, test, queries, progress)
        results[case] = r
        m = len(t.pre)
        summary[f"case{case}"] = {
            "set_seconds": r["set_seconds"], "each_seconds": r["each_seconds"],
            "seconds_per_sentence_set": r["set_seconds"] / m, "seconds_per_sentence_each": r["each_seconds"] / m,
            "example_gradient_seconds": r["set"].diagnostics["seconds"].get("example_gradients"),
            "solves_set": solves_summary(r["set"]), "solves_each": solves_summary(r["each"]),
        }  # fmt: skip
        log.info("case %d: %s", case, summary[f"case{case}"])
    texts = tweets["test_texts"]
    losses1, losses2 = test_losses(t.fin1, test), test_losses(t.fin2, test)
    for j, qi in enumerate(queries.tolist()):
        summary["queries"][str(qi)] = {"text": texts[qi], "label": int(test[1][qi]), "loss_case1": float(losses1[qi]),
                                       "loss_case2": float(losses2[qi])}  # fmt: skip
    scores = pd.DataFrame({"sentence": corpus})
    for case in (1, 2):
        scores[f"I_set_case{case}"] = results[case]["set"].values.numpy()
        scores[f"removal_set_case{case}"] = results[case]["set"].removal.numpy()
        for j, qi in enumerate(queries.tolist()):
            scores[f"I_tweet{qi}_case{case}"] = results[case]["each"].values[:, j].numpy()
    scores.to_csv(out / "scores.csv", index_label="index")
    tables = []
    for case in (1, 2):
        tab = table1(scores[f"I_set_case{case}"].to_numpy(), corpus)
        tables.append(tab.assign(case=case, query="test set"))
        for qi in queries.tolist()[:2]:
            tab = table1(scores[f"I_tweet{qi}_case{case}"].to_numpy(), corpus, k=5)
            tables.append(tab.assign(case=case, query=f"tweet {qi}: {texts[qi]}"))
    pd.concat(tables).to_csv(out / "table1_top_bottom.csv", index=False)
    summary["case_agreement_spearman_set"] = float(spearmanr(scores["I_set_case1"], scores["I_set_case2"])[0])
    return validate_leave_out(args, cfg, out, t, corpus, scores, summary, test, progress)


def validate_leave_out(args, cfg, out, t, corpus, scores, summary, test, progress) -> int:

    # leave-out re-training of groups chosen by the Case 1 test-set scores, plus random groups
    groups = leave_out_groups(cfg, scores, len(corpus))
    start = time.perf_counter()
    frame = leave_out(t, groups, cfg, test, progress, args.continue_lr)
    summary["leave_out_continue_lr"] = args.continue_lr
    summary["leave_out_seconds"] = time.perf_counter() - start
    summary["leave_out_control_losses"] = frame.attrs["control"]
    noise = frame["size"] == 0
    for case in (1, 2):
        removal = scores[f"removal_set_case{case}"].to_numpy()
        predicted = [float(removal[idx.numpy()].sum()) for idx in groups.values()]
        frame[f"predicted_case{case}"] = predicted + [0.0] * int(noise.sum())
        a, p = frame.loc[~noise, f"actual_case{case}"], frame.loc[~noise, f"predicted_case{case}"]
        summary[f"leave_out_case{case}"] = {
            "pearson": float(pearsonr(a, p)[0]), "spearman": float(spearmanr(a, p)[0]),
            "sign_agreement": float((np.sign(a) == np.sign(p)).mean()),
            "noise_floor_mean_abs": float(frame.loc[noise, f"actual_case{case}"].abs().mean()),
            "mean_abs_actual": float(a.abs().mean()), "mean_abs_predicted": float(p.abs().mean()),
        }  # fmt: skip
    frame.to_csv(out / "leaveout.csv", index=False)
    fig, axes = plt.subplots(1, 2, figsize=(9, 4))
    for ax, case in zip(axes, (1, 2)):
        a, p = frame[f"actual_case{case}"], frame[f"predicted_case{case}"]
        colors = ["C3" if g.startswith("harmful") else "C2" if g.startswith("helpful") else "C0" if g.startswith("noise")
                  else "C7" for g in frame["group"]]  # fmt: skip
        ax.scatter(p, a, c=colors)
        ax.axhline(0, lw=0.5, c="k")
        ax.axvline(0, lw=0.5, c="k")
        ax.set_xlabel("predicted change of summed test loss (Σ removal)")
        ax.set_ylabel("actual change (warm-start re-training)")
        ax.set_title(f"Case {case}: Pearson r = {summary[f'leave_out_case{case}']['pearson']:.2f} (groups; blue: noise)",
                     fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "leaveout_scatter.png", dpi=120)
    log.info("leave-out: %s", frame.to_string())
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=float))
    log.info("wrote %s", out)
    return 0


def ablation(name: str, cfg, out, t, test, queries, progress) -> int:
    """Scores with another pretraining solve (columns ``Iid_*`` / ``Iekfac_*``), and their agreement with the
    stored leave-out changes."""
    prefix = ABLATIONS[name][0]
    scores = pd.read_csv(out / "scores.csv")
    summary = json.loads((out / "summary.json").read_text())
    frame = pd.read_csv(out / "leaveout.csv")
    m = len(scores)
    groups = leave_out_groups(cfg, scores, m)
    noise = frame["size"] == 0
    for case in (1, 2):
        r = influence(t, case, cfg, test, queries, progress, pre_solver=name)
        scores[f"{prefix}_set_case{case}"] = r["set"].values.numpy()
        removal = r["set"].removal.numpy()
        for j, qi in enumerate(queries.tolist()):
            scores[f"{prefix}_tweet{qi}_case{case}"] = r["each"].values[:, j].numpy()
        frame[f"predicted_{name}_case{case}"] = [float(removal[idx.numpy()].sum()) for idx in groups.values()] + [0.0] * int(noise.sum())
        a, p = frame.loc[~noise, f"actual_case{case}"], frame.loc[~noise, f"predicted_{name}_case{case}"]
        summary[f"{name}_case{case}"] = {
            "leave_out_pearson": float(pearsonr(a, p)[0]), "leave_out_spearman": float(spearmanr(a, p)[0]),
            "spearman_with_minres_scores_set": float(spearmanr(scores[f"{prefix}_set_case{case}"], scores[f"I_set_case{case}"])[0]),
            "solves_set": solves_summary(r["set"]),
            "set_seconds": r["set_seconds"], "each_seconds": r["each_seconds"],
        }  # fmt: skip
        log.info("%s ablation, case %d: %s", name, case, summary[f"{name}_case{case}"])
    scores.to_csv(out / "scores.csv", index=False)
    frame.to_csv(out / "leaveout.csv", index=False)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=float))
    return 0


def leave_out_groups(cfg: Config, scores: pd.DataFrame, m: int) -> dict[str, torch.Tensor]:
    """Top-harmful, top-helpful (by the Case 1 test-set scores) and random groups of ``group_size`` sentences."""
    k = cfg.group_size
    order = np.argsort(-scores["I_set_case1"].to_numpy())
    groups = {"harmful 1-%d" % k: order[:k], "harmful %d-%d" % (k + 1, 2 * k): order[k : 2 * k],
              "helpful 1-%d" % k: order[::-1][:k], "helpful %d-%d" % (k + 1, 2 * k): order[::-1][k : 2 * k]}  # fmt: skip
    gen = torch.Generator().manual_seed(cfg.seed + 3)
    for r in range(cfg.n_random_groups):
        groups[f"random {r}"] = torch.randperm(m, generator=gen)[:k].numpy()
    return {name: torch.as_tensor(np.sort(idx)) for name, idx in groups.items()}


def lds_noise(k: int, run, retrain: "Retrain", out: Path, q: int) -> None:
    """Re-train subsets 0..k−1 with seed 1 and compare with seed 0: per output, the seed-to-seed spread against
    the subset-to-subset spread (if the former is as large, one-seed LDS measures re-training noise)."""
    rows = []
    for j in range(k):
        other = retrain(run.subsets[j].nonzero().reshape(-1), 1).numpy()
        rows.append(pd.DataFrame({"subset": j, "output": range(len(other)), "seed0": run.outputs[j, 0].numpy(), "seed1": other}))
    frame = pd.concat(rows)
    frame.to_csv(out / "lds_seed_noise.csv", index=False)
    outputs = run.outputs[:, 0].numpy()
    names = [f"case{c}_{n}" for c in (1, 2) for n in [f"query{i}" for i in range(q - 1)] + ["set"]]
    spread = pd.DataFrame({
        "output": names,
        "subset_std_seed0": outputs.std(0, ddof=1),
        "seed_diff_rms": np.sqrt(frame.assign(d=(frame.seed0 - frame.seed1) ** 2).groupby("output").d.mean().to_numpy() / 2),
    })  # fmt: skip
    spread.to_csv(out / "lds_seed_noise_summary.csv", index=False)
    log.info("re-training noise:\n%s", spread.to_string())


def run_lds_phase(args, cfg, out, enc, train, tokenizer, test, queries, progress) -> int:
    """Re-train on the LDS subsets (resumable; skipped with ``--lds-report``), then score whatever is finished."""
    from influkit.apps.lds import load_lds, run_lds
    from influkit.validation.lds import lds_per_query

    if not args.lds_report:
        retrain = Retrain(enc, train, tokenizer, cfg, test, queries)
        run_lds(retrain, len(enc["input_ids"]), out / "lds", n_subsets=args.lds, alpha=0.5,
                seeds=range(args.lds_seeds), progress=progress)  # fmt: skip
    run = load_lds(out / "lds")
    if args.lds_noise:
        lds_noise(args.lds_noise, run, Retrain(enc, train, tokenizer, cfg, test, queries), out, len(queries) + 1)
    done = torch.isfinite(run.outputs).all(-1).all(-1)  # subsets whose every seed finished
    actual = run.outputs[done].mean(1)  # (M_done, 2(q+1)), seed-averaged
    subsets = run.subsets[done]
    scores = pd.read_csv(out / "scores.csv")
    q = len(queries) + 1
    rows = []
    methods = {"minres": "I"} | {f"{k} H_G": v[0] for k, v in ABLATIONS.items() if f"{v[0]}_set_case1" in scores}
    for method, prefix in methods.items():
        for case in (1, 2):
            cols = [f"{prefix}_tweet{qi}_case{case}" for qi in queries.tolist()] + [f"{prefix}_set_case{case}"]
            per_query = lds_per_query(scores[cols].to_numpy(), subsets, actual[:, (case - 1) * q : case * q].numpy())
            rows += [{"method": method, "case": case, "query": name.split("_")[1], "lds": float(v)}
                     for name, v in zip(cols, per_query)]  # fmt: skip
    frame = pd.DataFrame(rows)
    frame.to_csv(out / "lds.csv", index=False)
    summary = {"M_finished": int(done.sum()), "M_planned": int(run.subsets.shape[0]), "seeds": len(run.seeds),
               "alpha": 0.5, "seconds_per_retrain": float(run.seconds[done].mean()),
               "mean_lds": {f"{method}, case {case}": float(g.lds.mean())
                            for (method, case), g in frame.groupby(["method", "case"])}}  # fmt: skip
    (out / "lds_summary.json").write_text(json.dumps(summary, indent=2, default=float))
    fig, axes = plt.subplots(1, 2, figsize=(9, 4))
    masks = subsets.numpy().astype(float)
    for ax, case in zip(axes, (1, 2)):
        pred = masks @ scores[f"I_set_case{case}"].to_numpy()
        act = actual[:, case * q - 1].numpy()
        ax.scatter(pred, act)
        ax.set_xlabel("sum over the subset of I(z, test set)")
        ax.set_ylabel("re-trained summed test loss")
        ax.set_title(f"Case {case}, test set (M = {len(act)}): Spearman {spearmanr(pred, act)[0]:.2f}, "
                     f"Pearson r = {pearsonr(pred, act)[0]:.2f}", fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(out / "lds_scatter.png", dpi=120)
    log.info("LDS: %s\n%s", summary, frame.to_string())
    return 0


if __name__ == "__main__":
    sys.exit(main())
