"""Leave-out retraining: the actual change of the summed test loss when pretraining examples are removed.

For each removal the harness copies both models at their original weights, re-runs pretraining without
the removed example(s) and then finetuning (a :class:`TwoStageRecipe` or any callable with its signature),
and measures Δ = f(T; retrained without z) − f(T; retrained with everything). The baseline is retrained the
same way, so the drift of continued training cancels. Rows are appended to a CSV log as they come, so an
interrupted run resumes where it stopped.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import pandas as pd
import torch
from tqdm.auto import tqdm

from ..errors import InputError
from ..params import shared_parameters
from ..results import InfluenceResult
from ..stage import Stage
from ..training import HessianFactor, fit_lbfgs, newton_fit, train_adam

BASELINE = "none"


@dataclass(frozen=True)
class TwoStageRecipe:
    """Re-run pretraining, then finetuning, from the models' current weights, in place.

    optimizer: "newton" (Newton-type steps with the Hessian at the original optimum, factorized once and
    reused by every run, to ‖∇‖ ≤ tol: the exact leave-out optimum nearest the original one), "lbfgs" (full
    batch, to ‖∇‖ ≤ tol or ``*_steps`` iterations) or "adam" (``*_steps`` seeded mini-batch steps, as the
    paper; its optimization noise adds to the measured changes, see :func:`noise_floor`).
    warmup: "newton" only — full-batch L-BFGS iterations before the Newton steps of every run; they carry a
    large removal's run out of the region where its Hessian is indefinite (which would cost a dense
    refactorization) and end at the same ‖∇‖ ≤ tol optimum. factors: Hessian factors of the original optima by
    stage ("pretrain", "finetune"), e.g. kept from training; missing ones are built on the first run.
    case 1 copies the retrained W into the finetune model and trains Θ. Case 2 shifts the finetuned W by the
    change of the pretrained W̄ and trains (W, Θ) with the proximal term α‖W − W̄‖² (the model the Case 2
    scores assume).
    """

    shared: str | Mapping[str, str]
    case: int = 1
    alpha: float = 0.01
    optimizer: str = "newton"
    pretrain_steps: int = 200
    finetune_steps: int = 200
    lr: float = 1e-3
    batch_size: int = 128
    seed: int = 0
    tol: float = 1e-9
    warmup: int = 0
    factors: dict = field(default_factory=dict, compare=False, repr=False)

    def _train(self, stage: Stage, steps: int, exclude: torch.Tensor | None, which: str) -> None:
        if self.optimizer == "newton":
            if which not in self.factors:  # the first call starts from the original optimum
                self.factors[which] = HessianFactor(stage)
            if self.warmup:
                fit_lbfgs(stage.without(exclude), max_iter=self.warmup, tol=self.tol, restarts=0)
            newton_fit(stage.without(exclude), factor=self.factors[which], tol=self.tol, max_steps=steps)
        elif self.optimizer == "lbfgs":
            fit_lbfgs(stage.without(exclude), max_iter=steps, tol=self.tol)
        elif self.optimizer == "adam":
            train_adam(stage, steps=steps, lr=self.lr, batch_size=self.batch_size, seed=self.seed, exclude=exclude)
        else:
            raise InputError(f"unknown optimizer {self.optimizer!r}; use 'newton', 'lbfgs' or 'adam'.")

    def __call__(self, pretrain: Stage, finetune: Stage, exclude: torch.Tensor | None) -> None:
        mapping = shared_parameters(pretrain.model, finetune.model, self.shared)
        before = {p: t.clone() for p, t in pretrain.state().items()}
        self._train(pretrain, self.pretrain_steps, exclude, "pretrain")
        after = pretrain.state()
        fin_params = dict(finetune.model.named_parameters())
        with torch.no_grad():
            for f_name, p_name in mapping.items():
                if self.case == 1:
                    fin_params[f_name].copy_(after[p_name])
                else:
                    fin_params[f_name].add_(after[p_name] - before[p_name])
        if self.case == 1:
            self._train(finetune, self.finetune_steps, None, "finetune")
            return
        centre = {f: after[p].clone() for f, p in mapping.items()}
        self._train(proximal_stage(finetune, centre, self.alpha), self.finetune_steps, None, "finetune")


def proximal_stage(finetune: Stage, centre: Mapping[str, torch.Tensor], alpha: float) -> Stage:
    """The Case 2 finetuning objective F(W, Θ) + α‖W − W̄‖² as a stage training W (``centre``'s keys) and Θ."""
    own = finetune.regularizer

    def regularizer(params):
        value = alpha * sum(((params[f] - centre[f]) ** 2).sum() for f in centre)
        return value + own(params) if own is not None else value

    names = list(dict.fromkeys(list(centre) + finetune.param_names))
    return Stage(finetune.model, finetune.loss, finetune._data, params=names, regularizer=regularizer)


Recipe = Callable[[Stage, Stage, "torch.Tensor | None"], None]


def group_label(group: Sequence[int] | None) -> str:
    """The row key of a removal group in a leave-out table ("3+17"; the baseline row for None)."""
    return BASELINE if group is None else "+".join(str(int(i)) for i in group)


def summed_test_loss(stage: Stage, x_test) -> float:
    """f(T) = Σ_t ℓ(x_t) of ``stage``'s model at its current weights on the test set ``x_test`` = (inputs, targets)."""
    inputs, targets = x_test
    with torch.no_grad():
        return float(stage.losses(stage.trained(), inputs.to(stage.device), targets.to(stage.device)).sum())


def _retrain(pretrain: Stage, finetune: Stage, recipe: Recipe, group, x_test) -> float:
    pre = pretrain.with_(model=copy.deepcopy(pretrain.model))
    fin = finetune.with_(model=copy.deepcopy(finetune.model))
    exclude = None if group is None else torch.as_tensor(list(group), dtype=torch.long)
    recipe(pre, fin, exclude)
    return summed_test_loss(fin, x_test)


def leave_out_retrain(
    pretrain: Stage,
    finetune: Stage,
    removals: Sequence[int] | Sequence[Sequence[int]],
    x_test,
    recipe: Recipe,
    *,
    predicted: InfluenceResult | Sequence[float] | None = None,
    log: str | Path | None = None,
    progress: bool = True,
) -> pd.DataFrame:
    """Actual change of the summed test loss for each removal, next to the predicted one.

    removals: pretraining example indices, or groups of indices removed together.
    x_test: (inputs, targets) of the finetuning test set.
    predicted: an InfluenceResult (its ``removal`` summed over each group) or one number per removal.
    log: CSV file the rows are appended to; rows already there are reused (resume).
    Returns a DataFrame with columns ``removed``, ``test_loss``, ``actual`` (and ``predicted``).
    """
    groups = [[int(r)] if not isinstance(r, (list, tuple, torch.Tensor)) else [int(i) for i in r] for r in removals]
    if not groups:
        raise InputError("removals is empty: give the pretraining examples to leave out.")
    done: dict[str, float] = {}
    if log is not None and Path(log).exists():
        previous = pd.read_csv(log, dtype={"removed": str})
        done = dict(zip(previous["removed"], previous["test_loss"]))

    def record(group) -> float:
        key = group_label(group)
        if key not in done:
            done[key] = _retrain(pretrain, finetune, recipe, group, x_test)
            if log is not None:
                row = pd.DataFrame({"removed": [key], "test_loss": [done[key]]})
                row.to_csv(log, mode="a", header=not Path(log).exists(), index=False)
        return done[key]

    baseline = record(None)
    losses = [record(g) for g in tqdm(groups, desc="leave-out retraining", disable=not progress)]
    frame = pd.DataFrame(
        {"removed": [group_label(g) for g in groups], "test_loss": losses, "actual": [v - baseline for v in losses]}
    )
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


def noise_floor(
    pretrain: Stage, finetune: Stage, x_test, recipe: TwoStageRecipe, seeds: Sequence[int] = (1, 2, 3)
) -> float:
    """Std of the summed test loss over no-removal reruns with different seeds: changes below it are noise.

    Only the "adam" recipe uses its seed (mini-batch order); the deterministic "newton"/"lbfgs" recipes give 0.
    """
    losses = [_retrain(pretrain, finetune, replace(recipe, seed=s), None, x_test) for s in seeds]
    return float(torch.tensor(losses).std())
