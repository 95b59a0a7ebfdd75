"""Turn-over dropout influence on scikit-learn's digits: LOO, Koh & Liang, self-influence, cleansing, mislabels.

An MLP 64→256→10 with TurnOverDropout(p=0.5) after the hidden layer is trained with turn-over dropout
(every example trains only its own sub-network). Then:

(a) the estimated removal effect −values[i] = L(x; 1−m_i) − L(x; m_i) against actual leave-one-out retraining
    (same initial weights, same data order minus the example) for top-|score| and random examples, and
    against Koh & Liang influence on the same (full) network, last layer, explicit Hessian (Pearson r);
(b) the histogram of self-influences L(z_i; m_i) − L(z_i; 1−m_i);
(c) data cleansing: remove the most harmful examples (largest influence on a validation set) vs random ones,
    retrain, test accuracy over several seeds;
(d) mislabel detection: flip 10% of the labels, rank by self-influence (most negative first), fraction of
    flipped labels found after checking 5/10/20/30% of the data, vs random and vs ranking by training loss.

Run: ``python studies/turnover_digits.py`` (about 5 minutes on 2 cores) or ``--quick`` (CI-sized; writes
to a temporary directory unless ``--out`` is given). Results: CSV + PNG under studies/results/turnover/.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import torch  # noqa: E402
from scipy.stats import pearsonr, spearmanr  # noqa: E402
from torch import nn  # noqa: E402

import influkit as ik  # noqa: E402
from influkit.apps.datasets import load_digits_tensors  # noqa: E402
from influkit.apps.objectives import cross_entropy as ce  # noqa: E402
from influkit.turnover import TurnOverDropout, influence, model_with_ids, self_influence, train_turnover  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "turnover"


def make_model(seed: int, hidden: int = 256, p: float = 0.5) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, hidden), nn.ReLU(), TurnOverDropout(p), nn.Linear(hidden, 10))


def split_digits(seed: int = 0, n_train: int = 1000, n_val: int = 300):
    """Returns (train, val, test) pairs of float32 inputs in [0, 1] and int64 labels, shuffled by ``seed``."""
    x, y = load_digits_tensors(torch.float32)
    order = torch.as_tensor(np.random.default_rng(seed).permutation(len(x)))
    x, y = x[order], y[order]
    cut = [n_train, n_train + n_val]
    return (x[: cut[0]], y[: cut[0]]), (x[cut[0] : cut[1]], y[cut[0] : cut[1]]), (x[cut[1] :], y[cut[1] :])


def fit(data, seed: int, cfg: dict, exclude=None) -> nn.Sequential:
    """Returns a model initialized and trained (turn-over dropout) with ``seed``, optionally without ``exclude``."""
    model = make_model(seed)
    train_turnover(
        model, ce, data, epochs=cfg["epochs"], batch_size=64, lr=1e-3, seed=seed, exclude=exclude, progress=False
    )
    return model


@torch.no_grad()
def evaluate(model: nn.Module, data) -> tuple[torch.Tensor, float]:
    """Returns the full network's per-example test losses and its accuracy."""
    model.eval()
    out = model(data[0])
    return ce(out, data[1]), float((out.argmax(1) == data[1]).float().mean())


def pearson(a, b) -> float:
    return float(pearsonr(np.asarray(a, dtype=float), np.asarray(b, dtype=float))[0])


# ---------------------------------------------------------------- (a) LOO and Koh & Liang


