"""How far from linear a recorded run is: its sharpness against its learning rate, checkpoint by checkpoint.

An SGD step with heavy-ball momentum μ and learning rate η is linearly stable along a Hessian eigen-direction with
eigenvalue λ exactly when 0 < η(λ + decay) < 2(1 + μ) (the edge of stability; ``decay`` the coupled weight decay;
with Nesterov momentum the edge is 2(1 + μ)/(1 + 2μ)).
Past it, the step's linearization expands that direction, and a run that still trains (its sharpness adapts, Cohen
et al. 2021) answers a change of its data weights far from linearly: the exact metagradient is then right for
infinitesimal changes (it is the run's derivative) but predicts whole-example drops poorly. :func:`sharpness`
measures λ_max of each stage's full-data objective (1/n) Σ ℓ(z; θ_t) + R(θ_t) (+ the Case 2 proximal term) over the
trained parameters at the record's checkpoints by Lanczos (:func:`influkit.stationarity.extreme_eigenvalues`; a
Ritz value, never above λ_max) and puts η_t·λ_max beside the edge. Adam's stability depends on its preconditioner
too, so its rows leave the edge empty.
"""

from __future__ import annotations

import pandas as pd
import torch
from tqdm.auto import tqdm

from ..curvature import HessianOperator
from ..stationarity import STEPS, extreme_eigenvalues
from .optimizers import SGD
from .record import Record
from .terms import holding

COLUMNS = ("stage", "step", "lr", "max_eigenvalue", "lr_times_eigenvalue", "edge", "past_edge", "lanczos_steps")


def sharpness(record: Record, *, steps: int = STEPS, memory: int | None = None, progress: bool = False) -> pd.DataFrame:
    """One row per checkpoint of every recorded stage (module docstring): ``stage``, ``step`` t, ``lr`` η_t (the
    learning rate of the step taken from θ_t; the last step's at the final checkpoint), ``max_eigenvalue`` λ_max of
    the stage objective's Hessian at θ_t plus the coupled weight decay, ``lr_times_eigenvalue`` η_t·λ_max,
    ``edge`` 2(1 + μ) for SGD (None for Adam/AdamW), ``past_edge`` (η_t·λ_max > edge), ``lanczos_steps``.
    steps: Lanczos steps (Hessian-vector products) per checkpoint; memory: their budget (bytes). The Hessian is the
    recorded objective's (w = 1), the Case 1 fixed block at the previous stage's final values."""
    rows = []
    jobs = [(k, t) for k, run in enumerate(record.runs) for t in sorted(run.checkpoints)]
    for k, t in tqdm(jobs, desc="sharpness", disable=not progress, leave=False):
        run = record.runs[k]
        theta = run.checkpoints[t][0]
        extra = None
        if run.alpha:
            anchors, alpha = run.anchors, run.alpha
            extra = lambda p: alpha * sum(((p[m] - anchors[m]) ** 2).sum() for m in run.inherited)  # noqa: E731
        with holding(run.stage.model, {n: run.anchors[n] for n in run.frozen}):
            operator = HessianOperator(run.stage, list(run.trained), at=theta, extra=extra, memory=memory)
            _, largest, m = extreme_eigenvalues(operator, steps)
        sgd = isinstance(run.optimizer, SGD)
        largest += run.optimizer.weight_decay if sgd else 0.0
        lr = run.lrs[min(t, run.steps - 1)]
        edge = edge_of_stability(run.optimizer) if sgd else None
        rows.append((k, t, lr, largest, lr * largest, edge, None if edge is None else lr * largest > edge, m))
    return pd.DataFrame(rows, columns=list(COLUMNS))


def edge_of_stability(optimizer: SGD) -> float:
    """The largest η·λ at which one SGD step is linearly stable: 2(1 + μ), or 2(1 + μ)/(1 + 2μ) with Nesterov."""
    mu = optimizer.momentum
    return 2 * (1 + mu) / (1 + 2 * mu) if optimizer.nesterov else 2 * (1 + mu)
