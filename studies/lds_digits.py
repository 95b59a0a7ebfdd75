"""Linear datamodeling score (LDS) of multi-stage influence on real digits, Case 1 and Case 2, against baselines.

The multi-stage digits setting, shrunk so that one re-training of both stages takes seconds on one core: a CNN
embedding (2 and 4 channels, 96 weights) with a head is pretrained on 200 scikit-learn digits 0–3, then a new head
is finetuned on 200 digits 4–9 (Case 1: embedding fixed; Case 2: embedding finetuned with α‖W − W̄‖², α = 0.01),
both to stationarity (float64 L-BFGS, then Newton, ‖∇‖ ≤ 1e-10). Every pretraining digit is scored against each of
100 test digits (``per_test=True``) by

- exact influence, ``SolveConfig(solver="direct")`` and ``"minres"`` (the same numbers by two solvers),
- the factored approximations ``"kfac"``, ``"ekfac"``, ``"arnoldi"`` (when this installation offers them),
- the identity-Hessian ablation ``"identity"`` (every stage's H := I),
- the gradient dot product (TracIn, one checkpoint): −∇_W ℓ_pre(z)ᵀ ∇_W f(t) over the shared embedding W, both at
  the trained weights (``influkit.apps.lds.gradient_dot``); in Case 2 it is the identity ablation ÷ 2α.

Then both stages are re-trained on M = 50 random halves of the pretraining set (α = 0.5, subsets seeded and
stored), and the LDS — per test digit the Spearman correlation over subsets between its actual test loss and the
sum of its scores over the subset, averaged over test digits — is reported for every method on the same subsets:

- **scratch** (the TRAK protocol): both stages re-initialized with the retraining seed (``reset_parameters`` under
  ``torch.manual_seed(seed)``: the seed picks the initial weights and hence, the model being non-convex, which
  optimum L-BFGS/Newton reaches; training itself is deterministic), seeds 0 and 1, outputs averaged over seeds;
- **warm**: both stages re-trained from the original optimum (one deterministic run per subset): the optimum of
  the subset objective nearest the original one, the one the influence function linearizes towards.

Run ``nice -n 10 python studies/lds_digits.py`` (≈ 1 h on one core; resumable: re-run to continue) or
``--quick`` (M = 6, one seed; a smoke test). Results: ``studies/results/lds/``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import pandas as pd
import torch

from influkit.apps.digits import digits_lds

RESULTS = Path(__file__).parent / "results" / "lds"
METHODS = ("direct", "minres", "kfac", "ekfac", "arnoldi", "identity", "gradient dot")


def markdown(frame: pd.DataFrame) -> str:
    """A GitHub markdown table of ``frame`` (index included), numbers to 3 decimals."""
    cols = [frame.index.name or ""] + [str(c) for c in frame.columns]
    fmt = lambda v: f"{v:.3f}" if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for key, row in frame.iterrows():
        lines.append("| " + " | ".join([str(key)] + [fmt(v) for v in row.tolist()]) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--subsets", type=int, default=50)
    parser.add_argument("--seeds", type=int, default=2, help="re-training seeds of the scratch protocol")
    parser.add_argument("--cases", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--no-warm", action="store_true", help="skip the warm-start re-trainings")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "influkit-lds-digits",
                        help="where the resumable re-training outputs are kept")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.quick:
        args.subsets, args.seeds = 6, 1
        args.out, args.work = args.out / "quick", args.work / "quick"
    start = time.perf_counter()
    rows, info = [], {}
    for case in args.cases:
        protocols = [("scratch", tuple(range(args.seeds)))] + ([] if args.no_warm else [("warm", (0,))])
        result = None
        for init, seeds in protocols:
            name = f"case{case}_{init}"
            t0 = time.perf_counter()
            result = digits_lds(case, directory=args.work / name, n_subsets=args.subsets, seeds=seeds, init=init,
                                methods=METHODS, reuse=result, progress=not args.quiet)
            result.write(args.out, name, plot_method="direct")
            table, attrs = result.table, result.table.attrs
            print(f"\n== Case {case}, {init} re-training: M = {attrs['M']} subsets of {attrs['n']} pretraining digits, "
                  f"seeds {attrs['seeds']}, {len(result.x_test[1])} test digits ==")
            print(table.to_string(float_format=lambda v: f"{v:.3f}"))
            for method, why in attrs["missing"].items():
                print(f"{method}: {why}")
            print(f"re-training {attrs['retrain_seconds']:.0f} s in total "
                  f"({attrs['retrain_seconds'] / table.attrs['M'] / len(seeds):.1f} s each), largest final ‖∇F‖ "
                  f"{attrs['max_retrain_grad_norm']:.1e}; seed agreement {attrs.get('seed_agreement', float('nan')):.3f}; "
                  f"this block {time.perf_counter() - t0:.0f} s")
            for method in table.index:
                row = {"case": case, "retraining": init, "method": method, **table.loc[method].to_dict()}
                rows.append(row)
            info[name] = {k: v for k, v in attrs.items() if k != "missing"} | {
                "missing": {k: str(v) for k, v in attrs["missing"].items()}, "chain": result.info}
    summary = pd.DataFrame(rows)
    summary.to_csv(args.out / "summary.csv", index=False)
    wide = summary.pivot_table(index=["case", "method"], columns="retraining", values="LDS", sort=False)
    sem = summary.pivot_table(index=["case", "method"], columns="retraining", values="sem", sort=False)
    for col in list(wide.columns):
        wide[f"{col} sem"] = sem[col]
    wide = wide.reset_index().set_index("method")
    wide["case"] = wide["case"].astype(int)
    (args.out / "summary.md").write_text(markdown(wide) + "\n")
    (args.out / "info.json").write_text(json.dumps(info, indent=1, default=str))
    print("\n" + markdown(wide))
    print(f"\ndone in {time.perf_counter() - start:.0f} s; wrote {args.out}")


if __name__ == "__main__":
    main()
