"""Which *pretraining documents* make a LoRA-finetuned language model complete a prompt the way it does?

Multi-stage influence (Chen et al. 2020, Case 1) for a decoder language model with ``influkit.hf``:

- Pretraining corpus (real English, from PyPI; see :mod:`influkit.elmo.corpora`): a seeded sample of the
  NYT-editorial and Amazon-review sentences of the ``vaderSentiment==3.3.2`` sdist, those of 6–``max_len``
  tokens, duplicates dropped. A byte-level BPE vocabulary is trained on them and on the finetuning texts
  locally (``hf.train_bpe``; nothing is downloaded but the sdist, once, by pip).
- Pretrained model: a small decoder-only transformer (Llama architecture built from a ``LlamaConfig``: 2 layers,
  hidden 64, 2 heads, MLP 128, untied output layer; its projections are ``nn.Linear``, which the EK-FAC
  factors — GPT-2's ``Conv1D`` would get diagonal blocks), next-token prediction on the documents
  (``hf.causal_lm_stage``): G = mean_z g(z) + (λ_pre/2)‖θ‖², g(z) the mean next-token NLL of document z;
  Adam with a linearly decaying step.
- Downstream task, sentiment-conditioned completion: the human-rated movie-review snippets of the same sdist
  (|rating| ≥ 1), prompt ``"positive:"`` or ``"negative:"`` (sign of the rating), completion the review
  (``hf.completion_batch``: prompt tokens carry label −100). LoRA adapters (``peft``, rank 4 on ``q_proj`` and
  ``v_proj``) on the frozen pretrained model; F = mean completion NLL + (λ_fin/2)‖adapters‖², fitted to
  stationarity by full-batch L-BFGS.
- Influence: ``ik.Chain([pre, fin], [hf.lora_link(pre, fin, case=1)])`` — the base is the shared block, the
  adapters are what finetuning trains. Query: the summed completion NLL of ``n_test`` held-out reviews. The
  pretraining solve ("exact") by MINRES on the Hessian estimated on a seeded sample (damped; the model is not at
  a stationary point, so H_G is indefinite), beside the same solve on the Gauss-Newton matrix (G ⪰ 0), the
  identity ablation (H_G = I) and influkit's EK-FAC approximate inverse (empirical Fisher); the finetuning solve
  (the adapters) by MINRES on the whole finetuning set in all four.
- Validation: leave-out of groups of pretraining documents (the top harmful and helpful by the exact scores,
  and random groups) by the warm-start protocol: continue pretraining from the pretrained weights for
  ``continue_epochs`` over fixed batches without the group (each batch's loss Σ_kept g / B, so removal drops exactly
  the group's terms), copy the new base into the LoRA model, refit the adapters from their solution; the
  actual change of the summed test NLL against the group's summed ``res.removal``. The re-training noise floor:
  the same continuation without removal under two other batch orders.

Run (1 core): ``python studies/lm_pretrain_lora.py`` (results in studies/results/lm/; 663 s on one core of a
machine at load 6.5–9, every phase's seconds in summary.json);
``--quick`` for a tiny smoke run into a temporary directory. If the sdist is absent and PyPI unreachable the
script prints the pip command and exits with status 2. Needs ``pip install 'influkit[lora]'``.
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
from influkit.apps.plotting import caption, save, scatter_with_r  # noqa: E402
from influkit.elmo.corpora import DataUnavailable, read_vader_set, vader_corpus  # noqa: E402

try:
    import peft
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
except ImportError:  # pragma: no cover
    sys.exit("this example needs the lora extra: pip install 'influkit[lora]'")


@dataclass(frozen=True)
class Config:
    n_pretrain: int = 400
    max_len: int = 32  # tokens of a pretraining document
    vocab: int = 1000
    hidden: int = 64
    layers: int = 2
    heads: int = 2
    intermediate: int = 128
    pre_epochs: int = 20
    pre_batch: int = 32
    pre_lr: float = 3e-3
    pre_decay: float = 1e-4
    n_finetune: int = 300
    n_test: int = 20
    completion_len: int = 32  # prompt + completion tokens
    min_abs_rating: float = 1.0
    lora_rank: int = 4
    lora_alpha: float = 8.0
    fin_decay: float = 1e-3
    # pretraining solve (exact), finetuning solve (adapters)
    hessian_samples: int = 128
    max_iter: tuple[int, int] = (40, 100)
    damping: tuple[float, float] = (1e-2, 1e-3)
    refit_iter: int = 40  # L-BFGS iterations refitting the adapters in a leave-out run (from their solution)
    group_size: int = 20
    n_ranked_groups: int = 5  # per side: top harmful and top helpful
    n_random_groups: int = 10
    continue_epochs: int = 3
    continue_lr: float = 0.05
    seed: int = 0


QUICK = Config(n_pretrain=60, vocab=300, hidden=16, intermediate=32, pre_epochs=5, n_finetune=40, n_test=5,
               hessian_samples=32, max_iter=(5, 20), group_size=5, n_ranked_groups=1, n_random_groups=2)  # fmt: skip

log = logging.getLogger("lm")
TARGETS = ("q_proj", "v_proj")


# ----------------------------------------------------------------------------------------------- data


def load_data(cfg: Config) -> dict:
    """Documents, tokenizer, the pretraining batch, the finetuning / test completion batches, and a summary."""
    sentences = list(dict.fromkeys(s.strip() for s in vader_corpus() if s.strip()))
    reviews = [(r, t.strip()) for _, r, t in read_vader_set("movieReviewSnippets") if abs(r) >= cfg.min_abs_rating]
    tokenizer = hf.train_bpe(sentences + [t for _, t in reviews], vocab_size=cfg.vocab)
    lengths = [len(ids) for ids in tokenizer(sentences)["input_ids"]]
    ok = [s for s, n in zip(sentences, lengths) if 6 <= n <= cfg.max_len]
    order = torch.randperm(len(ok), generator=torch.Generator().manual_seed(cfg.seed))[: cfg.n_pretrain]
    corpus = [ok[i] for i in order.tolist()]
    documents = hf.causal_lm_batch(tokenizer, corpus, max_length=cfg.max_len)

    prompts = ["positive:" if r > 0 else "negative:" for r, _ in reviews]
    completions = [" " + t for _, t in reviews]
    head = [len(ids) for ids in tokenizer(prompts)["input_ids"]]
    tail = [len(ids) for ids in tokenizer(completions, add_special_tokens=False)["input_ids"]]
    fits = [i for i in range(len(reviews)) if head[i] + tail[i] <= cfg.completion_len]
    pick = torch.randperm(len(fits), generator=torch.Generator().manual_seed(cfg.seed + 1))[: cfg.n_finetune + cfg.n_test]
    chosen = [fits[i] for i in pick.tolist()]
    split = {"train": chosen[cfg.n_test :], "test": chosen[: cfg.n_test]}
    out = {"corpus": corpus, "tokenizer": tokenizer, "documents": documents}
    for name, idx in split.items():
        out[name] = hf.completion_batch(tokenizer, [prompts[i] for i in idx], [completions[i] for i in idx],
                                        max_length=cfg.completion_len)  # fmt: skip
        out[name + "_texts"] = [prompts[i] + completions[i] for i in idx]
    out["info"] = {"candidate_documents": len(ok), "pretrain_documents": len(corpus), "vocab": len(tokenizer),
                   "document_tokens_mean": float(documents["attention_mask"].sum(1).float().mean()),
                   "reviews_rated": len(reviews), "reviews_fitting": len(fits),
                   "finetune_completions": len(split["train"]), "test_completions": len(split["test"]),
                   "positive_fraction_train": float(np.mean([reviews[i][0] > 0 for i in split["train"]]))}  # fmt: skip
    return out


def model_config(cfg: Config, vocab: int) -> LlamaConfig:
    return LlamaConfig(vocab_size=vocab, hidden_size=cfg.hidden, intermediate_size=cfg.intermediate,
                       num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads, num_key_value_heads=cfg.heads,
                       max_position_embeddings=max(cfg.max_len, cfg.completion_len), tie_word_embeddings=False,
                       attention_dropout=0.0, bos_token_id=0, eos_token_id=0, pad_token_id=1)  # fmt: skip


def l2(weight: float):
    """(weight/2)·‖θ‖² over the trained parameters."""
    return lambda params: 0.5 * weight * sum((p**2).sum() for p in params.values())


# ----------------------------------------------------------------------------------------------- training


def batch_order(n: int, batch: int, epochs: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [chunk for _ in range(epochs) for chunk in torch.randperm(n, generator=gen).split(batch)]


def pretrain(stage: ik.Stage, cfg: Config, progress: bool) -> float:
    """Adam on G over fixed shuffled batches, step decayed linearly to 0; returns the final G."""
    model = stage.model
    opt = torch.optim.Adam(model.parameters(), lr=cfg.pre_lr)
    batches = batch_order(len(stage), cfg.pre_batch, cfg.pre_epochs, cfg.seed)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1 - k / len(batches))
    for b in tqdm(batches, desc="pretraining", disable=not progress, leave=False):
        x, y = stage.data.take(b)
        loss = hf.causal_lm_losses(model(x), y).mean() + stage.regularizer(dict(model.named_parameters()))
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    with torch.no_grad():
        return float(stage.objective())


def continue_pretraining(stage: ik.Stage, cfg: Config, removed: torch.Tensor | None, seed: int) -> None:
    """``continue_epochs`` of SGD over fixed full-set batches with ``removed`` dropped (loss Σ_kept g / B + R)."""
    model = stage.model
    opt = torch.optim.SGD(model.parameters(), lr=cfg.continue_lr)
    gone = set() if removed is None else set(torch.as_tensor(removed).tolist())
    for b in batch_order(len(stage), cfg.pre_batch, cfg.continue_epochs, seed):
        kept = torch.tensor([i for i in b.tolist() if i not in gone], dtype=torch.long)
        loss = stage.regularizer(dict(model.named_parameters()))
        if len(kept):
            x, y = stage.data.take(kept)
            loss = loss + hf.causal_lm_losses(model(x), y).sum() / cfg.pre_batch
        opt.zero_grad()
        loss.backward()
        opt.step()


def lora_model(pre_model: LlamaForCausalLM, cfg: Config):
    """A copy of the pretrained model with LoRA adapters (rank ``lora_rank``, B = 0) on q_proj and v_proj, eval mode."""
    base = LlamaForCausalLM(pre_model.config)
    base.load_state_dict(pre_model.state_dict())
    config = peft.LoraConfig(r=cfg.lora_rank, lora_alpha=cfg.lora_alpha, target_modules=list(TARGETS), lora_dropout=0.0)
    return peft.get_peft_model(base, config).eval()


def fit_adapters(stage: ik.Stage, max_iter: int = 300, rounds: int = 3, gtol: float = 1e-4) -> float:
    """Case 1: minimize F over the adapters (base fixed) by full-batch L-BFGS from their current values, up to
    ``rounds`` restarts of ``max_iter`` iterations until ‖∇F‖ < ``gtol``; returns ‖∇F‖ over the adapters."""
    model = stage.model
    names = list(stage.param_names)
    named = dict(model.named_parameters())
    adapters = [named[n] for n in names]
    x, y = stage.data.take(torch.arange(len(stage)))

    def closure():
        opt.zero_grad()
        loss = hf.causal_lm_losses(model(x), y).mean() + stage.regularizer(dict(zip(names, adapters)))
        loss.backward()
        return loss

    for _ in range(rounds):
        opt = torch.optim.LBFGS(adapters, lr=1.0, max_iter=max_iter, history_size=50, tolerance_grad=gtol / 10,
                                tolerance_change=1e-12, line_search_fn="strong_wolfe")  # fmt: skip
        opt.step(closure)
        closure()
        norm = float(torch.cat([p.grad.reshape(-1) for p in adapters]).norm())
        if norm < gtol:
            break
    return norm


def set_base(fin: ik.Stage, pre: ik.Stage, link: ik.Link) -> None:
    """Copy the pretrained values into the LoRA model's base (Case 1 inherits W̄)."""
    state = dict(pre.model.named_parameters())
    named = dict(fin.model.named_parameters())
    with torch.no_grad():
        for f_name, p_name in link.shared.items():
            named[f_name].copy_(state[p_name])


