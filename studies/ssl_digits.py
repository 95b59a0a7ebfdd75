"""Per-example unlabeled weights on real data: scikit-learn digits with 50 labels and a consistency loss.

Per seed: 50 labeled and 50 validation images (5 per class), 500 test images, the remaining ≈1,200 unlabeled.
Model: an MLP 64-64-64-10. SSL loss: FixMatch-style consistency — the prediction on an augmented image
(random shift by ±1 pixel, Gaussian noise) must match the confident (p ≥ 0.8) prediction on the clean one.
Methods: supervised only, uniform weight, one learned λ, per-example λ_u (Algorithm 1, last-layer exact
hypergradient, M-Adam). Writes studies/results/ssl/digits_accuracy.csv, digits_summary.csv,
digits_curves.png. Run ``python studies/ssl_digits.py`` (≈ 4 min on one core) or ``--quick`` (CI size, written to results/ssl/quick/).
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
from torch import nn  # noqa: E402

from influkit.apps.datasets import load_digits_tensors  # noqa: E402
from influkit.apps.objectives import cross_entropy  # noqa: E402
from influkit import SolveConfig  # noqa: E402
from influkit.ssl import Consistency, SSLConfig, ShiftNoise, train_ssl  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "ssl"
METHODS = ("supervised", "uniform", "single", "per-example")


def split_digits(seed: int, per_class: int = 5, n_test: int = 500) -> dict:
    """Returns float32 splits of the digits: labeled and val (``per_class`` each per class), test, unlabeled."""
    x, y = load_digits_tensors(torch.float32)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(y))
    test, pool = order[:n_test], order[n_test:]
    lab = np.concatenate([pool[y[pool].numpy() == c][:per_class] for c in range(10)])
    val = np.concatenate([pool[y[pool].numpy() == c][per_class : 2 * per_class] for c in range(10)])
    unl = np.setdiff1d(pool, np.concatenate([lab, val]))
    return dict(labeled=(x[lab], y[lab]), val=(x[val], y[val]), test=(x[test], y[test]), unlabeled=x[unl])


def mlp(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))


def run(method: str, data: dict, seed: int, steps: int, warmup: int, weight_optimizer: str = "madam", weight_lr: float = 0.2):
    """Returns the SSLRun of one method (Algorithm 1 with the consistency loss; Λ updated every 15 θ steps)."""
    loss = Consistency(ShiftNoise(shape=(8, 8), max_shift=1, noise=0.05, seed=seed), threshold=0.8)
    return train_ssl(
        mlp(seed), cross_entropy, loss, data["labeled"], data["unlabeled"], data["val"],
        SSLConfig(mode=method, steps=steps, warmup=warmup, inner_steps=15, lr=3e-3, weight_lr=weight_lr,
                  weight_optimizer=weight_optimizer, labeled_batch=50, unlabeled_batch=256, hyper_params="4",
                  solve=SolveConfig(damping=1e-2), log_every=50, seed=seed),
        test=data["test"],
    )


def main(quick: bool = False) -> None:
    torch.set_num_threads(1)
    out = RESULTS / "quick" if quick else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    seeds = range(1) if quick else range(3)
    steps, warmup = (300, 100) if quick else (1500, 300)
    rows, curves = [], []
    start = time.perf_counter()
    for seed in seeds:
        data = split_digits(seed)
        for method in METHODS:
            result = run(method, data, seed, steps, warmup)
            h = result.history.assign(method=method, seed=seed)
            curves.append(h)
            last = h.iloc[-1]
            rows.append(dict(seed=seed, method=method, test_acc=last.test_acc, test_loss=last.test_loss,
                             val_acc=last.val_acc, val_loss=last.val_loss, weight_mean=last.weight_mean,
                             weight_std=last.weight_std, weight_zero_frac=last.weight_zero_frac))
            print(f"seed {seed} {method:12s} test acc {last.test_acc:.3f}  ({time.perf_counter() - start:.0f}s)")
    per_seed = pd.DataFrame(rows)
    per_seed.to_csv(out / "digits_accuracy.csv", index=False)
    summary = per_seed.groupby("method")[["test_acc", "test_loss", "val_loss"]].agg(["mean", "std"]).reindex(METHODS)
    summary.columns = [f"{a}_{b}" for a, b in summary.columns]
    summary = summary.reset_index()
    summary.to_csv(out / "digits_summary.csv", index=False)
    print(summary.to_string(index=False))

    history = pd.concat(curves)
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    for method in METHODS:
        mean = history[history.method == method].groupby("step")[["test_acc", "val_loss", "weight_mean"]].mean()
        axes[0].plot(mean.index, mean.test_acc, label=method)
        axes[1].plot(mean.index, mean.val_loss, label=method)
        axes[2].plot(mean.index, mean.weight_mean, label=method)
    for ax, title in zip(axes, ("test accuracy", "validation loss", "mean unlabeled weight")):
        ax.set_title(f"digits, 50 labels: {title}")
        ax.set_xlabel("θ step")
        ax.axvline(warmup, color="grey", ls=":", lw=1)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(out / "digits_curves.png", dpi=110)
    print(f"wrote {out} in {time.perf_counter() - start:.0f}s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 seed, 300 steps (CI size)")
    main(parser.parse_args().quick)
