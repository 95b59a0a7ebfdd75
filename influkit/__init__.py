"""influkit: trace a (finetuned) model's predictions back to the training and pretraining data that shaped them."""

from .chain import Chain, Link, Query, load_query
from .errors import (
    ConvergenceWarning,
    FileFormatError,
    InfluenceError,
    InputError,
    LossError,
    ModelModeError,
    NumericalError,
    ParameterError,
    VectorizationWarning,
)
from .influence import influence, self_influence
from .multistage import score
from .results import InfluenceResult, load
from .operators import DenseOperator, Operator
from .solvers import Solution, SolveConfig, solve
from .stage import Stage
from . import elmo, ssl, turnover, validation  # noqa: E402  (method packages: ik.ssl, ik.turnover, ...)

__all__ = [
    "Chain",
    "ConvergenceWarning",
    "DenseOperator",
    "FileFormatError",
    "InfluenceError",
    "InfluenceResult",
    "InputError",
    "Link",
    "LossError",
    "ModelModeError",
    "NumericalError",
    "Operator",
    "ParameterError",
    "Query",
    "Solution",
    "VectorizationWarning",
    "SolveConfig",
    "Stage",
    "elmo",
    "influence",
    "load",
    "load_query",
    "score",
    "self_influence",
    "solve",
    "ssl",
    "turnover",
    "validation",
]
__version__ = "0.1.0"
