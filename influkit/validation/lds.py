"""The linear datamodeling score (LDS, Park et al. 2023, "TRAK"): do summed scores rank re-trained models?

Draw M random subsets S_1..S_M of the (stage-1, pretraining) set, each holding a fraction α of its n examples;
re-train the model (every stage of a chain, stage 1 on S_j only) from scratch, once per seed; record each test
query's output. For query t the scores predict the output of the model trained on S as the **sum of the scores
of the examples in S**, and

    LDS(t) = Spearman_j( Σ_{i∈S_j} score_i(t),  output_t(S_j) ),     LDS = mean_t LDS(t).

Sign convention. influkit's scores are I(z_i, t) = d(test loss of t)/dε when the stage-1 objective gains ε·ℓ(z_i)
(positive = harmful), and the output is that same **test loss** (larger is worse). Training on S instead of
the full set re-weights example i from 1/n to w_i = 1/|S| (i ∈ S) or 0 (i ∉ S), so to first order

    loss_t(S) ≈ loss_t(full) + Σ_i (w_i − 1/n)·I_i = loss_t(full) − (1/n) Σ_{i∉S} I_i + (1/|S| − 1/n) Σ_{i∈S} I_i
             = const + (1/|S|) Σ_{i∈S} I_i,

and the "removal" form loss_t(full) + Σ_{i∉S} removal_i (removal_i = −I_i/n) equals const + (1/n) Σ_{i∈S} I_i.
With equal-size subsets both are increasing affine maps of Σ_{i∈S} I_i, so the ranks — and the LDS — are the
same, and exact influence gets a **positive** LDS. Scores of the opposite sign convention (positive = helpful,
as TRAK's τ on a margin) must be paired with outputs of that sign (e.g. minus the loss), or the LDS flips sign.

Per-query scores are ``chain.query(x_test, per_test=True).scores().values``, an (n, q) matrix. This module is the
metric only (plain functions, like dattri's ``metric/``); the re-training harness that produces the outputs
(:func:`influkit.apps.lds.run_lds`, :class:`influkit.apps.lds.ChainOutputs`) and the plots live in
:mod:`influkit.apps.lds`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import numpy as np
import torch

from ..errors import InputError, warn
from ..results import InfluenceResult
from .metrics import ranks

if TYPE_CHECKING:
    import pandas as pd


def random_subsets(n: int, n_subsets: int = 50, alpha: float = 0.5, seed: int = 0) -> torch.Tensor:
    """(M, n) bool masks: M seeded random subsets of n examples, each of exactly round(α·n) examples.

    The same (n, n_subsets, alpha, seed) always gives the same subsets (a CPU ``torch.Generator``).
    """
    if not 0 < alpha < 1:
        raise InputError(f"alpha is the fraction of examples kept in each subset and must be in (0, 1), got {alpha}.")
    if n < 2 or n_subsets < 3:
        raise InputError(f"need n ≥ 2 examples and at least 3 subsets to rank, got n = {n}, n_subsets = {n_subsets}.")
    size = int(round(alpha * n))
    if not 0 < size < n:
        raise InputError(f"alpha = {alpha} keeps {size} of {n} examples; choose alpha so that 0 < α·n < n.")
    gen = torch.Generator().manual_seed(int(seed))
    masks = torch.zeros(n_subsets, n, dtype=torch.bool)
    for j in range(n_subsets):
        masks[j, torch.randperm(n, generator=gen)[:size]] = True
    return masks


def _scores_matrix(scores, n: int) -> np.ndarray:
    """Scores as an (n, q) float64 array; an InfluenceResult is put in example order 0..n−1."""
    if isinstance(scores, InfluenceResult):
        values = scores.values.detach().cpu().double().numpy()
        index = scores.index.numpy()
        if sorted(index.tolist()) != list(range(n)):
            raise InputError(
                f"the InfluenceResult scores {len(index)} examples but the subsets are over n = {n}; score every "
                "stage-1 example (query.scores() with no z) before measuring the LDS."
            )
        values = values[np.argsort(index)]
    else:
        values = np.asarray(scores.detach().cpu() if torch.is_tensor(scores) else scores, dtype=float)
    if values.ndim == 1:
        values = values[:, None]
    if values.ndim != 2 or values.shape[0] != n:
        raise InputError(
            f"scores must be (n, q) = ({n}, q) — one row per stage-1 example, one column per test query "
            f"(query(..., per_test=True)) — got shape {values.shape}."
        )
    if not np.isfinite(values).all():
        raise InputError("scores hold NaN/Inf; check the solves' diagnostics before measuring the LDS.")
    return values


def _masks(subsets) -> np.ndarray:
    masks = np.asarray(subsets.detach().cpu() if torch.is_tensor(subsets) else subsets)
    if masks.ndim != 2 or masks.dtype != bool:
        raise InputError(f"subsets must be an (M, n) boolean mask (random_subsets), got {masks.dtype} {masks.shape}.")
    if masks.shape[0] < 3:
        raise InputError(f"need at least 3 subsets to rank, got {masks.shape[0]}.")
    return masks


def _outputs(outputs, m: int, q: int, name: str = "outputs") -> np.ndarray:
    out = np.asarray(outputs.detach().cpu() if torch.is_tensor(outputs) else outputs, dtype=float)
    if out.ndim == 1:
        out = out[:, None]
    if out.shape != (m, q):
        raise InputError(f"{name} must be (M, q) = ({m}, {q}): one row per subset, one column per query; got {out.shape}.")
    if not np.isfinite(out).all():
        raise InputError(f"{name} hold NaN/Inf (unfinished or failed re-trainings); finish the run first.")
    return out


def predicted_outputs(scores, subsets) -> np.ndarray:
    """(M, q): Σ_{i∈S_j} score_i(t), the (rank-equivalent) linear prediction of query t's output on subset j."""
    masks = _masks(subsets)
    return masks.astype(float) @ _scores_matrix(scores, masks.shape[1])