def test_loss_sum(fin: ik.Stage, test) -> float:
    with torch.no_grad():
        return float(fin.losses(fin.trained(), *test).sum())


# ----------------------------------------------------------------------------------------------- influence

SOLVES = {  # method: cfg -> (the pretraining stage's SolveConfig, its CurvatureConfig)
    "exact": lambda cfg: (ik.SolveConfig(solver="minres", damping=cfg.damping[0], max_iter=cfg.max_iter[0]),
                          ik.CurvatureConfig(hessian_samples=cfg.hessian_samples, seed=cfg.seed)),
    "gauss-newton": lambda cfg: (ik.SolveConfig(solver="minres", damping=cfg.damping[0], max_iter=cfg.max_iter[0]),
                                 ik.CurvatureConfig(matrix="gauss-newton", hessian_samples=cfg.hessian_samples,
                                                    seed=cfg.seed)),
    "identity": lambda cfg: (ik.SolveConfig(solver="identity"), ik.CurvatureConfig()),
    "ekfac": lambda cfg: (ik.SolveConfig(solver="ekfac", damping=cfg.damping[0]), ik.CurvatureConfig(fisher="empirical")),
}  # fmt: skip


def influence(pre: ik.Stage, fin: ik.Stage, link: ik.Link, test, cfg: Config, method: str, progress: bool):
    """(result, seconds): the Case 1 scores of every pretraining document on the summed test NLL."""
    pre_solve, pre_curvature = SOLVES[method](cfg)
    solve = [pre_solve, ik.SolveConfig(solver="minres", damping=cfg.damping[1], max_iter=cfg.max_iter[1])]
    curvature = [pre_curvature, ik.CurvatureConfig(seed=cfg.seed)]
    start = time.perf_counter()
    res = ik.Chain([pre, fin], [link], solve=solve, curvature=curvature).query(test, progress=progress).scores(
        progress=progress)
    return res, time.perf_counter() - start


