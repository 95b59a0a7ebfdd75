"""Adam and AdamW linearized on one piece of approximate unrolling: the second moment frozen at the piece's end.

Step t of torch's Adam is m ← β₁m + (1 − β₁)d, v ← β₂v + (1 − β₂)d², θ ← ρ_t θ − η_t/(1 − β₁^{t+1}) · m/(√v̂ + ε),
d = c_t g (+ λθ, coupled decay), c_t the recorded clipping's factor, ρ_t = 1 − η_t κ (decoupled decay). With
P = diag(1/(√v̂_b + ε)) frozen and c_t a constant gain the step is linear in (δθ, δm), and in φ = P^{−1/2}δθ it is
the heavy-ball recursion of :mod:`.pieces` with momentum β₁, curvature K = P^{1/2}(H + λ)P^{1/2} and learning rate
η'_t = η_t(1 − β₁)/(1 − β₁^{t+1}) (the documentation's approximate-unrolling page derives it).
"""

from __future__ import annotations

import torch

from ..errors import InputError
from .optimizers import SGD, Adam, Groups
from .steps import Steps
from .run import StageRun


def rules(run: StageRun) -> tuple[list, list[list[str]]]:
    """(update rules, the trained names each updates) of a stage's optimizer, refused (with the fix) where the pieces
    have no linear recursion: Nesterov momentum, SGD in parameter groups, Adam groups with different β's, maximize."""
    optimizer = run.optimizer
    found, groups = (list(optimizer.rules), [list(g) for g in optimizer.names]) if isinstance(optimizer, Groups) \
        else ([optimizer], [list(run.trained)])
    if isinstance(found[0], Adam):
        if all(isinstance(r, Adam) and r.betas == found[0].betas and not r.maximize for r in found):
            return found, groups
    elif isinstance(optimizer, SGD) and not optimizer.nesterov:
        return found, groups
    raise InputError(f"approximate unrolling linearizes SGD (with or without heavy-ball momentum) and Adam / AdamW "
                     f"(one β₁, β₂ for every parameter group, minimizing); a stage was trained with {optimizer!r}. Use "
                     "ik.unrolled.metagradients (exact) for it.")


class AdamPiece:
    """Adam linearized on one piece (module docstring): the frozen preconditioner P (p,) over the trained
    parameters in their order (each group's learning-rate ratio folded in), and per step the learning rate
    η'_t = η_t (1 − β₁)/(1 − β₁^{t+1}) of the heavy-ball form, the gain c_t of the recorded clipping, the decoupled
    decay ρ_t = 1 − η_t κ; ``coupled``: Adam's coupled weight decay per coordinate (added to the curvature) or None;
    ``notes``: what was approximated beyond the frozen P (a non-uniform decoupled decay taken at its mean)."""

    def __init__(self, run: StageRun, a: int, b: int, state: dict, names: list[str], gains: list[float]):
        found, groups = rules(run)
        beta1, beta2 = found[0].betas
        lrs = [run.lrs[t] if isinstance(run.optimizer, Groups) else (run.lrs[t],) for t in range(a, b)]
        reference = [max(rates) for rates in lrs]
        moving = [rates for rates, top in zip(lrs, reference) if top > 0]
        ratios = [rate / max(moving[0]) for rate in moving[0]] if moving else [1.0] * len(found)
        if any(abs(rate - ratio * max(rates)) > 1e-12 * max(rates) for rates in moving
               for rate, ratio in zip(rates, ratios)):
            raise InputError("the parameter groups' learning rates change their ratios within a segment, so Adam's "
                             "frozen preconditioner cannot absorb them; use ik.unrolled.metagradients (exact) or "
                             "schedule every group by the same factor.")
        group_of = {n: g for g, members in enumerate(groups) for n in members}
        correction = 1 - beta2 ** b
        parts, decay, coupled = [], [], []
        for n in names:
            g = group_of[n]
            rule, v = found[g], state["v"][n].reshape(-1)
            parts.append(ratios[g] / ((v / correction).sqrt() + rule.eps))
            rate = ratios[g] * rule.weight_decay
            decay.append(torch.full_like(v, rate if rule.decoupled else 0.0))
            coupled.append(torch.full_like(v, 0.0 if rule.decoupled else rule.weight_decay))
        self.P = torch.cat(parts)
        kappa, lam = torch.cat(decay), torch.cat(coupled)
        self.coupled = lam if bool(lam.any()) else None
        self.coupled_uniform = self.coupled is None or bool((lam == lam[0]).all())
        self.notes = []
        mean = float(kappa.mean())
        if not bool((kappa == kappa[0]).all()):
            self.notes.append("decoupled weight decay differs across parameter groups: the pieces take its mean over "
                              "the trained coordinates (diagnostics['stability']['decay_ignored']: the largest "
                              "relative change of δθ over a segment this leaves out)")
        self.decay_ignored = float((kappa - mean).abs().max()) * sum(reference)
        self.momentum = beta1
        self.lrs = [top * (1 - beta1) / (1 - beta1 ** (t + 1)) for t, top in zip(range(a, b), reference)]
        self.rho = [1 - top * mean for top in reference]
        self.gains = gains

    @property
    def steps(self) -> Steps:
        """The piece's steps in heavy-ball form (learning rates η'_t, momentum β₁, decays ρ_t, gains c_t)."""
        return Steps(self.lrs, self.momentum, self.rho, self.gains)
