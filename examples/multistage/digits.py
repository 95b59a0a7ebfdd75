"""Multi-stage influence on real digits: which pretraining images help or hurt a model finetuned on other digits?

Pretrain a small CNN embedding + head on scikit-learn digits 0–3, then finetune a new head on digits 4–9 —
Case 1 with the embedding fixed, Case 2 with the embedding finetuned too (proximal weight α = 0.01). Score every
pretraining image against the finetuning test set with ``influkit.score`` (positive = harmful: removing it would
lower the test loss), print the most harmful and most helpful ones and save a gallery of them to
``OUT/multistage_gallery_case{1,2}.png`` (``--out``, default ``influkit-results/multistage``; the committed ones
are in ``studies/results/digits/``). No leave-out validation here (see ``influkit demo`` and
``studies/paper_experiments.py case2``). Needs ``pip install 'influkit[apps]'``.

Run ``python examples/multistage/digits.py``, or ``--quick`` for a smaller problem (60 pretraining, 60 finetuning
and 30 test images).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import torch

import influkit
from influkit.apps import plotting
from influkit.apps.digits import DigitsSetup, accuracy, train_stages

RESULTS = Path("influkit-results/multistage")


def run_case(case: int, *, n_pretrain: int | None, n_finetune: int | None, n_test: int, k: int,
             out: Path) -> influkit.InfluenceResult:
    setup = DigitsSetup(case=case, n_pretrain=n_pretrain, n_finetune=n_finetune, n_test=n_test)
    split = setup.split()
    start = time.perf_counter()
    pre, fin = train_stages(setup, split)
    trained = time.perf_counter() - start
    result = influkit.score(pre, fin, torch.arange(len(pre)), split.test, shared="embedding", case=case,
                            alpha=setup.alpha, solve=influkit.SolveConfig(solver="direct"))
    scored = time.perf_counter() - start - trained
    what = "embedding fixed" if case == 1 else f"embedding finetuned, α = {setup.alpha}"
    print(f"\n== Case {case} ({what}): {len(pre)} pretraining digits 0–3 -> {len(split.finetune[1])} finetuning "
          f"digits 4–9, {len(split.test[1])} test; test accuracy {accuracy(fin, split.test):.3f}; "
          f"train {trained:.0f} s, score {scored:.0f} s ==")
    frame = result.to_frame()
    frame["label"] = [setup.pretrain_classes[int(c)] for c in split.pretrain[1][frame["example"].tolist()]]
    harmful = frame.nlargest(k, "score")[["example", "label", "score"]]
    helpful = frame.nsmallest(k, "score")[["example", "label", "score"]]
    print("most harmful pretraining examples (removing them would lower the test loss):")
    print(harmful.to_string(index=False, float_format=lambda v: f"{v:+.4f}"))
    print("most helpful pretraining examples:")
    print(helpful.to_string(index=False, float_format=lambda v: f"{v:+.4f}"))
    picks = list(harmful["example"]) + list(helpful["example"])
    captions = [f"#{i} ({lab})\n{s:+.3f}" for i, lab, s in
                zip(picks, list(harmful["label"]) + list(helpful["label"]), list(harmful["score"]) + list(helpful["score"]))]
    fig = plotting.image_gallery(split.pretrain[0][picks].numpy(), captions, columns=k,
                                 title=f"Case {case}: top row most harmful pretraining digits · bottom row most helpful")
    path = plotting.save(fig, out / f"multistage_gallery_case{case}.png", dpi=100)
    print(f"wrote {path}")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="n_pretrain=60, n_finetune=60, n_test=30 (CI size)")
    parser.add_argument("--k", type=int, default=8, help="how many harmful and helpful examples to show")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    n_pretrain, n_finetune, n_test = (60, 60, 30) if args.quick else (None, None, 300)
    out = args.out or (RESULTS / "quick" if args.quick else RESULTS)
    results = {case: run_case(case, n_pretrain=n_pretrain, n_finetune=n_finetune, n_test=n_test, k=args.k, out=out)
               for case in (1, 2)}
    a, b = (results[c].values.double() for c in (1, 2))
    corr = torch.corrcoef(torch.stack([a, b]))[0, 1]
    print(f"\nmean |score|: Case 1 {a.abs().mean():.4f}, Case 2 {b.abs().mean():.4f}; "
          f"Pearson r between the two cases' scores {corr:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
