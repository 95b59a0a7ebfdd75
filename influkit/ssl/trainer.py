"""Algorithm 1 of Ren et al. (2020): alternate N gradient steps on θ with a hypergradient step on the unlabeled weights Λ.

Each θ step draws batches D' ⊆ D, U' ⊆ U and descends

    L(D', U'; θ, Λ) = mean_{D'} ℓ_S + mean_{u∈U'} λ_u ℓ_U(u) + R(θ);

after ``warmup`` steps, every ``inner_steps`` θ steps draw fresh D', U', V' and update the weights of the U'
examples with ∂L_S(V', θ*)/∂λ_u, the ``values`` of :func:`influkit.ssl.hypergradient.hypergradient` (θ* := current θ),
by M-Adam (default), Adam or SGD, keeping λ ≥ 0. Modes: ``"per-example"`` (one λ_u per unlabeled example),
``"single"`` (one λ shared by all, its hypergradient is the sum over U' — the paper's ablation),
``"uniform"`` (a fixed λ: plain SSL) and ``"supervised"`` (no unlabeled term).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import pandas as pd
import torch
from torch import nn
from tqdm.auto import tqdm

from ..errors import InputError
from ..stage import Regularizer
from ..solvers import SolveConfig
from .hypergradient import hypergradient
from .madam import MaskedAdam

MODES = ("per-example", "single", "uniform", "supervised")
WEIGHT_OPTIMIZERS = ("madam", "adam", "sgd")


@dataclass
class SSLRun:
    """The outcome of :func:`train_ssl`: the trained ``model`` (in place), the final weights (|U|,), and the log."""

    model: nn.Module
    weights: torch.Tensor
    history: pd.DataFrame


def _evaluate(model: nn.Module, loss: Callable, data: tuple[torch.Tensor, torch.Tensor]) -> tuple[float, float]:
    """Returns (mean loss, accuracy) of ``model`` on ``data``."""
    with torch.no_grad():
        outputs = model(data[0])
        return float(loss(outputs, data[1]).mean()), float((outputs.argmax(-1) == data[1]).float().mean())


def last_linear(model: nn.Module) -> str:
    """Returns the name of the last ``nn.Linear`` submodule of ``model`` (the paper's default θ for the hypergradient)."""
    names = [name for name, module in model.named_modules() if isinstance(module, nn.Linear)]
    if not names or not names[-1]:
        raise InputError("the model has no nn.Linear submodule; pass hyper_params= the parameters to differentiate.")
    return names[-1]


def _weight_optimizer(name: str, weights: torch.Tensor, lr: float) -> torch.optim.Optimizer:
    if name == "madam":
        return MaskedAdam([weights], lr=lr, nonnegative=True)
    if name == "adam":
        return torch.optim.Adam([weights], lr=lr)
    return torch.optim.SGD([weights], lr=lr)


@dataclass(frozen=True)
class SSLConfig:
    """The settings of Algorithm 1 (:func:`train_ssl`), checked when built.

    mode: one of ``MODES``. steps: θ steps in all; inner_steps: N θ steps per Λ step; warmup: θ steps before the
    first Λ step. lr: Adam's step on θ; weight_lr, weight_optimizer (one of ``WEIGHT_OPTIMIZERS``): the Λ update;
    init_weight: λ at the start (≥ 0). labeled_batch, unlabeled_batch, val_batch: |D'|, |U'|, |V'| drawn per step
    (val_batch None: all of V). hyper_params: names/prefixes of the θ the hypergradient differentiates (default: the
    last nn.Linear layer, the paper's fast variant); solve: its :class:`~influkit.solvers.SolveConfig` (default
    ``auto``, an exact solve of the small layer, with ridge 1e-2). log_every: θ steps between rows of the history.
    seed: batch sampling.
    """

    mode: str = "per-example"
    steps: int = 1000
    inner_steps: int = 10
    warmup: int = 100
    lr: float = 1e-3
    weight_lr: float = 1e-2
    weight_optimizer: str = "madam"
    init_weight: float = 1.0
    labeled_batch: int = 64
    unlabeled_batch: int = 128
    val_batch: int | None = None
    hyper_params: str | tuple[str, ...] | None = None
    solve: SolveConfig = SolveConfig(damping=1e-2)
    log_every: int = 50
    seed: int = 0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise InputError(f"unknown mode {self.mode!r}; choose one of {MODES}.")
        if self.weight_optimizer not in WEIGHT_OPTIMIZERS:
            raise InputError(f"unknown weight optimizer {self.weight_optimizer!r}; choose one of {WEIGHT_OPTIMIZERS}.")
        if self.init_weight < 0:
            raise InputError(f"init_weight must be ≥ 0, got {self.init_weight}.")
        if self.inner_steps < 1 or self.steps < 0:
            raise InputError("inner_steps must be ≥ 1 and steps ≥ 0.")
        if min(self.labeled_batch, self.unlabeled_batch, self.log_every) < 1 or (self.val_batch or 1) < 1:
            raise InputError("labeled_batch, unlabeled_batch, val_batch and log_every must be ≥ 1.")
        if not isinstance(self.solve, SolveConfig):
            raise InputError(f"solve must be an influkit.SolveConfig, got {type(self.solve).__name__}.")


def train_ssl(
    model: nn.Module,
    sup_loss: Callable,
    unsup_loss: Callable,
    labeled: tuple[torch.Tensor, torch.Tensor],
    unlabeled: torch.Tensor,
    val: tuple[torch.Tensor, torch.Tensor],
    config: SSLConfig = SSLConfig(),
    *,
    regularizer: Regularizer | None = None,
    test: tuple[torch.Tensor, torch.Tensor] | None = None,
    callback: Callable | None = None,
    device: torch.device | str | None = None,
    progress: bool = False,
) -> SSLRun:
    """Returns an :class:`SSLRun` after training ``model`` in place by Algorithm 1 (Adam on θ, ``weight_optimizer`` on Λ).

    sup_loss(outputs, targets) -> (B,); unsup_loss(model, inputs) -> (B,) with detached targets (e.g.
    :class:`~influkit.ssl.losses.PseudoLabel`, :class:`~influkit.ssl.losses.Consistency`).
    labeled, val, test: (inputs, targets); unlabeled: inputs. The model stays in eval mode (no dropout or
    batch-norm statistics: the hypergradient needs a deterministic loss).
    config: the :class:`SSLConfig` (mode, steps, learning rates, batch sizes, the hypergradient's θ and solve).
    regularizer: R(θ), added to the θ loss and to the hypergradient's objective.
    callback(step, model, weights) is called at every row of ``history`` (every ``config.log_every`` θ steps);
    device: where to train (default: the model's).
    """
    if not isinstance(config, SSLConfig):
        raise InputError(f"config must be an influkit.ssl.SSLConfig, got {type(config).__name__}.")
    if unlabeled.shape[0] == 0:
        raise InputError("the unlabeled set is empty: give at least one unlabeled example.")
    mode, steps, inner_steps, warmup = config.mode, config.steps, config.inner_steps, config.warmup
    batch_size, unlabeled_batch, val_batch = config.labeled_batch, config.unlabeled_batch, config.val_batch
    hyper_params, solve, log_every = config.hyper_params, config.solve, config.log_every
    hyper_params = last_linear(model) if hyper_params is None else hyper_params
    device = torch.device(device) if device is not None else next(model.parameters()).device
    model.to(device).eval()
    dtype = next(model.parameters()).dtype
    labeled = (labeled[0].to(device), labeled[1].to(device))
    val = (val[0].to(device), val[1].to(device))
    test = None if test is None else (test[0].to(device), test[1].to(device))
    unlabeled = unlabeled.to(device)
    n_l, n_u, n_v = labeled[0].shape[0], unlabeled.shape[0], val[0].shape[0]

    size = 1 if mode in ("single", "uniform") else n_u
    weights = torch.full((size,), float(config.init_weight), dtype=dtype, device=device, requires_grad=False)
    learn = mode in ("per-example", "single")
    weight_opt = _weight_optimizer(config.weight_optimizer, weights, config.weight_lr) if learn else None
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=config.lr)
    gen = torch.Generator().manual_seed(config.seed)

    def draw(n: int, k: int | None) -> torch.Tensor:
        k = n if k is None else min(k, n)
        return torch.randperm(n, generator=gen)[:k].to(device)

    def weights_of(idx: torch.Tensor) -> torch.Tensor:
        return weights[idx] if mode == "per-example" else weights.expand(idx.shape[0])

    rows, updates, last_hyper, train_loss = [], 0, float("nan"), float("nan")
    start = time.perf_counter()

    def log(step: int) -> None:
        val_loss, val_acc = _evaluate(model, sup_loss, val)
        full = weights.detach().expand(n_u) if mode != "per-example" else weights.detach()
        if mode == "supervised":
            full = torch.zeros_like(full)
        row = dict(
            step=step, train_loss=train_loss, val_loss=val_loss, val_acc=val_acc,
            weight_mean=float(full.mean()), weight_std=float(full.std()) if n_u > 1 else 0.0,
            weight_min=float(full.min()), weight_max=float(full.max()),
            weight_zero_frac=float((full == 0).float().mean()),
            weight_updates=updates, hypergrad_abs_mean=last_hyper, seconds=time.perf_counter() - start,
        )
        if test is not None:
            row["test_loss"], row["test_acc"] = _evaluate(model, sup_loss, test)
        rows.append(row)
        if callback is not None:
            callback(step, model, full.clone())

    bar = tqdm(range(1, steps + 1), desc=f"ssl ({mode})", disable=not progress, leave=False)
    log(0)
    for step in bar:
        idx_l, idx_u = draw(n_l, batch_size), draw(n_u, unlabeled_batch)
        opt.zero_grad()
        loss = sup_loss(model(labeled[0][idx_l]), labeled[1][idx_l]).mean()
        if mode != "supervised":
            loss = loss + (weights_of(idx_u) * unsup_loss(model, unlabeled[idx_u])).mean()
        if regularizer is not None:
            loss = loss + regularizer({n: p for n, p in model.named_parameters() if p.requires_grad})
        loss.backward()
        opt.step()
        train_loss = float(loss.detach())

        if learn and step > warmup and (step - warmup) % inner_steps == 0:
            idx_l, idx_u, idx_v = draw(n_l, batch_size), draw(n_u, unlabeled_batch), draw(n_v, val_batch)
            result = hypergradient(
                model, sup_loss, unsup_loss, (labeled[0][idx_l], labeled[1][idx_l]), unlabeled[idx_u],
                (val[0][idx_v], val[1][idx_v]), weights_of(idx_u).detach(), index=idx_u,
                params=hyper_params, regularizer=regularizer, solve=solve,
            )
            grad = torch.zeros_like(weights)
            if mode == "per-example":
                grad[idx_u] = result.values.to(dtype)
            else:
                grad[0] = result.values.sum()
            weights.grad = grad
            weight_opt.step()
            with torch.no_grad():
                weights.clamp_(min=0.0)
            updates += 1
            last_hyper = float(result.values.abs().mean())
        if step % log_every == 0 or step == steps:
            log(step)
            bar.set_postfix(val_acc=f"{rows[-1]['val_acc']:.3f}")
    bar.close()
    final = weights.detach().expand(n_u).clone() if mode != "per-example" else weights.detach().clone()
    if mode == "supervised":
        final.zero_()
    return SSLRun(model=model, weights=final, history=pd.DataFrame(rows))
