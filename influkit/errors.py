"""Errors and warnings raised by influkit; every message says what to change, and every warning points at the
user's line (:func:`warn`)."""

import contextlib
import functools
import os
import sys
import warnings

import torch

# frames in these directories are library code: a warning is attributed to the first frame outside them (influkit's
# folder and torch's)
_LIBRARY_DIRS = (os.path.dirname(os.path.abspath(__file__)) + os.sep,
                 os.path.dirname(os.path.abspath(torch.__file__)) + os.sep)
_LIBRARY_FILES = (os.path.abspath(contextlib.__file__), os.path.abspath(functools.__file__))


def _is_library(filename: str) -> bool:
    path = os.path.abspath(filename)
    return path.startswith(_LIBRARY_DIRS) or path in _LIBRARY_FILES


def warn(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` attributed to the user's line: the first caller outside influkit (and torch, whose
    transforms and hooks call back into it), however deep the call that found the problem."""
    frame, level = sys._getframe(1), 2  # stacklevel 2: warn's caller
    while frame.f_back is not None and _is_library(frame.f_code.co_filename):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


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


class NotReplayable(InfluenceError, ValueError):
    """A training run that replay cannot repeat bit for bit (an unknown optimizer, autocast, a sampler whose indices
    cannot be captured, ...), refused before its first step; the message names the change that makes it replayable."""


class NumericalError(InfluenceError, FloatingPointError):
    """NaN or Inf appeared in a gradient, Hessian-vector product or solver iterate."""


class MemoryBudgetError(InfluenceError, MemoryError):
    """The memory budget cannot hold even one example of a phase; the message gives the bytes one example needs."""


class MissingDependencyError(InfluenceError, ImportError):
    """An optional dependency is not installed; the message names the extra that installs it (``influkit[elmo]``...)."""


class IndexMismatchError(InfluenceError, ValueError):
    """A gradient index used with another checkpoint, other data or other settings than it was built from."""


class DataUnavailable(InfluenceError, RuntimeError):
    """A data set that is not on this machine and could not be fetched; the message says how to get it."""


class ConvergenceWarning(UserWarning):
    """An iterative solver stopped before reaching its tolerance; the message gives the residual."""


class StationarityWarning(UserWarning):
    """A stage is not at a minimum of its objective (non-stationary, a saddle, or singular); the message gives
    the numbers (:mod:`influkit.stationarity`) and what ``solver="auto"`` did about it."""


class ProximalWarning(UserWarning):
    """A Case 2 stage's shared block drifted from the previous stage's values differently from what its proximal
    weight α implies; the message gives the α that matches the drift (:mod:`influkit.proximal`)."""


class VectorizationWarning(UserWarning):
    """A loss could not be vectorized with ``torch.func.vmap`` and runs in a (slower) per-example loop instead."""


class ProjectionNoiseWarning(UserWarning):
    """A compressed index's random projection adds noise of the order of the scores themselves; the message gives
    the bound and the index that removes it."""


class FileFormatError(InfluenceError, ValueError):
    """A file that is not an influkit file of the expected kind, or that was modified after it was written."""


class ContractionWarning(UserWarning):
    """Contracted scores did not match the gradient of the summed loss; per-example gradients are used instead."""
