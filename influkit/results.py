"""The result type shared by every influence method in influkit.

Sign convention (DESIGN §1): ``values[i]`` is I(z_i, T) = d/dε of the summed test loss when the training
objective gains ε·ℓ(z_i). Positive = up-weighting z_i raises the test loss (harmful). Removing z_i is
ε = −1/n, so the predicted change of the summed test loss is ``removal = −values / n``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from .errors import InputError


@dataclass
class InfluenceResult:
    """Influence scores of training examples on a test set, with the diagnostics of their computation.

    values: (len(z),) summed over the test set, or (len(z), len(x_test)) when computed per test point.
    n_train: number of examples the training objective averages over (m or n), used for ``removal``.
    index: the example ids of ``values``' rows (indices into the training data, or 0..len(z)-1).
    method: a short name of how the scores were computed ("single-stage", "multi-stage case 1", ...).
    diagnostics: solver iterations, residuals, timings and settings.
    """

    values: torch.Tensor
    n_train: int
    index: torch.Tensor | None = None
    method: str = ""
    diagnostics: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.values = self.values.detach()
        if self.index is None:
            self.index = torch.arange(self.values.shape[0])
        self.index = torch.as_tensor(self.index).detach().cpu()
        if self.index.shape[0] != self.values.shape[0]:
            raise InputError(
                f"index has {self.index.shape[0]} entries but values has {self.values.shape[0]} rows; "
                "pass one example id per row of values."
            )

    @property
    def per_test(self) -> bool:
        """True when ``values`` holds one column per test point."""
        return self.values.dim() == 2

    @property
    def removal(self) -> torch.Tensor:
        """Predicted change of the (summed) test loss when each example is removed: −values / n_train."""
        return -self.values / self.n_train

    @property
    def total(self) -> torch.Tensor:
        """Scores summed over the test set, shape (len(z),)."""
        return self.values.sum(dim=1) if self.per_test else self.values

    def to_frame(self) -> pd.DataFrame:
        """One row per example: ``example``, ``score`` and ``removal`` (summed over the test set).

        With per-test values, the columns ``score_t{j}`` hold each test point's score as well.
        """
        total = self.total.cpu().double().numpy()
        frame = pd.DataFrame(
            {"example": self.index.numpy(), "score": total, "removal": -total / self.n_train}
        )
        if self.per_test:
            per = self.values.cpu().double().numpy()
            for j in range(per.shape[1]):
                frame[f"score_t{j}"] = per[:, j]
        return frame

    def top(self, k: int = 10, harmful: bool = True) -> pd.DataFrame:
        """The k most harmful (largest score) or, with ``harmful=False``, most helpful examples."""
        frame = self.to_frame()[["example", "score", "removal"]]
        return frame.sort_values("score", ascending=not harmful).head(k).reset_index(drop=True)

    def save(self, path: str | Path) -> None:
        """Write the result to ``path`` (a torch file); read it back with :func:`load`."""
        torch.save(
            {
                "values": self.values.cpu(),
                "n_train": self.n_train,
                "index": self.index,
                "method": self.method,
                "diagnostics": self.diagnostics,
            },
            Path(path),
        )

    def __repr__(self) -> str:
        shape = tuple(self.values.shape)
        return f"InfluenceResult(method={self.method!r}, values{shape}, n_train={self.n_train})"


def load(path: str | Path) -> InfluenceResult:
    """Read an :class:`InfluenceResult` written by :meth:`InfluenceResult.save`."""
    state = torch.load(Path(path), weights_only=False)
    return InfluenceResult(**state)
