"""influkit: trace a (finetuned) model's predictions back to the training and pretraining data that shaped them."""

from .errors import (
    ConvergenceWarning,
    InfluenceError,
    InputError,
    LossError,
    ModelModeError,
    NumericalError,
    ParameterError,
)
from .influence import influence, self_influence
from .multistage import score
from .results import InfluenceResult, load
from .solvers import Solution, solve
from .stage import Stage
from . import elmo, ssl, turnover, validation  # noqa: E402  (method packages: ik.ssl, ik.turnover, ...)

__all__ = [
    "ConvergenceWarning",
    "InfluenceError",
    "InfluenceResult",
    "InputError",
    "LossError",
    "ModelModeError",
    "NumericalError",
    "ParameterError",
    "Solution",
    "Stage",
    "elmo",
    "influence",
    "load",
    "score",
    "self_influence",
    "solve",
    "ssl",
    "turnover",
    "validation",
]
__version__ = "0.1.0"