def correlations(predicted, actual) -> dict[str, float]:
    return {"pearson": float(pearsonr(predicted, actual)[0]), "spearman": float(spearmanr(predicted, actual)[0])}


def solves_summary(res: ik.InfluenceResult) -> list[dict]:
    keys = ("stage", "solver", "iterations", "residual", "converged", "seconds", "damping")
    return [{k: s.get(k) for k in keys} for s in res.diagnostics["solves"]]


# ----------------------------------------------------------------------------------------------- leave-out


def leave_out_groups(cfg: Config, exact: np.ndarray) -> dict[str, torch.Tensor]:
    """Consecutive-rank groups of the top harmful and top helpful documents, and random groups."""
    order = np.argsort(-exact)
    k, n = cfg.group_size, len(exact)
    groups = {}
    for g in range(cfg.n_ranked_groups):
        groups[f"harmful {g * k + 1}-{(g + 1) * k}"] = torch.as_tensor(order[g * k : (g + 1) * k].copy())
        groups[f"helpful {g * k + 1}-{(g + 1) * k}"] = torch.as_tensor(order[::-1][g * k : (g + 1) * k].copy())
    gen = torch.Generator().manual_seed(cfg.seed + 5)
    for g in range(cfg.n_random_groups):
        groups[f"random {g}"] = torch.randperm(n, generator=gen)[:k]
    return groups


