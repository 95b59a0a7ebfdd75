"""Per-example unlabeled weights on 2-D toy data (Ren et al. 2020, §4.1, Figures 1-2).

Linearly separable, circles and moons: 10 labeled, 30 validation, 1,000 unlabeled and 1,000 test points;
an MLP with two 100-unit ReLU layers; pseudo-labelling (Lee 2013) as the SSL loss. Methods: supervised only,
uniform weights (plain pseudo-labelling) and one learned λ_u per unlabeled point (Algorithm 1, last-layer
exact hypergradient on all 1,000 unlabeled points every 5 θ steps, M-Adam; the single-λ ablation is in
ssl_digits.py). Writes to studies/results/ssl/:

- synthetic_accuracy.csv (per seed), synthetic_summary.csv (mean ± std of test accuracy)
- synthetic_downweighted.csv: of the 100 lowest-weighted unlabeled points (10%; ties by index), the fraction
  on the wrong side of the boundary that pseudo-labelled them (end of warm-up) and of the final learned
  boundary, next to the base rates over all unlabeled points, and the fraction of zero weights
- synthetic_boundaries.png: decision boundaries (seed 0) with unlabeled points shaded by weight

Run ``python studies/ssl_synthetic.py`` (≈ 10 min on one free core) or ``--quick`` (CI size, written to results/ssl/quick/).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402
from sklearn.datasets import make_circles, make_classification, make_moons  # noqa: E402
from torch import nn  # noqa: E402

from influkit.apps.objectives import cross_entropy  # noqa: E402
from influkit import SolveConfig  # noqa: E402
from influkit.ssl import PseudoLabel, SSLConfig, train_ssl  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "ssl"
DATASETS = ("linear", "circles", "moons")
METHODS = ("supervised", "uniform", "per-example")


def make_data(name: str, seed: int, n_labeled: int = 10, n_val: int = 30, n_unlabeled: int = 1000, n_test: int = 1000):
    """Returns dict of float32 tensors: labeled (balanced), val, unlabeled (with hidden labels) and test splits."""
    n = n_labeled + n_val + n_unlabeled + n_test
    if name == "circles":
        x, y = make_circles(n, noise=0.08, factor=0.5, random_state=seed)
    elif name == "moons":
        x, y = make_moons(n, noise=0.1, random_state=seed)
    else:
        x, y = make_classification(
            n, n_features=2, n_redundant=0, n_informative=2, n_clusters_per_class=1, class_sep=1.5, flip_y=0,
            random_state=seed,
        )
    x = (x - x.mean(0)) / x.std(0)
    rng = np.random.default_rng(seed)
    lab = np.concatenate([rng.choice(np.flatnonzero(y == c), n_labeled // 2, replace=False) for c in (0, 1)])
    rest = rng.permutation(np.setdiff1d(np.arange(n), lab))
    val, unl, test = rest[:n_val], rest[n_val : n_val + n_unlabeled], rest[n_val + n_unlabeled :]
    X, Y = torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.long)
    return dict(labeled=(X[lab], Y[lab]), val=(X[val], Y[val]), unlabeled=X[unl], unlabeled_y=Y[unl], test=(X[test], Y[test]))


def mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(2, 100), nn.ReLU(), nn.Linear(100, 100), nn.ReLU(), nn.Linear(100, 2))


def run(method: str, data: dict, seed: int, steps: int, warmup: int, snapshots: dict | None = None):
    """Returns the SSLRun of one method; ``snapshots`` (step -> None) is filled with (predictions on U, weights, model copy)."""
    model = mlp(seed)

    def callback(step, m, weights):
        if snapshots is not None and step in snapshots:
            with torch.no_grad():
                snapshots[step] = (m(data["unlabeled"]).argmax(-1), weights, [p.detach().clone() for p in m.parameters()])

    return train_ssl(
        model, cross_entropy, PseudoLabel(), data["labeled"], data["unlabeled"], data["val"],
        SSLConfig(mode=method, steps=steps, warmup=warmup, inner_steps=5, lr=1e-2, weight_lr=0.2, labeled_batch=10,
                  unlabeled_batch=1000, hyper_params="4", solve=SolveConfig(damping=1e-2), log_every=25, seed=seed),
        test=data["test"], callback=callback,
    )


def grid_predict(params: list[torch.Tensor], xx: np.ndarray, yy: np.ndarray) -> np.ndarray:
    model = mlp(0)
    with torch.no_grad():
        for p, value in zip(model.parameters(), params):
            p.copy_(value)
        pts = torch.tensor(np.c_[xx.ravel(), yy.ravel()], dtype=torch.float32)
        return torch.softmax(model(pts), -1)[:, 1].reshape(xx.shape).numpy()


def plot_panel(ax, data, params, weights, title):
    unl, lab = data["unlabeled"].numpy(), data["labeled"][0].numpy()
    lo, hi = np.minimum(unl.min(0), lab.min(0)) - 0.3, np.maximum(unl.max(0), lab.max(0)) + 0.3
    xx, yy = np.meshgrid(np.linspace(lo[0], hi[0], 150), np.linspace(lo[1], hi[1], 150))
    ax.contourf(xx, yy, grid_predict(params, xx, yy), levels=[0, 0.5, 1], colors=["#dbe9f6", "#fde0c5"], alpha=0.8)
    ax.contour(xx, yy, grid_predict(params, xx, yy), levels=[0.5], colors="tab:blue", linewidths=2)
    ax.scatter(unl[:, 0], unl[:, 1], c=weights.numpy(), cmap="RdPu", vmin=0, vmax=2, s=6, edgecolors="none")
    ax.scatter(lab[:, 0], lab[:, 1], c="tab:orange", s=60, marker="*", edgecolors="k", linewidths=0.5)
    ax.set_title(title, fontsize=9)
    ax.set_xticks([])
    ax.set_yticks([])


def main(quick: bool = False) -> None:
    torch.set_num_threads(1)
    out = RESULTS / "quick" if quick else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    seeds = range(2) if quick else range(5)
    steps, warmup = (300, 50) if quick else (600, 100)
    show = [warmup, warmup + (steps - warmup) // 100 * 25, steps]
    rows, down_rows, figure = [], [], {}
    start = time.perf_counter()
    for name in DATASETS:
        for seed in seeds:
            data = make_data(name, seed)
            for method in METHODS:
                snaps = {s: None for s in show}
                result = run(method, data, seed, steps, warmup, snaps)
                acc = float(result.history.test_acc.iloc[-1])
                rows.append(dict(dataset=name, seed=seed, method=method, test_acc=acc,
                                 val_acc=float(result.history.val_acc.iloc[-1]),
                                 weight_zero_frac=float(result.history.weight_zero_frac.iloc[-1])))
                print(f"{name:8s} seed {seed} {method:12s} test acc {acc:.3f}  ({time.perf_counter() - start:.0f}s)")
                if method == "per-example":
                    truth = data["unlabeled_y"]
                    weights = result.weights
                    low = torch.zeros_like(truth, dtype=torch.bool)
                    low[torch.argsort(weights, stable=True)[: len(weights) // 10]] = True
                    wrong_then = snaps[warmup][0] != truth
                    wrong_final = snaps[steps][0] != truth
                    down_rows.append(dict(
                        dataset=name, seed=seed, zero_weight_frac=float((weights == 0).float().mean()),
                        low_wrong_at_warmup=float(wrong_then[low].float().mean()),
                        all_wrong_at_warmup=float(wrong_then.float().mean()),
                        low_wrong_final=float(wrong_final[low].float().mean()),
                        all_wrong_final=float(wrong_final.float().mean()),
                    ))
                if seed == 0:
                    figure[(name, method)] = snaps
    per_seed = pd.DataFrame(rows)
    per_seed.to_csv(out / "synthetic_accuracy.csv", index=False)
    summary = per_seed.groupby(["dataset", "method"]).test_acc.agg(["mean", "std", "count"]).reset_index()
    summary.to_csv(out / "synthetic_summary.csv", index=False)
    down = pd.DataFrame(down_rows)
    down.to_csv(out / "synthetic_downweighted.csv", index=False)
    print(summary.to_string(index=False))
    print(down.groupby("dataset").mean(numeric_only=True).drop(columns="seed").to_string())

    fig, axes = plt.subplots(len(DATASETS), 2 + len(show), figsize=(3 * (2 + len(show)), 3 * len(DATASETS)))
    for r, name in enumerate(DATASETS):
        data = make_data(name, 0)
        for c, method in enumerate(("supervised", "uniform")):
            _, w, params = figure[(name, method)][steps]
            acc = per_seed.query("dataset == @name and seed == 0 and method == @method").test_acc.iloc[0]
            plot_panel(axes[r, c], data, params, w, f"{name}: {method} (acc {acc:.2f})")
        for c, step in enumerate(show):
            _, w, params = figure[(name, "per-example")][step]
            plot_panel(axes[r, 2 + c], data, params, w, f"{name}: per-example, step {step}")
    fig.suptitle("Decision boundaries (seed 0); unlabeled points shaded by weight, white = 0 to dark = ≥ 2 (start: 1); labeled = stars", fontsize=11)
    fig.tight_layout()
    fig.savefig(out / "synthetic_boundaries.png", dpi=110)
    print(f"wrote {out} in {time.perf_counter() - start:.0f}s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 seeds, 300 steps (CI size)")
    main(parser.parse_args().quick)
