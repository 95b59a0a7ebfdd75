"""Replay: the recorded run again — same start, batches, learning rates and optimizer — with other data weights.

``replay(record, weights)`` re-runs every stage with the per-example weights w (1 = as recorded, 0 = dropped,
1 ± ε = the finite differences that check the metagradient); a later stage starts from, and under Case 1 keeps,
the *replayed* previous stage's shared block. ``outputs(record, measure, weights)`` is the measure of the
replayed final model: the quantity the metagradient differentiates and the replay LDS protocol ranks.
``reweighted(record, weights)`` is the record re-run at w: a record of that run (its checkpoints, same schedule)
that carries w, so the reverse pass differentiates it (``metagradients(..., at=w)``).
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from tqdm.auto import tqdm

from ..chain import Measure
from ..errors import InputError, NotReplayable
from .optimizers import Tensors
from .record import Record, stage_weights
from .run import StageRun, replaying


def start(run: StageRun, anchors: Tensors) -> Tensors:
    """θ_0 of a stage given its inherited block: the recorded start, with inherited trained parameters from ``anchors``."""
    theta = run.checkpoints[0][0]
    return {n: anchors[n] if n in run.inherited else v for n, v in theta.items()}


def unit_weights(run: StageRun, idx: torch.Tensor, weights: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """The batch's data weights w_B (the run's own where no weights are given: ones for a recorded run), on the
    stage's device, in the inputs' floating dtype (the trained parameters' for token ids)."""
    dtype = like.dtype if like.is_floating_point() else next(iter(run.checkpoints[0][0].values())).dtype
    weights = run.weights if weights is None else weights
    if weights is None:
        return torch.ones(idx.numel(), dtype=dtype, device=run.stage.device)
    return weights.to(run.stage.device, dtype)[idx.to(run.stage.device)]


def replay_run(run: StageRun, anchors: Tensors, weights: torch.Tensor | None, *, check: bool = False,
               keep: bool = False, progress: bool = False) -> tuple[Tensors, float, dict]:
    """(final values, largest |difference| from a recorded checkpoint — only with ``check``, else 0.0, and — only
    with ``keep`` — the replayed (θ, state) at the recorded checkpoint steps, else {})."""
    theta, state = start(run, anchors), run.checkpoints[0][1]
    error, kept = 0.0, ({0: (theta, state)} if keep else {})
    for t in tqdm(range(run.steps), desc="replay", disable=not progress, leave=False):
        idx, x, y = run.batch(t)
        theta, state = run.step(t, theta, state, anchors, unit_weights(run, idx, weights, x), x, y)
        if t + 1 in run.checkpoints:
            if check:
                error = max(error, deviation((theta, state), run.checkpoints[t + 1]))
            if keep:
                kept[t + 1] = (theta, state)
    return {n: anchors[n] for n in run.frozen} | theta, error, kept


def verify(record: Record) -> float:
    """Replay every stage from its recorded start and return the largest |difference| from a recorded checkpoint
    (θ and optimizer state, every checkpoint of every stage): 0.0 means bit-equal."""
    error, previous = 0.0, None
    for run in record.runs:
        anchors = run.anchors if previous is None else {n: previous[m] for n, m in run.inherited.items()}
        _, err, _ = replay_run(run, anchors, None, check=True)
        error = max(error, err)
        previous = run.final
    return error


def refuse_unreproduced(k: int, step: int, error: float, tolerance: float = 0.0) -> None:
    """Refuse (:class:`~influkit.errors.NotReplayable`) a stage whose replay ends a segment ``error`` away from its
    recorded checkpoint at ``step`` (more than ``tolerance``): the record does not hold the run that trained, so no
    score of it describes that run."""
    if error > tolerance:
        raise NotReplayable(
            f"replay does not reproduce the recorded run: stage {k}'s replay reaches step {step} up to {error:.3g} "
            f"away from its checkpoint{f' (tolerance {tolerance:.3g})' if tolerance else ''}, so the scores would be "
            "those of a run that never happened. Likely causes: the loop's loss is not the one replay computes (a "
            "Case 2 link with alpha > 0 needs run.penalty() added to it; no other terms), parameters were changed "
            "outside the optimizer (in-place edits, weight averaging), non-deterministic kernels, or the record "
            "was replayed on another device or thread setting than it was recorded on. ik.unrolled.verify(record) "
            "repeats the check.")


def deviation(a, b) -> float:
    """Largest |a − b| over matching (nested dict / tuple of) tensors."""
    if torch.is_tensor(a):
        return float((a - b).abs().max()) if a.numel() else 0.0
    if isinstance(a, dict):
        return max((deviation(a[k], b[k]) for k in a), default=0.0)
    return max((deviation(u, v) for u, v in zip(a, b)), default=0.0)


def replay(record: Record, weights=None, *, progress: bool = False) -> list[Tensors]:
    """Each stage's final values (trained θ_T and fixed shared block) after re-running the record with ``weights``.

    weights: None (the recorded run), one tensor of per-example weights for stage 0, or one entry (tensor of
    shape (n_k,) or None) per stage; None keeps a stage at the weights its run carries (w = 1 when recorded). A
    language-model stage also takes per-token weights (n_k, L), one per token term of its loss
    (:mod:`influkit.per_token`).
    """
    if not len(record):
        raise InputError("the record has no stage; train one with record.train(...) or record.recorder(...).")
    finals, previous = [], None
    for run, w in zip(record.runs, stage_weights(record, weights)):
        anchors = run.anchors if previous is None else {n: previous[m] for n, m in run.inherited.items()}
        previous, _, _ = replay_run(run, anchors, w, progress=progress)
        finals.append(previous)
    return finals


def reweighted(record: Record, weights, *, progress: bool = False) -> Record:
    """The record re-run at data weights ``weights`` (as :func:`replay` takes them): same starts, batches, learning
    rates and checkpoint steps; each stage's checkpoints, and a later stage's inherited block S̄, are those of the
    re-run, and each stage carries its weights (``StageRun.weights``), so :func:`replay`, :func:`verify` and the
    reverse pass of :func:`~.metagradient.metagradients` run at them. Models and data are shared, not copied."""
    if not len(record):
        raise InputError("the record has no stage; train one with record.train(...) or record.recorder(...).")
    out, previous = Record(), None
    for run, w in zip(record.runs, stage_weights(record, weights)):
        moved = copy.copy(run)
        if w is not None:
            moved.weights = w.detach().to(run.stage.device)
        if previous is not None:
            moved.anchors = {n: previous[m] for n, m in run.inherited.items()}
        previous, _, moved.checkpoints = replay_run(moved, moved.anchors, None, keep=True, progress=progress)
        out.runs.append(moved)
    return out


def as_measure(record: Record, test, measure: Measure | None = None) -> Callable[[Tensors], torch.Tensor]:
    """``test`` as a function of the last stage's final values returning a scalar or a (q,) vector.

    test: an (inputs, targets) test set — its per-test values ``measure(outputs, targets)`` under the last stage,
    the model in eval mode (no dropout); ``measure`` is the :data:`influkit.chain.Measure` that ``Chain.query`` takes
    (the same object gives the same test function to both), default the stage's loss — or a callable
    params → tensor of the final values themselves (then ``measure`` must be None).
    """
    if measure is not None and not callable(measure):
        raise InputError("measure must be callable as measure(outputs, targets) -> (B,), as Chain.query takes it.")
    if callable(test):
        if measure is not None:
            raise InputError("measure= applies to an (inputs, targets) test set; a callable test is already a "
                             "function of the final values.")
        return test
    if isinstance(test, (tuple, list)) and len(test) == 2 and all(torch.is_tensor(t) for t in test):
        stage = record.runs[-1].stage
        inputs, targets = (t.to(stage.device) for t in test)
        evaluation = [(module, False) for module in stage.model.modules()]

        def values(params):
            with replaying(None, evaluation):
                if measure is None:
                    return stage.losses(params, inputs, targets)
                return measure(stage.outputs(params, inputs), targets)

        return values
    raise InputError("the test must be an (inputs, targets) pair of test tensors or a callable params -> tensor.")


def outputs(record: Record, test, weights=None, *, measure: Measure | None = None,
            progress: bool = False) -> torch.Tensor:
    """The measure (scalar or (q,)) of the final model after replaying the record with ``weights`` (``test`` and
    ``measure`` as :func:`as_measure` takes them)."""
    with torch.no_grad():
        return as_measure(record, test, measure)(replay(record, weights, progress=progress)[-1]).detach()
