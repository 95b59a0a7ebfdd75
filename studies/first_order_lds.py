"""Replay LDS of first-order trajectory attribution against exact replay and the cheaper methods, with cost.

Two recorded runs, trained the way users train (AdamW, warmup then linear decay, mini-batches):

- ``digits``: an MLP 64 → 32 (tanh) → 10 on 1,500 scikit-learn digits (standardized), 1,000 AdamW steps of 32,
  float64; 50 held-out digits are the test points.
- ``gpt2``: a tiny GPT-2 (2 layers, width 32, a BPE vocabulary of 400 trained here) on 400 vaderSentiment sentences,
  300 AdamW steps of 16, float32; 12 held-out sentences are the test documents (their mean next-token NLL).

For each drop fraction f ∈ {1 %, 5 %, 10 %}, M = 30 seeded random drop sets D_j of ⌊f·n⌋ training examples are
dropped by replaying the record with w_z = 0 on D_j (``ik.unrolled.outputs``: same start, batches, learning rates;
deterministic, noise ceiling 1). Each method's per-test scores rank the replayed test losses:
LDS(t) = Spearman_j(Σ_{z kept} s_z(t), loss_t(replay without D_j)), mean ± sem over test points, s = −removal.

Methods: the exact metagradient (``metagradients``), first order (``first_order``), first order with the
correction (``CORRECTION``: 20 Hessian eigenpairs at the start of each of 10 segments on digits, 10 and 5
on the transformer; the same segments with EK-FAC's whole-spectrum curvature instead), the approximate
unrolling (``approximate``, EK-FAC, 10 segments), EK-FAC influence functions (``ik.influence``), and the field's
cheap trajectory methods as peers (``PEERS``, run in the bench venv: ``PYTHONPATH=$PWD .bench-venv/bin/python -m
studies.first_order_lds method --method ...``): dattri's DVEmb (``benchmarks/dvemb_peer.py``) on the record's own
batches, learning rates and replayed θ_t — its SGD-form approximation of the AdamW run; Bergson's TrackStar
(``benchmarks/trackstar_peer.py``) summed over the gpt2 record's checkpoints ``TRACKSTAR_STEPS``, and its SOURCE
(``benchmarks/source_peer.py``: approximate unrolling over ``SOURCE_SEGMENTS`` segments of ``SOURCE_STEPS``); Bergson's
pipelines take only causal LMs and text, so on digits those rows keep the reason (``CANNOT_RUN``) and no numbers.
Each method runs in its own process, which
first times one plain ``torch.optim.AdamW`` training run of the same model on the same batches (the ratio's
denominator), then records the run and computes the method: its seconds and the process's peak resident memory
(``ru_maxrss``) and the resident memory before it. ``first_order_check`` reads the record first
(``diagnostic.csv``): whether first order is enough on that run.

Resumable: each method's scores and each fraction's replays are kept under ``cache/`` (git-ignored) and skipped
when present.

    python -m studies.first_order_lds run --task digits      # every step, each method in its own process
    python -m studies.first_order_lds table --task digits    # lds.csv, results.md and the manifest
"""

from __future__ import annotations

import argparse
import math
import resource
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch

import influkit as ik
from benchmarks.manifest import record as manifest
from influkit.unrolled import AdamW, Record
from influkit.validation.lds import lds_per_query

HERE = Path(__file__).resolve().parent
FRACTIONS = (0.01, 0.05, 0.1)
SUBSETS = 30
METHODS = ("exact", "first-order", "first-order + correction", "first-order + EK-FAC correction",
           "approximate (EK-FAC, 10 segments)", "EK-FAC influence")
