"""The registered factored approximations — ``"diagonal"``, ``"kfac"``, ``"ekfac"`` — of :mod:`.approximations`:
each a class saying which passes of a :class:`~influkit.factored.fit.FactorFit` it runs."""

from __future__ import annotations

from typing import ClassVar

from .approximations import Approximation, register, space_of
from .fit import FactorFit, fit_curvature
from .operator import FactoredCurvature


class _Factored(Approximation):
    """A :class:`FactoredCurvature` fitted from the stage's layers by :func:`fit_curvature`: the registered class
    of each kind says which passes of a :class:`FactorFit` it runs (``passes``)."""

    kronecker: ClassVar[bool] = True  # False: no Kronecker factors (no layer is too wide for them)
    depends_on = ("fisher", "seed")
    measures_gradient = True

    @classmethod
    def fit(cls, operator, config, *, memory=None, progress=False, gradient=False):
        return fit_curvature(operator.stage, operator.names, kind=cls.name, fisher=config.fisher,
                             indices=operator.indices, extra=operator.extra, at=getattr(operator, "at", None),
                             seed=config.seed, memory=memory, gradient=gradient, progress=progress)

    @classmethod
    def from_state(cls, tensors, meta, operator, prefix=""):
        return FactoredCurvature.from_state(tensors, meta, space_of(operator), prefix)

    @classmethod
    def passes(cls, fit: FactorFit) -> FactoredCurvature:
        raise NotImplementedError


@register("diagonal")
class Diagonal(_Factored):
    """diag(GGN) = (1/n) Σ_{i,j} (∇_θ ℓ_ij)²: one pass of squared per-example gradients, every parameter its block."""

    kronecker = False

    @classmethod
    def passes(cls, fit):
        fit.statistics_pass(squares=True)
        return fit.assemble({}, {})


@register("kfac")
class KFAC(_Factored):
    """C_M = G ⊗ A: one covariance pass, their eigendecompositions, eigenvalues the products of the factors'."""

    @classmethod
    def passes(cls, fit):
        fit.statistics_pass(squares=False)
        eigen = fit.eigendecomposition()
        return fit.assemble(eigen, fit.kfac_values(eigen))


@register("ekfac")
class EKFAC(_Factored):
    """K-FAC's eigenbases with the eigenvalues corrected to the per-example gradients' second moments in them."""

    @classmethod
    def passes(cls, fit):
        fit.statistics_pass(squares=False, keep=True)
        eigen = fit.eigendecomposition()
        return fit.assemble(eigen, fit.correction_pass(eigen))