def experiment_loo(train, test, cfg: dict, out: Path) -> dict:
    model = fit(train, 0, cfg)
    test_losses, acc = evaluate(model, test)
    target = int(test_losses.argmax())  # the test point the model gets most wrong (as in Koh & Liang)
    print(f"\n(a) model accuracy {acc:.3f}; test point {target} (label {int(test[1][target])}, loss {float(test_losses[target]):.3f})")
    n = train[0].shape[0]
    point = (test[0][target : target + 1], test[1][target : target + 1])
    to_point = influence(model, torch.arange(n), point, measure=ce, n_train=n, progress=False)
    to_set = influence(model, torch.arange(n), test, measure=ce, n_train=n, progress=False)
    # null check: ids n..2n−1 (of a set of 2n whose second half was never trained on) are pure sub-network noise
    unseen = torch.arange(n, 2 * n)
    noise = pd.DataFrame(
        [
            (name, float(seen.values.std()), float(null.values.std()), float(seen.values.std() / null.values.std()))
            for name, seen, null in [
                ("test point", to_point, influence(model, unseen, point, measure=ce, n_train=2 * n, progress=False)),
                ("summed test loss", to_set, influence(model, unseen, test, measure=ce, n_train=2 * n, progress=False)),
            ]
        ],
        columns=["target", "std_trained_ids", "std_unseen_ids", "ratio"],
    )
    noise.to_csv(out / "signal_to_noise.csv", index=False)
    print("spread of turn-over scores: trained ids vs never-trained ids (ratio ≈ 1 means noise dominates)")
    print(noise.to_string(index=False, float_format="%.3f"))

    stage = ik.Stage(model, ce, train, params="3")  # Koh & Liang on the full network's last layer
    kl = ik.influence(stage, torch.arange(n), point, solve=ik.SolveConfig(solver="direct", damping=cfg["damping"]))

    rng = np.random.default_rng(0)
    half = cfg["loo"] // 2
    top = torch.argsort(to_point.values.abs(), descending=True)[:half].tolist()
    rest = [i for i in range(n) if i not in top]
    chosen = top + rng.choice(rest, size=cfg["loo"] - half, replace=False).tolist()
    rows = []
    start = time.perf_counter()
    for i in chosen:
        loo_losses, _ = evaluate(fit(train, 0, cfg, exclude=[i]), test)
        rows.append(
            {
                "example": i,
                "group": "top" if i in top else "random",
                "actual_point": float(loo_losses[target] - test_losses[target]),
                "turnover_point": float(to_point.removal[i]),
                "kl_point": float(kl.removal[i]),
                "actual_testset": float(loo_losses.sum() - test_losses.sum()),
                "turnover_testset": float(to_set.removal[i]),
            }
        )
    frame = pd.DataFrame(rows)
    frame.to_csv(out / "loo.csv", index=False)
    corr = pd.DataFrame(
        [
            ("turn-over vs LOO, test point", pearson(frame.turnover_point, frame.actual_point), spearmanr(frame.turnover_point, frame.actual_point)[0]),
            ("Koh&Liang vs LOO, test point", pearson(frame.kl_point, frame.actual_point), spearmanr(frame.kl_point, frame.actual_point)[0]),
            ("turn-over vs LOO, summed test loss", pearson(frame.turnover_testset, frame.actual_testset), spearmanr(frame.turnover_testset, frame.actual_testset)[0]),
            ("turn-over vs Koh&Liang, all train", pearson(to_point.removal, kl.removal), spearmanr(to_point.removal, kl.removal)[0]),
        ],
        columns=["comparison", "pearson", "spearman"],
    )
    corr.to_csv(out / "correlations.csv", index=False)
    print(f"LOO retraining of {len(chosen)} examples: {time.perf_counter() - start:.0f} s")
    print(corr.to_string(index=False, float_format="%.3f"))

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, x, y, name in [
        (axes[0], frame.turnover_point, frame.actual_point, "turn-over"),
        (axes[1], frame.kl_point, frame.actual_point, "Koh & Liang (last layer)"),
    ]:
        for group, marker in [("top", "o"), ("random", "x")]:
            sel = frame.group == group
            ax.scatter(x[sel], y[sel], marker=marker, label=group)
        ax.set(xlabel=f"{name}: predicted loss change", ylabel="LOO retraining: actual loss change",
               title=f"{name} vs LOO (Pearson r = {pearson(x, y):.2f})")
        ax.axhline(0, color="grey", lw=0.5)
        ax.axvline(0, color="grey", lw=0.5)
        ax.legend()
    axes[2].scatter(kl.removal, to_point.removal, s=4)
    axes[2].set(xlabel="Koh & Liang removal", ylabel="turn-over removal",
                title=f"all {n} examples (Pearson r = {pearson(kl.removal, to_point.removal):.2f})")
    fig.tight_layout()
    fig.savefig(out / "loo_and_koh_liang.png", dpi=80)
    plt.close(fig)
    return {"model": model, "accuracy": acc}


# ---------------------------------------------------------------- (b) self-influence


def experiment_self_influence(model: nn.Module, train, out: Path) -> None:
    res = self_influence(model, ce, train, progress=False)
    values = res.values.numpy()
    n = len(values)
    with torch.no_grad():  # the same inputs under never-trained ids n..2n−1: the null distribution
        unseen = torch.arange(n, 2 * n)
        with model_with_ids(model, unseen):
            own = ce(model(train[0]), train[1])
        with model_with_ids(model, unseen, flip=True):
            null = (own - ce(model(train[0]), train[1])).double().numpy()
    share, null_share = float((values < 0).mean()), float((null < 0).mean())
    print(f"\n(b) self-influence L(z;m) − L(z;1−m): {100 * share:.1f}% negative (= positive in the paper's sign), "
          f"median {np.median(values):.3f}; never-trained ids: {100 * null_share:.1f}% negative, median {np.median(null):.3f}")
    summary = pd.DataFrame({"trained ids": values, "never-trained ids": null}).describe().T
    summary.insert(0, "share_negative", [share, null_share])
    summary.to_csv(out / "self_influence_summary.csv")
    fig, ax = plt.subplots(figsize=(5.5, 3.5))
    bins = np.linspace(min(values.min(), null.min()), max(values.max(), null.max()), 70)
    ax.hist(values, bins=bins, alpha=0.7, label=f"trained ids ({100 * share:.0f}% < 0)")
    ax.hist(null, bins=bins, alpha=0.5, label=f"never-trained ids ({100 * null_share:.0f}% < 0)")
    ax.axvline(0, color="k", lw=0.8)
    ax.set(xlabel="self-influence L(z; m) − L(z; 1−m)  (< 0: z lowers its own loss)", ylabel="examples",
           title="turn-over self-influence")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "self_influence_hist.png", dpi=80)
    plt.close(fig)