DVEMB = "DVEmb (dattri 0.3, SGD-form approximation of the AdamW run)"
DVEMB_PROJECTION = {"digits": None, "gpt2": 2048}
"""DVEmb's gradient dimension per task: the full 2,410 on digits; dattri's random projection to 2,048 of the
transformer's gradients (its d × d matrix would not fit in memory unprojected)."""
TRACKSTAR = "TrackStar (Bergson 2.5.1)"
SOURCE = "SOURCE (Bergson 2.5.1 approx-unrolling)"
PEERS = (DVEMB, TRACKSTAR, SOURCE)
"""The peer methods: they import their library, so they run only in the bench venv (``scripts/bench-env.sh``)."""
METHODS += PEERS
CANNOT_RUN = {
    ("digits", TRACKSTAR): "not run: Bergson 2.5.1's TrackStar (bergson.cli.trackstar: approximate_hessians, "
    "build_query, score_dataset) loads its model only through AutoModelForCausalLM.from_pretrained(model path) and "
    "its data only through AutoTokenizer and a Hugging Face dataset (bergson.utils.worker_utils.setup_model_and_peft, "
    "setup_data_pipeline); the digits MLP is not a causal LM and its examples are not text. Its pipeline also scores "
    "one model, with no sum over checkpoints.",
    ("digits", SOURCE): "not run: Bergson 2.5.1's approximate unrolling (bergson.approx_unrolling.pipeline."
    "approx_unrolling_pipeline) takes the trajectory as a list of checkpoint directories, each loaded through "
    "AutoModelForCausalLM (setup_model_and_peft per checkpoint; AutoConfig / AutoModelForCausalLM.from_config for the "
    "Adam preconditioner) with its data through AutoTokenizer and a Hugging Face dataset (setup_data_pipeline); the "
    "digits MLP is not a causal LM and its examples are not text.",
}
"""(task, method): why the peer cannot run on that task's model (its row keeps the note and no numbers)."""
TRACKSTAR_STEPS = [100, 200, 300]
"""The gpt2 record's checkpoints TrackStar sums over (every 100th step's weights, the last one the final model)."""
SOURCE_STEPS = list(range(20, 301, 20))
SOURCE_SEGMENTS = 3
"""The gpt2 record's checkpoints SOURCE takes (every one the record keeps after the start: 15) and its segments."""
CORRECTION = {"digits": {"correction": 20, "segments": 10}, "gpt2": {"correction": 10, "segments": 5}}
"""The correction's eigenpairs and segments per task (the transformer's Lanczos products cost more)."""


@dataclass
class Run:
    """A task's recorded run: the record, its stage, the test set, the plain training's seconds, the batches."""

    record: Record
    stage: ik.Stage
    test: tuple
    plain_seconds: float
    recorded_seconds: float


def schedule(steps: int, lr: float, warmup: int):
    return lambda t: lr * min((t + 1) / warmup, 1.0) * (1.0 - 0.9 * t / steps)


def digits_parts():
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    x, y = torch.tensor(x, dtype=torch.float64)[perm], torch.tensor(y)[perm]
    train, test = slice(0, 1500), slice(1500, 1550)
    mean, std = x[train].mean(0), x[train].std(0) + 1e-3
    x = (x - mean) / std
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, 10)).double().eval()
    loss = lambda out, target: torch.nn.functional.cross_entropy(out, target, reduction="none")  # noqa: E731
    stage = ik.Stage(model, loss, (x[train], y[train]))
    return stage, (x[test], y[test]), {"steps": 1000, "batch_size": 32, "lr": 2e-3, "warmup": 50, "every": 32}


def gpt2_corpus():
    """(tokenizer, training sentences, test sentences) of the gpt2 task (deterministic)."""
    from influkit import hf
    from influkit.elmo.corpora import vader_corpus

    sentences = list(dict.fromkeys(s.strip() for s in vader_corpus() if s.strip()))
    tokenizer = hf.train_bpe(sentences, vocab_size=400)
    lengths = [len(ids) for ids in tokenizer(sentences)["input_ids"]]
    ok = [s for s, n in zip(sentences, lengths) if 6 <= n <= 24]
    order = torch.randperm(len(ok), generator=torch.Generator().manual_seed(0))[:412].tolist()
    return tokenizer, [ok[i] for i in order[:400]], [ok[i] for i in order[400:412]]


def gpt2_parts():
    from transformers import GPT2Config, GPT2LMHeadModel

    from influkit import hf

    tokenizer, train, test = gpt2_corpus()
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=32, n_embd=32, n_layer=2, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config).eval()
    stage = hf.causal_lm_stage(model, hf.causal_lm_batch(tokenizer, train, max_length=24))
    test_set = hf.pack(hf.causal_lm_batch(tokenizer, test, max_length=24))
    return stage, test_set, {"steps": 300, "batch_size": 16, "lr": 3e-3, "warmup": 30, "every": 20}


TASKS = {"digits": digits_parts, "gpt2": gpt2_parts}


