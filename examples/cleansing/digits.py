"""Data cleansing with influence functions on real digits: wrong labels, then harmful pretraining examples.

1. Mislabel detection: 10% of the labels of a logistic regression's training digits are flipped; ranking the
   digits by self-influence (``ik.self_influence``: how much removing a digit would raise its own loss) finds
   them far sooner than ranking by training loss or at random, and fixing the flagged ones restores accuracy.
2. Pretraining cleansing (``--pretraining``): remove the 10% most harmful pretraining digits of a two-stage
   model (``ik.score``), re-train both stages, and compare the test loss with removing a random 10%.

Both run ``influkit.apps.cleansing`` (also ``influkit clean`` on the command line). Needs
``pip install 'influkit[apps]'``. About 20 s (mislabels) plus ~1 min per seed (``--pretraining``) on one core:

    python examples/cleansing/digits.py [--pretraining] [--seeds 2]
"""

from __future__ import annotations

import argparse

import torch

from influkit.apps.cleansing import cleansing_table, mislabel_detection
from influkit.apps.digits import DigitsSetup


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pretraining", action="store_true", help="also cleanse the pretraining set")
    parser.add_argument("--seeds", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    found, accuracy = mislabel_detection(flip_fraction=0.1)
    print("share of the flipped labels found after checking the top x% of the training digits:")
    print(found.to_string(float_format=lambda v: f"{v:.0%}"))
    print("test accuracy: " + ", ".join(f"{name} {value:.3f}" for name, value in accuracy.items()))
    if args.pretraining:
        table = cleansing_table(DigitsSetup(n_pretrain=240, n_test=200), fraction=0.1, seeds=args.seeds, progress=False)
        print(table.to_string())


if __name__ == "__main__":
    main()
