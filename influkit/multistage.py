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

from collections.abc import Callable, Iterable, Mapping

from torch import nn

from .chain import Chain, Link
from .errors import InputError
from .results import InfluenceResult
from .solvers import SolveConfig
from .stage import Stage


def _pair(value, name: str):
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise InputError(f"{name} must be one value or a (pretrain, finetune) pair, got {value!r}.")
        return value[0], value[1]
    return value, value


def _as_stage(obj, loss, data, params, regularizer, which: str) -> Stage:
    if isinstance(obj, Stage):
        return obj
    if isinstance(obj, nn.Module):
        if loss is None or data is None:
            raise InputError(
                f"{which} is a plain nn.Module: also pass {which}_loss= and {which}_data= (or give a Stage)."
            )
        return Stage(obj, loss, data, params=params, regularizer=regularizer)
    raise InputError(f"{which} must be an influkit.Stage or an nn.Module, got {type(obj).__name__}.")


def score(
    pretrain: Stage | nn.Module,
    finetune: Stage | nn.Module,
    z,
    x_test,
    *,
    shared: str | Mapping[str, str],
    case: int = 1,
    alpha: float = 0.01,
    solver: str | tuple[str, str] = "cg",
    damping: float | tuple[float, float] = (1e-2, 1e-8),
    hessian_samples: int | tuple[int | None, int | None] | None = None,
    per_test: bool = False,
    tol: float | None = None,
    max_iter: int | None = None,
    chunk_size: int = 128,
    seed: int = 0,
    progress: bool = True,
    pretrain_loss: Callable | None = None,
    pretrain_data=None,
    pretrain_params: str | Iterable[str] | None = None,
    pretrain_regularizer: Callable | None = None,
    finetune_loss: Callable | None = None,
    finetune_data=None,
    finetune_params: str | Iterable[str] | None = None,
    finetune_regularizer: Callable | None = None,
) -> InfluenceResult:
    """Influence I(z, T) of each pretraining example z on the finetuned model's summed test loss f(T).

    pretrain, finetune: Stages, or nn.Modules with the ``pretrain_*``/``finetune_*`` keywords.
    z: pretraining examples, (inputs, targets) or indices into the pretrain data; x_test likewise for the
    finetune stage (the test loss is the finetune stage's loss).
    shared: the shared parameters W (module prefix, or {finetune_name: pretrain_name}).
    case: 1 (W fixed in finetuning) or 2 (W finetuned with the proximal term α‖W − W̄‖², α > 0).
    solver, damping, hessian_samples: one value or a (pretrain, finetune) pair; damping follows
    :func:`influkit.solvers.solve` (for ``cg`` it is added to H²); the default pair (1e-2, 1e-8) is the
    paper's MNIST setting. ``solver="identity"`` is the paper's ablation (every H⁻¹ replaced by I).
    per_test: return the (len(z), len(x_test)) matrix, from batched right-hand sides (still two solves).
    """
    link = Link(shared, case=case, alpha=alpha)
    pre = _as_stage(pretrain, pretrain_loss, pretrain_data, pretrain_params, pretrain_regularizer, "pretrain")
    fin = _as_stage(finetune, finetune_loss, finetune_data, finetune_params, finetune_regularizer, "finetune")
    pre_solver, fin_solver = _pair(solver, "solver")
    pre_damping, fin_damping = _pair(damping, "damping")
    pre_samples, fin_samples = (
        hessian_samples if isinstance(hessian_samples, (tuple, list)) else (hessian_samples, None)
    )
    common = {"tol": tol, "max_iter": max_iter, "seed": seed}
    configs = [
        SolveConfig(solver=pre_solver, damping=pre_damping, hessian_samples=pre_samples, **common),
        SolveConfig(solver=fin_solver, damping=fin_damping, hessian_samples=fin_samples, **common),
    ]
    chain = Chain([pre, fin], [link], solve=configs)
    query = chain.query(x_test, per_test=per_test, chunk_size=chunk_size, progress=progress)
    return query.scores(z, chunk_size=chunk_size, progress=progress)