def plain_training(stage: ik.Stage, batches: list[torch.Tensor], lrs: list[float], start: dict) -> float:
    """Seconds of one plain torch.optim.AdamW run of the stage's model over ``batches`` (from ``start``)."""
    model = stage.model
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(start[n])
    optimizer = torch.optim.AdamW(model.parameters(), lr=lrs[0], weight_decay=0.01)
    began = time.perf_counter()
    for idx, lr in zip(batches, lrs):
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = stage.data.take(idx)
        stage.losses({n: p for n, p in model.named_parameters()}, x, y).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    return time.perf_counter() - began


def build(task: str) -> Run:
    """The task's recorded run (deterministic: the same in every process) and one plain run's seconds."""
    torch.set_num_threads(1)
    stage, test, cfg = TASKS[task]()
    start = {n: p.detach().clone() for n, p in stage.model.named_parameters()}
    record = Record()
    began = time.perf_counter()
    record.train(stage, AdamW(lr=cfg["lr"], weight_decay=0.01), steps=cfg["steps"], batch_size=cfg["batch_size"],
                 schedule=schedule(cfg["steps"], cfg["lr"], cfg["warmup"]), checkpoint_every=cfg["every"])
    recorded = time.perf_counter() - began
    final = {n: p.detach().clone() for n, p in stage.model.named_parameters()}
    run = record.runs[0]
    plain = plain_training(stage, run.batches, list(run.lrs), start)
    with torch.no_grad():  # the recorded final model back in place (what the influence rows read)
        for n, p in stage.model.named_parameters():
            p.copy_(final[n])
    return Run(record, stage, test, plain, recorded)


def folder(task: str) -> Path:
    return HERE / "results" / f"first_order_lds_{task}"


def cache(task: str) -> Path:
    path = folder(task) / "cache"
    path.mkdir(parents=True, exist_ok=True)
    return path


def slug(method: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in method).strip("_")


def scores_of(task: str, method: str, run: Run) -> np.ndarray:
    """(n, q) s_z(t) = −removal (d loss_t / d w_z for the unrolled methods)."""
    record, test = run.record, run.test
    if method == "exact":
        result = ik.unrolled.metagradients(record, test, per_test=True, progress=False)[0]
    elif method == "first-order":
        result = ik.unrolled.first_order(record, test, per_test=True, progress=False)[0]
    elif method == "first-order + EK-FAC correction":
        result = ik.unrolled.first_order(record, test, per_test=True, progress=False, correction="ekfac",
                                         segments=CORRECTION[task]["segments"])[0]
    elif method == "first-order + correction":
        result = ik.unrolled.first_order(record, test, per_test=True, progress=False, **CORRECTION[task])[0]
    elif method.startswith("approximate"):
        result = ik.unrolled.approximate(record, test, per_test=True, segments=10, curvature="ekfac",
                                         progress=False)[0]
    elif method == DVEMB:
        from benchmarks.dvemb_peer import dvemb_scores

        return dvemb_scores(record, test, proj_dim=DVEMB_PROJECTION[task]).double().numpy()
    elif method == TRACKSTAR:
        from benchmarks.trackstar_peer import trackstar_scores

        tokenizer, train, test_texts = gpt2_corpus()
        return trackstar_scores(record, tokenizer, train, test_texts, TRACKSTAR_STEPS).double().numpy()
    elif method == SOURCE:
        from benchmarks.source_peer import source_scores

        tokenizer, train, test_texts = gpt2_corpus()
        result = source_scores(record, tokenizer, train, test_texts, SOURCE_STEPS, segments=SOURCE_SEGMENTS)
        return result.double().numpy()
    elif method == "EK-FAC influence":
        result = ik.influence(run.stage, None, test, solve=ik.SolveConfig(solver="ekfac"), per_test=True,
                              progress=False)
    else:
        raise SystemExit(f"unknown method {method!r}")
    return (-result.removal).double().numpy()


def step_method(task: str, method: str) -> None:
    if (task, method) in CANNOT_RUN:
        print(f"{task} {method}: {CANNOT_RUN[task, method]}", flush=True)
        return
    out = cache(task) / f"scores_{slug(method)}.npz"
    if out.exists():
        return
    run = build(task)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    began = time.perf_counter()
    scores = scores_of(task, method, run)
    seconds = time.perf_counter() - began
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    np.savez(out, scores=scores, seconds=seconds, plain_seconds=run.plain_seconds,
             recorded_seconds=run.recorded_seconds, peak_rss=peak, rss_before=before)
    print(f"{task} {method}: {seconds:.1f} s ({seconds / run.plain_seconds:.2f}× plain training)", flush=True)


