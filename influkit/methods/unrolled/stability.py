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
too, so its rows leave the edge empty. Past the edge is a cause, not the only one: a run below it can still answer
drops irregularly (mini-batch noise; on Fashion-MNIST SGD at lr 0.05 stayed at η·λ_max ≤ 0.48 of an edge of 3.8 and
was chaotic), so :func:`linearity` checks the answer itself: a few drop sets replayed at full and at small size,
against the scores' prediction.
"""

from __future__ import annotations

import pandas as pd
import torch
from tqdm.auto import tqdm

from ..curvature import HessianOperator
from ..errors import InputError
from ..results import InfluenceResult
from ..stationarity import STEPS, extreme_eigenvalues
from .optimizers import SGD
from .record import Record
from .replay import outputs
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
        with holding(run.stage.model, {n: run.anchors[n] for n in run.frozen}):
            operator = HessianOperator(run.stage, list(run.trained), at=theta, extra=run.proximal(), memory=memory)
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


def linearity(record: Record, measure, scores: InfluenceResult, *, stage: int = 0, fraction: float = 0.01,
              sets: int = 5, steps=(1.0, 0.1), seed: int = 0) -> pd.DataFrame:
    """Does the recorded run answer drops as ``scores`` (d measure / d w_z of stage ``stage``'s examples, e.g. from
    :func:`~.metagradient.metagradients`) predict? For ``sets`` seeded random sets D of ⌊fraction·n⌋ examples (at
    least 1) and each t in ``steps`` the record is replayed at w = 1 − t·1_D (t = 1: D dropped), and
    Δ_t = (m(w) − m(1)) / t is compared with the prediction p = −Σ_{z∈D} score_z over the measure's q outputs (the
    outputs' sum for one column of scores: a summed measure's).
    One row per (set, t): ``cosine`` cos(Δ_t, p) and ``ratio`` ‖Δ_t‖ / ‖p‖. A run linear in w has both 1 at every t;
    for the exact metagradient both tend to 1 as t → 0, so a cosine or ratio far from 1 at t = 1 says how much of a
    whole drop the derivative misses. Costs sets × len(steps) + 1 replays."""
    n = len(record.runs[stage].stage)
    if scores.values.shape[0] != n or not 0 < fraction < 1:
        raise InputError(f"linearity needs the {n} scores of stage {stage} (got {tuple(scores.values.shape)}) and a "
                         f"fraction in (0, 1) (got {fraction!r}).")
    values = torch.zeros(n, *scores.values.shape[1:], dtype=torch.float64)
    values[scores.index] = scores.values.double()  # rows by example id (a streamed or sharded result's order)
    values = values[:, None] if values.dim() == 1 else values
    q = values.shape[1]  # scores of a summed measure (one column) are compared with the measure's sum

    def measured(weights=None):
        value = outputs(record, measure, weights).double().reshape(-1)
        return value.sum(0, keepdim=True) if q == 1 else value

    base = measured()
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for j in range(sets):
        dropped = torch.randperm(n, generator=gen)[:max(1, int(fraction * n))]
        predicted = -values[dropped].sum(0)
        for t in steps:
            weights = [None] * len(record.runs)
            weights[stage] = torch.ones(n)
            weights[stage][dropped] = 1 - t
            delta = (measured(weights) - base) / t
            cosine = float(delta @ predicted / (delta.norm() * predicted.norm()).clamp_min(1e-300))
            rows.append((j, t, cosine, float(delta.norm() / predicted.norm().clamp_min(1e-300))))
    return pd.DataFrame(rows, columns=["set", "t", "cosine", "ratio"])
