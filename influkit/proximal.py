"""Whether a Case 2 finetuning stopped where its proximal term says: the drift of the shared block against α.

A Case 2 link assumes the finetuning minimized F(W, Θ) + α‖W − W̄‖² (W the shared block, W̄ the previous stage's
values, F the stage's mean loss + its own regularizer). Its stationarity in W reads

    ∇_W F(W*, Θ*) = −2α (W* − W̄),

so the gradient of F at the finetuned block and the block's drift d = W* − W̄ determine the α the run behaved as:

- ``alpha_fit`` α̂ = −⟨∇_W F, d⟩ / (2‖d‖²), the least-squares α of ‖∇_W F + 2α d‖ (positive when the loss pulls
  the block back towards W̄, as a proximal term does);
- ``residual`` ‖∇_W F + 2α d‖ / (‖∇_W F‖ + 2α‖d‖) ∈ [0, 1] at the link's α (0: the condition holds), and
  ``residual_fit`` the same at α̂ (what no α explains: the part of ∇_W F across the drift);
- ``agrees``: α̂ > 0 and α̂ / α within [1/``FACTOR``, ``FACTOR``] (None when the block did not move).

A finetuning without a proximal term has no α; the one that explains its drift is α̂ (early stopping acts like a
proximal term of some weight): use ``Link(..., case=2, alpha=α̂)``, which the warning names, and the check then
agrees (α̂ does not depend on the α given). α̂ ≤ 0 (the loss pulls the block further away) means no proximal
term explains where the block stopped. Cost: one gradient pass of F over the shared block.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from .curvature import gradient
from .errors import ProximalWarning, warn
from .links import StagePlan

FACTOR = 2.0  # α̂ within a factor of 2 of α: the drift agrees with the proximal weight


@dataclass(frozen=True)
class Drift:
    """The drift of a Case 2 stage's shared block against its proximal weight (module docstring)."""

    alpha: float  # α of the link
    alpha_fit: float  # α̂ = −⟨∇_W F, d⟩ / (2‖d‖²); NaN when d = 0
    residual: float  # ‖∇_W F + 2α d‖ / (‖∇_W F‖ + 2α‖d‖)
    residual_fit: float  # the same at α̂
    drift: float  # ‖d‖ = ‖W* − W̄‖
    gradient: float  # ‖∇_W F(W*, Θ*)‖
    agrees: bool | None  # None: the block did not move

    def summary(self) -> dict:
        """JSON-friendly, for ``diagnostics["stages"][k]["proximal"]``."""
        return asdict(self) | {"factor": FACTOR}

    def describe(self) -> str:
        """One line: the numbers the check rests on."""
        return (f"‖W − W̄‖ = {self.drift:.3g}, ‖∇_W F‖ = {self.gradient:.3g}; the α that best explains the drift is "
                f"α̂ = {self.alpha_fit:.4g} (relative residual of ∇_W F = −2α(W − W̄): {self.residual:.2f} at α = "
                f"{self.alpha:g}, {self.residual_fit:.2f} at α̂)")


def measure(plan: StagePlan, previous: dict[str, torch.Tensor], *, memory: int | None = None) -> Drift:
    """The :class:`Drift` of a Case 2 ``plan``'s shared block at its current values; ``previous``: the previous
    stage's state (W̄)."""
    centre = plan.centre(previous)
    names = list(centre)
    state = plan.stage.state()
    g = gradient(plan.stage, names, memory=memory)
    g = torch.cat([g[n].detach().double().reshape(-1) for n in names])
    d = torch.cat([(state[n].detach() - centre[n]).double().reshape(-1) for n in names])
    alpha = float(plan.link.alpha)
    size, pull = float(d.norm()), float(g.norm())

    def residual(a: float) -> float:
        scale = pull + 2 * abs(a) * size
        return float((g + 2 * a * d).norm()) / scale if scale > 0 else 0.0

    if size == 0.0:
        return Drift(alpha, math.nan, residual(alpha), math.nan, 0.0, pull, None)
    fit = -float(g @ d) / (2 * size**2)
    agrees = fit > 0 and 1 / FACTOR <= fit / alpha <= FACTOR
    return Drift(alpha, fit, residual(alpha), residual(fit), size, pull, agrees)


def check(plans: Sequence[StagePlan], *, memory: int | None = None) -> list[Drift | None]:
    """The :class:`Drift` of every Case 2 stage of a chain's ``plans`` (None for the others), with one
    :class:`~influkit.errors.ProximalWarning` naming each stage whose drift disagrees with its α, and what to do."""
    drifts = [measure(plan, plans[k - 1].stage.state(), memory=memory) if plan.case == 2 else None
              for k, plan in enumerate(plans)]
    lines = []
    for k, drift in enumerate(drifts):
        if drift is None or drift.agrees is not False:
            continue
        name = f"stage {k} ({type(plans[k].stage.model).__name__})"
        if drift.alpha_fit > 0:
            lines.append(f"{name}: {drift.describe()}. If the finetuning had no proximal term, or another α, use "
                         f"Link(..., case=2, alpha={drift.alpha_fit:.4g}), the α that matches the drift.")
        else:
            lines.append(f"{name}: {drift.describe()}. α̂ ≤ 0: the loss pulls the block further from W̄, so no proximal "
                         "term explains where it stopped; finetune with the proximal term α‖W − W̄‖² to a minimum, "
                         "or attribute the run as it went with influkit.unrolled.")
    if lines:
        warn("a Case 2 link assumes the finetuning minimized F + α‖W − W̄‖², so ∇_W F = −2α(W − W̄) at its end; the "
             "drift of the shared block disagrees (diagnostics['stages'][k]['proximal']):\n  " + "\n  ".join(lines),
             ProximalWarning)
    return drifts
