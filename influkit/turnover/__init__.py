"""Turn-over dropout influence (Kobayashi et al. 2020): influence from forward passes only.

Every training example trains only the sub-network picked by its own dropout mask m_i; the flipped mask
1 − m_i picks a sub-network that never saw it. influkit's sign (positive = harmful):
values[i] = L(x; m_i) − L(x; 1 − m_i), already a whole-removal difference, so ``removal = −values``
(results carry ``removal_eps = −1`` and ``n_train`` = the training set size).

Typical use::

    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), TurnOverDropout(0.5), nn.Linear(256, 10))
    train_turnover(model, loss, (X, y), epochs=30)
    res = influence(model, torch.arange(len(X)), (x_test, y_test), measure=loss, n_train=len(X))
"""

from .influence import influence, self_influence
from .layers import TurnOverDropout, model_with_ids, turnover_layers
from ..philox import philox4x32, random_words
from .masks import HashedMasks, VolatileMasks
from .training import IndexedDataset, epoch_order, train_turnover

__all__ = [
    "HashedMasks",
    "IndexedDataset",
    "TurnOverDropout",
    "VolatileMasks",
    "epoch_order",
    "influence",
    "model_with_ids",
    "philox4x32",
    "random_words",
    "self_influence",
    "train_turnover",
    "turnover_layers",
]
