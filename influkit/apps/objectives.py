"""The objective pieces the apps, examples, benchmarks and tests train with: one loss, one regularizer.

influkit's loss convention is per-example: ``loss(outputs, targets)`` returns shape (B,), and the stage
objective is its mean plus the regularizer R(θ) evaluated on the dict of trained parameters.
"""

from __future__ import annotations

import torch
from torch import nn


def cross_entropy(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-example cross-entropy, shape (B,) (``reduction='none'``)."""
    return nn.functional.cross_entropy(outputs, targets, reduction="none")


def l2(weight: float):
    """The regularizer R(θ) = (weight/2)·‖θ‖² over the trained parameters (its Hessian is weight·I)."""
    return lambda params: 0.5 * weight * sum((p**2).sum() for p in params.values())
