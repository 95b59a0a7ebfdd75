"""Where a stage's pieces begin and end, and the parameters and optimizer state there (from the record's checkpoints
or replayed from the last one before), with each step's recorded clipping factor."""

from __future__ import annotations

import copy

import torch

from .replay import start, unit_weights
from .run import StageRun
from .watch import eval_stage


def boundaries(run: StageRun, pieces: int) -> list[tuple[int, int]]:
    """[(a, b)]: the run's steps cut into ``pieces`` contiguous pieces."""
    cuts = sorted({round(run.steps * i / pieces) for i in range(pieces + 1)})
    return list(zip(cuts[:-1], cuts[1:]))


def fed_rows(run: StageRun) -> tuple[StageRun, float, torch.Tensor]:
    """(a copy of a Trainer run (its batches as the collator made them, ``run.inputs``) whose stage has one row per fed
    example per step, as the collator fed it — its recorded masks, padded to the stage's length with the stage's own
    padding —, so that the stage's mean over rows is the mean of the recorded steps' objectives in eval mode; c, the
    steps' mean examples per predicted token (the Trainer divides a masked-LM batch's summed loss by its number of
    predicted tokens; 1 for classification), the factor of that mean in a step's data term; the example each row
    belongs to). The curvature of the steps' data term is c times that of the copy's stage."""
    x, y = run.stage.data.take(torch.cat([run.batches[t] for t in range(run.steps)]))
    begin = 0
    for t in range(run.steps):
        xb, yb = (v.to(x.device) for v in run.inputs[t])
        rows = slice(begin, begin + xb.shape[0])
        begin += xb.shape[0]
        x[rows, ..., :xb.shape[-1]] = xb  # positions past the batch's length are padding in both
        if y.dim() == 2:
            y[rows, :yb.shape[-1]] = yb
        else:
            y[rows] = yb
    collated = copy.copy(run)
    collated.stage = eval_stage(run.stage.model, lambda: run.stage.with_(data=(x, y)))
    scale = sum(run.data_scale(t) for t in range(run.steps)) / run.steps
    return collated, float(scale), torch.cat([run.batches[t] for t in range(run.steps)])


def checkpoint_at(run: StageRun, b: int) -> tuple[dict, dict]:
    """(θ_b, optimizer state_b): the recorded checkpoint when step b has one, else replayed from the last before b."""
    if b in run.checkpoints:
        return run.checkpoints[b]
    a = max(t for t in run.checkpoints if t < b)
    theta, state = run.checkpoints[a] if a else (start(run, run.anchors), run.checkpoints[0][1])
    for t in range(a, b):
        idx, x, y = run.batch(t)
        theta, state = run.step(t, theta, state, run.anchors, unit_weights(run, idx, None, x), x, y)
    return {n: v.detach() for n, v in theta.items()}, state


def clipped_trajectory(run: StageRun, ends: list[int]) -> tuple[dict, list[float]]:
    """({b: (θ_b, state_b)} at the pieces' ends, [c_t for every step]): one replay of the stage from its start, each
    step's gradient giving the factor c_t its recorded clipping scaled it by (1.0 where it did not clip) — one
    gradient per step in all; an end with a checkpoint keeps the record's own tensors."""
    theta, state = start(run, run.anchors), run.checkpoints[0][1]
    kept, gains = {}, []
    for t in range(max(ends)):
        idx, x, y = run.batch(t)
        grads = run.gradient(t, theta, run.anchors, (x, y, unit_weights(run, idx, None, x)))
        clip = run.recorded_clip(t)
        gains.append(1.0 if clip is None else float(run.optimizer.clip_coefficient(grads, *clip, order=run.clip_order)))
        theta, state = run.update(t, theta, state, grads)
        if t + 1 in ends:
            kept[t + 1] = run.checkpoints[t + 1] if t + 1 in run.checkpoints else \
                ({n: v.detach() for n, v in theta.items()}, state)
    return kept, gains


def moved_frozen(run: StageRun) -> dict:
    """The frozen inherited block's values where they differ from the model's own (a record re-run at other weights
    ends its previous stage elsewhere): the curvature fits and the example terms read the block from the model."""
    named = dict(run.stage.model.named_parameters())
    return {n: run.anchors[n] for n in run.frozen if not torch.equal(named[n].detach(), run.anchors[n])}
