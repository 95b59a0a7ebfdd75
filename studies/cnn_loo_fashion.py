"""Leave-out validation of multi-stage influence on a real CNN (Case 1): exact vs EK-FAC vs identity.

Fashion-MNIST (Debian's ``dataset-fashion-mnist``: ``sudo apt-get install -y dataset-fashion-mnist``; or
``$FASHION_MNIST`` pointing at the four IDX files), 2×2-average-pooled to 14×14, float64:

- **pretraining** on classes 0–4 (T-shirt, trouser, pullover, dress, coat): a small CNN with smooth
  activations — Conv(1→6, 3) tanh AvgPool2 · Conv(6→8, 3) tanh AvgPool2 · Linear(32→16) tanh = the embedding W,
  and a head Linear(16→5), 1,113 parameters — on 500 images (100 per class) with L2 weight decay 3e-2, trained
  by Adam, then full-batch L-BFGS, then Newton steps to ‖∇‖ ≤ 1e-10, so the influence function's stationarity assumption holds (the smallest Hessian eigenvalue
  is reported: a minimum, not a saddle);
- **finetuning** on classes 5–9 (sandal, shirt, sneaker, bag, ankle boot): the embedding fixed (Case 1), a new
  head Linear(16→5) trained to ‖∇‖ ≤ 1e-10; the test set is taken from Fashion-MNIST's own test split.

Influence of every pretraining image on the summed test loss, by ``ik.Chain([pre, fin], [ik.Link("embedding")])``
with three ways of applying the two inverse Hessians:

- ``exact``: ``SolveConfig(solver="direct")`` (dense Hessians, Cholesky);
- ``ekfac``: ``SolveConfig(solver="ekfac")`` — the EK-FAC approximate inverse (sampled-label Fisher), kronfluence's
  method, for both stages (the Case 1 cross product stays one exact Hessian-vector product);
- ``identity``: every H⁻¹ replaced by I (the multi-stage paper's ablation).

A fourth run, ``SolveConfig(solver="minres", preconditioner="ekfac")`` to tolerance 1e-10, checks that the
preconditioned Krylov solve reaches the exact answer (iterations, HVPs, relative error vs ``direct``).

Validation: ``n_removals`` pretraining images (half the largest |exact score|, half at random) are removed one
at a time; pretraining and then finetuning are re-run from the original weights by Newton steps (each solved by
MINRES on the true Hessian, preconditioned with the original optimum's Cholesky factor, never refactored; with
backtracking) to the same stationarity (‖∇‖ ≤ 1e-10, the reached norms are reported),
through :func:`influkit.validation.leave_out_retrain`, and the actual change of the summed test loss is
compared with each method's predicted ``res.removal`` (Pearson, Spearman) — the same removals for all three.

Run ``python studies/cnn_loo_fashion.py`` (145 s at load average ~2 on 2 shared cores, longer on a busier
machine; ``--pretrain-per-class 200`` for 1,000 pretraining images, 251 s; results, plot and README in
``studies/results/cnn_loo/``) or ``--quick`` (smaller sets and net, 32 s; written to ``studies/results/cnn_loo/quick/``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402

import influkit as ik  # noqa: E402
from influkit.apps import plotting  # noqa: E402
from influkit.apps.datasets import load_fashion_mnist  # noqa: E402
from influkit.apps.digits import choose_removals  # noqa: E402
from influkit.apps.objectives import cross_entropy, l2  # noqa: E402
from influkit.curvature import HessianOperator, gradient  # noqa: E402
from influkit.errors import InputError  # noqa: E402
from influkit.training import fit_lbfgs, gradient_norm, newton_fit, train_adam  # noqa: E402
from influkit.validation import Retrainer, leave_out_retrain, loo_corr  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "cnn_loo"
PRETRAIN_CLASSES = (0, 1, 2, 3, 4)
FINETUNE_CLASSES = (5, 6, 7, 8, 9)
NAMES = ["T-shirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "ankle boot"]


@dataclass(frozen=True)
class Config:
    pretrain_per_class: int = 100  # 500 pretraining images
    finetune_per_class: int = 100  # 500 finetuning images
    test_per_class: int = 100  # 500 test images (Fashion-MNIST's test split)
    channels: tuple = (6, 8)
    width: int = 16
    weight_decay: float = 3e-2
    adam_steps: int = 1500
    adam_lr: float = 3e-3
    lbfgs_iter: int = 1000
    tol: float = 1e-10  # ‖∇‖ of every fit and refit
    n_removals: int = 30
    minres_tol: float = 1e-10
    seed: int = 0


QUICK = Config(pretrain_per_class=40, finetune_per_class=30, test_per_class=30, channels=(2, 4), width=8,
               adam_steps=300, lbfgs_iter=800,
               n_removals=10)  # fmt: skip


class Net(nn.Module):
    """embedding: Conv(1→c1,3) tanh AvgPool2 Conv(c1→c2,3) tanh AvgPool2 Flatten Linear(4·c2→width) tanh; head: Linear(width→5)."""

    def __init__(self, channels=(6, 8), width: int = 16, classes: int = 5):
        super().__init__()
        c1, c2 = channels
        self.embedding = nn.Sequential(
            nn.Conv2d(1, c1, 3), nn.Tanh(), nn.AvgPool2d(2), nn.Conv2d(c1, c2, 3), nn.Tanh(), nn.AvgPool2d(2),
            nn.Flatten(), nn.Linear(4 * c2, width), nn.Tanh(),
        )  # fmt: skip
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        return self.head(self.embedding(x))


def pick(x, y, classes, per_class: int, seed: int):
    """``per_class`` seeded images of each class, shuffled, 2×2-average-pooled to 14×14, float64, labels from 0."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for c in classes:
        idx = (y == c).nonzero().reshape(-1)
        if len(idx) < per_class:
            raise InputError(f"class {c} has {len(idx)} images, {per_class} asked for.")
        rows.append(idx[torch.randperm(len(idx), generator=gen)[:per_class]])
    rows = torch.cat(rows)
    rows = rows[torch.randperm(len(rows), generator=gen)]
    images = nn.functional.avg_pool2d(x[rows].double(), 2)
    return images.contiguous(), y[rows] - min(classes)


