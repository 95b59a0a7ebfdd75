"""Turn-over dropout influence (Kobayashi et al. 2020) from forward passes only.

Sign convention (influkit's, docs/conventions.md §1: positive = harmful): for training example i and test point x,

    values[i] = L(x; m_i) − L(x; 1 − m_i)

the loss of the sub-network trained on i minus the loss of the sub-network that never saw i. Positive means
training on i raised the loss on x. The paper reports the opposite sign (L(1 − m_i) − L(m_i), positive =
helpful).

Removal rule: the values are already whole-removal differences L(with i) − L(without i), not derivatives
with respect to a weight, so results carry ``removal_eps = −1`` and
``result.removal = −values = L(x; 1 − m_i) − L(x; m_i)``: the estimated change of the test loss when i is
removed (loss without i minus loss with i). ``n_train`` is the size of the training set the model was
trained on with :func:`~influkit.turnover.training.train_turnover`; the result's ``index`` holds the ids into
it. Both functions run forward passes only: ``diagnostics`` has no solves, ``seconds = {"forward": ...}`` and
``settings = {"forward_examples": ..., "batch_size": ...}``.
"""

from __future__ import annotations

import operator
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn
from torch.utils.data import Dataset
from tqdm.auto import tqdm

from ..errors import InputError, LossError
from ..results import InfluenceResult
from .layers import model_with_ids, turnover_layers

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _as_ids(ids: Sequence[int] | torch.Tensor, n: int) -> torch.Tensor:
    ids = torch.as_tensor(ids)
    if ids.dim() != 1 or ids.numel() == 0:
        raise InputError(f"z must be a non-empty 1-D sequence of training example ids, got shape {tuple(ids.shape)}.")
    if ids.is_floating_point() or ids.dtype == torch.bool:
        raise InputError(f"z must be integer example ids, got dtype {ids.dtype}.")
    ids = ids.to(torch.int64)
    if int(ids.min()) < 0 or int(ids.max()) >= n:
        raise InputError(
            f"z must index the training set of {n} examples, [0, {n}), got {int(ids.min())}..{int(ids.max())}; "
            "pass ids into the training set (and its size as n_train)."
        )
    return ids


def _as_size(n_train) -> int:
    try:
        n_train = operator.index(n_train)
    except TypeError:
        n_train = None
    if n_train is None or n_train < 1:
        raise InputError("n_train must be the size of the training set the ids index (a positive integer), e.g. len(X).")
    return n_train