def drop_sets(n: int, fraction: float, m: int) -> np.ndarray:
    """(m, n) kept masks: m seeded random drop sets of ⌊f·n⌋ examples."""
    gen = torch.Generator().manual_seed(int(1000 * fraction))
    count = max(1, math.floor(fraction * n))
    masks = np.ones((m, n), dtype=bool)
    for j in range(m):
        masks[j, torch.randperm(n, generator=gen)[:count].numpy()] = False
    return masks


def step_replays(task: str, m: int) -> None:
    run = None
    for fraction in FRACTIONS:
        out = cache(task) / f"replays_{fraction}.npz"
        done = dict(np.load(out)) if out.exists() else {}
        if len(done.get("outputs", ())) >= m:
            continue
        run = run or build(task)
        n = len(run.stage)
        masks = drop_sets(n, fraction, m)
        outputs = list(done.get("outputs", []))
        for j in range(len(outputs), m):
            weights = torch.tensor(masks[j], dtype=torch.float64)
            outputs.append(ik.unrolled.outputs(run.record, run.test, [weights]).double().numpy())
            if (j + 1) % 5 == 0 or j + 1 == m:
                np.savez(out, masks=masks[:j + 1], outputs=np.stack(outputs))
        print(f"{task}: replays at {fraction:.0%} done", flush=True)


def step_diagnostic(task: str) -> None:
    out = folder(task) / "diagnostic.csv"
    if out.exists():
        return
    run = build(task)
    sharp = ik.unrolled.sharpness(run.record)
    table = ik.unrolled.first_order_check(run.record, sharp)
    folder(task).mkdir(parents=True, exist_ok=True)
    table.to_csv(out, index=False)
    sharp.to_csv(folder(task) / "sharpness.csv", index=False)


