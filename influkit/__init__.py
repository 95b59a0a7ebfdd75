"""influkit: trace a (finetuned) model's predictions back to the training and pretraining data that shaped them."""

from typing import TYPE_CHECKING

from .chain import Chain, Link, Query, load_query
from .ensemble import Ensemble
from .errors import (
    ConvergenceWarning,
    FileFormatError,
    IndexMismatchError,
    InfluenceError,
    InputError,
    LossError,
    MemoryBudgetError,
    MissingDependencyError,
    ModelModeError,
    NotReplayable,
    NumericalError,
    ParameterError,
    ProjectionNoiseWarning,
    ProximalWarning,
    StationarityWarning,
    VectorizationWarning,
)
from .auto import Training
from .fitted import CurvatureConfig, FittedCurvature
from .influence import influence, self_influence
from .multistage import score
from .pairwise import Pairwise, pairwise
from .per_token import TokenScores
from .results import InfluenceResult, load
from .operators import DenseOperator, Operator
from .solvers import Solution, SolveConfig, solve
from .stage import Stage

# Method and application packages load on first use (``ik.ssl``, ``ik.validation``, ...), so `import influkit`
# stays the core: no h5py (elmo), transformers (hf), pandas (validation, ssl) or matplotlib (apps); the optional
# dependencies are extras (influkit/extras.py).
_LAZY = ("apps", "elmo", "hf", "index", "ssl", "turnover", "unrolled", "validation")

if TYPE_CHECKING:  # type checkers and IDEs see the lazy packages as the modules they are, not as Any
    from . import apps, elmo, hf, index, ssl, turnover, unrolled, validation


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'influkit' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "Chain",
    "ConvergenceWarning",
    "CurvatureConfig",
    "DenseOperator",
    "Ensemble",
    "FileFormatError",
    "FittedCurvature",
    "InfluenceError",
    "InfluenceResult",
    "Pairwise",
    "TokenScores",
    "InputError",
    "NotReplayable",
    "Link",
    "LossError",
    "MemoryBudgetError",
    "MissingDependencyError",
    "ModelModeError",
    "NumericalError",
    "Operator",
    "ParameterError",
    "ProjectionNoiseWarning",
    "ProximalWarning",
    "Query",
    "Solution",
    "StationarityWarning",
    "Training",
    "VectorizationWarning",
    "SolveConfig",
    "Stage",
    "apps",
    "elmo",
    "hf",
    "index",
    "influence",
    "load",
    "load_query",
    "pairwise",
    "score",
    "self_influence",
    "solve",
    "ssl",
    "turnover",
    "unrolled",
    "validation",
]
__version__ = "0.1.0"