def leave_out(pre: ik.Stage, fin: ik.Stage, link: ik.Link, groups: dict, test, cfg: Config, progress: bool) -> pd.DataFrame:
    """Actual change of the summed test NLL when each group is removed (warm start), and two noise rows."""
    pre_state = {k: v.clone() for k, v in pre.model.state_dict().items()}
    fin_state = {k: v.clone() for k, v in fin.model.state_dict().items()}

    def run(removed, seed):
        pre.model.load_state_dict(pre_state)
        fin.model.load_state_dict(fin_state)
        continue_pretraining(pre, cfg, removed, seed)
        set_base(fin, pre, link)
        fit_adapters(fin, max_iter=cfg.refit_iter, rounds=1)
        return test_loss_sum(fin, test)

    seed = cfg.seed + 7
    control = run(None, seed)
    rows = []
    for name, idx in tqdm(groups.items(), desc="leave-out groups", disable=not progress):
        rows.append({"group": name, "size": len(idx), "members": " ".join(map(str, idx.tolist())),
                     "actual": run(idx, seed) - control})  # fmt: skip
    for other in (seed + 1, seed + 2):
        rows.append({"group": f"noise: no removal, batch order {other}", "size": 0, "members": "",
                     "actual": run(None, other) - control})  # fmt: skip
    pre.model.load_state_dict(pre_state)
    fin.model.load_state_dict(fin_state)
    frame = pd.DataFrame(rows)
    frame.attrs["control"] = control
    return frame