def step_table(task: str) -> None:
    rows = []
    for method in METHODS:
        if (task, method) in CANNOT_RUN:
            rows.append({"method": method, "note": CANNOT_RUN[task, method]})
            continue
        path = cache(task) / f"scores_{slug(method)}.npz"
        if not path.exists():
            continue
        saved = np.load(path)
        row = {"method": method, "seconds": float(saved["seconds"]),
               "ratio_to_plain_training": float(saved["seconds"] / saved["plain_seconds"]),
               "plain_training_seconds": float(saved["plain_seconds"]),
               "peak_rss_mib": float(saved["peak_rss"]) / 2**20, "rss_before_mib": float(saved["rss_before"]) / 2**20}
        for fraction in FRACTIONS:
            replays = cache(task) / f"replays_{fraction}.npz"
            if not replays.exists():
                continue
            done = np.load(replays)
            per_query = lds_per_query(saved["scores"], done["masks"], done["outputs"])
            valid = per_query[np.isfinite(per_query)]
            row[f"lds_{fraction:g}"] = float(valid.mean())
            row[f"sem_{fraction:g}"] = float(valid.std(ddof=1) / np.sqrt(len(valid)))
            row[f"subsets_{fraction:g}"] = int(done["masks"].shape[0])
        rows.append(row)
    frame = pd.DataFrame(rows)
    exact = frame[frame["method"] == "exact"]
    for fraction in FRACTIONS:
        if f"lds_{fraction:g}" in frame and not exact.empty:
            column = f"lds_{fraction:g}"
            frame[f"share_of_exact_{fraction:g}"] = frame[column] / float(exact[column].iloc[0])
    target = folder(task)
    frame.to_csv(target / "lds.csv", index=False)
    lines = [f"# First-order trajectory attribution, replay LDS: {task}", "",
             "LDS mean ± sem over test points; seconds of the method beside one plain torch.optim.AdamW training run "
             "of the same model and batches in the same process; peak RSS of the method's process.", "",
             "| method | " + " | ".join(f"LDS {f:.0%} (M = {int(frame[f'subsets_{f:g}'].max())})"
                                        if f"subsets_{f:g}" in frame else f"LDS {f:.0%}" for f in FRACTIONS)
             + " | seconds | × plain training | "
             "peak RSS (MiB) |", "|---" * (len(FRACTIONS) + 4) + "|"]
    for row in rows:
        if "note" in row:
            lines.append(f"| {row['method']} | " + " | ".join(["—"] * (len(FRACTIONS) + 3)) + " |")
            continue
        cells = [f"{row.get(f'lds_{f:g}', float('nan')):.3f} ± {row.get(f'sem_{f:g}', float('nan')):.3f}"
                 for f in FRACTIONS]
        lines.append(f"| {row['method']} | " + " | ".join(cells) +
                     f" | {row['seconds']:.1f} | {row['ratio_to_plain_training']:.2f} | {row['peak_rss_mib']:.0f} |")
    if any(row["method"] == DVEMB and "note" not in row for row in rows):
        dim = DVEMB_PROJECTION[task]
        lines += ["", "DVEmb's gradients: " + ("the full ones." if dim is None else
                                            f"dattri's random projection to {dim} dimensions.")]
    if any(row["method"] == TRACKSTAR and "note" not in row for row in rows):
        lines += ["", "TrackStar: Bergson's scores summed over the record's checkpoints at steps "
                  + ", ".join(map(str, TRACKSTAR_STEPS)) + " (equal weights); each unit-normalized and preconditioned "
                  "by the training gradients' autocorrelation Hessian, without Adam's second moments (Bergson reads "
                  "them only from an optimizer.pt file)."]
    if any(row["method"] == SOURCE and "note" not in row for row in rows):
        lines += ["", f"SOURCE: Bergson's approximate unrolling over the record's {len(SOURCE_STEPS)} checkpoints at "
                  f"steps {SOURCE_STEPS[0]}, {SOURCE_STEPS[1]}, …, {SOURCE_STEPS[-1]} in {SOURCE_SEGMENTS} segments, "
                  "EK-FAC at each, its SGD form (each segment's mean recorded learning rate × its steps; the Adam form "
                  "needs optimizer.pt files)."]
    notes = [f"- {row['method']}: {row['note']}" for row in rows if "note" in row]
    if notes:
        lines += ["", "## Peers that did not run", "", *notes]
    diagnostic = target / "diagnostic.csv"
    if diagnostic.exists():
        lines += ["", "## What the record says first (`first_order_check`)", "",
                  markdown(pd.read_csv(diagnostic))]
    (target / "results.md").write_text("\n".join(lines) + "\n")
    files = ["lds.csv", "results.md"] + [p.name for p in (diagnostic, target / "sharpness.csv") if p.exists()]
    manifest(target, files, command=f"python -m studies.first_order_lds run --task {task}",
             note="the peer rows (" + ", ".join(PEERS) + ") ran in the bench venv (scripts/bench-env.sh): "
             "PYTHONPATH=$PWD .bench-venv/bin/python -m studies.first_order_lds method --task " + task
             + " --method NAME; the load is the table step's")
    print("\n".join(lines))


def markdown(frame: pd.DataFrame) -> str:
    """A markdown table of ``frame``."""
    head = "| " + " | ".join(map(str, frame.columns)) + " |\n" + "|---" * len(frame.columns) + "|"
    body = ["| " + " | ".join(f"{v:.4g}" if isinstance(v, float) else str(v) for v in row) + " |"
            for row in frame.itertuples(index=False)]
    return "\n".join([head, *body])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("step", choices=("run", "method", "replays", "diagnostic", "table"))
    parser.add_argument("--task", choices=tuple(TASKS), default="digits")
    parser.add_argument("--method", choices=METHODS)
    parser.add_argument("--subsets", type=int, default=SUBSETS)
    args = parser.parse_args(argv)
    if args.step == "method":
        step_method(args.task, args.method)
    elif args.step == "replays":
        step_replays(args.task, args.subsets)
    elif args.step == "diagnostic":
        step_diagnostic(args.task)
    elif args.step == "table":
        step_table(args.task)
    else:
        step_diagnostic(args.task)
        for method in METHODS:  # each in its own process: its peak memory is its own
            subprocess.run([sys.executable, "-m", "studies.first_order_lds", "method", "--task", args.task,
                            "--method", method], check=False)
        step_replays(args.task, args.subsets)
        step_table(args.task)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
