"""Semi-supervised learning with a learned weight per unlabeled example (Ren, Yeh & Schwing 2020) on two moons.

10 labelled points, 30 for validation, 500 unlabeled ones pseudo-labelled by the model itself. Algorithm 1
(``influkit.ssl.train_ssl``) alternates Adam steps on the network with hypergradient steps on the weights:
an unlabeled point whose up-weighting would raise the validation loss is down-weighted, towards 0. Prints the
test accuracy of plain supervised training, uniform pseudo-labels and per-example weights, and how often the
most down-weighted points carry a wrong pseudo-label. Needs ``pip install 'influkit[apps]'`` (scikit-learn's
``make_moons``). About 20 s on one core:

    python examples/ssl/moons.py
"""

from __future__ import annotations

import torch
from sklearn.datasets import make_moons
from torch import nn

from influkit.ssl import PseudoLabel, SSLConfig, train_ssl


def cross_entropy(outputs, targets):
    return nn.functional.cross_entropy(outputs, targets, reduction="none")


def main() -> None:
    torch.set_num_threads(1)
    x, y = make_moons(1040, noise=0.15, random_state=0)
    x, y = torch.tensor(x, dtype=torch.float32), torch.tensor(y)
    labeled, val, test = (x[:10], y[:10]), (x[10:40], y[10:40]), (x[540:], y[540:])
    unlabeled, truth = x[40:540], y[40:540]
    for mode in ("supervised", "uniform", "per-example"):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(2, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))
        config = SSLConfig(mode=mode, steps=400, warmup=100, inner_steps=5, lr=1e-2, weight_lr=0.2, labeled_batch=10,
                           unlabeled_batch=500)
        run = train_ssl(model, cross_entropy, PseudoLabel(), labeled, unlabeled, val, config, test=test)
        line = f"{mode:>11}: test accuracy {run.history.test_acc.iloc[-1]:.3f}"
        if mode == "per-example":
            with torch.no_grad():
                wrong = model(unlabeled).argmax(-1) != truth
            lowest = run.weights.argsort()[:50]
            line += (f"; the 50 most down-weighted points have a wrong pseudo-label {wrong[lowest].float().mean():.0%}"
                     f" of the time ({wrong.float().mean():.0%} overall)")
        print(line)


if __name__ == "__main__":
    main()
