"""Errors and warnings raised by influkit; every message says what to change."""


class InfluenceError(Exception):
    """Base class of every error influkit raises on purpose."""


class InputError(InfluenceError, ValueError):
    """Data or arguments of the wrong shape, type, size or content (NaN, empty)."""


class ParameterError(InfluenceError, KeyError):
    """A parameter name or prefix that does not match the model, or mismatched parameter shapes."""

    def __str__(self) -> str:  # KeyError would otherwise quote the message
        return str(self.args[0]) if self.args else ""


class LossError(InfluenceError, ValueError):
    """A loss function that does not return one finite value per example."""


class ModelModeError(InfluenceError, RuntimeError):
    """A model left in train mode with dropout or batch-norm layers."""


class NumericalError(InfluenceError, FloatingPointError):
    """NaN or Inf appeared in a gradient, Hessian-vector product or solver iterate."""


class MemoryBudgetError(InfluenceError, MemoryError):
    """The memory budget cannot hold even one example of a phase; the message gives the bytes one example needs."""


class ConvergenceWarning(UserWarning):
    """An iterative solver stopped before reaching its tolerance; the message gives the residual."""


class StationarityWarning(UserWarning):
    """A stage is not at a minimum of its objective (non-stationary, a saddle, or singular); the message gives
    the numbers (:mod:`influkit.stationarity`) and what ``solver="auto"`` did about it."""


class VectorizationWarning(UserWarning):
    """A loss could not be vectorized with ``torch.func.vmap`` and runs in a (slower) per-example loop instead."""


class FileFormatError(InfluenceError, ValueError):
    """A file that is not an influkit file of the expected kind, or that was modified after it was written."""


class ContractionWarning(UserWarning):
    """Contracted scores did not match the gradient of the summed loss; per-example gradients are used instead."""