class DenseFactor:
    """The Cholesky factor of a stage's dense Hessian (+ μI if needed), as ``newton_fit`` uses it (names, space, solve):
    :class:`influkit.training.HessianFactor`'s matrix (equal to the bit), from the chain's operator, whose dense H the
    exact solve already formed (HessianFactor forms it again from the stage: p more HVPs)."""

    def __init__(self, operator: HessianOperator, damping: float = 0.0):
        self.names, self.space = list(operator.names), operator.space
        dense = operator.dense()
        eye = torch.eye(dense.shape[0], dtype=dense.dtype)
        chol, info = torch.linalg.cholesky_ex(dense + damping * eye)
        if int(info) != 0:
            damping = 2 * abs(float(torch.linalg.eigvalsh(dense)[0])) + damping
            chol = torch.linalg.cholesky(dense + damping * eye)
        self.chol, self.damping = chol, damping

    def solve(self, vec: torch.Tensor) -> torch.Tensor:
        return torch.cholesky_solve(vec.reshape(vec.shape[0], -1), self.chol).reshape(vec.shape)


def fit(stage: ik.Stage, cfg: Config, adam: bool) -> dict:
    """Adam (optional), L-BFGS, then Newton to ‖∇‖ ≤ tol; returns the gradient norms after each phase."""
    out = {}
    if adam:
        train_adam(stage, steps=cfg.adam_steps, lr=cfg.adam_lr, batch_size=128, seed=cfg.seed)
        out["after_adam"] = gradient_norm(stage)
    start = time.perf_counter()
    out["after_lbfgs"] = fit_lbfgs(stage, max_iter=cfg.lbfgs_iter, tol=1e-8, restarts=1)
    out["lbfgs_seconds"] = time.perf_counter() - start
    start = time.perf_counter()
    out["after_newton"] = newton_fit(stage, tol=cfg.tol)
    out["newton_seconds"] = time.perf_counter() - start
    return out


