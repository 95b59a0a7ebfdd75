"""The trajectory index on a two-stage digits run: build cost, bytes per example, query cost against the exact
two-stage metagradient and first order from scratch, and the replay LDS of each on the same drop sets.

Pretraining: the MLP 64 → 32 (tanh) → 10 of ``studies.first_order_lds`` on its 1,500 standardized scikit-learn
digits, 1,000 AdamW steps of 32 (warmup then linear decay), float64. Two finetunes of that one recorded run, on 200
other digits (ids 1,550 … 1,749) with a new two-class head:

- ``head``: parity (y mod 2), the hidden layer fixed (Case 1), 200 AdamW steps of 16;
- ``full``: y ≥ 5, every weight finetuned from the pretrained ones (plain finetuning), 200 AdamW steps of 16.

The test set is the 50 held-out digits (ids 1,500 … 1,549) with each finetune's labels; the measure is each test
point's loss. Methods, each scoring the 1,500 pretraining examples: the exact two-stage metagradient
(``metagradients``), first order from scratch over both stages (``first_order``), and the trajectory index — exact
(D = 2,410, every parameter) and compressed (at most ``DIMS`` numbers per example) — queried with the finetune's
exact replay.
The index is built once (its seconds in ``build.csv``) and serves both finetunes.

Replay LDS: for f ∈ {1 %, 5 %, 10 %}, M = 30 seeded drop sets of ⌊f · 1,500⌋ pretraining examples, the whole
two-stage run replayed with w_z = 0 on each (``ik.unrolled.outputs``); LDS(t) = Spearman_j(Σ_{z kept} s_z(t),
loss_t(replay)), mean ± sem over the test points. Resumable: scores, indexes and replays under ``cache/``
(git-ignored), each skipped when present.

    python -m studies.trajectory_index_digits run       # everything, then the tables
    python -m studies.trajectory_index_digits table     # build.csv, queries.csv, lds.csv, results.md, manifest
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

import influkit as ik
from benchmarks.manifest import record as manifest
from influkit.unrolled import AdamW, Record, TrajectoryIndex
from influkit.validation.lds import lds_per_query
from studies.first_order_lds import drop_sets, schedule

HERE = Path(__file__).resolve().parent
OUT = HERE / "results" / "trajectory_index_digits"
FRACTIONS = (0.01, 0.05, 0.1)
SUBSETS = 30
DIMS = (256, 1024)
FINETUNES = ("head", "full")
INDEXES = {"exact": None} | {f"compressed, D ≤ {dim}": dim for dim in DIMS}
METHODS = ("exact", "first-order from scratch", *(f"index ({name})" for name in INDEXES))


def cache() -> Path:
    path = OUT / "cache"
    path.mkdir(parents=True, exist_ok=True)
    return path


def digits():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = torch.tensor(x, dtype=torch.float64)[perm], torch.tensor(y)[perm]
    mean, std = x[:1500].mean(0), x[:1500].std(0) + 1e-3
    return (x - mean) / std, y


def loss(out, target):
    return torch.nn.functional.cross_entropy(out, target, reduction="none")


def pretrained() -> tuple[Record, float]:
    """The recorded pretraining (deterministic: the same in every process) and its seconds."""
    torch.set_num_threads(1)
    x, y = digits()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, 10)).double().eval()
    record = Record()
    began = time.perf_counter()
    record.train(ik.Stage(model, loss, (x[:1500], y[:1500])), AdamW(lr=2e-3, weight_decay=0.01), steps=1000,
                 batch_size=32, schedule=schedule(1000, 2e-3, 50), checkpoint_every=32)
    return record, time.perf_counter() - began


def labels(kind: str, y: torch.Tensor) -> torch.Tensor:
    return y % 2 if kind == "head" else (y >= 5).long()


def finetuned(pre: Record, kind: str) -> tuple[Record, tuple]:
    """``pre`` continued by the finetune ``kind``, and its test set."""
    x, y = digits()
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2)).double().eval()
    stage = ik.Stage(model, loss, (x[1550:1750], labels(kind, y[1550:1750])), params="2" if kind == "head" else None)
    link = ik.Link("0", case=1) if kind == "head" else ik.Link.finetune("0")
    record = pre.branch()
    record.train(stage, AdamW(lr=5e-3, weight_decay=0.01), steps=200, batch_size=16, link=link,
                 schedule=schedule(200, 5e-3, 20), checkpoint_every=16)
    return record, (x[1500:1550], labels(kind, y[1500:1550]))


def index_dir(name: str) -> Path:
    return cache() / f"index_{slug(name)}"


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name).strip("_")


def step_build() -> None:
    out = cache() / "build.csv"
    rows = pd.read_csv(out).to_dict("records") if out.exists() else []
    pre, recorded = pretrained()
    for name, dim in INDEXES.items():
        if any(r["index"] == name for r in rows):
            continue
        began = time.perf_counter()
        index = TrajectoryIndex.build(pre, index_dir(name), dim=dim, block=128 if dim is None else 64)
        seconds = time.perf_counter() - began
        rows.append({"index": name, "build_seconds": seconds, "width": index.width,
                     "bytes_per_example": index.bytes_per_example, "examples": 1500,
                     "pretraining_recorded_seconds": recorded, "blocks_computed": index.blocks["computed"],
                     "blocks_reused": index.blocks["reused"]})
        pd.DataFrame(rows).to_csv(out, index=False)
        print(f"index {name}: {seconds:.1f} s, {index.width} numbers per example", flush=True)


def step_scores(kind: str) -> None:
    pre = record = test = None
    for method in METHODS:
        out = cache() / f"scores_{kind}_{slug(method)}.npz"
        if out.exists():
            continue
        if record is None:
            pre, _ = pretrained()
            record, test = finetuned(pre, kind)
        began = time.perf_counter()
        if method == "exact":
            result = ik.unrolled.metagradients(record, test, per_test=True)[0]
        elif method == "first-order from scratch":
            result = ik.unrolled.first_order(record, test, per_test=True, progress=False)[0]
        else:
            index = TrajectoryIndex(index_dir(method.removeprefix("index (").removesuffix(")")))
            result = index.scores(record, test, per_test=True, progress=False)[0]
        seconds = time.perf_counter() - began
        parts = result.diagnostics["seconds"] if method.startswith("index") else {}
        np.savez(out, scores=(-result.removal).double().numpy(), seconds=seconds,
                 finetune_recorded_seconds=record.runs[1].seconds,
                 finetune_replay_seconds=parts.get("exact pass (later stages)", np.nan),
                 index_pass_seconds=parts.get("index pass", np.nan))
        print(f"{kind} {method}: {seconds:.1f} s", flush=True)


def step_replays(kind: str, m: int) -> None:
    pre = record = test = None
    for fraction in FRACTIONS:
        out = cache() / f"replays_{kind}_{fraction}.npz"
        done = dict(np.load(out)) if out.exists() else {}
        if len(done.get("outputs", ())) >= m:
            continue
        if record is None:
            pre, _ = pretrained()
            record, test = finetuned(pre, kind)
        masks = drop_sets(1500, fraction, m)
        outputs = list(done.get("outputs", []))
        for j in range(len(outputs), m):
            weights = torch.tensor(masks[j], dtype=torch.float64)
            outputs.append(ik.unrolled.outputs(record, test, [weights, None]).double().numpy())
            if (j + 1) % 5 == 0 or j + 1 == m:
                np.savez(out, masks=masks[:j + 1], outputs=np.stack(outputs))
        print(f"{kind}: replays at {fraction:.0%} done", flush=True)


def pearson(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.corrcoef(a.reshape(-1), b.reshape(-1))[0, 1])


def step_table() -> None:
    build = pd.read_csv(cache() / "build.csv")
    queries, lds_rows = [], []
    for kind in FINETUNES:
        saved = {m: np.load(path) for m in METHODS if (path := cache() / f"scores_{kind}_{slug(m)}.npz").exists()}
        if "exact" not in saved:
            continue
        reference = {m: saved[m]["scores"] for m in ("exact", "first-order from scratch", "index (exact)")
                     if m in saved}
        for method, values in saved.items():
            s = values["scores"]
            queries.append({"finetune": kind, "method": method, "seconds": float(values["seconds"]),
                            "speedup_vs_exact": float(saved["exact"]["seconds"]) / float(values["seconds"]),
                            "finetune_recorded_seconds": float(values["finetune_recorded_seconds"]),
                            "of_which_finetune_replay": float(values["finetune_replay_seconds"]),
                            "of_which_index_pass": float(values["index_pass_seconds"])}
                           | {f"pearson_vs_{slug(m)}": pearson(s, r) for m, r in reference.items()})
            row = {"finetune": kind, "method": method}
            for fraction in FRACTIONS:
                replays = cache() / f"replays_{kind}_{fraction}.npz"
                if not replays.exists():
                    continue
                done = np.load(replays)
                per_query = lds_per_query(s, done["masks"], done["outputs"])
                valid = per_query[np.isfinite(per_query)]
                row |= {f"lds_{fraction:g}": float(valid.mean()),
                        f"sem_{fraction:g}": float(valid.std(ddof=1) / np.sqrt(len(valid))),
                        f"subsets_{fraction:g}": int(done["masks"].shape[0])}
            lds_rows.append(row)
    build.to_csv(OUT / "build.csv", index=False)
    queries, lds = pd.DataFrame(queries), pd.DataFrame(lds_rows)
    queries.to_csv(OUT / "queries.csv", index=False)
    lds.to_csv(OUT / "lds.csv", index=False)
    lines = ["# The trajectory index on a two-stage digits run", "",
             "Pretraining: 1,000 AdamW steps on 1,500 digits; two finetunes of that one record (a new head with the "
             "hidden layer fixed; the whole model). Seconds on a shared 2-core CPU (load in the manifest).", "",
             "## Build (once, for every finetune)", "", markdown(build), "",
             "## Scoring the 1,500 pretraining examples for 50 test points, per finetune", "", markdown(queries), ""]
    if not lds.empty:
        lines += ["## Replay LDS (drops of pretraining examples, the two-stage run replayed)", "", markdown(lds), ""]
    (OUT / "results.md").write_text("\n".join(lines))
    manifest(OUT, ["build.csv", "queries.csv", "lds.csv", "results.md"],
             command="python -m studies.trajectory_index_digits run",
             note="build, scores and replays run as resumable steps on a 2-core machine shared with other jobs; each "
                  "query method timed in one process, one after the other; the load is the table step's")
    print("\n".join(lines))


def markdown(frame: pd.DataFrame) -> str:
    head = "| " + " | ".join(map(str, frame.columns)) + " |\n" + "|---" * len(frame.columns) + "|"
    body = ["| " + " | ".join(f"{v:.4g}" if isinstance(v, float) and not math.isnan(v) else str(v) for v in row)
            + " |" for row in frame.itertuples(index=False)]
    return "\n".join([head, *body])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=("run", "build", "scores", "replays", "table"))
    parser.add_argument("--finetune", choices=FINETUNES)
    parser.add_argument("--subsets", type=int, default=SUBSETS)
    args = parser.parse_args(argv)
    kinds = (args.finetune,) if args.finetune else FINETUNES
    if args.step in ("build", "run"):
        step_build()
    if args.step in ("scores", "run"):
        for kind in kinds:
            step_scores(kind)
    if args.step in ("replays", "run"):
        for kind in kinds:
            step_replays(kind, args.subsets)
    if args.step in ("table", "run"):
        step_table()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
