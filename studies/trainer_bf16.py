"""A bf16 Trainer run recorded and replayed at its own precision: how far its float32 metagradient is from the
float32 run's, and why central differences of the bf16 re-run cannot check it.

The test suite's Trainer at its defaults (a tiny BERT, float32 weights, fused AdamW, sdpa, accumulation 2, one
epoch: 5 steps) with ``bf16=True`` (accelerate's CPU autocast) and without. Written: whether the recorded run is the
plain one and replays bit for bit, the largest weight gap between the bf16 and the float32 runs, the relative norm
error and cosine of the bf16 run's metagradient against the float32 run's exact one, and, for four examples,
central differences of the bf16 re-run at ε = 0.03, 0.1 and 0.3 beside both metagradients.

Results: ``studies/results/trainer_bf16/summary.json`` and ``differences.csv``.

    python -m studies.trainer_bf16
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import torch

import influkit as ik
from benchmarks.manifest import record as manifest

from .trainer_fd_truncation import suite_module

OUT = Path(__file__).resolve().parent / "results" / "trainer_bf16"


def main():
    from influkit import hf

    torch.set_num_threads(1)
    suite = suite_module()
    tokenizer = hf.wordpiece_tokenizer(suite.VOCAB)
    record, exact = ik.unrolled.Record(), ik.unrolled.Record()
    recorded = suite.at_defaults(tokenizer, [hf.RecordCallback(record)], dtype=torch.float32, num_train_epochs=1,
                                 bf16=True)
    plain = suite.at_defaults(tokenizer, dtype=torch.float32, num_train_epochs=1, bf16=True)
    full = suite.at_defaults(tokenizer, [hf.RecordCallback(exact)], dtype=torch.float32, num_train_epochs=1)
    final = ik.unrolled.replay(record)[0]
    test = record.runs[0].stage.data.take(torch.tensor([0, 3]))
    mixed = ik.unrolled.metagradients(record, test)[0].values
    reference = ik.unrolled.metagradients(exact, test)[0].values
    n = len(record.runs[0].stage)
    rows = []
    for z in (3, 6, 7, 12):
        for eps in (0.03, 0.1, 0.3):
            weights = [torch.ones(n), torch.ones(n)]
            weights[0][z] += eps
            weights[1][z] -= eps
            plus, minus = (float(ik.unrolled.outputs(record, test, [w]).sum()) for w in weights)
            rows.append({"example": z, "eps": eps, "bf16 metagradient": float(mixed[z]),
                         "float32 run's metagradient": float(reference[z]),
                         "central difference of the bf16 re-run": (plus - minus) / (2 * eps)})
    summary = {
        "recorded run equals the plain bf16 run": all(torch.equal(a, b) for a, b in
                                                      zip(recorded.parameters(), plain.parameters())),
        "replay repeats the final weights bit for bit": all(torch.equal(final[k], p)
                                                            for k, p in recorded.named_parameters()),
        "verify": ik.unrolled.verify(record),
        "largest weight gap bf16 vs float32 run": max(float((a - b).detach().abs().max())
                                                      for a, b in zip(recorded.parameters(), full.parameters())),
        "relative norm error vs the float32 run's metagradient": float((mixed - reference).norm() / reference.norm()),
        "cosine vs the float32 run's metagradient": float(mixed @ reference / (mixed.norm() * reference.norm())),
        "steps": record.runs[0].steps,
    }
    print(json.dumps(summary, indent=1))
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    pd.DataFrame(rows).to_csv(OUT / "differences.csv", index=False)
    manifest(OUT, ["summary.json", "differences.csv"], note="shared 2-core machine; one torch thread; CPU bf16 "
             "autocast (accelerate, use_cpu=True)")


if __name__ == "__main__":
    main()