def newton_refit(stage: ik.Stage, factor: DenseFactor, tol: float, max_steps: int = 30) -> tuple[float, int]:
    """Newton steps from the current weights, each solved by MINRES on the true Hessian H(θ) preconditioned with the
    original optimum's factor (never refactored), with backtracking; returns (‖∇‖ at the end, HVPs used).

    Not :func:`influkit.training.newton_fit`: it reaches the same optimum (summed test loss within 1.8e-8 on 10
    removals), but its CG fails on top-|score| removals here and it refactors the dense Hessian: 76-89 s a refit
    against 5 s (load 15; results README, "A first attempt")."""
    named = dict(stage.model.named_parameters())
    trained = {n: named[n] for n in stage.param_names}
    products, best, stalls = 0, math.inf, 0
    for _ in range(max_steps):
        g = factor.space.flatten(gradient(stage, stage.param_names))
        norm = float(g.norm())
        if norm <= tol:
            break
        stalls = stalls + 1 if norm > 0.9 * best else 0
        if stalls >= 3:
            break
        best = min(best, norm)
        operator = HessianOperator(stage)
        sol = ik.solve(operator, g, "minres", preconditioner=factor.solve, tol=1e-12, max_iter=200, warn=False)
        products += sol.products
        step = factor.space.unflatten(sol.x)
        with torch.no_grad():
            start = float(stage.objective(trained))
            for t in 0.5 ** torch.arange(20):
                for name, delta in step.items():
                    named[name].sub_(t * delta)
                if float(stage.objective(trained)) <= start + 1e-13 * abs(start):
                    break
                for name, delta in step.items():
                    named[name].add_(t * delta)
    return gradient_norm(stage), products


def summed_loss(stage: ik.Stage, data) -> float:
    with torch.no_grad():
        return float(stage.losses(stage.trained(), *data).sum())


def accuracy(model: nn.Module, data) -> float:
    with torch.no_grad():
        return float((model(data[0]).argmax(1) == data[1]).double().mean())


