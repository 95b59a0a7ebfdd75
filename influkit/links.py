"""How a stage inherits the shared block S from the stage before it: the one place that decides it.

A :class:`Link` joins stage k−1 to stage k; a :class:`StagePlan` is what stage k is trained on because of it:

- Case 1: S_k is *fixed* at the previous stage's values S̄ (part of the model, not trained): stage k trains
  θ_k = its own parameters minus S_k, and minimizes F_k(θ_k; S̄).
- Case 2: S_k is trained with the rest, pulled towards S̄ by the proximal term α‖S_k − S̄‖² (which the library
  adds): stage k minimizes F_k(θ_k) + α‖S_k − S̄‖² over θ_k = its own parameters and S_k.
- Plain finetuning (:meth:`Link.finetune`, Case 2 with α = 0): S_k starts at S̄ and is trained with the rest, no
  proximal term. Its result depends on S̄ only through that start, which a recorded run differentiates exactly
  (:mod:`influkit.unrolled`); an influence function at the finetuning's minimum has no such dependence, so
  :class:`~influkit.chain.Chain` refuses it.

LoRA is a Case 1 or Case 2 link whose shared block is the base model's weights (``influkit.hf.lora_link``).
The influence computation (:class:`~influkit.chain.Chain`: trained names, the proximal term of each stage's
Hessian), every re-training (:mod:`influkit.validation.retrain`: which names to train, the objective, where
the block starts) and every recorded run (:class:`influkit.unrolled.record.StageRun`: what it trains, what it holds
fixed, its proximal term) read these plans, so all agree on what each stage optimizes.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from .errors import InputError, ParameterError, warn
from .params import shared_parameters
from .stage import Stage

Penalty = Callable[[Mapping[str, torch.Tensor]], torch.Tensor]


@dataclass(frozen=True)
class Link:
    """How a stage inherits the shared block S from the previous stage.

    shared: a module prefix present in both models, or {this_stage_name: previous_stage_name} (names or prefixes).
    case: 1 keeps S fixed at the previous stage's values; 2 finetunes S, starting from them, with the proximal
    term α‖S − S̄‖².
    alpha: the proximal weight α ≥ 0 of Case 2 (the multi-stage paper uses 0.01); α = 0 is plain finetuning of the
    whole model from the previous stage's values (:meth:`finetune`).
    """

    shared: str | Mapping[str, str]
    case: int = 1
    alpha: float = 0.01

    def __post_init__(self) -> None:
        if self.case not in (1, 2):
            raise InputError(f"case must be 1 (shared block fixed) or 2 (finetuned), got {self.case!r}.")
        if self.case == 2 and not (isinstance(self.alpha, (int, float)) and 0 <= self.alpha < float("inf")):
            raise InputError(
                f"Case 2 needs a finite proximal weight alpha ≥ 0 (the paper uses 0.01; 0 is plain finetuning from "
                f"the previous stage's values, Link.finetune(shared)), got {self.alpha!r}."
            )
        if not self.shared:
            raise ParameterError("shared is empty: name the shared block (a module prefix or a name mapping).")

    @classmethod
    def finetune(cls, shared: str | Mapping[str, str]) -> "Link":
        """Plain finetuning: the stage starts from the previous stage's final values of ``shared`` and trains them
        with everything else, no proximal term — ``Link(shared, case=2, alpha=0.0)``, what ``model.train()`` on
        every weight of a pretrained model does. Recorded runs (:mod:`influkit.unrolled`) attribute through it
        exactly."""
        return cls(shared, case=2, alpha=0.0)

    @property
    def plain(self) -> bool:
        """Whether this is plain finetuning (Case 2 without a proximal term)."""
        return self.case == 2 and self.alpha == 0


class StagePlan:
    """What one stage of a chain trains: names θ (``trained``), inherited names S ({name: previous name},
    ``inherited``), those of them held fixed (``fixed``, Case 1) and the proximal term (``proximal``, Case 2)
    centred at the previous stage's current values."""

    def __init__(self, stage: Stage, link: Link | None = None, previous: "StagePlan | None" = None, *,
                 inherit: bool = False):
        """inherit: write the previous stage's current values of the shared block into ``stage``'s model first
        (:meth:`receive`; a recorded run trains from them), else the model must already hold them (Case 1 warns)."""
        self.stage = stage
        self.link = link
        self.inherited: dict[str, str] = {}
        if link is not None:
            self.inherited = shared_parameters(previous.stage.model, stage.model, link.shared)
            live = set(previous.trained) | set(previous.inherited)
            dead = [p for p in self.inherited.values() if p not in live]
            if dead:
                raise ParameterError(
                    f"shared parameters {dead[:3]}{f' (and {len(dead) - 3} more)' if len(dead) > 3 else ''} are "
                    "neither trained in the previous stage nor inherited by it, so they cannot carry influence; "
                    "include them in that stage's params, or narrow the link's shared block to what that stage "
                    "trains (hf.lora_link(..., shared=prefix) for a LoRA stage)."
                )
            if inherit:
                self.receive(stage.model, previous.stage.state())
        order = [n for n, _ in stage.model.named_parameters()]
        if self.case == 1:
            self.trained = [n for n in stage.param_names if n not in self.inherited]
            if not self.trained:
                raise ParameterError(
                    f"stage {type(stage.model).__name__} trains nothing besides the shared block; a Case 1 link needs "
                    "parameters the stage trains on top of it."
                )
        elif self.case == 2:
            chosen = set(stage.param_names) | set(self.inherited)
            self.trained = [n for n in order if n in chosen]
        else:
            self.trained = list(stage.param_names)
        self.fixed = list(self.inherited) if self.case == 1 else []
        self.proximal = self.penalty(previous.stage.state()) if self.case == 2 else None
        if self.case == 1:
            state, previous_state = stage.state(), previous.stage.state()
            drift = max(float((state[n] - previous_state[p]).abs().max()) for n, p in self.inherited.items())
            if drift > 0:
                size = max(float(previous_state[p].abs().max()) for p in self.inherited.values())
                warn(
                    f"a Case 1 link assumes {type(stage.model).__name__} keeps the previous stage's shared block "
                    f"{self.link.shared!r} as it was pretrained, but its parameters differ by up to {drift:.2e} (the "
                    f"pretrained ones are up to {size:.2e}). Most likely the pretrained weights were not copied into "
                    "the finetuning model: load them before training its head (e.g. "
                    "clf.bert.load_state_dict(mlm.bert.state_dict()), or build it with from_pretrained), then refit "
                    "the head. If the block was finetuned on purpose, use Link(..., case=2)."
                )

    @property
    def case(self) -> int | None:
        """1 or 2 as the incoming link says; None for the first stage (it inherits nothing)."""
        return None if self.link is None else self.link.case

    def centre(self, previous: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """S̄ on this stage's names: {name: previous stage's value}, detached copies of ``previous`` (its state)."""
        return {name: previous[earlier].detach().clone() for name, earlier in self.inherited.items()}

    def penalty(self, previous: Mapping[str, torch.Tensor]) -> Penalty | None:
        """α Σ_S ‖S − S̄‖² as a function of this stage's parameters, S̄ from ``previous`` (Case 2; else None)."""
        if self.case != 2:
            return None
        centre = self.centre(previous)
        return lambda params: self.proximal_term(params, centre)

    def proximal_term(self, params: Mapping[str, torch.Tensor], centre: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """α Σ_{s∈S} ‖params_s − centre_s‖² (Case 2's proximal term, differentiable in both; centre on this stage's
        names)."""
        return self.link.alpha * sum(((params[n] - centre[n]) ** 2).sum() for n in self.inherited)

    def objective(self, stage: Stage, previous: Mapping[str, torch.Tensor] | None = None, *,
                  regularizer_scale: float = 1.0) -> Stage:
        """``stage`` (this stage's model, data and loss, maybe re-trained copies) as the objective this plan trains.

        (1/n) Σ_i ℓ(x_i; θ) + c·R(θ) [+ α‖S − S̄‖², Case 2, S̄ from ``previous``, the previous stage's state],
        minimized over ``trained``; R is the stage's own regularizer over its own parameters, c =
        ``regularizer_scale``. With c = 1 and S̄ the chain's own previous stage, its Hessian is the chain's.
        """
        penalty = self.penalty(previous) if self.case == 2 else None

        def regularizer(params):
            own = stage.regularization(params)
            value = regularizer_scale * own if own is not None else 0.0
            return value + penalty(params) if penalty is not None else value

        return stage.with_(params=list(self.trained), regularizer=regularizer)

    def receive(self, model: nn.Module, previous: Mapping[str, torch.Tensor],
                original: Mapping[str, torch.Tensor] | None = None) -> None:
        """Write the inherited block into ``model`` (in place) from ``previous``, the previous stage's new state.

        Case 1, and Case 2 without ``original``: S ← S̄ (the block starts at, or stays at, the previous values).
        Case 2 with ``original`` (the previous stage's values this model was trained against: a warm start):
        S ← S + (S̄ − S̄_original), the model's own finetuned block moved by the change of the previous one.
        """
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, earlier in self.inherited.items():
                if self.case == 2 and original is not None:
                    params[name].add_(previous[earlier] - original[earlier])
                else:
                    params[name].copy_(previous[earlier])
