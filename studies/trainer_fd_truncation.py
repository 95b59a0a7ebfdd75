"""Why a finite-difference check of a Trainer run's metagradient failed in one process and passed in another.

``hf.train_wordpiece`` learns another vocabulary on every call (``tokenizers`` breaks ties between equally frequent
merges arbitrarily), so every training of the test suite's tiny tokenizer gives another recorded run. For each of
``--trials`` trainings this study records the test suite's Trainer at its defaults (a tiny float64 BERT, fused
AdamW, sdpa, accumulation 2, one epoch: 5 steps) and compares the exact metagradient of examples 1, 6 and 12 with
central differences of the re-run training at ε = 1e-6 (the suite's check), at ε = 1e-7, and with the Richardson
extrapolation (4 D(ε) − D(2ε)) / 3 at ε = 1e-6 (truncation error O(ε⁴) instead of O(ε²)). Where the check at 1e-6
fails and the extrapolation agrees, the failure is the difference's truncation error (AdamW's m/(√v + ε) on
coordinates with tiny gradients curves the measure strongly in the example weights), not the metagradient.

Results: ``studies/results/trainer_fd_truncation/truncation.csv`` (one row per trial and example: relative errors
of each difference against the metagradient, the suite's check passed or not) and ``summary.json``.

    python -m studies.trainer_fd_truncation --trials 30
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import pandas as pd
import torch

import influkit as ik
from benchmarks.manifest import record as manifest

OUT = Path(__file__).resolve().parent / "results" / "trainer_fd_truncation"
EXAMPLES = (1, 6, 12)
EPS = 1e-6


def suite_module():
    """The test suite's Trainer module (tests/test_hf_trainer_record.py), loaded from its file: the study repeats its
    run and its check."""
    path = Path(__file__).resolve().parents[1] / "tests" / "test_hf_trainer_record.py"
    spec = importlib.util.spec_from_file_location("test_hf_trainer_record", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def trial(suite, tokenizer) -> list[dict]:
    """The rows of one recorded run: each example's metagradient against its differences."""
    from influkit import hf

    record = ik.unrolled.Record()
    suite.at_defaults(tokenizer, [hf.RecordCallback(record)], num_train_epochs=1)
    test = record.runs[0].stage.data.take(torch.tensor([0, 3]))
    scores = ik.unrolled.metagradients(record, test)[0].values
    rows = []
    for z in EXAMPLES:
        value = float(scores[z])
        f = {k: suite.replayed(record, test, 0, z, k * EPS) for k in (-2, -1, 1, 2)}
        small = (suite.replayed(record, test, 0, z, EPS / 10) - suite.replayed(record, test, 0, z, -EPS / 10)) / (
            2 * EPS / 10)
        d1, d2 = (f[1] - f[-1]) / (2 * EPS), (f[2] - f[-2]) / (4 * EPS)
        rounding = 16 * torch.finfo(torch.float64).eps * max(abs(f[1]), abs(f[-1])) / (2 * EPS)
        rows.append({"example": z, "metagradient": value, "rel error eps 1e-6": abs(d1 - value) / abs(value),
                     "rel error eps 1e-7": abs(small - value) / abs(value),
                     "rel error Richardson eps 1e-6": abs((4 * d1 - d2) / 3 - value) / abs(value),
                     "suite check passes": abs(d1 - value) <= max(1e-6 * abs(d1), rounding)})
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trials", type=int, default=30)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    torch.set_default_dtype(torch.float64)
    suite = suite_module()

    from influkit import hf

    rows = []
    for t in range(args.trials):
        tokenizer = hf.train_wordpiece(suite.TEXTS * 2, vocab_size=60)
        rows += [{"trial": t} | row for row in trial(suite, tokenizer)]
        print(rows[-3:], flush=True)
    table = pd.DataFrame(rows)
    failed = table.groupby("trial")["suite check passes"].all().eq(False)
    bad = table[table["trial"].isin(failed[failed].index)]
    summary = {"trials": args.trials, "failing trials (suite check at eps 1e-6)": int(failed.sum()),
               "largest rel error eps 1e-6": float(table["rel error eps 1e-6"].max()),
               "largest rel error eps 1e-7": float(table["rel error eps 1e-7"].max()),
               "largest rel error Richardson eps 1e-6": float(table["rel error Richardson eps 1e-6"].max()),
               "largest rel error Richardson eps 1e-6 on failing trials":
                   float(bad["rel error Richardson eps 1e-6"].max()) if len(bad) else None,
               "fixed vocabulary of the suite passes": all(r["suite check passes"] for r in
                                                           trial(suite, hf.wordpiece_tokenizer(suite.VOCAB)))}
    print(json.dumps(summary, indent=1))
    OUT.mkdir(parents=True, exist_ok=True)
    table.to_csv(OUT / "truncation.csv", index=False)
    (OUT / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    manifest(OUT, ["truncation.csv", "summary.json"], note="shared 2-core machine; one torch thread; float64")


if __name__ == "__main__":
    main()
