"""A stage's curvature apart from how its systems are solved: the settings (:class:`CurvatureConfig`) and what
they fit, once (:class:`FittedCurvature`).

:class:`CurvatureConfig` says which matrix H every solve of a stage uses (the exact Hessian of the stage
objective or its Gauss-Newton matrix), on which examples it is estimated, and how the approximations of it
(:mod:`influkit.factored.approximations`: K-FAC, EK-FAC, diagonal, Arnoldi) are fitted.
:class:`~influkit.solvers.SolveConfig` says how (H + λI) x = b is then solved.

:class:`FittedCurvature` holds one stage's operator H (with its dense form once a ``direct`` solve built it) and each
approximation a solver asked for, fitted on first request and kept. A :class:`~influkit.Chain` owns one per stage
and hands it to that stage's solver; :meth:`influkit.Chain.with_solve` hands the same object to new solve settings,
so a damping or solver sweep refits nothing; for a stage whose CurvatureConfig changed it hands over
:meth:`FittedCurvature.derive`, which keeps every fitted item whose settings did not change. What an item depends
on is declared: the operator by :data:`OPERATOR_SETTINGS`, each approximation by its ``depends_on``
(:class:`~influkit.factored.approximations.Approximation`); the values of those settings are kept beside each fitted
item (``reads``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace

import torch

from .curvature import CURVATURES, HessianOperator
from .errors import InputError
from .factored import FISHER, FactoredCurvatureError
from .factored.approximations import APPROXIMATIONS
from .operators import DenseOperator, Operator

MATRICES = CURVATURES  # ("hessian", "gauss-newton")
OPERATOR_SETTINGS = ("matrix", "hessian_samples", "seed")  # what a stage's HessianOperator is built from


@dataclass(frozen=True)
class CurvatureConfig:
    """Which matrix H a stage's solves use and how its approximations are fitted.

    matrix: ``"hessian"`` (default: the exact Hessian of the stage objective) or ``"gauss-newton"`` (the generalized
    Gauss-Newton matrix G ⪰ 0, :mod:`influkit.curvature`: G's damped system is positive definite for convex
    losses, so MINRES/CG converge where an indefinite H + λI stalls, and it is the matrix K-FAC/EK-FAC approximate).
    The links between stages (the Case 1/2 cross derivatives) stay exact Hessian products either way.
    hessian_samples: estimate H, and fit its approximations, on a seeded random sample of this many examples
    (default: all). seed: of that sample, of the sampled-Fisher labels and of the Lanczos start vector.
    fisher: how K-FAC, EK-FAC and the diagonal approximation estimate the Gauss-Newton matrix: ``"sampled"`` labels
    (default; cross-entropy or squared-error losses), ``"empirical"`` (true labels, any loss), ``"exact"``
    (:mod:`influkit.factored.fisher`). rank: eigenpairs of the ``"arnoldi"`` approximation and of
    ``SolveConfig(deflate=True)`` (Lanczos steps: max(2·rank, rank + 20)).
    """

    matrix: str = "hessian"
    hessian_samples: int | None = None
    seed: int = 0
    fisher: str = "sampled"
    rank: int = 50

    def __post_init__(self) -> None:
        if self.matrix not in MATRICES:
            raise InputError(f"unknown matrix {self.matrix!r}; choose one of {MATRICES}.")
        if self.hessian_samples is not None and (isinstance(self.hessian_samples, bool) or self.hessian_samples <= 0):
            raise InputError(f"hessian_samples must be a positive number of examples (or None for all), got "
                             f"{self.hessian_samples!r}.")
        if self.fisher not in FISHER:
            raise InputError(f"unknown fisher {self.fisher!r}; choose one of {FISHER}.")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
            raise InputError(f"rank must be a positive number of eigenpairs, got {self.rank!r}.")

    def summary(self) -> dict:
        """The settings as JSON-friendly values."""
        return asdict(self)


def settings(config: CurvatureConfig, names: tuple[str, ...]) -> dict:
    """{name: value} of the settings ``names`` of ``config`` (what a fitted item depends on)."""
    return {name: getattr(config, name) for name in names}


class FittedCurvature:
    """One stage's curvature as fitted for a :class:`CurvatureConfig`: the operator H and the approximations
    solvers asked for (``approximation(name)``: fitted on first request, then kept).

    operator: the stage's :class:`~influkit.curvature.HessianOperator` (:meth:`of_stage` builds it from the config),
    or any :class:`~influkit.operators.Operator` (then only approximations that need no stage can be fitted).
    memory: the budget in bytes the fits size their batches from (None: a share of what is free).
    ``notes`` say where a fit departed from the settings (e.g. the empirical Fisher for an unrecognised loss);
    ``reads`` the settings each fitted item ("operator", each approximation's name) read, which :meth:`derive` compares.
    """

    def __init__(self, operator: Operator | torch.Tensor, config: CurvatureConfig = CurvatureConfig(), *,
                 memory: int | None = None):
        self.operator = DenseOperator(operator) if torch.is_tensor(operator) else operator
        self.config, self.memory = config, memory
        self.approximations: dict[str, object] = {}
        self.notes: list[str] = []
        self.reads: dict[str, dict] = {"operator": {}}

    @classmethod
    def of_stage(cls, stage, names, config: CurvatureConfig, *, extra=None, memory: int | None = None) -> "FittedCurvature":
        """The (not yet fitted) curvature of ``stage``'s objective [+ ``extra``] over the parameters ``names``."""
        operator = HessianOperator(stage, names, samples=config.hessian_samples, seed=config.seed, extra=extra,
                                   curvature=config.matrix, memory=memory)
        fitted = cls(operator, config, memory=memory)
        fitted.reads["operator"] = settings(config, OPERATOR_SETTINGS)
        return fitted

    def derive(self, config: CurvatureConfig) -> "FittedCurvature":
        """The same stage's curvature for ``config``: this one if ``config`` is its own; else one that keeps the
        operator (and its dense H) and each approximation whose read settings are unchanged — every approximation is
        fitted on the operator, so a new operator keeps none — and fits the rest when asked."""
        if config == self.config:
            return self
        unchanged = lambda name: all(getattr(config, k) == v for k, v in self.reads[name].items())  # noqa: E731
        if not unchanged("operator"):
            op = self.operator
            return FittedCurvature.of_stage(op.stage, op.names, config, extra=op.extra, memory=self.memory)
        out = FittedCurvature(self.operator, config, memory=self.memory)
        for name, fitted in self.approximations.items():
            if unchanged(name):
                out.approximations[name], out.reads[name] = fitted, self.reads[name]
        out.reads["operator"] = self.reads["operator"]
        out.notes = [note for note in self.notes if note.split(" ", 1)[0] in out.approximations]
        return out

    def __repr__(self) -> str:
        return f"FittedCurvature({self.config.matrix}, p={self.operator.dim}, fitted {sorted(self.approximations)})"

    def approximation(self, name: str, *, progress: bool = False, fallback: bool = False, gradient: bool = False):
        """The fitted approximation ``name`` (:data:`~influkit.factored.approximations.APPROXIMATIONS`), fitted now
        unless kept. fallback: where the sampled Fisher does not recognise the loss, fit on the empirical Fisher
        (with a note) instead of raising, and without a stage return None (with a note) — ``solver="auto"``'s
        preconditioner, which may do without. gradient: an approximation fitted now whose ``measures_gradient``
        also measures the objective's gradient in its data pass (its ``gradient``; a kept one is returned as kept)."""
        kept = self.approximations.get(name)
        if kept is not None and (fallback or kept.info.get("fisher", self.config.fisher) == self.config.fisher):
            return kept
        kind = APPROXIMATIONS[name]
        if kind.needs_stage and not isinstance(self.operator, HessianOperator):
            if fallback:
                self.notes.append("no preconditioner: the operator has no Stage to fit factors on")
                return None
            raise InputError(
                f"{name!r} needs the Hessian operator of a Stage (the factors come from the model's layers); got a "
                f"{type(self.operator).__name__}. Use influkit.curvature.HessianOperator or a Chain."
            )
        config = self.config
        measure = {"gradient": True} if gradient and kind.measures_gradient else {}
        try:
            fitted = kind.fit(self.operator, config, memory=self.memory, progress=progress, **measure)
        except FactoredCurvatureError:
            if not fallback or self.config.fisher != "sampled":
                raise
            self.notes.append(f"{name} on the empirical Fisher: the loss's predictive distribution is not recognised")
            config = replace(self.config, fisher="empirical")
            fitted = kind.fit(self.operator, config, memory=self.memory, progress=progress, **measure)
        self.approximations[name], self.reads[name] = fitted, settings(config, kind.depends_on)
        return fitted

    def share(self, name: str, other: "FittedCurvature") -> bool:
        """Take ``other``'s fitted approximation ``name`` as this curvature's, without fitting it again, where it is
        the same fit: one fitted from the stage's layers (``needs_stage``: K-FAC, EK-FAC and the diagonal estimate
        the Gauss-Newton matrix whichever matrix the operator multiplies by) of the same stage, parameters, examples
        and settings, the two configs differing at most in ``matrix``. Returns whether it was taken (else nothing
        changes: not fitted there, already fitted here, or another fit)."""
        fitted, mine, theirs = other.approximations.get(name), self.operator, other.operator
        same = (fitted is not None and name not in self.approximations and APPROXIMATIONS[name].needs_stage
                and isinstance(mine, HessianOperator) and isinstance(theirs, HessianOperator)
                and mine.stage is theirs.stage and mine.names == theirs.names and mine.extra is theirs.extra
                and mine.at is theirs.at and _same_examples(mine.indices, theirs.indices)
                and replace(other.config, matrix=self.config.matrix) == self.config)
        if same:
            self.approximations[name], self.reads[name] = fitted, other.reads[name]
            self.notes += [note for note in other.notes if note.split(" ", 1)[0] == name and note not in self.notes]
        return same

    def memory_plans(self) -> list[dict]:
        """The batch sizes the operator and each fit chose from the memory budget."""
        plans = [dict(self.operator.memory)] if isinstance(self.operator, HessianOperator) else [{}]
        return plans + [a.info["memory"] for a in self.approximations.values() if "memory" in a.info]

    # ---- persistence (tensors + JSON meta; see influkit.files)
    def state(self, prefix: str = "") -> tuple[dict[str, torch.Tensor], dict]:
        """(tensors, JSON meta) of what was fitted — the dense H if built, every approximation — for :meth:`load`."""
        tensors: dict[str, torch.Tensor] = {}
        if isinstance(self.operator, HessianOperator) and self.operator.has_dense:
            tensors[f"{prefix}hessian"] = self.operator.dense()
        meta: dict = {"notes": list(self.notes), "reads": self.reads, "approximations": {}}
        for name, fitted in self.approximations.items():
            t, meta["approximations"][name] = fitted.state(f"{prefix}{name}.")
            tensors.update(t)
        return tensors, meta

    def load(self, tensors: Mapping[str, torch.Tensor], meta: Mapping, prefix: str = "") -> "FittedCurvature":
        """Put what :meth:`state` saved back instead of fitting it again (bit for bit). Returns self."""
        if f"{prefix}hessian" in tensors:
            self.operator.restore_dense(tensors[f"{prefix}hessian"])
        self.notes = list(meta.get("notes", []))
        self.reads = {name: dict(read) for name, read in meta.get("reads", {"operator": {}}).items()}
        self.approximations = {
            name: APPROXIMATIONS[name].from_state(tensors, saved, self.operator, f"{prefix}{name}.")
            for name, saved in meta.get("approximations", {}).items()
        }
        return self


def _same_examples(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    """Whether two operators' example samples (None: every example) are the same."""
    return a is None and b is None or a is not None and b is not None and torch.equal(a, b)
