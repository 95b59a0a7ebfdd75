"""The registry of fitted curvature approximations: one class per approximation, looked up by name.

An approximation C ≈ H (or of the Gauss-Newton matrix) is fitted once per stage and used by the solvers as an
approximate inverse (x = (C + λI)⁻¹ b) or as a preconditioner M = C + λI. Each class says how it is fitted
(``fit``) and read back from a file (``from_state``); the fitted object has ``solve(rhs, damping)``,
``state(prefix)`` and ``info``. A new approximation is one registered class.

| name       | fitted object          | needs                                   |
|------------|------------------------|-----------------------------------------|
| ``kfac``   | :class:`FactoredCurvature` | the stage's layers (module hooks)   |
| ``ekfac``  | :class:`FactoredCurvature` | the stage's layers (module hooks)   |
| ``diagonal`` | :class:`FactoredCurvature` | the stage's per-example gradients |
| ``arnoldi``| :class:`ArnoldiInverse` | Hessian-vector products only (any operator) |

``config`` is the stage's curvature settings (:class:`influkit.CurvatureConfig`: ``fisher``, ``seed``, ``rank``).
"""

from __future__ import annotations

from typing import ClassVar

from ..params import ParamSpace, point
from .arnoldi import ArnoldiInverse, lanczos

APPROXIMATIONS: dict[str, type["Approximation"]] = {}


def register(name: str):
    """Class decorator: the :class:`Approximation` fitted for ``name`` (``SolveConfig(solver=name)`` or
    ``preconditioner=name``)."""

    def add(cls):
        cls.name = name
        APPROXIMATIONS[name] = cls
        return cls

    return add


class Approximation:
    """How one approximation is fitted on a stage's operator and restored from a file."""

    name: ClassVar[str] = ""
    needs_stage: ClassVar[bool] = True  # fitted from the stage's model and data, not from the operator's products
    depends_on: ClassVar[tuple[str, ...]] = ()  # the CurvatureConfig settings its fit reads (besides the operator)
    measures_gradient: ClassVar[bool] = False  # its fit takes gradient=True: its data pass measures ∇L as well

    @classmethod
    def fit(cls, operator, config, *, memory: int | None = None, progress: bool = False):
        """The fitted approximation of ``operator`` (a stage's Hessian operator) with settings ``config`` (one whose
        ``measures_gradient``: also ``gradient=True``, the objective's gradient measured in its data pass)."""
        raise NotImplementedError

    @classmethod
    def from_state(cls, tensors, meta: dict, operator, prefix: str = ""):
        """The approximation saved by its ``state(prefix)``, for ``operator``'s parameters."""
        raise NotImplementedError


@register("arnoldi")
class Arnoldi(Approximation):
    """The top-``rank`` Lanczos eigenpairs (θ, V) of H: (H + λI)⁻¹ ≈ V diag(1/(θ + λ)) Vᵀ (:mod:`.arnoldi`)."""

    needs_stage = False
    depends_on = ("rank", "seed")

    @classmethod
    def fit(cls, operator, config, *, memory=None, progress=False):
        theta, vectors, info = lanczos(operator, config.rank, seed=config.seed, progress=progress)
        return ArnoldiInverse(theta, vectors, operator.dtype, info | {"seed": config.seed})

    @classmethod
    def from_state(cls, tensors, meta, operator, prefix=""):
        return ArnoldiInverse.from_state(tensors, meta, operator.dtype, operator.device, prefix)


def space_of(operator) -> ParamSpace:
    """The parameter space of a stage's operator (its trained parameters at the point it is taken)."""
    return ParamSpace(point(operator.stage.state(), operator.names, getattr(operator, "at", None)))
