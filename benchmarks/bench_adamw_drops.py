"""AdamW runs and single-example drops: why the exact metagradient predicts them badly, and what fixes it.

A tanh MLP (64 → WIDTH → classes) is pretrained on scikit-learn's digits 0–4 (all 901 examples) and finetuned on
200 examples of digits 5–9 (the measure: the summed loss of 100 more), pretraining 200 steps then finetuning 100
steps, batches of 32, both stages with the same optimizer, recorded by ``ik.unrolled.Record``; Case 1 (the
pretrained embedding fixed, a new head trained) and Case 2 (everything finetuned, proximal α = 0.01).
For ``--singles`` seeded pretraining examples z the record is replayed with w_z = 0 (``ik.unrolled.outputs``) and the
replayed change of the measure is compared with the prediction −score_z (``ik.unrolled.metagradients``): Pearson r
and Spearman ρ over the drops. One factor at a time is changed from the AdamW baseline (lr 1e-2, β = (0.9, 0.999),
ε = 1e-8, weight decay 1e-2, no warmup): ε, β₂, a linear warmup of the learning rate over the first W steps of each
stage, the learning rate, the batch size (same number of steps), and Adam without bias correction; SGD + momentum
is the reference. Beside each: the test loss of the recorded run, and the preconditioned sharpness against Adam's
edge of stability (``ik.unrolled.sharpness``: η·λ_max / edge at the first checkpoint and the largest later one).

Linearity (baseline and remedy): for the same single drops, the replayed change at w_z = 1 − t divided by t for t
in (1e-5, 0.25, 0.5, 1), against −score_z: the derivative is right when t = 1e-5 agrees; the t where the agreement
leaves says how far the run answers linearly.

    python -m benchmarks.bench_adamw_drops            # every factor, both cases (about 10 minutes on an idle core)
    python -m benchmarks.bench_adamw_drops --quick    # baseline, SGD and the remedy only

Writes benchmarks/results/bench_adamw_drops/{factors.md, factors.csv, linearity.md, diagnosis.md,
single_drops.png} and MANIFEST.json.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch
from torch import nn

import influkit as ik
from influkit.apps.datasets import load_digits_tensors
from influkit.apps.objectives import cross_entropy
from influkit.unrolled import SGD, AdamW

from .common import machine_info, setup
from .manifest import record as manifest

RESULTS = Path(__file__).resolve().parent / "results" / "bench_adamw_drops"
WIDTH = 256
LINEARITY_STEPS = (1e-5, 0.25, 0.5, 1.0)


class MLP(nn.Module):
    """``head(embedding(x))``, the embedding one tanh layer (the shared block)."""

    def __init__(self, classes: int, width: int = WIDTH):
        super().__init__()
        self.embedding = nn.Sequential(nn.Linear(64, width), nn.Tanh())
        self.head = nn.Linear(width, classes)

    def forward(self, x):
        return self.head(self.embedding(x))


class AdamWUncorrected(AdamW):
    """AdamW without bias correction (m and v used as they are): a factor of the benchmark, not a remedy."""

    def update(self, params, state, grads, lr, step):
        beta1, beta2 = self.betas
        new_params, m_new, v_new = {}, {}, {}
        for n, p in params.items():
            p = p * (1 - lr * self.weight_decay)
            m_new[n] = state["m"][n] + (1 - beta1) * (grads[n] - state["m"][n])
            v_new[n] = beta2 * state["v"][n] + (1 - beta2) * grads[n] ** 2
            new_params[n] = p - lr * m_new[n] / (torch.sqrt(v_new[n] + 1e-300) + self.eps)
        return new_params, {"m": m_new, "v": v_new}


@dataclass(frozen=True)
class Setting:
    """One training configuration of both stages."""

    name: str
    optimizer: object = field(default_factory=lambda: AdamW(lr=1e-2, weight_decay=1e-2))
    warmup: tuple[int, int] = (0, 0)  # linear warmup steps of (pretraining, finetuning); 0: none
    batch_size: int = 32
    lr_divisor: tuple[float, float] = (1.0, 1.0)  # each stage's learning rate divided by


def settings(quick: bool) -> list[Setting]:
    base = Setting("AdamW baseline (lr 1e-2, ε 1e-8, β₂ 0.999, batch 32)")
    adamw = lambda **kw: AdamW(**({"lr": 1e-2, "weight_decay": 1e-2} | kw))  # noqa: E731
    remedy = Setting("AdamW + linear warmup over 100 steps", warmup=(100, 100))
    sgd = Setting("SGD + momentum 0.9 (lr 0.05)", SGD(lr=0.05, momentum=0.9))
    if quick:
        return [base, sgd, remedy]
    return [base, sgd,
            Setting("ε = 1e-4", adamw(eps=1e-4)), Setting("ε = 1e-3", adamw(eps=1e-3)),
            Setting("β₂ = 0.99", adamw(betas=(0.9, 0.99))),
            Setting("no bias correction", AdamWUncorrected(lr=1e-2, weight_decay=1e-2)),
            Setting("warmup 10 steps", warmup=(10, 10)), Setting("warmup 30 steps", warmup=(30, 30)),
            remedy,
            Setting("lr 1e-3", adamw(lr=1e-3)), Setting("batch 128", batch_size=128)]


def data():
    """(pretraining, finetuning, test) sets of digits."""
    x, y = load_digits_tensors()
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    first = y < 5
    xf, yf = x[~first], y[~first] - 5
    return (x[first], y[first]), (xf[:200], yf[:200]), (xf[200:300], yf[200:300])


def train(setting: Setting, case: int, sets) -> ik.unrolled.Record:
    """Record pretraining (200 steps) and Case ``case`` finetuning (100 steps) under ``setting``."""
    pre_data, fin_data, _ = sets
    torch.manual_seed(0)
    pre = ik.Stage(MLP(5).double(), cross_entropy, pre_data)
    fin = ik.Stage(MLP(5).double(), cross_entropy, fin_data, params="head" if case == 1 else None)
    def schedule(k):
        lr, warmup = setting.optimizer.lr / setting.lr_divisor[k], setting.warmup[k]
        if not warmup and lr == setting.optimizer.lr:
            return None
        return lambda t: lr * min(1.0, (t + 1) / warmup) if warmup else lr

    record = ik.unrolled.Record()
    record.train(pre, setting.optimizer, steps=200, batch_size=setting.batch_size, seed=0, schedule=schedule(0))
    record.train(fin, setting.optimizer, steps=100, batch_size=setting.batch_size, seed=1, schedule=schedule(1),
                 link=ik.Link("embedding", case=case, alpha=0.01 if case == 2 else 0.0))
    return record


def single_drops(record, test, drops: torch.Tensor, ts=(1.0,)) -> tuple[np.ndarray, np.ndarray]:
    """(−score_z, replayed (m(w_z = 1 − t) − m(1)) / t for each t) over the dropped pretraining examples."""
    scores = ik.unrolled.metagradients(record, test)[0]
    predicted = -scores.values.double()[torch.argsort(scores.index)][drops]
    base = ik.unrolled.outputs(record, test).sum()
    n = len(record.runs[0].stage)
    replayed = np.zeros((len(drops), len(ts)))
    for i, z in enumerate(drops):
        for j, t in enumerate(ts):
            w = torch.ones(n, dtype=torch.float64)
            w[z] = 1 - t
            replayed[i, j] = float(ik.unrolled.outputs(record, test, [w, None]).sum() - base) / t
    return predicted.numpy(), replayed


def markdown(frame: pd.DataFrame, floatfmt: str) -> str:
    """A GitHub table of ``frame`` (floats formatted with ``floatfmt``)."""
    cell = lambda v: format(v, floatfmt) if isinstance(v, float) else str(v)  # noqa: E731
    lines = ["| " + " | ".join(map(str, frame.columns)) + " |", "|---" * len(frame.columns) + "|"]
    return "\n".join(lines + ["| " + " | ".join(cell(v) for v in row) + " |" for row in frame.itertuples(index=False)])


def pearson(a, b) -> float:
    return float(np.corrcoef(a, b)[0, 1])


def spearman(a, b) -> float:
    rank = lambda v: np.argsort(np.argsort(v))  # noqa: E731
    return pearson(rank(a), rank(b))


def measure(setting: Setting, case: int, sets, drops) -> tuple[dict, tuple]:
    record = train(setting, case, sets)
    test = sets[2]
    loss = float(ik.unrolled.outputs(record, test).sum())
    predicted, replayed = single_drops(record, test, drops)
    table = ik.unrolled.sharpness(record, steps=10)
    ratio = table["lr_times_eigenvalue"] / table["edge"]
    if isinstance(setting.optimizer, AdamWUncorrected):  # sharpness assumes the bias-corrected preconditioner
        ratio = ratio * np.nan
    first, later = ratio[table["step"] == 0], ratio[table["step"] > 0]
    row = {"setting": setting.name, "case": case, "pearson": pearson(predicted, replayed[:, 0]),
           "spearman": spearman(predicted, replayed[:, 0]), "test loss (sum)": loss,
           "sharpness/edge at step 0 (max over stages)": float(first.max()),
           "sharpness/edge later (max)": float(later.max())}
    return row, (predicted, replayed[:, 0])


def diagnosis(setting: Setting, case: int, sets, lines: list[str], margin: float = ik.unrolled.stability.MARGIN) -> pd.DataFrame:
    """ik.unrolled.diagnose of one run (its sharpness with every step < 12, and 1 % drop sets' linearity), appended
    to ``lines`` as Markdown."""
    record = train(setting, case, sets)
    scores = ik.unrolled.metagradients(record, sets[2])[0]
    table = ik.unrolled.sharpness(record, steps=10, first=12)
    early = table[table["step"] < 12]
    lines += [f"## {setting.name}, Case {case}", "",
              "η·λ_max(P⁻¹H) / edge at steps 0..11, per stage: " + "; ".join(
                  f"stage {k}: " + ", ".join(f"{v:.2f}" for v in (g["lr_times_eigenvalue"] / g["edge"]))
                  for k, g in early.groupby("stage")), ""]
    found = ik.unrolled.diagnose(table, ik.unrolled.linearity(record, sets[2], scores, fraction=0.01, sets=4,
                                                                steps=(1.0, 1e-4)), margin=margin)
    lines += [markdown(found, ".3g") if len(found) else "no finding", ""]
    return found


def remedies(args) -> int:
    """--remedies: each case's baseline diagnosed at each margin (diagnose's ``margin``: every step kept below that
    share of the edge), then single drops under the remedies each names (remedies.md, .csv)."""
    setup(1)
    sets = data()
    drops = torch.randperm(len(sets[0][0]), generator=torch.Generator().manual_seed(1))[:args.singles]
    start, rows, lines = time.perf_counter(), [], []
    baseline = settings(True)[0]
    for case in (1, 2):
        candidates = [baseline]
        for margin in args.margins:
            warmup, divisor = [0, 0], [1.0, 1.0]
            lines += [f"# margin {margin:g}", ""]
            for row in diagnosis(baseline, case, sets, lines, margin).itertuples():
                if row.finding == "past the edge of stability":
                    warmup[row.stage] = 0 if pd.isna(row.warmup) else int(row.warmup)
                    divisor[row.stage] = 1.0 if pd.isna(row.lr_divisor) else round(float(row.lr_divisor), 1)
            named = f"AdamW + the warmup diagnosed at margin {margin:g} {tuple(warmup)}"
            candidates.append(Setting(named, warmup=tuple(warmup)))
            if divisor != [1.0, 1.0]:
                candidates.append(Setting(f"{named}, lr / {tuple(divisor)}", warmup=tuple(warmup),
                                          lr_divisor=tuple(divisor)))
        for setting in candidates:
            row, _ = measure(setting, case, sets, drops)
            rows.append(row)
            print(f"{setting.name:70s} case {case}: r {row['pearson']:+.3f} loss {row['test loss (sum)']:.2f}",
                  flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    table = pd.DataFrame(rows)
    table.to_csv(args.out / "remedies.csv", index=False)
    (args.out / "remedies.md").write_text(
        f"# The diagnosed remedies, applied\n\n{machine_info()} (shared machine)\n\nEach case's baseline diagnosed "
        f"(ik.unrolled.diagnose of sharpness(first=12) and linearity) at margins {args.margins} (every step kept "
        "below that share of the edge; the library's default is ik.unrolled.stability.MARGIN), then its remedies "
        "recorded and "
        f"{args.singles} single pretraining drops replayed (columns as in factors.md).\n\n"
        + markdown(table, ".3f") + "\n\n" + "\n".join(lines) + "\n")
    seconds = time.perf_counter() - start
    manifest(args.out, ["remedies.md", "remedies.csv"], note=f"{seconds:.0f} s; shared 2-core machine")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="baseline, SGD and the remedy only")
    parser.add_argument("--singles", type=int, default=30, help="single pretraining drops replayed per run")
    parser.add_argument("--remedies", action="store_true",
                        help="only diagnose the baseline and measure its remedies: the named warmups, and the warmups "
                             "with the learning rates divided as the diagnosis names where a warmup alone is capped")
    parser.add_argument("--margins", type=float, nargs="+", default=[1.0, ik.unrolled.stability.MARGIN],
                        help="with --remedies: the diagnoses' margins (every step kept below margin × the edge)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.remedies:
        return remedies(args)
    setup(1)
    print(machine_info(), flush=True)
    sets = data()
    drops = torch.randperm(len(sets[0][0]), generator=torch.Generator().manual_seed(1))[:args.singles]
    args.out.mkdir(parents=True, exist_ok=True)
    suffix = "_quick" if args.quick else ""
    start = time.perf_counter()

    # what ik.unrolled.diagnose says about the baseline (every one of the first 12 steps measured), and its remedy
    lines = ["# ik.unrolled.diagnose on the baseline and on the remedy it names", "",
             "sharpness(record, steps=10, first=12) (every step < 12 and every checkpoint) and linearity(record, "
             "test, scores, fraction=0.01, sets=4, steps=(1.0, 1e-4)) of each run.", ""]
    baseline = settings(args.quick)[0]
    diagnosed = {}
    for case in (1, 2):
        warmup = [0, 0]
        for row in diagnosis(baseline, case, sets, lines).itertuples():
            if row.finding == "past the edge of stability" and not pd.isna(row.warmup):
                warmup[row.stage] = int(row.warmup)
        diagnosed[case] = Setting(f"AdamW + the diagnosed warmup {tuple(warmup)}", warmup=tuple(warmup))
        diagnosis(diagnosed[case], case, sets, lines)
    (args.out / f"diagnosis{suffix}.md").write_text("\n".join(lines) + "\n")

    rows, scatter = [], {}
    for case in (1, 2):
        for setting in settings(args.quick) + [diagnosed[case]]:
            row, points = measure(setting, case, sets, drops)
            rows.append(row)
            scatter[setting.name, case] = points
            print(f"{setting.name:55s} case {case}: r {row['pearson']:+.3f} ρ {row['spearman']:+.3f} "
                  f"loss {row['test loss (sum)']:.2f} "
                  f"sharpness/edge {row['sharpness/edge at step 0 (max over stages)']:.2f}"
                  f" / {row['sharpness/edge later (max)']:.2f}", flush=True)
    factors = pd.DataFrame(rows)
    factors.to_csv(args.out / f"factors{suffix}.csv", index=False)
    header = (f"# AdamW single-drop predictions: one factor at a time\n\n{machine_info()} (shared machine)\n\n"
              f"{args.singles} single pretraining drops replayed per run; Pearson r / Spearman ρ of −score and the "
              f"replayed change of the summed test loss; sharpness/edge = η·λ_max(P⁻¹H)/(2(1+β₁)/(1−β₁)) for Adam, "
              f"η·λ_max(H)/(2(1+μ)) for SGD, at the checkpoints (every ⌈√T⌉ steps; diagnosis.md has every early "
              f"step). {__doc__.split(chr(10) + chr(10))[1]}\n\n")
    (args.out / f"factors{suffix}.md").write_text(header + markdown(factors, ".3f") + "\n")

    # linearity of the baseline and the diagnosed remedy in the dropped weight, single drops
    lines = ["# Linearity of single drops: replayed (m(w_z = 1 − t) − m(1))/t against −score_z", "",
             "Pearson r and median |replayed / predicted| over the single drops, per t (t = 1e-5: the derivative).",
             ""]
    lin_rows = []
    for case in (1, 2):
        for setting in (baseline, diagnosed[case]):
            record = train(setting, case, sets)
            predicted, replayed = single_drops(record, sets[2], drops[:args.singles // 2], LINEARITY_STEPS)
            for j, t in enumerate(LINEARITY_STEPS):
                ratio = np.median(np.abs(replayed[:, j] / np.where(predicted == 0, np.nan, predicted)))
                lin_rows.append({"setting": setting.name, "case": case, "t": t,
                                 "pearson": pearson(predicted, replayed[:, j]), "median |ratio|": float(ratio)})
    lines.append(markdown(pd.DataFrame(lin_rows), ".4g"))
    (args.out / f"linearity{suffix}.md").write_text("\n".join(lines) + "\n")

    fig, axes = plt.subplots(2, 2, figsize=(9, 8))
    for i in range(2):
        for j, case in enumerate((1, 2)):
            name = diagnosed[case].name if i else baseline.name
            p, a = scatter[name, case]
            ax = axes[j, i]
            ax.scatter(p, a, s=12, alpha=0.8)
            lo, hi = min(p.min(), a.min()), max(p.max(), a.max())
            ax.plot([lo, hi], [lo, hi], color="grey", lw=0.8, ls="--")
            ax.set_title(f"{'before' if i == 0 else 'after'}: {name}\nCase {case}: Pearson r {pearson(p, a):.3f}",
                         fontsize=8)
            ax.set_xlabel("predicted change (−metagradient)", fontsize=8)
            ax.set_ylabel("replayed change (w_z = 0)", fontsize=8)
    fig.tight_layout()
    fig.savefig(args.out / f"single_drops{suffix}.png", dpi=100)
    seconds = time.perf_counter() - start
    files = [f"factors{suffix}.md", f"factors{suffix}.csv", f"linearity{suffix}.md", f"single_drops{suffix}.png",
             f"diagnosis{suffix}.md"]
    manifest(args.out, files, note=f"{seconds:.0f} s; shared 2-core machine, other helpers running")
    print(f"wrote {args.out} in {seconds:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