# ---------------------------------------------------------------- (c) cleansing


def experiment_cleansing(train, val, test, cfg: dict, out: Path) -> None:
    n = train[0].shape[0]
    rows = []
    for seed in range(cfg["seeds"]):
        model = fit(train, seed, cfg)
        rows.append({"seed": seed, "removed": 0.0, "strategy": "none", "accuracy": evaluate(model, test)[1]})
        harmful = torch.argsort(influence(model, torch.arange(n), val, measure=ce, n_train=n, progress=False).values, descending=True)
        rng = np.random.default_rng(100 + seed)
        for frac in cfg["fractions"]:
            k = int(round(frac * n))
            for strategy, drop in [("turn-over harmful", harmful[:k].tolist()), ("random", rng.choice(n, k, replace=False).tolist())]:
                acc = evaluate(fit(train, seed, cfg, exclude=drop), test)[1]
                rows.append({"seed": seed, "removed": frac, "strategy": strategy, "accuracy": acc})
    frame = pd.DataFrame(rows)
    frame.to_csv(out / "cleansing.csv", index=False)
    table = frame.groupby(["removed", "strategy"]).accuracy.agg(["mean", "std", "count"]).reset_index()
    print(f"\n(c) data cleansing: test accuracy over {cfg['seeds']} seeds")
    print(table.to_string(index=False, float_format="%.4f"))
    fig, ax = plt.subplots(figsize=(5, 3.5))
    base = table[table.strategy == "none"]
    for strategy in ["turn-over harmful", "random"]:
        part = pd.concat([base, table[table.strategy == strategy]])
        ax.errorbar(100 * part.removed, part["mean"], yerr=part["std"], marker="o", capsize=3, label=strategy)
    ax.set(xlabel="training data removed (%)", ylabel="test accuracy (mean ± std)",
           title=f"cleansing by turn-over influence ({cfg['seeds']} seeds)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "cleansing.png", dpi=80)
    plt.close(fig)


# ---------------------------------------------------------------- (d) mislabel detection


def experiment_mislabels(train, cfg: dict, out: Path) -> None:
    n = train[0].shape[0]
    checked = [0.05, 0.10, 0.20, 0.30]
    rows = []
    for seed in range(cfg["seeds"]):
        rng = np.random.default_rng(200 + seed)
        flipped = rng.choice(n, n // 10, replace=False)
        labels = train[1].clone()
        labels[flipped] = (labels[flipped] + torch.tensor(rng.integers(1, 10, len(flipped)))) % 10
        noisy = (train[0], labels)
        model = fit(noisy, seed, cfg)
        scores = {
            "turn-over self-influence": -self_influence(model, ce, noisy, progress=False).values,
            "training loss (full net)": evaluate(model, noisy)[0].double(),
        }
        is_flipped = torch.zeros(n, dtype=torch.bool)
        is_flipped[flipped] = True
        for name, score in scores.items():
            order = torch.argsort(score, descending=True)
            for frac in checked:
                found = float(is_flipped[order[: int(round(frac * n))]].sum()) / len(flipped)
                rows.append({"seed": seed, "method": name, "checked": frac, "found": found})
        for frac in checked:
            rows.append({"seed": seed, "method": "random (expected)", "checked": frac, "found": frac})
    frame = pd.DataFrame(rows)
    frame.to_csv(out / "mislabels.csv", index=False)
    table = frame.pivot_table(index="method", columns="checked", values="found", aggfunc=["mean", "std"])
    print(f"\n(d) mislabel detection (10% flipped): fraction found after checking a share of the data, {cfg['seeds']} seeds")
    print(table.to_string(float_format="%.3f"))
    fig, ax = plt.subplots(figsize=(5, 3.5))
    for name, part in frame.groupby("method"):
        agg = part.groupby("checked").found.agg(["mean", "std"])
        ax.errorbar(100 * agg.index, agg["mean"], yerr=agg["std"].fillna(0), marker="o", capsize=3, label=name)
    ax.set(xlabel="training data checked (%)", ylabel="flipped labels found", title="mislabel detection")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "mislabels.png", dpi=80)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="CI-sized run (fewer epochs, examples and seeds)")
    parser.add_argument("--out", type=Path, default=None, help="output directory (default: studies/results/turnover)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (small kernels: 1 is fastest)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = (
        {"epochs": 8, "loo": 6, "seeds": 1, "fractions": [0.05], "damping": 0.01}
        if args.quick
        else {"epochs": 30, "loo": 30, "seeds": 3, "fractions": [0.02, 0.05, 0.10], "damping": 0.01}
    )
    out = args.out or (Path(tempfile.mkdtemp(prefix="turnover_quick_")) if args.quick else RESULTS)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    train, val, test = split_digits()
    if args.quick:
        train = (train[0][:300], train[1][:300])
    print(f"digits: {len(train[0])} train / {len(val[0])} val / {len(test[0])} test; config {cfg}")
    loo = experiment_loo(train, test, cfg, out)
    experiment_self_influence(loo["model"], train, out)
    experiment_cleansing(train, val, test, cfg, out)
    experiment_mislabels(train, cfg, out)
    print(f"\nresults in {out}; total {time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
