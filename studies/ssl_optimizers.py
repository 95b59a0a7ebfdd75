"""M-Adam vs Adam vs SGD on the per-example weights (Ren et al. 2020, Fig. 4 centre): validation loss curves.

The digits setting of ssl_digits.py (50 labels, consistency loss, per-example weights on ≈1,200 unlabeled
images); each Λ step gives a hypergradient to the 256 examples of the sampled batch only (≈ 20%). Plain
Adam then decays the moments of the other 80% with zeros and still moves them (its momentum is non-zero);
M-Adam advances only the sampled entries. Adam and M-Adam use step 0.2; SGD's step is chosen per seed from
a grid by final validation loss (hypergradients are O(1/|U'|), so its scale differs from Adam's). Writes
studies/results/ssl/optimizers_curves.csv, optimizers_summary.csv and optimizers.png.
Run ``python studies/ssl_optimizers.py`` (≈ 6 min on one core) or ``--quick`` (CI size, written to results/ssl/quick/).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402

from ssl_digits import run, split_digits  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "ssl"
SGD_GRID = (100.0, 1000.0)
LABELS = {"madam": "M-Adam", "adam": "Adam", "sgd": "SGD (best lr of grid)"}


def history(data: dict, seed: int, optimizer: str, weight_lr: float, steps: int, warmup: int) -> pd.DataFrame:
    result = run("per-example", data, seed, steps, warmup, weight_optimizer=optimizer, weight_lr=weight_lr)
    return result.history.assign(optimizer=optimizer, weight_lr=weight_lr, seed=seed)


def main(quick: bool = False) -> None:
    torch.set_num_threads(1)
    out = RESULTS / "quick" if quick else RESULTS
    out.mkdir(parents=True, exist_ok=True)
    seeds = range(1) if quick else range(3)
    steps, warmup = (300, 100) if quick else (1500, 300)
    curves = []
    start = time.perf_counter()
    for seed in seeds:
        data = split_digits(seed)
        for optimizer in ("madam", "adam"):
            curves.append(history(data, seed, optimizer, 0.2, steps, warmup))
        sgd = [history(data, seed, "sgd", lr, steps, warmup) for lr in SGD_GRID]
        curves.append(min(sgd, key=lambda h: h.val_loss.iloc[-1]))
        print(f"seed {seed} done ({time.perf_counter() - start:.0f}s)")
    table = pd.concat(curves, ignore_index=True)
    table.to_csv(out / "optimizers_curves.csv", index=False)
    late = table[table.step > warmup + (steps - warmup) // 2]
    summary = late.groupby(["optimizer", "seed"])[["val_loss", "test_acc"]].mean().groupby("optimizer").agg(["mean", "std"])
    summary.columns = [f"{a}_{b}" for a, b in summary.columns]
    summary = summary.reset_index()
    summary.to_csv(out / "optimizers_summary.csv", index=False)
    print("mean over the second half of the Λ updates:")
    print(summary.to_string(index=False))

    fig, ax = plt.subplots(figsize=(6, 4))
    for optimizer, label in LABELS.items():
        mean = table[table.optimizer == optimizer].groupby("step").val_loss.mean()
        ax.plot(mean.index, mean.values, label=label)
    ax.axvline(warmup, color="grey", ls=":", lw=1)
    ax.set_xlabel("θ step")
    ax.set_ylabel("validation loss")
    ax.set_title(f"digits, per-example weights optimized by … ({len(seeds)} seeds)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "optimizers.png", dpi=110)
    print(f"wrote {out} in {time.perf_counter() - start:.0f}s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 seed, 300 steps (CI size)")
    main(parser.parse_args().quick)