# ----------------------------------------------------------------------------------------------- main


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, a smoke run")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    cfg = QUICK if args.quick else Config()
    out = args.out or (Path(tempfile.mkdtemp(prefix="lm-")) if args.quick else Path("studies/results/lm"))
    out.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s",
                        handlers=[logging.StreamHandler(), logging.FileHandler(out / "run.log", mode="w")])  # fmt: skip
    progress = not args.no_progress
    t0 = time.perf_counter()
    seconds = {}
    try:
        data = load_data(cfg)
    except DataUnavailable as exc:
        print(exc, file=sys.stderr)
        return 2
    tokenizer, corpus = data["tokenizer"], data["corpus"]
    log.info("data: %s", data["info"])
    seconds["data"] = time.perf_counter() - t0

    start = time.perf_counter()
    torch.manual_seed(cfg.seed)
    pre_model = LlamaForCausalLM(model_config(cfg, len(tokenizer))).eval()
    pre = hf.causal_lm_stage(pre_model, data["documents"], regularizer=l2(cfg.pre_decay))
    training = {"pretrain_parameters": sum(p.numel() for p in pre_model.parameters()),
                "pretrain_objective_initial": float(pre.objective())}  # fmt: skip
    training["pretrain_objective"] = pretrain(pre, cfg, progress)
    seconds["pretraining"] = time.perf_counter() - start

    start = time.perf_counter()
    test = hf.pack(data["test"])
    fin = hf.causal_lm_stage(lora_model(pre_model, cfg), data["train"], regularizer=l2(cfg.fin_decay))
    link = hf.lora_link(pre, fin, case=1)
    training["test_nll_sum_before_lora"] = test_loss_sum(fin, test)
    training["adapter_parameters"] = sum(fin.state()[n].numel() for n in fin.param_names)
    training["lora_grad_norm"] = fit_adapters(fin, max_iter=200, rounds=2)
    training["finetune_objective"] = float(fin.objective())
    training["test_nll_sum"] = test_loss_sum(fin, test)
    training["test_nll_per_completion"] = training["test_nll_sum"] / cfg.n_test
    seconds["lora"] = time.perf_counter() - start
    log.info("trained: %s", training)

    results, summary = {}, {"config": asdict(cfg), "data": data["info"], "training": training, "solves": {}}
    for method in SOLVES:
        res, sec = influence(pre, fin, link, test, cfg, method, progress)
        results[method] = res
        seconds[f"influence_{method}"] = sec
        summary["solves"][method] = solves_summary(res)
        log.info("%s: %.1f s, solves %s", method, sec, summary["solves"][method])
    scores = pd.DataFrame({"document": corpus})
    for method, res in results.items():
        scores[f"I_{method}"] = res.values.numpy()
        scores[f"removal_{method}"] = res.removal.numpy()
    scores.to_csv(out / "scores.csv", index_label="index")
    top = pd.concat([results["exact"].top(10, texts=corpus).assign(kind="harmful"),
                     results["exact"].top(10, harmful=False, texts=corpus).assign(kind="helpful")])  # fmt: skip
    top.to_csv(out / "top_documents.csv", index=False)
    log.info("most harmful / helpful documents for the test completions:\n%s", top.to_string())
    summary["agreement_spearman"] = {f"exact_vs_{m}": float(spearmanr(scores["I_exact"], scores[f"I_{m}"])[0])
                                     for m in SOLVES if m != "exact"}  # fmt: skip

    start = time.perf_counter()
    groups = leave_out_groups(cfg, scores["I_exact"].to_numpy())
    frame = leave_out(pre, fin, link, groups, test, cfg, progress)
    seconds["leave_out"] = time.perf_counter() - start
    real = frame["size"] > 0
    rand = frame["group"].str.startswith("random")
    for method in SOLVES:
        removal = scores[f"removal_{method}"].to_numpy()
        frame[f"predicted_{method}"] = [float(removal[[int(i) for i in m.split()]].sum()) if m else np.nan
                                        for m in frame["members"]]  # fmt: skip
    frame.drop(columns="members").to_csv(out / "leaveout.csv", index=False)
    actual = frame.loc[real, "actual"].to_numpy()
    noise = frame.loc[~real, "actual"].to_numpy()
    summary["leave_out"] = {
        "groups": int(real.sum()), "group_size": cfg.group_size, "control_test_nll_sum": frame.attrs["control"],
        "actual_abs_mean": float(np.abs(actual).mean()), "noise_floor_abs": [float(abs(v)) for v in noise],
        "correlation": {m: correlations(frame.loc[real, f"predicted_{m}"], actual) for m in SOLVES},
        # the groups chosen by the exact scores span a wide range; random groups alone test the fine ordering
        "correlation_random_groups": {m: correlations(frame.loc[rand, f"predicted_{m}"], frame.loc[rand, "actual"])
                                      for m in SOLVES},
        # least-squares slope actual ≈ slope · predicted: 1 if the warm-start continuation re-optimized fully
        "slope_actual_on_predicted": {m: float(np.polyfit(frame.loc[real, f"predicted_{m}"], actual, 1)[0])
                                      for m in SOLVES},
    }  # fmt: skip
    log.info("leave-out:\n%s\n%s", frame.drop(columns="members").to_string(), summary["leave_out"])

    fig, axes = plt.subplots(1, len(SOLVES), figsize=(4.5 * len(SOLVES), 4.4))
    for ax, method in zip(axes, SOLVES):
        scatter_with_r(frame.loc[real, f"predicted_{method}"], actual, ax=ax, own_scale=True,
                       title=f"{method} (pretraining solve)")  # fmt: skip  (warm start: effects ≪ predictions)
        for v in noise:
            ax.axhspan(-abs(v), abs(v), color="orange", alpha=0.12, lw=0)
    caption(fig, f"Leave-out of {int(real.sum())} groups of {cfg.group_size} pretraining documents (warm start, "
                 f"{cfg.continue_epochs} epochs, adapters refit); shaded: re-training noise "
                 "(two batch orders, no removal)")  # fmt: skip
    save(fig, out / "leaveout_scatter.png")
    plt.close(fig)

    seconds["total"] = time.perf_counter() - t0
    summary["seconds"] = seconds
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    log.info("seconds: %s", seconds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
