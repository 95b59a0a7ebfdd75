"""Leave-out validation: the actual change of the last stage's summed test loss when stage-1 examples are removed
and every stage of a :class:`~influkit.chain.Chain` is re-run, next to the change the scores predict.

For each removal group G the chain is re-trained without G by a :class:`~influkit.validation.retrain.Retrainer`
(default: Newton steps from the chain's own weights to ‖∇F_k‖ ≤ 1e-10 in every stage, each removed example
leaving the stage-1 sum while every other keeps its weight 1/m), and Δ = f(T; re-trained without G) −
f(T; re-trained with everything) is measured, f the summed loss of the last stage on the test set T. The baseline
is re-trained the same way, so whatever drift continued training adds cancels. The influence prediction of Δ for
removing one stage-1 example z is −I(z, T)/m (``InfluenceResult.removal``); for a group, the sum over its members.
Rows are appended to a CSV log as they come, so an interrupted run resumes where it stopped.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import pandas as pd
import torch
from tqdm.auto import tqdm

from ..chain import Chain
from ..errors import InputError
from ..results import InfluenceResult
from ..stage import Stage
from .retrain import Retrainer, kept

BASELINE = "none"

Retrain = Callable[..., "tuple[list[Stage], list[float]]"]  # retrain(chain, keep) -> (stages, ‖∇F_k‖), a Retrainer


def group_label(group: Sequence[int] | None) -> str:
    """The row key of a removal group in a leave-out table ("3+17"; the baseline row for None)."""
    return BASELINE if group is None else "+".join(str(int(i)) for i in group)


def summed_test_loss(stage: Stage, x_test) -> float:
    """f(T) = Σ_t ℓ(x_t) of ``stage``'s model at its current weights on the test set ``x_test`` = (inputs, targets)."""
    inputs, targets = x_test
    with torch.no_grad():
        return float(stage.losses(stage.trained(), inputs.to(stage.device), targets.to(stage.device)).sum())


def leave_out_retrain(
    chain: Chain,
    removals: Sequence[int] | Sequence[Sequence[int]],
    x_test,
    retrainer: Retrain | None = None,
    *,
    predicted: InfluenceResult | Sequence[float] | None = None,
    log: str | Path | None = None,
    progress: bool = True,
) -> pd.DataFrame:
    """Actual change of the last stage's summed test loss for each removal of stage-1 examples, every stage re-run.

    removals: stage-1 example indices, or groups of indices removed together.
    x_test: (inputs, targets) of the last stage's test set.
    retrainer: how the stages are re-run, called as ``retrainer(chain, keep)`` with the kept stage-1 indices
    (default :class:`~influkit.validation.retrain.Retrainer`: Newton, ‖∇‖ ≤ 1e-10).
    predicted: an InfluenceResult of the chain (its ``removal`` summed over each group) or one number per removal.
    log: CSV file rows are appended to as they come; rows already there are reused (an interrupted run resumes).
    Returns a DataFrame with ``removed``, ``test_loss``, ``actual`` (Δ against the re-trained baseline),
    ``grad_norm`` (the largest final ‖∇F_k‖ over the stages; ~1e-10 means every stage is stationary) and
    ``predicted`` when given.
    """
    retrainer = retrainer or Retrainer()
    groups = [[int(r)] if not isinstance(r, (list, tuple, torch.Tensor)) else [int(i) for i in r] for r in removals]
    if not groups:
        raise InputError("removals is empty: give the stage-1 examples to leave out.")
    n = len(chain.stages[0])
    outside = [i for g in groups for i in g if not 0 <= i < n]
    if outside:
        raise InputError(f"removals {outside[:5]} are not indices of the {n} stage-1 examples.")
    done: dict[str, tuple[float, float]] = {}
    if log is not None and Path(log).exists():
        previous = pd.read_csv(log, dtype={"removed": str})
        done = {key: (loss, norm) for key, loss, norm in zip(previous["removed"], previous["test_loss"], previous["grad_norm"])}

    def record(group) -> tuple[float, float]:
        key = group_label(group)
        if key not in done:
            stages, norms = retrainer(chain, kept(n, group))
            done[key] = (summed_test_loss(stages[-1], x_test), max(norms))
            if log is not None:
                row = pd.DataFrame({"removed": [key], "test_loss": [done[key][0]], "grad_norm": [done[key][1]]})
                row.to_csv(log, mode="a", header=not Path(log).exists(), index=False)
        return done[key]

    baseline, base_norm = record(None)
    runs = [record(g) for g in tqdm(groups, desc="leave-out retraining", disable=not progress)]
    frame = pd.DataFrame({
        "removed": [group_label(g) for g in groups],
        "test_loss": [loss for loss, _ in runs],
        "actual": [loss - baseline for loss, _ in runs],
        "grad_norm": [max(norm, base_norm) for _, norm in runs],
    })
    if predicted is not None:
        frame["predicted"] = predicted_changes(predicted, groups)
    return frame


def predicted_changes(predicted, groups) -> list[float]:
    """The predicted change of the summed test loss for each removal group: Σ_{i∈group} removal_i (or the given values)."""
    if isinstance(predicted, InfluenceResult):
        position = {int(i): k for k, i in enumerate(predicted.index.tolist())}
        missing = [i for g in groups for i in g if i not in position]
        if missing:
            raise InputError(f"removed examples {missing[:5]} were not scored; score them before validating.")
        removal = predicted.total.cpu().double() * (-1.0 / predicted.n_train)
        return [float(sum(removal[position[i]] for i in g)) for g in groups]
    values = [float(v) for v in predicted]
    if len(values) != len(groups):
        raise InputError(f"predicted has {len(values)} values for {len(groups)} removals.")
    return values
