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

import time
import warnings
from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn

from .curvature import HessianOperator, ParamSpace, hvp
from .data import as_examples
from .errors import InputError, ParameterError
from .gradients import per_example_grads, project_per_example_grads, total_grad
from .influence import check_example_shape
from .results import InfluenceResult
from .solvers import solve
from .stage import Stage


def shared_parameters(pretrain: Stage, finetune: Stage, shared: str | Mapping[str, str]) -> dict[str, str]:
    """The shared parameters W as {finetune_name: pretrain_name}, checked to exist and agree in shape.

    ``shared`` is a module prefix present in both models, or a mapping whose keys/values are parameter
    names or prefixes of the finetune/pretrain model.
    """
    pre = dict(pretrain.model.named_parameters())
    fin = dict(finetune.model.named_parameters())
    pairs = {shared: shared} if isinstance(shared, str) else dict(shared)
    if not pairs:
        raise ParameterError("shared is empty: name the shared embedding (a module prefix or a name mapping).")
    mapping: dict[str, str] = {}
    for f_sel, p_sel in pairs.items():
        if f_sel in fin:
            hits = {f_sel: p_sel}
        else:
            f_prefix, p_prefix = f_sel.rstrip(".") + ".", p_sel.rstrip(".") + "."
            hits = {n: p_prefix + n[len(f_prefix) :] for n in fin if n.startswith(f_prefix)}
        if not hits:
            raise ParameterError(
                f"shared={f_sel!r} matches no parameter of the finetune model "
                f"({type(finetune.model).__name__}); its modules are {sorted({n.split('.')[0] for n in fin})}."
            )
        for f_name, p_name in hits.items():
            if p_name not in pre:
                raise ParameterError(
                    f"shared parameter {f_name!r} of the finetune model maps to {p_name!r}, which the pretrain "
                    f"model ({type(pretrain.model).__name__}) does not have; pass shared={{finetune_name: "
                    "pretrain_name}} to map them explicitly."
                )
            if pre[p_name].shape != fin[f_name].shape:
                raise ParameterError(
                    f"shared parameter {f_name!r} has shape {tuple(fin[f_name].shape)} in the finetune model but "
                    f"{p_name!r} has {tuple(pre[p_name].shape)} in the pretrain model; they must be the same W."
                )
            mapping[f_name] = p_name
    missing = [p for p in mapping.values() if p not in pretrain.param_names]
    if missing:
        raise ParameterError(
            f"shared parameters {missing} are not trained in the pretrain stage; include them in its params."
        )
    return mapping


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
    if case not in (1, 2):
        raise InputError(f"case must be 1 (embedding fixed) or 2 (embedding finetuned), got {case!r}.")
    if case == 2 and not alpha > 0:
        raise InputError(
            f"Case 2 needs a proximal weight alpha > 0 (the paper uses 0.01), got {alpha!r}; with alpha = 0 the "
            "finetuned model does not depend on the pretrained W at all."
        )
    pre = _as_stage(pretrain, pretrain_loss, pretrain_data, pretrain_params, pretrain_regularizer, "pretrain")
    fin = _as_stage(finetune, finetune_loss, finetune_data, finetune_params, finetune_regularizer, "finetune")
    mapping = shared_parameters(pre, fin, shared)
    w_fin = list(mapping)
    theta = [n for n in fin.param_names if n not in mapping]
    if case == 1 and not theta:
        raise ParameterError("the finetune stage trains nothing besides W; Case 1 needs finetuned parameters Θ.")
    pre_solver, fin_solver = _pair(solver, "solver")
    pre_damping, fin_damping = _pair(damping, "damping")
    pre_samples, fin_samples = (
        hessian_samples if isinstance(hessian_samples, (tuple, list)) else (hessian_samples, None)
    )
    pre_state, fin_state = pre.state(), fin.state()
    drift = max(float((fin_state[f] - pre_state[p]).abs().max()) for f, p in mapping.items())
    if case == 1 and drift > 0:
        warnings.warn(
            f"Case 1 assumes the finetuned model keeps the pretrained W, but they differ by up to {drift:.2e}: "
            "the embedding was not fixed during finetuning. Use case=2 if it was finetuned.",
            UserWarning,
            stacklevel=2,
        )

    (zx, zy), z_ids = as_examples(z, pre.data, "z")
    (tx, ty), _ = as_examples(x_test, fin.data, "x_test")
    check_example_shape(pre, zx, "z")
    check_example_shape(fin, tx, "x_test")
    timings: dict[str, float] = {}

    # stage 1: the finetuning solve, giving u in W-space (finetune names)
    start = time.perf_counter()
    phi = theta if case == 1 else w_fin + theta
    test_names = w_fin + theta
    if per_test:
        test_grad = per_example_grads(fin, tx, ty, test_names, chunk_size=chunk_size).T
    else:
        test_grad = total_grad(fin, tx, ty, test_names)
    test_space = ParamSpace({n: fin_state[n] for n in test_names})
    grads = test_space.unflatten(test_grad)
    proximal = None
    if case == 2:
        centre = {f: pre_state[p] for f, p in mapping.items()}
        proximal = lambda params: alpha * sum(((params[f] - centre[f]) ** 2).sum() for f in w_fin)  # noqa: E731
    operator = HessianOperator(fin, phi, samples=fin_samples, seed=seed, extra=proximal)
    phi_grad = operator.space.flatten({n: grads[n] for n in phi}, batched=per_test)
    timings["test_gradient"] = time.perf_counter() - start
    fin_sol = solve(
        operator, phi_grad, fin_solver, damping=fin_damping, tol=tol, max_iter=max_iter, progress=progress
    )
    v = operator.space.unflatten(fin_sol.x)

    start = time.perf_counter()
    if case == 1:
        tangent = {n: torch.zeros_like(grads[n]) for n in w_fin}
        tangent.update(v)
        cross = hvp(fin, tangent, indices=operator.indices, batched=per_test)
        u = {n: grads[n] - cross[n] for n in w_fin}
    else:
        u = {n: 2 * alpha * v[n] for n in w_fin}
    timings["cross_product"] = time.perf_counter() - start

    # stage 2: the pretraining solve s = H_G⁻¹ [u; 0_U]
    pre_operator = HessianOperator(pre, pre.param_names, samples=pre_samples, seed=seed)
    k = test_grad.shape[1] if per_test else None
    rhs_blocks = {}
    for n in pre.param_names:
        shape = pre_state[n].shape if k is None else (k, *pre_state[n].shape)
        rhs_blocks[n] = torch.zeros(shape, dtype=pre_state[n].dtype, device=pre_state[n].device)
    for f_name, p_name in mapping.items():
        rhs_blocks[p_name] = u[f_name]
    rhs = pre_operator.space.flatten(rhs_blocks, batched=per_test)
    pre_sol = solve(
        pre_operator, rhs, pre_solver, damping=pre_damping, tol=tol, max_iter=max_iter, progress=progress
    )

    # every z: one per-example gradient dot product
    start = time.perf_counter()
    values = -project_per_example_grads(
        pre, zx, zy, pre_sol.x, pre.param_names, chunk_size=chunk_size, progress=progress
    )
    timings["pretrain_gradients"] = time.perf_counter() - start
    timings["finetune_solve"] = fin_sol.seconds
    timings["pretrain_solve"] = pre_sol.seconds
    return InfluenceResult(
        values=values if per_test else values.reshape(-1),
        n_train=len(pre),
        index=z_ids,
        method=f"multi-stage case {case}",
        diagnostics={
            "finetune_solve": fin_sol.summary(),
            "pretrain_solve": pre_sol.summary(),
            "seconds": timings,
            "shared": mapping,
            "case": case,
            "alpha": alpha if case == 2 else None,
            "hessian_samples": (pre_samples, fin_samples),
        },
    )