def _as_pair(data: tuple[torch.Tensor, torch.Tensor] | Dataset, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    if isinstance(data, Dataset):
        items = [data[i] for i in range(len(data))]
        if not items:
            raise InputError(f"{name} is empty.")
        data = (torch.stack([torch.as_tensor(x) for x, _ in items]), torch.stack([torch.as_tensor(y) for _, y in items]))
    if not isinstance(data, (tuple, list)) or len(data) != 2:
        raise InputError(f"{name} must be a pair (inputs, targets) of tensors or a Dataset of such pairs.")
    inputs, targets = (torch.as_tensor(t) for t in data)
    if inputs.dim() == 0 or targets.dim() == 0 or inputs.shape[0] != targets.shape[0]:
        raise InputError(
            f"{name}: inputs {tuple(inputs.shape)} and targets {tuple(targets.shape)} need the same first dimension."
        )
    if inputs.shape[0] == 0:
        raise InputError(f"{name} is empty.")
    for tensor in (inputs, targets):
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise InputError(f"{name} contains NaN or Inf; clean or impute it first.")
    return inputs, targets


def _losses(model: nn.Module, loss: LossFn, ids: torch.Tensor, x: torch.Tensor, y: torch.Tensor, flip: bool) -> torch.Tensor:
    with model_with_ids(model, ids, flip=flip):
        out = loss(model(x), y)
    if out.shape != (x.shape[0],):
        raise LossError(
            f"loss returned shape {tuple(out.shape)}; it must return one loss per example, shape ({x.shape[0]},)."
        )
    if not torch.isfinite(out).all():
        raise LossError("loss returned NaN or Inf on a sub-network; check the model and the inputs.")
    return out


class _EvalMode:
    """Puts a model in eval mode (TurnOverDropout is driven by routed ids, not by the mode) and restores it."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.modes = {m: m.training for m in model.modules()}

    def __enter__(self) -> nn.Module:
        self.model.eval()
        return self.model

    def __exit__(self, *exc: object) -> None:
        for module, mode in self.modes.items():
            module.training = mode


def influence(
    model: nn.Module,
    z: Sequence[int] | torch.Tensor,
    x_test: tuple[torch.Tensor, torch.Tensor] | Dataset,
    *,
    measure: LossFn,
    n_train: int,
    per_test: bool = False,
    batch_size: int = 1024,
    device: torch.device | str | None = None,
    progress: bool = True,
) -> InfluenceResult:
    """Returns the turn-over influence of each training example in ``z`` on the test points ``x_test``.

    values[i, t] = L(x_t; m_i) − L(x_t; 1 − m_i), L = ``measure`` (positive = training on i raised the measure on
    x_t: harmful for a loss), summed over t unless ``per_test``; ``removal = −values`` (``removal_eps = −1``) is
    the estimated change of the test measure when i is removed. Uses 2·len(z)·len(x_test) example-forward passes
    under ``torch.no_grad()``, grouped into batches of about ``batch_size`` (train id, test point) pairs; the model
    is evaluated in eval mode and its modes are restored afterwards.
    z: the training examples' ids (as routed during :func:`train_turnover`), in [0, n_train);
    measure: what is attributed, ``measure(outputs, targets) -> (B,)`` one value per test example (the model
    carries no loss of its own, so it is required: the training loss gives the test loss);
    n_train: the size of the training set they index; x_test: (inputs, targets) or a Dataset of pairs;
    device: where to compute (default: the model's; the model is moved there).
    Scores are noisy: even an id never trained on gets L(x; m) − L(x; 1 − m) ≠ 0 from the two random
    sub-networks. To see how much of the spread is signal, score ids n..2n−1 of a model trained on n examples
    with ``n_train=2n`` (a set whose second half no example carried in training): their scores are pure noise.
    """
    turnover_layers(model)
    n_train = _as_size(n_train)
    ids = _as_ids(z, n_train)
    inputs, targets = _as_pair(x_test, "x_test")
    device = torch.device(device) if device is not None else next(model.parameters()).device
    inputs, targets = inputs.to(device), targets.to(device)
    n_test = inputs.shape[0]
    test_chunk = min(n_test, batch_size)
    train_chunk = max(1, batch_size // test_chunk)
    values = torch.empty(ids.shape[0], n_test, dtype=torch.float64)
    start = time.perf_counter()
    with torch.no_grad(), _EvalMode(model.to(device)):
        for first in tqdm(range(0, ids.shape[0], train_chunk), desc="turn-over influence", disable=not progress):
            chunk = ids[first : first + train_chunk].to(device)
            for t0 in range(0, n_test, test_chunk):
                x, y = inputs[t0 : t0 + test_chunk], targets[t0 : t0 + test_chunk]
                pair_ids = chunk.repeat_interleave(x.shape[0])
                xs = x.repeat(chunk.shape[0], *([1] * (x.dim() - 1)))
                ys = y.repeat(chunk.shape[0], *([1] * (y.dim() - 1)))
                diff = _losses(model, measure, pair_ids, xs, ys, False) - _losses(model, measure, pair_ids, xs, ys, True)
                values[first : first + chunk.shape[0], t0 : t0 + x.shape[0]] = diff.reshape(chunk.shape[0], -1).double().cpu()
    return InfluenceResult(
        values=values if per_test else values.sum(dim=1),
        n_train=n_train,
        index=ids,
        method="turn-over dropout",
        diagnostics={
            "seconds": {"forward": time.perf_counter() - start},
            "settings": {"forward_examples": 2 * ids.shape[0] * n_test, "batch_size": batch_size},
        },
        removal_eps=-1.0,
    )


def self_influence(
    model: nn.Module,
    loss: LossFn,
    train_data: tuple[torch.Tensor, torch.Tensor] | Dataset,
    ids: Sequence[int] | torch.Tensor | None = None,
    *,
    batch_size: int = 1024,
    device: torch.device | str | None = None,
    progress: bool = True,
) -> InfluenceResult:
    """Returns each training example's turn-over influence on itself: values[i] = L(z_i; m_i) − L(z_i; 1 − m_i).

    Negative = training on z_i lowered its own loss (the usual case; the paper, with the opposite sign,
    reports most self-influences positive). Strongly negative values flag examples the model had to
    memorize (mislabeled or atypical). ``ids`` index ``train_data`` (default: all of it), whose size is the
    result's ``n_train``; ``removal = −values`` (``removal_eps = −1``): how much z_i's own loss changes when
    it is removed. Uses 2·len(ids) example-forward passes in batches of ``batch_size``.
    """
    turnover_layers(model)
    inputs, targets = _as_pair(train_data, "train_data")
    ids = _as_ids(torch.arange(inputs.shape[0]) if ids is None else ids, inputs.shape[0])
    device = torch.device(device) if device is not None else next(model.parameters()).device
    values = torch.empty(ids.shape[0], dtype=torch.float64)
    start = time.perf_counter()
    with torch.no_grad(), _EvalMode(model.to(device)):
        for first in tqdm(range(0, ids.shape[0], batch_size), desc="turn-over self-influence", disable=not progress):
            chunk = ids[first : first + batch_size]
            x, y, dev_ids = inputs[chunk].to(device), targets[chunk].to(device), chunk.to(device)
            diff = _losses(model, loss, dev_ids, x, y, False) - _losses(model, loss, dev_ids, x, y, True)
            values[first : first + chunk.shape[0]] = diff.double().cpu()
    return InfluenceResult(
        values=values,
        n_train=inputs.shape[0],
        index=ids,
        method="turn-over self-influence",
        diagnostics={
            "seconds": {"forward": time.perf_counter() - start},
            "settings": {"forward_examples": 2 * ids.shape[0], "batch_size": batch_size},
        },
        removal_eps=-1.0,
    )