def run(cfg: Config, out: Path, log=print) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    summary: dict = {"config": asdict(cfg), "machine": machine()}
    x_tr, y_tr = load_fashion_mnist("train")
    x_te, y_te = load_fashion_mnist("test")
    pre_data = pick(x_tr, y_tr, PRETRAIN_CLASSES, cfg.pretrain_per_class, cfg.seed)
    # finetuning images: other seeded rows of the same split (classes 5–9 never occur in pretraining)
    fin_data = pick(x_tr, y_tr, FINETUNE_CLASSES, cfg.finetune_per_class, cfg.seed + 1)
    test = pick(x_te, y_te, FINETUNE_CLASSES, cfg.test_per_class, cfg.seed + 2)
    summary["data"] = {"pretrain": len(pre_data[1]), "finetune": len(fin_data[1]), "test": len(test[1]),
                       "pixels": list(pre_data[0].shape[1:])}  # fmt: skip
    log(f"data: {summary['data']}")

    torch.manual_seed(cfg.seed)
    pre_model = Net(cfg.channels, cfg.width).double().eval()
    pre = ik.Stage(pre_model, cross_entropy, pre_data, regularizer=l2(cfg.weight_decay))
    start = time.perf_counter()
    pre_fit = fit(pre, cfg, adam=True)
    pre_fit["seconds"] = time.perf_counter() - start
    pre_fit["parameters"] = pre.num_trained
    pre_fit["train_accuracy"] = accuracy(pre_model, pre_data)
    summary["pretraining"] = pre_fit
    log(f"pretraining: {pre_fit}")

    fin_model = Net(cfg.channels, cfg.width).double().eval()
    fin_model.embedding.load_state_dict(pre_model.embedding.state_dict())
    torch.manual_seed(cfg.seed + 1)
    fin_model.head.reset_parameters()
    fin = ik.Stage(fin_model, cross_entropy, fin_data, params="head", regularizer=l2(cfg.weight_decay))
    start = time.perf_counter()
    fin_fit = fit(fin, cfg, adam=False)
    fin_fit["seconds"] = time.perf_counter() - start
    fin_fit |= {"parameters": fin.num_trained, "train_accuracy": accuracy(fin_model, fin_data),
                "test_accuracy": accuracy(fin_model, test), "test_loss_sum": summed_loss(fin, test)}  # fmt: skip
    summary["finetuning"] = fin_fit
    log(f"finetuning: {fin_fit}")

    # -- influence of every pretraining image, three (+1) ways
    link = [ik.Link("embedding", case=1)]
    methods = {
        "exact": ik.SolveConfig(solver="direct"),
        "ekfac": ik.SolveConfig(solver="ekfac"),
        "identity": ik.SolveConfig(solver="identity"),
        "minres_ekfac": ik.SolveConfig(solver="minres", preconditioner="ekfac", tol=cfg.minres_tol),
    }
    results, chains, timing = {}, {}, {}
    for name, config in methods.items():
        fin_config = config if name != "minres_ekfac" else methods["exact"]
        chain = ik.Chain([pre, fin], link, solve=[config, fin_config])
        start = time.perf_counter()
        chain.fit()
        fit_seconds = time.perf_counter() - start
        query = chain.query(test)
        res = query.scores()
        timing[name] = {"fit": fit_seconds, "total": time.perf_counter() - start, "solves": query.solves,
                        "seconds": res.diagnostics["seconds"]}  # fmt: skip
        results[name], chains[name] = res, chain
        solve0 = query.solves[0]
        log(f"{name}: {timing[name]['total']:.1f} s (fit {fit_seconds:.1f} s); pretraining solve: method "
            f"{solve0['solver']}, iterations {solve0['iterations']}, HVPs {solve0['products']}, residual "
            f"{solve0['residual']:.2e}, preconditioner {solve0['preconditioner'] or '-'}")  # fmt: skip
    for k, part in enumerate(("pretraining", "finetuning")):  # the dense Hessians at the optimum, built by "exact"
        eig = torch.linalg.eigvalsh(chains["exact"].operator(k).dense())
        summary[part] |= {"min_hessian_eigenvalue": float(eig[0]), "max_hessian_eigenvalue": float(eig[-1])}
    log(f"Hessian eigenvalue range: pretraining {summary['pretraining']['min_hessian_eigenvalue']:.3e} .. "
        f"{summary['pretraining']['max_hessian_eigenvalue']:.3e}, finetuning {summary['finetuning']['min_hessian_eigenvalue']:.3e} .. "
        f"{summary['finetuning']['max_hessian_eigenvalue']:.3e}")  # fmt: skip
    exact = results["exact"].values.double()
    agreement = {}
    for name, res in results.items():
        v = res.values.double()
        agreement[name] = {
            "relative_error": float((v - exact).norm() / exact.norm()),
            "pearson": float(np.corrcoef(v.numpy(), exact.numpy())[0, 1]),
            "spearman": ik.validation.spearman(v.numpy(), exact.numpy()),
            "top50_overlap": ik.validation.top_k_overlap(v.abs().numpy(), exact.abs().numpy(), min(50, len(v))),
        }  # fmt: skip
    summary["influence"] = {"timing": timing, "agreement_with_exact": agreement}
    log(f"agreement with exact over all {len(exact)} pretraining images: {agreement}")
    pd.DataFrame({"index": np.arange(len(exact)), "label": pre_data[1].numpy()}
                 | {f"removal_{n}": r.removal.double().numpy() for n, r in results.items()}
                 ).to_csv(out / "scores.csv", index=False, float_format="%.8g")  # fmt: skip

    # -- leave-one-out re-training (deterministic Newton refits from the original weights)
    removals = choose_removals(results["exact"], cfg.n_removals, seed=cfg.seed)
    factors = {"pre": DenseFactor(chains["exact"].operator(0)), "fin": DenseFactor(chains["exact"].operator(1))}
    stats = {"refits": 0, "max_grad_pre": 0.0, "max_grad_fin": 0.0}

    def refit(objective: ik.Stage) -> float:
        """One stage of a leave-out run (the Retrainer hands over pretraining, then finetuning)."""
        which = "fin" if objective.param_names == fin.param_names else "pre"
        t0 = time.perf_counter()
        norm, hvps = newton_refit(objective, factors[which], cfg.tol)
        stats[f"max_grad_{which}"] = max(stats[f"max_grad_{which}"], norm)
        stats["refits"] += which == "fin"
        log(f"  refit {which}: {time.perf_counter() - t0:.1f} s, {hvps} HVPs, ‖∇‖ {norm:.1e}")
        return norm

    log_file = out / "loo_log.csv"
    if log_file.exists():
        log_file.unlink()
    start = time.perf_counter()
    retrainer = Retrainer(optimizer=refit, keep_weights=False)  # stage 1 re-fitted as the mean over the kept images
    frame = leave_out_retrain(chains["exact"], removals, test, retrainer, log=log_file, progress=False)
    loo_seconds = time.perf_counter() - start
    baseline = pd.read_csv(log_file, dtype={"removed": str}).set_index("removed").loc["none", "test_loss"]
    for name, res in results.items():
        frame[f"predicted_{name}"] = [float(res.removal[i]) for i in removals]
    frame["kind"] = ["top |score|"] * (cfg.n_removals // 2) + ["random"] * (cfg.n_removals - cfg.n_removals // 2)
    frame["label"] = [NAMES[PRETRAIN_CLASSES[int(pre_data[1][i])]] for i in removals]
    frame.drop(columns=["predicted"], errors="ignore").to_csv(out / "loo.csv", index=False, float_format="%.10g")
    log_file.unlink()
    corr = {name: loo_corr(frame[f"predicted_{name}"], frame["actual"]) for name in results}
    top = frame["kind"] == "top |score|"
    for name in results:
        corr[name]["pearson_top"] = ik.validation.pearson(frame.loc[top, f"predicted_{name}"], frame.loc[top, "actual"])
        corr[name]["pearson_random"] = ik.validation.pearson(frame.loc[~top, f"predicted_{name}"], frame.loc[~top, "actual"])
    summary["loo"] = {
        "removals": len(removals), "baseline_test_loss": float(baseline),
        "baseline_minus_original": float(baseline) - fin_fit["test_loss_sum"],
        "seconds": loo_seconds, "seconds_per_refit": loo_seconds / max(stats["refits"], 1),
        "max_grad_norm_after_refit": {"pretrain": stats["max_grad_pre"], "finetune": stats["max_grad_fin"]},
        "mean_abs_actual": float(frame["actual"].abs().mean()), "correlation": corr,
    }  # fmt: skip
    for name in results:
        log(f"LOO {name}: {corr[name]}")

    panels = [("exact", "exact (direct)"), ("ekfac", "EK-FAC"), ("identity", "identity (H := I)")]
    fig, axes = plt.subplots(1, 3, figsize=(13.5, 4.4))
    for ax, (name, title) in zip(axes, panels):
        plotting.scatter_with_r(frame[f"predicted_{name}"], frame["actual"], ax=ax, title=title)
        ax.set_xlim(*_limits(frame[f"predicted_{name}"]))
    fig.suptitle(f"Fashion-MNIST CNN, Case 1: {len(removals)} pretraining images left out "
                 f"(half top-|exact score|, half random)", fontsize=10)  # fmt: skip
    fig.tight_layout()
    plotting.save(fig, out / "loo_scatter.png")

    summary["seconds_total"] = time.perf_counter() - t_start
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=_jsonable))
    return summary