def _columnwise_spearman(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Spearman ρ between the matching columns of a and b (NaN where either column is constant)."""
    ra = np.stack([ranks(column) for column in np.asarray(a, float).T], axis=1)
    rb = np.stack([ranks(column) for column in np.asarray(b, float).T], axis=1)
    ra = ra - ra.mean(0)
    rb = rb - rb.mean(0)
    denom = np.sqrt((ra**2).sum(0) * (rb**2).sum(0))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(denom > 0, (ra * rb).sum(0) / np.where(denom > 0, denom, 1.0), np.nan)


def lds_per_query(scores, subsets, outputs) -> np.ndarray:
    """(q,) LDS(t) = Spearman over subsets j of (Σ_{i∈S_j} score_i(t), outputs[j, t]) for each query t.

    scores: (n, q) (or (n,) for one query, or an InfluenceResult); subsets: (M, n) bool; outputs: (M, q), the
    re-trained models' test loss of each query (seed-averaged). A query whose outputs (or predictions) are the
    same on every subset has no ranking: its value is NaN.
    """
    masks = _masks(subsets)
    predicted = predicted_outputs(scores, masks)
    actual = _outputs(outputs, masks.shape[0], predicted.shape[1])
    return _columnwise_spearman(predicted, actual)


def _mean_over_queries(per_query: np.ndarray) -> float:
    valid = np.isfinite(per_query)
    if not valid.any():
        raise InputError("no query has outputs that vary across subsets: the LDS is undefined.")
    if not valid.all():
        warn(
            f"{int((~valid).sum())} of {per_query.size} queries have constant outputs or predictions across subsets "
            "and are left out of the LDS mean.",
        )
    return float(per_query[valid].mean())


def lds(scores, subsets, outputs) -> float:
    """The linear datamodeling score: the mean over queries of :func:`lds_per_query` (NaN queries left out, warned).

    1 means the summed scores rank the re-trained models' test losses perfectly for every query; 0 means no
    relation; scores of the wrong sign give a negative value (module docstring).
    """
    return _mean_over_queries(lds_per_query(scores, subsets, outputs))


def seed_agreement(outputs) -> float:
    """Mean over queries and seed pairs of Spearman_j(outputs[j, s, t], outputs[j, s', t]), for (M, S, q) outputs.

    How well one re-training seed ranks the subsets the way another does: when it is low, re-training noise
    (not the scores) limits the LDS of single-seed outputs.
    """
    out = np.asarray(outputs.detach().cpu() if torch.is_tensor(outputs) else outputs, dtype=float)
    if out.ndim != 3 or out.shape[1] < 2:
        raise InputError(f"seed_agreement needs (M, S, q) outputs with S ≥ 2 seeds, got shape {out.shape}.")
    values = [
        _columnwise_spearman(out[:, s], out[:, r]) for s in range(out.shape[1]) for r in range(s + 1, out.shape[1])
    ]
    return float(np.nanmean(np.stack(values)))


def lds_table(methods: Mapping[str, object], subsets, outputs) -> "pd.DataFrame":
    """One row per method: LDS on the same subsets and outputs, its spread over queries, and per-seed values.

    methods: {name: (n, q) scores or per-test InfluenceResult}; outputs: (M, q), or (M, S, q) per seed, whose
    seed mean is the reference (as TRAK averages models trained on the same subset), with one extra column
    ``LDS seed s`` per seed. Columns: ``LDS``, ``sem`` (std over queries / √q), ``median``, ``queries``.
    ``attrs`` records M, n, α and, with several seeds, :func:`seed_agreement`.
    """
    import pandas as pd

    masks = _masks(subsets)
    out = np.asarray(outputs.detach().cpu() if torch.is_tensor(outputs) else outputs, dtype=float)
    per_seed = out if out.ndim == 3 else None
    actual = out.mean(1) if per_seed is not None else out
    rows = {}
    for name, scores in methods.items():
        per_query = lds_per_query(scores, masks, actual)
        valid = per_query[np.isfinite(per_query)]
        row = {
            "LDS": _mean_over_queries(per_query),
            "sem": float(valid.std(ddof=1) / np.sqrt(valid.size)) if valid.size > 1 else float("nan"),
            "median": float(np.median(valid)),
            "queries": int(valid.size),
        }
        if per_seed is not None:
            for s in range(per_seed.shape[1]):
                row[f"LDS seed {s}"] = float(np.nanmean(lds_per_query(scores, masks, per_seed[:, s])))
        rows[name] = row
    table = pd.DataFrame(rows).T
    table["queries"] = table["queries"].astype(int)
    table.index.name = "method"
    table.attrs.update({"M": int(masks.shape[0]), "n": int(masks.shape[1]), "alpha": float(masks.mean())})
    if per_seed is not None and per_seed.shape[1] >= 2:
        table.attrs["seed_agreement"] = seed_agreement(per_seed)
    return table
