"""The result type shared by every influence method in influkit.

Sign convention: ``values[i]`` is I(z_i, T) = d/dε of the summed test loss when the training objective
gains ε·ℓ(z_i). Positive = up-weighting z_i raises the test loss (harmful). The predicted change when z_i is
removed is ``removal = removal_eps · values``, with ``removal_eps`` the ε that removes z_i:

- −1/n for objectives that *average* over n examples (influence, multi-stage, the default);
- −λ_u for the SSL weight hypergradient (values are ∂L_S/∂λ_u; removing u sets its weight λ_u to 0);
- −1 for turn-over dropout, whose values are already whole-removal differences L(with i) − L(without i).
- −1 for unrolled attribution (``influkit.unrolled``), whose values are d f/d w_z of the data weight w_z = 1
  that removal sets to 0.

``diagnostics`` has one shape everywhere: ``{"solves": [Solution summaries, each with a "stage" key],
"seconds": {phase: seconds}, "settings": {...}}`` (empty lists/dicts where a method has none).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from . import files
from .errors import InputError

if TYPE_CHECKING:  # pandas is imported by the methods that build tables, not by `import influkit`
    import pandas as pd


KIND = "influence-result"


@dataclass
class InfluenceResult:
    """Influence scores of training examples on a test set, with the diagnostics of their computation.

    values: (len(z),) summed over the test set, or (len(z), len(x_test)) when computed per test point.
    n_train: number of examples of the training objective (m or n).
    index: the example ids of ``values``' rows (indices into the training data, or 0..len(z)-1).
    method: a short name of how the scores were computed ("single-stage", "multi-stage case 1", ...).
    diagnostics: ``{"solves": [...], "seconds": {...}, "settings": {...}}`` (module docstring).
    removal_eps: the ε removing each example, a number or one per row (default −1/n_train).
    """

    values: torch.Tensor
    n_train: int
    index: torch.Tensor | None = None
    method: str = ""
    diagnostics: dict[str, Any] = field(default_factory=dict)
    removal_eps: float | torch.Tensor | None = None

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
        if self.removal_eps is None:
            self.removal_eps = -1.0 / self.n_train
        if torch.is_tensor(self.removal_eps):
            self.removal_eps = self.removal_eps.detach().to(self.values.device, self.values.dtype).reshape(-1)
            if self.removal_eps.shape[0] != self.values.shape[0]:
                raise InputError("removal_eps needs one value per row of values (or one number for all).")
        self.diagnostics = {"solves": [], "seconds": {}, "settings": {}} | dict(self.diagnostics)

    @property
    def per_test(self) -> bool:
        """True when ``values`` holds one column per test point."""
        return self.values.dim() == 2

    @property
    def removal(self) -> torch.Tensor:
        """Predicted change of the (summed) test loss when each example is removed: removal_eps · values."""
        eps = self.removal_eps
        return eps.reshape(-1, *([1] * (self.values.dim() - 1))) * self.values if torch.is_tensor(eps) else eps * self.values

    @property
    def total(self) -> torch.Tensor:
        """Scores summed over the test set, shape (len(z),)."""
        return self.values.sum(dim=1) if self.per_test else self.values

    def to_frame(self) -> "pd.DataFrame":
        """One row per example: ``example``, ``score`` and ``removal`` (summed over the test set).

        With per-test values, the columns ``score_t{j}`` hold each test point's score as well.
        """
        import pandas as pd

        total = self.total.cpu().double()
        eps = self.removal_eps.cpu().double() if torch.is_tensor(self.removal_eps) else self.removal_eps
        frame = pd.DataFrame(
            {"example": self.index.numpy(), "score": total.numpy(), "removal": (eps * total).numpy()}
        )
        if self.per_test:
            per = self.values.cpu().double().numpy()
            for j in range(per.shape[1]):
                frame[f"score_t{j}"] = per[:, j]
        return frame

    def top(self, k: int = 10, *, harmful: bool = True, texts=None) -> "pd.DataFrame":
        """The k most harmful (largest score) or, with ``harmful=False``, most helpful examples.

        texts: optional text (or label) of every training example, indexed by example id (a list over the
        whole training set, or a mapping id → text); shown in a ``text`` column.
        """
        frame = self.to_frame()[["example", "score", "removal"]]
        return _with_texts(frame.sort_values("score", ascending=not harmful).head(k).reset_index(drop=True), texts)

    def top_indices(self, k: int = 10, *, harmful: bool = True) -> torch.Tensor:
        """The example ids of :meth:`top` (the k largest scores, or the k smallest with ``harmful=False``), in that
        order, as a LongTensor that indexes the training data directly (``x[res.top_indices(10)]``)."""
        order = torch.argsort(self.total.cpu().double(), descending=harmful, stable=True)[:k]
        return self.index[order].long()

    def suspicious(self, k: int = 10, texts=None) -> "pd.DataFrame":
        """The k examples a self-influence result flags first: those whose removal would raise their own loss the
        most (largest ``removal``) — the ones the model fits only by memorizing them: mislabelled, duplicated with
        another label, atypical. No sign to remember: the self-influence I(z, z) = −∇ℓ(z)ᵀH⁻¹∇ℓ(z) of a
        positive definite H is negative, and the most negative come first. texts: as in :meth:`top`.
        """
        if "self-influence" not in self.method:
            raise InputError(
                f"suspicious() ranks a self-influence result (ik.self_influence), not a {self.method!r} one; on "
                "influence on a test set, top(k) gives the most harmful examples and top(k, harmful=False) the most "
                "helpful."
            )
        frame = self.to_frame()[["example", "score", "removal"]]
        return _with_texts(frame.sort_values("removal", ascending=False).head(k).reset_index(drop=True), texts)

    def save(self, path: str | Path) -> Path:
        """Write the result to ``path`` (safetensors + JSON header, any file name); read it with :func:`load`."""
        tensors = {"values": self.values, "index": self.index}
        if torch.is_tensor(self.removal_eps):
            tensors["removal_eps"] = self.removal_eps
        meta = {"n_train": self.n_train, "method": self.method, "diagnostics": self.diagnostics}
        if not torch.is_tensor(self.removal_eps):
            meta["removal_eps"] = self.removal_eps
        return files.write(path, KIND, tensors, meta)

    def __repr__(self) -> str:
        shape = tuple(self.values.shape)
        return f"InfluenceResult(method={self.method!r}, values{shape}, n_train={self.n_train})"


def _with_texts(frame: "pd.DataFrame", texts) -> "pd.DataFrame":
    """``frame`` with a ``text`` column from ``texts`` (indexed by example id), if given."""
    if texts is not None:
        try:
            frame["text"] = [texts[int(i)] for i in frame["example"]]
        except (IndexError, KeyError) as exc:
            raise InputError(
                f"texts has no entry for example {exc}; pass one text per training example, indexed by its id."
            ) from None
    return frame


def load(path: str | Path) -> InfluenceResult:
    """Read an :class:`InfluenceResult` written by :meth:`InfluenceResult.save` (never unpickles).

    Raises :class:`~influkit.errors.FileFormatError` for a file that is not one, or was modified.
    """
    tensors, meta = files.read(path, KIND)
    return InfluenceResult(
        values=tensors["values"], index=tensors["index"], n_train=meta["n_train"], method=meta["method"],
        diagnostics=meta["diagnostics"], removal_eps=tensors.get("removal_eps", meta.get("removal_eps")),
    )
