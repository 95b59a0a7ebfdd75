"""Attribute the training that ran: exact metagradients through a recorded pretrain → finetune run on real digits.

Pretrain a small CNN on scikit-learn digits 0–3 with SGD + momentum (150 steps of 32), then finetune a new head on
digits 4–9 with AdamW (100 steps of 32; Case 1: the pretrained embedding fixed), recording both stages
(``ik.unrolled.Record``). Neither stage reaches a minimum, which the influence function assumes.
``ik.unrolled.metagradients`` differentiates the summed test loss of the final model through every recorded step
of both stages: a score is d test loss / d w_z (w_z = 1 in the recorded run), so removing z predicts −score.

Then check the scores on the run itself: replay the record (``ik.unrolled.outputs``) with the k most harmful
pretraining digits dropped, the k most helpful and k random ones, and with single digits dropped, and compare the
replayed change of the test loss with −Σ score. The influence function of the same final models (``ik.score``
with its default solve, which warns that neither stage is at a minimum) is shown beside it. Writes a scatter of predicted vs replayed single drops to
``OUT/unrolled_single_drops.png`` (``--out``, default ``influkit-results/unrolled``). About 30 s on one core.
Needs ``pip install 'influkit[apps]'``.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import torch

import influkit as ik
from influkit.apps import plotting
from influkit.apps.digits import DigitsSetup
from influkit.apps.models import digits_classifier
from influkit.apps.objectives import cross_entropy, l2

RESULTS = Path("influkit-results/unrolled")


def record_chain(setup: DigitsSetup, split) -> tuple[ik.unrolled.Record, ik.Stage, ik.Stage]:
    """Train and record SGD + momentum pretraining, then AdamW finetuning of a new head on the fixed embedding."""
    torch.manual_seed(setup.seed)
    pre_model = digits_classifier(len(setup.pretrain_classes), setup.channels).double()
    fin_model = digits_classifier(len(setup.finetune_classes), setup.channels).double()
    pre = ik.Stage(pre_model, cross_entropy, split.pretrain, regularizer=l2(setup.weight_decay))
    fin = ik.Stage(fin_model, cross_entropy, split.finetune, params="head", regularizer=l2(setup.weight_decay))
    record = ik.unrolled.Record()
    record.train(pre, ik.unrolled.SGD(lr=0.05, momentum=0.9), steps=150, batch_size=32, seed=0)
    record.train(fin, ik.unrolled.AdamW(lr=1e-2, weight_decay=1e-2), steps=100, batch_size=32, seed=1,
                 link=ik.Link("embedding", case=1))
    return record, pre, fin


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--k", type=int, default=10, help="digits per dropped set")
    parser.add_argument("--singles", type=int, default=20, help="single-digit drops replayed")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    setup = DigitsSetup(n_pretrain=240, n_test=100)
    split = setup.split()
    start = time.perf_counter()
    record, pre, fin = record_chain(setup, split)
    trained = time.perf_counter() - start
    start = time.perf_counter()
    error = ik.unrolled.verify(record)
    replayed_once = time.perf_counter() - start
    print(f"recorded {[run.steps for run in record.runs]} steps in {trained:.1f} s; replay ({replayed_once:.1f} s) "
          f"reproduces every checkpoint to {error:.1e}; ‖∇‖ at the end: pretraining "
          f"{ik.training.gradient_norm(pre):.3f}, finetuning {ik.training.gradient_norm(fin):.3f} (not minima)")

    start = time.perf_counter()
    pre_scores, fin_scores = ik.unrolled.metagradients(record, split.test)
    seconds = time.perf_counter() - start
    print(f"exact metagradients of the summed test loss through both stages: {seconds:.1f} s "
          f"({seconds / replayed_once:.1f}× one replay of the training), {pre_scores.values.numel()} pretraining and {fin_scores.values.numel()} "
          f"finetuning scores")
    influence = ik.score(pre, fin, torch.arange(len(pre)), split.test, shared="embedding", case=1)  # warns: no minima
    predicted = pre_scores.removal.double()[torch.argsort(pre_scores.index)]  # −score: predicted change if dropped
    influence_predicted = influence.removal.double()[torch.argsort(influence.index)]
    print(f"Pearson r of the two predictions (metagradient, influence function at the final models): "
          f"{torch.corrcoef(torch.stack([predicted, influence_predicted]))[0, 1]:.3f}")

    base = ik.unrolled.outputs(record, split.test).sum()
    n = len(pre)

    def replayed_change(dropped: torch.Tensor) -> float:
        weights = torch.ones(n, dtype=torch.float64)
        weights[dropped] = 0
        return float(ik.unrolled.outputs(record, split.test, [weights, None]).sum() - base)

    print(f"\ndrop k = {args.k} pretraining digits, replay the recorded run: change of the summed test loss "
          f"({float(base):.3f})")
    gen = torch.Generator().manual_seed(0)
    sets = {"most harmful (most negative change)": predicted.argsort()[:args.k],
            "most helpful (most positive change)": predicted.argsort(descending=True)[:args.k],
            "random": torch.randperm(n, generator=gen)[:args.k]}
    for name, dropped in sets.items():
        print(f"  {name:36s} predicted {float(predicted[dropped].sum()):+.4f}   replayed "
              f"{replayed_change(dropped):+.4f}   influence function {float(influence_predicted[dropped].sum()):+.4f}")

    singles = torch.randperm(n, generator=gen)[:args.singles]
    replayed = torch.tensor([replayed_change(i.reshape(1)) for i in singles], dtype=torch.float64)
    r = torch.corrcoef(torch.stack([predicted[singles], replayed]))[0, 1]
    r_if = torch.corrcoef(torch.stack([influence_predicted[singles], replayed]))[0, 1]
    print(f"\n{args.singles} single-digit drops replayed: Pearson r of predicted and replayed change "
          f"{r:.3f} (metagradient), {r_if:.3f} (influence function)")
    fig = plotting.scatter_with_r(predicted[singles].numpy(), replayed.numpy(), title="one pretraining digit dropped")
    fig.axes[0].set_xlabel("predicted change of the test loss (−metagradient)")
    fig.axes[0].set_ylabel("change when the recorded run is replayed")
    print(f"wrote {plotting.save(fig, args.out / 'unrolled_single_drops.png', dpi=100)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
