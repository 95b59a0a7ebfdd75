"""The stage boundary that the exact and the approximate reverse passes share: the measure's adjoint on the last
stage's final values, the adjoint handed from a stage to the one before it, and the data weights ``at=``.

A score is d measure / d w_z; the last stage's reverse pass starts from θ̄_T = ∂ measure / ∂(its final values)
(:func:`measure_adjoint`), and stage k's adjoint on its start and on its inherited block is stage k − 1's θ̄_T
(:func:`hand_over`).
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch.func import jacrev

from ..chain import Measure
from ..errors import InputError
from .record import Record, stage_weights
from .replay import as_measure, reweighted


def reweighted_at(record: Record, measure, at, progress: bool) -> Record:
    """The record re-run at the weights ``at`` (itself when None), for a measure that is not an :class:`Adjoint`."""
    if at is None:
        return record
    if isinstance(measure, Adjoint):
        raise InputError("an Adjoint is d measure / d the recorded final values, which at= moves; pass the "
                         "measure itself, or compute the adjoint on ik.unrolled.reweighted(record, at) and "
                         "pass that record without at.")
    return reweighted(record, at_weights(record, at), progress=progress)


def at_weights(record: Record, at) -> list[torch.Tensor | None]:
    """``at`` of :func:`~.metagradient.metagradients` as per-stage weights (None: as recorded), checked: finite and
    ≥ 0."""
    full = lambda run, value: torch.full((len(run.stage),), float(value), dtype=torch.float64)  # noqa: E731
    is_number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
    if is_number(at):
        weights = [full(run, at) for run in record.runs]
    else:
        entries = [at] if torch.is_tensor(at) else list(at)
        weights = stage_weights(record, [full(run, v) if is_number(v) else v
                                         for run, v in zip(record.runs, entries)] + entries[len(record):], name="at")
    for k, w in enumerate(weights):
        if w is not None and not (torch.isfinite(w).all() and (w >= 0).all()):
            raise InputError(f"at[{k}] holds negative or non-finite weights; take the metagradient at data weights "
                             "w ≥ 0 (1: the recorded run; 1 − f: the mean rule for dropping a fraction f).")
    return weights


def describe_at(at, record: Record):
    """``at`` for the diagnostics: None, the float, or per stage None or the weights' min / mean / max."""
    if at is None or isinstance(at, (int, float)):
        return at
    return [None if run.weights is None else {"min": float(run.weights.min()), "mean": float(run.weights.mean()),
                                              "max": float(run.weights.max())} for run in record.runs]


@dataclass(frozen=True)
class Adjoint:
    """A measure given by its adjoint on the last stage's final values: {name: d measure / d that tensor}.

    Use it when the measure is reached through something the record does not hold — e.g. a later stage refit to
    its optimum after the recorded run, whose implicit-function adjoint on the shared block (the Case 1 chain's
    df/dS̄ = b − H_{S,θ} H⁻¹ a) is computed outside. Names: final values of the last recorded stage (trained θ_T or
    fixed shared block); missing names count as 0. Shapes: the parameter's, or ``(q, *shape)`` for q measure
    outputs with ``batched``. Pass it as the test set of :func:`~.metagradient.metagradients` or
    :func:`~.segments.approximate`.
    """

    tensors: Mapping[str, torch.Tensor]
    batched: bool = False


def measure_adjoint(record: Record, test, per_test: bool, measure: Measure | None = None) -> tuple[dict, int, int]:
    """(θ̄_T = ∂f/∂(final values) with a leading dimension q, q, the measure's number of outputs)."""
    if not len(record):
        raise InputError("the record has no stage; train one with record.train(...) or record.recorder(...).")
    if isinstance(test, Adjoint):
        if measure is not None:
            raise InputError("measure= applies to an (inputs, targets) test set, not to an Adjoint.")
        return given_adjoint(record, test, per_test)
    fn = as_measure(record, test, measure)
    final = {n: v.detach() for n, v in record.runs[-1].final.items()}
    with torch.no_grad():
        outputs = fn(final).numel()
    q = outputs if per_test else 1
    padding = record.runs[-1].padding

    def vector(params, rows):
        with padding.feeding(rows) if rows else nullcontext():  # the fed padding rows: inputs of their own
            value = fn(params)
        return value.reshape(-1) if per_test else value.sum().reshape(1)

    rows = {} if padding is None else padding.values(final)
    through, row_terms = jacrev(vector, argnums=(0, 1))(final, rows)
    adjoint = {n: j.reshape(q, *final[n].shape) for n, j in through.items()}
    return (padding.add(adjoint, row_terms) if rows else adjoint), q, outputs


def given_adjoint(record: Record, adjoint: Adjoint, per_test: bool) -> tuple[dict, int, int]:
    """:func:`measure_adjoint` of an :class:`Adjoint`, checked against the record's final values."""
    final, given, batched = record.runs[-1].final, dict(adjoint.tensors), adjoint.batched
    unknown = [n for n in given if n not in final]
    if unknown:
        raise InputError(f"adjoint names {unknown} are not final values of the last recorded stage; use names among "
                         f"{list(final)[:5]}{' ...' if len(final) > 5 else ''}.")
    if not given:
        raise InputError("the adjoint is empty; give d measure / d (final value) for at least one parameter.")
    bad = [n for n, v in given.items() if tuple(v.shape[1 if batched else 0:]) != tuple(final[n].shape)]
    lead = {v.shape[0] if batched else 1 for v in given.values()}
    if bad or len(lead) > 1 or lead == {0}:
        raise InputError(f"every adjoint tensor must have its parameter's shape"
                         f"{' after one common leading size q' if batched else ''} (batched={batched}); "
                         f"mismatched: {bad or list(given)}.")
    outputs = lead.pop()
    tensors = {n: (v if batched else v.unsqueeze(0)).to(final[n].device, final[n].dtype) for n, v in given.items()}
    if not per_test:
        tensors = {n: v.sum(0, keepdim=True) for n, v in tensors.items()}
    return tensors, outputs if per_test else 1, outputs


def hand_over(record: Record, k: int, theta_bar: dict, anchor_bar: dict, q: int) -> dict:
    """Stage k − 1's final adjoint from stage k's: θ̄_0 of each inherited trained block + the inherited block's S̄."""
    run = record.runs[k]
    adjoint = {n: torch.zeros(q, *v.shape, dtype=v.dtype, device=v.device) for n, v in record.runs[k - 1].final.items()}
    for n, m in run.inherited.items():
        adjoint[m] = adjoint[m] + anchor_bar[n] + (theta_bar[n] if n in theta_bar else 0)
    return adjoint
