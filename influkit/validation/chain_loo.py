"""Leave-out retraining of a whole :class:`~influkit.chain.Chain`: the actual change of the last stage's summed
test loss when stage-1 examples are removed and every stage is re-run.

For each removal the harness copies every stage's model at its original weights and re-runs the chain in order
(a :class:`ChainRecipe`), with the objectives the chain's scores differentiate:

- stage 1 re-minimizes F_1 − (1/m)Σ_{i∈G} ℓ_i = (1/m)Σ_{i∉G} ℓ_i + R: the removed group G leaves the sum, every
  other example keeps its weight 1/m (the perturbation ε = −1/m the scores linearize; ``keep_weights``);
- a stage behind a Case 1 link copies the retrained shared block S from the stage before it and re-minimizes
  what it trains with S fixed;
- a stage behind a Case 2 link shifts its own S by the change of the previous stage's S (a warm start) and
  re-minimizes F_k + α‖S − S̄′‖², the proximal centre S̄′ being the *retrained* previous values.

The reported change is Δ = f(T; chain retrained without the group) − f(T; chain retrained with everything), f
the summed loss of the last stage on the test set T. The baseline is retrained the same way, so whatever drift
continued training adds cancels. The influence prediction of Δ for removing one stage-1 example z is
−I(z, T)/n_1 (``InfluenceResult.removal``); for a group, the sum over its members.

The default ``newton`` recipe forms each stage's Hessian at the original optimum once per chain, factorizes it
(Cholesky) and uses it to precondition CG for the Newton steps of every run, so a run costs a few Hessian-vector
products per stage and ends at ‖∇F_k‖ ≤ ``tol`` (float64): the leave-out optimum nearest the original one, which
is the point the influence function linearizes towards.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import torch
from tqdm.auto import tqdm

from ..chain import Chain
from ..errors import InputError
from ..stage import Stage
from ..training import HessianFactor, fit_lbfgs, newton_fit
from .loo import group_label, predicted_changes, summed_test_loss

OPTIMIZERS = ("newton", "lbfgs")


def stage_objective(
    stage: Stage,
    trained: Sequence[str],
    centre: dict[str, torch.Tensor] | None = None,
    alpha: float = 0.0,
    *,
    regularizer_scale: float = 1.0,
) -> Stage:
    """A stage over ``trained`` whose objective is the stage's own, plus α‖S − centre‖² when a centre is given.

    Objective: (1/n) Σ_i ℓ(x_i; θ) + c·R(θ over the stage's own ``param_names``) + α Σ_{S∈centre} ‖S − centre_S‖²,
    c = ``regularizer_scale``, minimized over ``trained`` (the names a :class:`~influkit.chain.Chain` plan trains:
    for a Case 2 link the shared block too, for a Case 1 link everything but it). With c = 1 this is the
    objective whose Hessian the chain uses.
    """
    centre = dict(centre or {})

    def regularizer(params):
        own = stage.regularization(params)
        value = regularizer_scale * own if own is not None else 0.0
        if centre:
            value = value + alpha * sum(((params[n] - c) ** 2).sum() for n, c in centre.items())
        return value

    return Stage(stage.model, stage.loss, stage._data, params=list(trained), regularizer=regularizer,
                 batch_size=stage.data.batch_size)


@dataclass(frozen=True)
class ChainRecipe:
    """Re-run every stage of a :class:`~influkit.chain.Chain` in place, from the weights of the given stage copies.

    optimizer: "newton" (Newton steps by CG preconditioned with the stage's Hessian factor at the original
    optimum, built once per chain and reused by every run, to ‖∇‖ ≤ ``tol``) or "lbfgs" (full-batch L-BFGS,
    restarted, to ‖∇‖ ≤ ``tol`` or ``max_steps`` iterations per restart).
    tol: the gradient norm each stage is driven to; max_steps: Newton steps (or L-BFGS iterations) per stage.
    keep_weights: True (default) re-minimizes stage 1 as (1/m) Σ_{i∉G} ℓ_i + R — exactly the perturbation
    ε = −1/m per removed example that the influence function linearizes (computed as the mean over the m − |G|
    kept examples + m/(m − |G|)·R, which has the same minimizer). False takes the plain mean over the kept
    examples + R, which also strengthens the loss against R by m/(m − |G|): an extra O(|G|/m) change of the
    optimum, nearly the same for every removal (it shifts all actual changes alike, so Pearson barely moves,
    but it is not what −I/m predicts).
    Links are honoured as the chain defines them: Case 1 copies the retrained shared block and keeps it fixed,
    Case 2 trains it with α‖S − S̄′‖² centred at the retrained previous stage (module docstring).
    """

    optimizer: str = "newton"
    tol: float = 1e-10
    max_steps: int = 100
    keep_weights: bool = True
    _factors: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise InputError(f"unknown optimizer {self.optimizer!r}; use one of {OPTIMIZERS}.")
        if not self.tol > 0:
            raise InputError(f"tol must be positive, got {self.tol!r}.")

    def objective(self, chain: Chain, k: int, stages: Sequence[Stage], exclude: torch.Tensor | None = None) -> Stage:
        """Stage k's training objective over what it trains, proximal term centred at ``stages[k-1]``'s current S."""
        plan = chain.plans[k]
        if k == 0:
            removed = 0 if exclude is None else len(exclude)
            scale = len(stages[0]) / (len(stages[0]) - removed) if self.keep_weights else 1.0
            return stage_objective(stages[0].without(exclude), plan.trained, regularizer_scale=scale)
        base = stages[k]
        if plan.link.case == 1:
            return stage_objective(base, plan.trained)
        previous = stages[k - 1].state()
        centre = {name: previous[earlier].detach().clone() for name, earlier in plan.inherited.items()}
        return stage_objective(base, plan.trained, centre, plan.link.alpha)

    def factor(self, chain: Chain, k: int) -> HessianFactor:
        """The Hessian factor of stage k's objective at the chain's original weights (built once, kept)."""
        entry = self._factors.get(id(chain))
        if entry is None or entry[0] is not chain:
            entry = (chain, {})
            self._factors[id(chain)] = entry
        if k not in entry[1]:
            entry[1][k] = HessianFactor(self.objective(chain, k, chain.stages))
        return entry[1][k]

    def inherit(self, chain: Chain, k: int, stages: Sequence[Stage]) -> None:
        """Carry the retrained shared block of stage k−1 into stage k: copy it (Case 1) or shift by its change (Case 2)."""
        plan = chain.plans[k]
        now, original = stages[k - 1].state(), chain.stages[k - 1].state()
        params = dict(stages[k].model.named_parameters())
        with torch.no_grad():
            for name, earlier in plan.inherited.items():
                if plan.link.case == 1:
                    params[name].copy_(now[earlier])
                else:
                    params[name].add_(now[earlier] - original[earlier])

    def __call__(self, chain: Chain, stages: Sequence[Stage], exclude: torch.Tensor | None) -> list[float]:
        """Retrain ``stages`` (copies of the chain's stages) in order without the stage-1 examples ``exclude``;
        return ‖∇F_k‖ of every stage's objective at the end."""
        if len(stages) != len(chain):
            raise InputError(f"the chain has {len(chain)} stages, got {len(stages)} to retrain.")
        norms = []
        for k in range(len(chain)):
            if k:
                self.inherit(chain, k, stages)
            objective = self.objective(chain, k, stages, exclude if k == 0 else None)
            if self.optimizer == "newton":
                norms.append(newton_fit(objective, factor=self.factor(chain, k), tol=self.tol, max_steps=self.max_steps))
            else:
                norms.append(fit_lbfgs(objective, max_iter=self.max_steps, tol=self.tol))
        return norms


def retrain_chain(chain: Chain, exclude=None, recipe: ChainRecipe | None = None) -> tuple[list[Stage], list[float]]:
    """(retrained copies of the chain's stages, ‖∇F_k‖ of each at the end): every stage re-run by ``recipe``
    without the stage-1 examples ``exclude`` (indices; None removes nothing). The chain's models are not touched."""
    recipe = recipe or ChainRecipe()
    models = copy.deepcopy([stage.model for stage in chain.stages])  # one copy: modules shared between stages stay shared
    stages = [stage.with_(model=model) for stage, model in zip(chain.stages, models)]
    exclude = None if exclude is None else torch.as_tensor(list(exclude), dtype=torch.long).reshape(-1)
    norms = recipe(chain, stages, exclude)
    return stages, norms


def leave_out_retrain_chain(
    chain: Chain,
    removals: Sequence[int] | Sequence[Sequence[int]],
    x_test,
    recipe: ChainRecipe | None = None,
    *,
    predicted=None,
    log: str | Path | None = None,
    progress: bool = True,
) -> pd.DataFrame:
    """Actual change of the last stage's summed test loss for each removal of stage-1 examples, every stage re-run.

    removals: stage-1 example indices, or groups of indices removed together.
    x_test: (inputs, targets) of the last stage's test set.
    recipe: how the stages are re-run (default :class:`ChainRecipe`: Newton, ‖∇‖ ≤ 1e-10).
    predicted: an InfluenceResult of the chain (its ``removal`` summed over each group) or one number per removal.
    log: CSV file rows are appended to as they come; rows already there are reused (an interrupted run resumes).
    Returns a DataFrame with ``removed``, ``test_loss``, ``actual`` (Δ against the retrained baseline),
    ``grad_norm`` (the largest final ‖∇F_k‖ over the stages; ~1e-10 means every stage is stationary) and
    ``predicted`` when given.
    """
    recipe = recipe or ChainRecipe()
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
            stages, norms = retrain_chain(chain, group, recipe)
            done[key] = (summed_test_loss(stages[-1], x_test), max(norms))
            if log is not None:
                row = pd.DataFrame({"removed": [key], "test_loss": [done[key][0]], "grad_norm": [done[key][1]]})
                row.to_csv(log, mode="a", header=not Path(log).exists(), index=False)
        return done[key]

    baseline, base_norm = record(None)
    runs = [record(g) for g in tqdm(groups, desc="chain leave-out retraining", disable=not progress)]
    frame = pd.DataFrame({
        "removed": [group_label(g) for g in groups],
        "test_loss": [loss for loss, _ in runs],
        "actual": [loss - baseline for loss, _ in runs],
        "grad_norm": [max(norm, base_norm) for _, norm in runs],
    })
    if predicted is not None:
        frame["predicted"] = predicted_changes(predicted, groups)
    return frame
