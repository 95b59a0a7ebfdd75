"""Multi-stage influence (Chen et al., NeurIPS 2020): the effect of a *pretraining* example on a finetuned
model's test loss.

Pretraining: W̄, Ū = argmin G(W, U) = (1/m) Σ_z g(z; W, U) + R_pre. Finetuning, Case 1 (W fixed):
Θ* = argmin_Θ F(W̄, Θ). Case 2 (W finetuned): W*, Θ* = argmin F(W, Θ) + α‖W − W̄‖².
Perturbing G → G + ε·g(z), the influence on the summed test loss f(T) is I(z, T) = d f(T) / dε (positive =
harmful; removing z changes f(T) by −I/m). With H_G = ∇²_{(W,U)} G both cases reduce to

    s = H_G⁻¹ [u; 0_U],   I(z, T) = −∇g(z)ᵀ s,

so every z costs one per-example gradient and two solves serve them all:
- Case 1: v = H_ΘΘ⁻¹ ∇_Θ f(T), u = ∇_W f(T) − H_WΘ v   (H over Θ of F, and its W-Θ cross block);
- Case 2: v = H_φφ⁻¹ ∇_φ f(T) over φ = (W, Θ) with the proximal block 2αI on W, u = 2α v_W
  (from ∂²/∂φ∂W̄ of the proximal term = [−2αI; 0]).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .chain import Chain, Link, Measure
from .errors import InputError
from .results import InfluenceResult
from .scoring import Rows
from .fitted import CurvatureConfig
from .solvers import SolveConfig
from .stage import Stage


def score(
    pretrain: Stage,
    finetune: Stage,
    z=None,
    x_test=None,
    *,
    shared: str | Mapping[str, str],
    case: int = 1,
    alpha: float = 0.01,
    solve: SolveConfig | Sequence[SolveConfig] | None = None,
    curvature: CurvatureConfig | str | Sequence[CurvatureConfig | str] | None = None,
    measure: Measure | None = None,
    per_test: bool = False,
    chunk_size: int | None = None,
    progress: bool = True,
) -> InfluenceResult:
    """Influence I(z, T) of each pretraining example z on the finetuned model's summed test loss f(T).

    pretrain, finetune: the two stages (:class:`~influkit.stage.Stage`: model, loss, data, trained parameters,
    regularizer).
    z: pretraining examples, (inputs, targets) or indices into the pretrain data (default None: every one);
    x_test (required) likewise for the finetune stage (the test loss is the finetune stage's loss, or ``measure``:
    see :meth:`influkit.Chain.query`). Both are checked before anything is fitted.
    shared: the shared parameters W (module prefix, or {finetune_name: pretrain_name}).
    case: 1 (W fixed in finetuning) or 2 (W finetuned with the proximal term α‖W − W̄‖², α > 0).
    solve: one :class:`~influkit.solvers.SolveConfig` or a (pretrain, finetune) pair (default ``SolveConfig()``:
    ``solver="auto"``, no damping, the choice recorded in ``diagnostics["solves"]``). The paper's MNIST setting is
    ``[SolveConfig(solver="cg", damping=1e-2), SolveConfig(solver="cg", damping=1e-8)]`` (for ``cg`` the damping
    is added to H²); ``SolveConfig(solver="identity")`` is its ablation (every H⁻¹ replaced by I).
    curvature: one :class:`~influkit.fitted.CurvatureConfig` or a (pretrain, finetune) pair (which matrix,
    ``hessian_samples``, how approximations are fitted; default ``CurvatureConfig()``).
    per_test: return the (len(z), len(x_test)) matrix, from batched right-hand sides (still two solves).
    progress: a bar on every phase longer than a few seconds (``False``: nothing printed).
    """
    for which, stage in (("pretrain", pretrain), ("finetune", finetune)):
        if not isinstance(stage, Stage):
            raise InputError(f"{which} must be an influkit.Stage, got {type(stage).__name__}; wrap a model as "
                             f"influkit.Stage(model, loss, data, params=..., regularizer=...).")
    if x_test is None:
        raise InputError("x_test is required: the finetune stage's test examples, (inputs, targets) or indices.")
    Rows.of(pretrain, z)  # z checked before the fit
    link = Link(shared, case=case, alpha=alpha)
    chain = Chain([pretrain, finetune], [link], solve=SolveConfig() if solve is None else solve,
                  curvature=curvature or CurvatureConfig(), progress=progress)
    query = chain.query(x_test, measure=measure, per_test=per_test, chunk_size=chunk_size, progress=progress)
    return query.scores(z, chunk_size=chunk_size, progress=progress)
