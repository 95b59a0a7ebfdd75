"""Re-training a whole :class:`~influkit.chain.Chain` on part of its stage-1 data: the one retrainer behind
leave-out validation (:mod:`.loo`), the LDS harness (:mod:`influkit.apps.lds`) and the examples.

Every stage is re-run in chain order on copies of its model (the chain's own models are never touched), with the
objective its :class:`~influkit.links.StagePlan` defines — the same one the chain's scores differentiate:

- stage 1 re-minimizes (1/|K|) Σ_{i∈K} ℓ_1(z_i) + c·R_1 over the kept examples K; ``keep_weights`` takes
  c = m/|K|, which has the minimizer of (1/m) Σ_{i∈K} ℓ_i + R_1: every kept example keeps its weight 1/m, the
  perturbation ε = −1/m per removed example that the scores linearize; without it c = 1 (a plain re-fit on K);
- a stage behind a Case 1 link takes the re-trained shared block S of the stage before it and keeps it fixed;
- a stage behind a Case 2 link trains S too, with α‖S − S̄′‖² centred at the *re-trained* previous values S̄′.

Where the block starts (:meth:`~influkit.links.StagePlan.receive`): from the chain's own weights (``init="warm"``)
a Case 2 block is moved by the change of the previous stage's block; from a fresh initialization it starts at S̄′.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from ..chain import Chain
from ..errors import InputError
from ..stage import Stage
from ..training import HessianFactor, fit_lbfgs, newton_fit

OPTIMIZERS = ("newton", "lbfgs")
INITS = ("warm", "scratch")

Train = Callable[[Stage], float]  # train(stage) -> ‖∇L‖, minimizing the stage objective in place
Init = Callable[[nn.Module, int], None]  # init(model, seed), re-initializing a model copy in place


@dataclass(frozen=True)
class Retrainer:
    """retrainer(chain, keep, seed) -> (re-trained copies of the chain's stages, final ‖∇F_k‖ of each stage).

    optimizer: "newton" (Newton steps by CG preconditioned with the Hessian factor of stage k's objective at the
    chain's original weights — built once per chain and reused by every run, or taken from ``factors`` — to
    ‖∇‖ ≤ ``tol`` or ``max_steps`` steps; ``warmup`` full-batch L-BFGS iterations first), "lbfgs" (full batch,
    restarted, to ‖∇‖ ≤ ``tol`` or ``max_steps`` iterations per restart), or ``train(stage) -> ‖∇‖`` (e.g.
    :func:`~influkit.training.train_to_stationarity`, or seeded Adam).
    init: "warm" continues every stage from the chain's current weights; "scratch" re-initializes, under
    ``torch.manual_seed(seed)``, every module holding parameters a stage trains besides the inherited block, by its
    ``reset_parameters()`` (:func:`reset_parameters`); or ``init(model, seed)``.
    keep_weights: stage 1's regularizer scaled by m/|K| (module docstring); False re-fits plainly on K.
    factors: {stage index: :class:`~influkit.training.HessianFactor`} preconditioners for "newton" (e.g. kept
    from training); the missing ones are built at the chain's weights on first use.
    """

    optimizer: str | Train = "newton"
    init: str | Init = "warm"
    tol: float = 1e-10
    max_steps: int = 100
    warmup: int = 0
    keep_weights: bool = True
    factors: Mapping[int, HessianFactor] = field(default_factory=dict, compare=False, repr=False)
    _built: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if not (self.optimizer in OPTIMIZERS or callable(self.optimizer)):
            raise InputError(f"unknown optimizer {self.optimizer!r}; use one of {OPTIMIZERS} or a callable train(stage).")
        if not (self.init in INITS or callable(self.init)):
            raise InputError(f"init must be one of {INITS} or a callable init(model, seed), got {self.init!r}.")
        if not self.tol > 0:
            raise InputError(f"tol must be positive, got {self.tol!r}.")

    @property
    def setup(self) -> dict:
        """What this retrainer does, JSON-friendly (stored beside LDS outputs, compared on resume)."""
        name = lambda v: v if isinstance(v, str) else getattr(v, "__qualname__", type(v).__name__)  # noqa: E731
        return {"init": name(self.init), "train": name(self.optimizer)}

    def __call__(self, chain: Chain, keep=None, seed: int = 0) -> tuple[list[Stage], list[float]]:
        """Re-train copies of ``chain``'s stages in order, stage 1 on the examples ``keep`` (indices; None: all)."""
        n = len(chain.stages[0])
        if keep is not None:
            keep = torch.as_tensor(keep, dtype=torch.long).reshape(-1)
            if len(keep) == 0 or not bool(((keep >= 0) & (keep < n)).all()):
                raise InputError(f"keep must be non-empty indices of the {n} stage-1 examples.")
        models = copy.deepcopy([stage.model for stage in chain.stages])  # one copy: modules shared by stages stay shared
        stages: list[Stage] = []
        norms: list[float] = []
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(seed))
            for k, (plan, model) in enumerate(zip(chain.plans, models)):
                if self.init == "scratch":
                    reset_parameters(model, [name for name in plan.trained if name not in plan.inherited])
                elif callable(self.init):
                    self.init(model, int(seed))
                stage = plan.stage.with_(model=model)
                if k == 0:
                    scale = 1.0
                    if keep is not None:
                        stage = stage.with_(data=stage.data.take(keep))
                        scale = n / len(keep) if self.keep_weights else 1.0
                    objective = plan.objective(stage, regularizer_scale=scale)
                else:
                    previous = stages[-1].state()
                    plan.receive(model, previous, chain.stages[k - 1].state() if self.init == "warm" else None)
                    objective = plan.objective(stage, previous)
                norms.append(self._train(chain, k, objective))
                stages.append(stage)
        return stages, norms

    def _train(self, chain: Chain, k: int, objective: Stage) -> float:
        if callable(self.optimizer):
            return float(self.optimizer(objective))
        if self.optimizer == "lbfgs":
            return fit_lbfgs(objective, max_iter=self.max_steps, tol=self.tol)
        if self.warmup:
            fit_lbfgs(objective, max_iter=self.warmup, tol=self.tol, restarts=0)
        return newton_fit(objective, factor=self.factor(chain, k), tol=self.tol, max_steps=self.max_steps)

    def factor(self, chain: Chain, k: int) -> HessianFactor:
        """The Hessian factor of stage k's objective at the chain's weights (``factors[k]``, or built once and kept)."""
        if k in self.factors:
            return self.factors[k]
        entry = self._built.get(id(chain))
        if entry is None or entry[0] is not chain:
            entry = self._built[id(chain)] = (chain, {})
        if k not in entry[1]:
            plan = chain.plans[k]
            entry[1][k] = HessianFactor(plan.objective(plan.stage, chain.stages[k - 1].state() if k else None))
        return entry[1][k]


