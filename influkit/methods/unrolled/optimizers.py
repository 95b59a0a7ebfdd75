"""Optimizer update rules as pure functions of (params, state, grads, lr, step), so reverse mode through them is exact.

Each rule returns new tensors and never updates in place; training, replay and the metagradient's reverse pass all
call the same function, so a replay repeats the recorded arithmetic operation for operation. ``params``,
``grads`` and every state slot are dicts name → tensor over the trained parameters; ``step`` counts from 1;
``lr`` is the step's learning rate (a schedule is recorded step by step). The formulas follow ``torch.optim``'s
(``foreach=False``) so a run recorded here matches one trained with it to rounding (``tests/test_unrolled.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..errors import InputError

Tensors = dict[str, torch.Tensor]
State = dict[str, Tensors]


def _safe_sqrt(x: torch.Tensor) -> torch.Tensor:
    """√x with the value of ``torch.sqrt`` and derivative 0 (not ∞) where x = 0.

    Adam's second moment v is exactly 0 only for a coordinate whose gradient was exactly 0 at every step so far;
    there √v is not differentiable and 0 is its symmetric subgradient (∞·0 would turn the adjoint into NaN).
    """
    positive = x > 0
    return torch.sqrt(torch.where(positive, x, torch.ones_like(x))) * positive


@dataclass(frozen=True)
class SGD:
    """Stochastic gradient descent with heavy-ball momentum μ and coupled weight decay λ (``torch.optim.SGD``).

    d = g + λθ;  b ← μ b + d (b₀ = 0, so b₁ = d);  θ ← θ − lr·(d + μ b if nesterov else b).
    """

    lr: float
    momentum: float = 0.0
    nesterov: bool = False
    weight_decay: float = 0.0

    def __post_init__(self) -> None:
        _check(self.lr > 0, f"lr must be > 0, got {self.lr!r}")
        _check(0 <= self.momentum < 1, f"momentum must lie in [0, 1), got {self.momentum!r}")
        _check(self.weight_decay >= 0, f"weight_decay must be ≥ 0, got {self.weight_decay!r}")
        _check(not self.nesterov or self.momentum > 0, "nesterov needs momentum > 0")

    def init(self, params: Tensors) -> State:
        """The state before the first step: the momentum buffer b = 0 (none without momentum)."""
        return {"momentum": {n: torch.zeros_like(p) for n, p in params.items()}} if self.momentum else {}

    def update(self, params: Tensors, state: State, grads: Tensors, lr: float, step: int) -> tuple[Tensors, State]:
        """(θ', state') after one step."""
        new_params, buffers = {}, {}
        for n, p in params.items():
            d = grads[n] + self.weight_decay * p if self.weight_decay else grads[n]
            if self.momentum:
                buffers[n] = self.momentum * state["momentum"][n] + d
                d = d + self.momentum * buffers[n] if self.nesterov else buffers[n]
            new_params[n] = p - lr * d
        return new_params, ({"momentum": buffers} if self.momentum else {})


@dataclass(frozen=True)
class Adam:
    """Adam (Kingma & Ba) with coupled weight decay λ (an L2 term in the gradient; ``torch.optim.Adam``).

    d = g + λθ;  m ← m + (1−β₁)(d − m);  v ← β₂v + (1−β₂)d²;
    θ ← θ − (lr / (1−β₁ᵗ)) · m / (√v / √(1−β₂ᵗ) + ε).
    """

    lr: float
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0

    decoupled = False

    def __post_init__(self) -> None:
        _check(self.lr > 0, f"lr must be > 0, got {self.lr!r}")
        _check(all(0 <= b < 1 for b in self.betas), f"betas must lie in [0, 1), got {self.betas!r}")
        _check(self.eps > 0, f"eps must be > 0, got {self.eps!r}")
        _check(self.weight_decay >= 0, f"weight_decay must be ≥ 0, got {self.weight_decay!r}")

    def init(self, params: Tensors) -> State:
        """The state before the first step: both moments m = v = 0."""
        return {"m": {n: torch.zeros_like(p) for n, p in params.items()},
                "v": {n: torch.zeros_like(p) for n, p in params.items()}}

    def update(self, params: Tensors, state: State, grads: Tensors, lr: float, step: int) -> tuple[Tensors, State]:
        """(θ', state') after one step (``step`` ≥ 1 enters the bias corrections)."""
        beta1, beta2 = self.betas
        step_size = lr / (1 - beta1**step)
        correction2 = math.sqrt(1 - beta2**step)
        new_params, m_new, v_new = {}, {}, {}
        for n, p in params.items():
            d = grads[n]
            if self.weight_decay and self.decoupled:
                p = p * (1 - lr * self.weight_decay)
            elif self.weight_decay:
                d = d + self.weight_decay * p
            m_new[n] = state["m"][n] + (1 - beta1) * (d - state["m"][n])
            v_new[n] = beta2 * state["v"][n] + (1 - beta2) * d * d
            new_params[n] = p - step_size * m_new[n] / (_safe_sqrt(v_new[n]) / correction2 + self.eps)
        return new_params, {"m": m_new, "v": v_new}


@dataclass(frozen=True)
class AdamW(Adam):
    """Adam with decoupled weight decay (Loshchilov & Hutter; ``torch.optim.AdamW``): θ ← θ(1 − lr·λ) first,
    then Adam's step on the plain gradient g."""

    weight_decay: float = 1e-2
    decoupled = True


Optimizer = SGD | Adam


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise InputError(message + "; fix the optimizer's hyper-parameters.")
