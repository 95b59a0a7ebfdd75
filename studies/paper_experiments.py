"""The multi-stage influence paper's (Chen et al., 2020) experiments on scikit-learn digits.

Subcommands (each writes CSV + PNG under studies/results/digits/ and prints pandas tables):

- ``case2``       §4.1, Case 2 (embedding finetuned, α = 0.01): leave-out validation of 40 removals, scatter of
                  predicted vs actual change next to the identity-Hessian ablation (≈ 6 min).
- ``similarity``  §4.3: one pretrained model (Case 1, embedding fixed), finetuned on the *same* task (digits 0–3,
                  disjoint examples) vs a *different* task (4–9); histograms and mean |score| (≈ 3 min).
- ``size``        §4.4: Case 2, finetuning on n vs 3n examples; histograms and mean |score| (≈ 3 min).
- ``cleansing``   §4.2: remove the top 10% most harmful pretraining examples vs a random 10% vs nothing,
                  retrain, test accuracy/loss mean ± std over seeds (``--seeds``, default 5).
- ``mislabel``    self-influence vs training loss vs random for finding flipped labels (< 1 min).
- ``all``         all of the above in that order.

Run: ``python studies/paper_experiments.py all`` or e.g. ``python studies/paper_experiments.py similarity``.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import numpy as np
import pandas as pd
import torch

import influkit
from influkit.apps import plotting
from influkit.apps.cleansing import cleansing_table, mislabel_detection
from influkit.apps.datasets import load_digits_tensors
from influkit.apps.digits import DigitsSetup, accuracy, train_stages, validate_digits, write_validation

RESULTS = Path(__file__).parent / "results" / "digits"
DPI = 100
FMT = lambda v: f"{v:.4g}"


def _score_all(setup: DigitsSetup, split=None):
    """Train both stages on ``setup`` (or the given split) and score every pretraining example on the test set."""
    split = setup.split() if split is None else split
    pre, fin = train_stages(setup, split)
    res = influkit.score(pre, fin, torch.arange(len(pre)), split.test, shared="embedding", case=setup.case,
                         alpha=setup.alpha, solve=influkit.SolveConfig(solver="direct"))
    return split, pre, fin, res


def _test_loss(stage, test) -> float:
    """Summed test loss f(T), the quantity the scores differentiate (context for comparing score scales)."""
    with torch.no_grad():
        return float(stage.losses(stage.trained(), *test).sum())


def run_case2(out: Path, n_removals: int = 40) -> pd.DataFrame:
    """§4.1 Case 2: LOO validation vs the identity-Hessian ablation."""
    run = validate_digits(DigitsSetup(case=2), n_removals=n_removals, progress=False)
    write_validation(run, out, "case2")
    attrs = run.summary.attrs
    print(f"\n== Case 2 (α = {run.setup.alpha}) LOO validation, {len(run.pretrain)} pretraining digits, "
          f"{n_removals} removals ==")
    print(f"finetuned test accuracy {attrs['finetune_test_accuracy']:.3f}; timings "
          + ", ".join(f"{k} {v:.0f} s" for k, v in attrs["timings"].items()))
    print(run.summary.drop(columns="case").to_string(float_format=FMT))
    print(f"wrote {out}/case2_scatter.png, case2_gallery.png, case2_loo.csv, case2_summary.csv")
    return run.summary


def run_similarity(out: Path) -> pd.DataFrame:
    """§4.3: same pretrained model (Case 1), finetuned on the same task (0–3) vs a different task (4–9).

    Identical pretraining set: with overlapping classes ``two_task_split`` keeps the first half of its seeded
    permutation of the 0–3 examples for pretraining (the other half feeds finetune/test); with disjoint classes it
    keeps the same permutation (its first rng draw is the same) truncated to ``n_pretrain``. So giving the
    different-task setup ``n_pretrain = half`` yields exactly the same pretraining examples, in the same order,
    and ``train_stages`` (same seed) yields the same pretrained model. Both finetuning tasks use the same number
    of finetuning and test examples (the 0–3 pool left over is only 360 images). Asserted below.
    """
    _, y = load_digits_tensors()
    half = int(np.isin(y.numpy(), (0, 1, 2, 3)).sum()) // 2
    n_fin = n_test = half // 2
    common = {"case": 1, "n_pretrain": half, "n_finetune": n_fin, "n_test": n_test}
    setups = {
        "same task (0–3 → 0–3)": DigitsSetup(finetune_classes=(0, 1, 2, 3), **common),
        "different task (0–3 → 4–9)": DigitsSetup(finetune_classes=(4, 5, 6, 7, 8, 9), **common),
    }
    splits = {name: s.split() for name, s in setups.items()}
    a, b = splits.values()
    assert torch.equal(a.pretrain[0], b.pretrain[0]) and torch.equal(a.pretrain[1], b.pretrain[1])
    same = a
    overlap = (same.pretrain[0][:, None, :] == torch.cat([same.finetune[0], same.test[0]])[None]).all(-1).any()
    print(f"\n== §4.3 task similarity: {half} identical pretraining digits; finetune {n_fin}, test {n_test}; "
          f"pretrain/finetune images disjoint: {not bool(overlap)} ==")
    scores, rows, pre_weights = {}, [], []
    for name, setup in setups.items():
        split, pre, fin, res = _score_all(setup, splits[name])
        pre_weights.append(torch.cat([p.detach().flatten() for p in pre.model.parameters()]))
        v = res.values.double()
        scores[name] = v.numpy()
        rows.append({"finetune task": name, "n_pretrain": len(pre), "n_finetune": len(split.finetune[1]),
                     "n_test": len(split.test[1]), "test_accuracy": accuracy(fin, split.test),
                     "test_loss_sum": _test_loss(fin, split.test), "mean_abs_score": float(v.abs().mean()), "median_abs_score": float(v.abs().median()),
                     "std_score": float(v.std()), "max_abs_score": float(v.abs().max())})
    assert torch.allclose(pre_weights[0], pre_weights[1]), "pretrained models differ"
    table = pd.DataFrame(rows).set_index("finetune task")
    pd.DataFrame(scores).to_csv(out / "similarity_scores.csv", index=False)
    table.to_csv(out / "similarity_summary.csv")
    plotting.save(plotting.score_histograms(scores, title="§4.3 task similarity (Case 1): I(z, T) of every pretraining digit"),
                  out / "similarity_hist.png", dpi=DPI)
    print(table.to_string(float_format=FMT))
    print(f"wrote {out}/similarity_hist.png, similarity_summary.csv, similarity_scores.csv")
    return table


def run_size(out: Path, n: int = 200) -> pd.DataFrame:
    """§4.4: Case 2, finetuning on n vs 3n examples of 4–9 (same pretraining set, same test set, nested sets)."""
    # One split with 3n finetuning examples; the n-example run uses its first n (the same seeded permutation
    # that a split with n_finetune=n would take), so both share the pretraining set and the test set.
    big = DigitsSetup(case=2, n_finetune=3 * n, n_test=300)
    full = big.split()
    scores, rows = {}, []
    tests = []
    for n_fin in (n, 3 * n):
        setup = replace(big, n_finetune=n_fin, timings={})
        split = replace(full, finetune=(full.finetune[0][:n_fin], full.finetune[1][:n_fin]))
        split, pre, fin, res = _score_all(setup, split)
        tests.append(split.test[0])
        v = res.values.double()
        name = f"n_finetune = {n_fin}"
        scores[name] = v.numpy()
        rows.append({"finetuning set": name, "n_pretrain": len(pre), "n_test": len(split.test[1]),
                     "test_accuracy": accuracy(fin, split.test), "test_loss_sum": _test_loss(fin, split.test),
                     "mean_abs_score": float(v.abs().mean()),
                     "median_abs_score": float(v.abs().median()), "std_score": float(v.std()),
                     "max_abs_score": float(v.abs().max())})
    same_test = tests[0].shape == tests[1].shape and bool(torch.equal(tests[0], tests[1]))
    table = pd.DataFrame(rows).set_index("finetuning set")
    table["same_test_set"] = same_test
    pd.DataFrame(scores).to_csv(out / "size_scores.csv", index=False)
    table.to_csv(out / "size_summary.csv")
    plotting.save(plotting.score_histograms(scores, title=f"§4.4 finetuning-set size (Case 2): n = {n} vs 3n = {3 * n}"),
                  out / "size_hist.png", dpi=DPI)
    print("\n== §4.4 finetuning-set size (Case 2, α = 0.01) ==")
    print(table.to_string(float_format=FMT))
    print(f"wrote {out}/size_hist.png, size_summary.csv, size_scores.csv")
    return table


def run_cleansing(out: Path, seeds: int = 5) -> pd.DataFrame:
    """§4.2: remove the top 10% harmful vs random 10% vs nothing (Case 1), retrain, test accuracy and loss."""
    table = cleansing_table(DigitsSetup(case=1), fraction=0.1, seeds=seeds, progress=False)
    table.attrs["seeds"] = seeds
    table.to_csv(out / "cleansing.csv")
    print(f"\n== §4.2 data cleansing (Case 1, 10%, {seeds} seeds; mean ± std) ==")
    print(table.to_string(float_format=lambda v: f"{v:.4f}"))
    print(f"wrote {out}/cleansing.csv")
    return table


def run_mislabel(out: Path) -> pd.DataFrame:
    """Flipped-label detection: fraction of the flipped labels found after checking the top x%."""
    table, accs = mislabel_detection()
    table.to_csv(out / "mislabel.csv")
    pd.Series(accs, name="test_accuracy").to_csv(out / "mislabel_accuracy.csv")
    print("\n== mislabel detection (logistic regression, 1000 digits, 10% flipped): fraction of flipped found ==")
    print(table.to_string(float_format=lambda v: f"{v:.3f}"))
    print(pd.Series(accs, name="test accuracy").to_string(float_format=lambda v: f"{v:.4f}"))
    print(f"wrote {out}/mislabel.csv, mislabel_accuracy.csv")
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("experiment", choices=("case2", "similarity", "size", "cleansing", "mislabel", "all"))
    parser.add_argument("--removals", type=int, default=40, help="case2: leave-out retrainings")
    parser.add_argument("--seeds", type=int, default=5, help="cleansing: seeds")
    parser.add_argument("--n", type=int, default=200, help="size: the smaller finetuning set (the other is 3n)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)
    jobs = {
        "case2": lambda: run_case2(args.out, args.removals),
        "similarity": lambda: run_similarity(args.out),
        "size": lambda: run_size(args.out, args.n),
        "cleansing": lambda: run_cleansing(args.out, args.seeds),
        "mislabel": lambda: run_mislabel(args.out),
    }
    for name in jobs if args.experiment == "all" else [args.experiment]:
        start = time.perf_counter()
        jobs[name]()
        print(f"[{name} done in {time.perf_counter() - start:.0f} s]", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