def kept(n: int, removed) -> torch.Tensor | None:
    """The sorted indices of 0..n−1 not in ``removed`` (the ``keep`` of a leave-out run); None when nothing is removed."""
    if removed is None or len(removed) == 0:
        return None
    mask = torch.ones(n, dtype=torch.bool)
    mask[torch.as_tensor(removed, dtype=torch.long)] = False
    return mask.nonzero().reshape(-1)


def reset_parameters(model: nn.Module, names: Sequence[str]) -> None:
    """Re-initialize the modules owning ``names`` by their reset_parameters(), restoring every other parameter."""
    fresh = set(names)
    keep = {n: p.detach().clone() for n, p in model.named_parameters() if n not in fresh}
    for prefix, module in model.named_modules():
        own = [f"{prefix}.{p}" if prefix else p for p, _ in module.named_parameters(recurse=False)]
        if not fresh.intersection(own):
            continue
        if not hasattr(module, "reset_parameters"):
            raise InputError(
                f"module {prefix or type(model).__name__!r} ({type(module).__name__}) holds trained parameters but has "
                "no reset_parameters(), so it cannot be re-initialized from scratch; pass init=callable(model, seed) "
                "or init='warm' to the Retrainer."
            )
        module.reset_parameters()
    named = dict(model.named_parameters())
    with torch.no_grad():
        for n, value in keep.items():
            named[n].copy_(value)