def _limits(values) -> tuple[float, float]:
    v = np.asarray(values, float)
    pad = 0.08 * (v.max() - v.min() + 1e-30)
    return float(v.min() - pad), float(v.max() + pad)


def _jsonable(obj):
    if isinstance(obj, (np.floating, np.integer)):
        return obj.item()
    if isinstance(obj, float) and math.isnan(obj):
        return None
    return str(obj)


def machine() -> str:
    load = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else "?"
    return (f"{os.cpu_count()} cores, load average {' '.join(load)} at start | python {platform.python_version()} | "
            f"torch {torch.__version__} | torch threads {torch.get_num_threads()}")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sets, ~2 minutes (written to .../cnn_loo/quick/)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--removals", type=int, default=None)
    parser.add_argument("--pretrain-per-class", type=int, default=None, help="pretraining images per class (default 100)")
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else Config()
    if args.removals is not None:
        cfg = replace(cfg, n_removals=args.removals)
    if args.pretrain_per_class is not None:
        cfg = replace(cfg, pretrain_per_class=args.pretrain_per_class)
    out = args.out or (RESULTS / "quick" if args.quick else RESULTS)
    torch.set_num_threads(args.threads)
    out.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []

    def log(text: str) -> None:
        print(text, flush=True)
        lines.append(text)

    try:
        summary = run(cfg, out, log)
    except InputError as exc:
        print(f"cnn_loo_fashion: {exc}", file=sys.stderr)
        return 2
    finally:
        (out / "run.log").write_text("\n".join(lines) + "\n")
    print(f"results in {out} ({summary['seconds_total']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
