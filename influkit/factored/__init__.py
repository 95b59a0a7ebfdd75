"""Factored and low-rank curvature: K-FAC, EK-FAC, diagonal Fisher, and Lanczos (Arnoldi) eigenpairs.

Each is an :class:`~influkit.operators.Operator` over a stage's trained parameters (in its ParamSpace order)
with an exact inverse application, used two ways by :mod:`influkit.solvers`:

- as an **approximate inverse** (``SolveConfig(solver="ekfac" | "kfac" | "arnoldi")``): x = C⁻¹ b, like
  kronfluence (EK-FAC/K-FAC) or Schioppa et al. (Arnoldi);
- as a **preconditioner** of an exact solve (``SolveConfig(solver="minres" | "cg_spd", preconditioner="ekfac" |
  "kfac" | "diagonal")``): MINRES/CG on the true H + λI with M = C + λI, so the answer is the exact one and the
  factors only decide how fast it is reached.

Modules: :mod:`.fisher` (pseudo output-gradients: sampled labels, empirical, exact), :mod:`.layers` (which
parameters get Kronecker factors; the layer types are :mod:`influkit.layers`), :mod:`.blocks` (a layer's
Kronecker block, the diagonal block), :mod:`.operator` (the fitted curvature as an operator, its inverse, its files),
:mod:`.fit` (fitting in passes: statistics, all-reduce, memory probing), :mod:`.gradient` (what the fit's data pass
measures of the objective's gradient for the stationarity check), :mod:`.head` (that pass's true-label backward
started below the output layer, on the output rows that carry a gradient), :mod:`.regularizer` (R's diagonal),
:mod:`.kinds` (the registered ``diagonal``, ``kfac``, ``ekfac``), :mod:`.arnoldi` (Lanczos eigenpairs, the low-rank inverse, deflation),
:mod:`.approximations` (the registry: one class per approximation, which :class:`influkit.FittedCurvature` fits by
name), :mod:`.tokens` (a summed gradient whose Kronecker blocks are kept as token factors, solved from them).
"""

from .approximations import APPROXIMATIONS
from .arnoldi import ArnoldiInverse, deflated, lanczos
from .fisher import FISHER, FactoredCurvatureError
from .fit import KINDS, fit_curvature
from .gradient import ObjectiveGradient
from .kinds import EKFAC, KFAC, Diagonal
from .layers import plan_layers
from .operator import FactoredCurvature, InverseOperator
from .regularizer import regularizer_diagonal

__all__ = [
    "APPROXIMATIONS",
    "ArnoldiInverse",
    "Diagonal",
    "EKFAC",
    "FISHER",
    "FactoredCurvature",
    "FactoredCurvatureError",
    "InverseOperator",
    "KFAC",
    "KINDS",
    "ObjectiveGradient",
    "deflated",
    "fit_curvature",
    "lanczos",
    "plan_layers",
    "regularizer_diagonal",
]
