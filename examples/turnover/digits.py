"""Turn-over dropout (Kobayashi et al. 2020): influence of every training digit from forward passes only.

An MLP with a ``TurnOverDropout`` layer is trained so that each example trains only the sub-network its own
mask picks; the flipped mask picks a sub-network that never saw it. Then, with no gradient and no Hessian:

- ``turnover.influence``: each training digit's effect on a test digit's loss (positive = harmful), and
- ``turnover.self_influence``: each digit's effect on its own loss, which finds flipped labels — 10% of the
  labels are flipped here, and the script reports how many of them the most self-influential 10% contain.

Needs ``pip install 'influkit[apps]'`` (scikit-learn's digits). About 30 s on one core:

    python examples/turnover/digits.py
"""

from __future__ import annotations

import torch
from torch import nn

from influkit.apps.datasets import load_digits_tensors
from influkit.turnover import TurnOverDropout, influence, self_influence, train_turnover


def cross_entropy(outputs, targets):
    return nn.functional.cross_entropy(outputs, targets, reduction="none")


def main() -> None:
    torch.set_num_threads(1)
    x, y = load_digits_tensors(torch.float32)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    train, test = (x[order[:1000]], y[order[:1000]].clone()), (x[order[1000:]], y[order[1000:]])
    flipped = torch.randperm(1000, generator=torch.Generator().manual_seed(1))[:100]
    train[1][flipped] = (train[1][flipped] + torch.randint(1, 10, (100,))) % 10  # a wrong label for 10%

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), TurnOverDropout(0.5), nn.Linear(256, 10))
    train_turnover(model, cross_entropy, train, epochs=30, batch_size=64, lr=1e-3, progress=False)
    with torch.no_grad():
        accuracy = float((model.eval()(test[0]).argmax(1) == test[1]).float().mean())
    print(f"test accuracy {accuracy:.3f} (trained with 10% wrong labels)")

    res = influence(model, torch.arange(1000), (test[0][:1], test[1][:1]), measure=cross_entropy, n_train=1000,
                    progress=False)
    print(f"test digit 0 (label {int(test[1][0])}): most harmful training digits {res.top(5).example.tolist()}, "
          f"most helpful {res.top(5, harmful=False).example.tolist()}")

    own = self_influence(model, cross_entropy, train, progress=False)  # negative = memorized
    suspects = own.values.argsort()[:100]
    found = torch.isin(suspects, flipped).float().mean()
    print(f"the 100 most negative self-influences hold {found:.0%} of flipped labels (random: 10%)")


if __name__ == "__main__":
    main()
