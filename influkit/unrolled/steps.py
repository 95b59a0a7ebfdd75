"""A piece's steps in heavy-ball form, the input of every closed-form piece of approximate unrolling."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Steps:
    """A piece's steps in heavy-ball form: learning rates η_t, momentum μ, decays ρ_t (None: 1) and gains c_t (None:
    1)."""

    lrs: list[float]
    momentum: float
    rho: list[float] | None = None
    gains: list[float] | None = None

    def decays(self) -> list[float]:
        return [1.0] * len(self.lrs) if self.rho is None else self.rho

    def factors(self) -> list[float]:
        return [1.0] * len(self.lrs) if self.gains is None else self.gains

    def edge(self) -> float:
        """The eigenvalue past which one step's linear map expands: 2(1 + μ) / max_t η_t c_t (inf for no step)."""
        largest = max(lr * c for lr, c in zip(self.lrs, self.factors()))
        return 2 * (1 + self.momentum) / largest if largest > 0 else float("inf")
