"""The adjoint recursion of a :class:`~influkit.chain.Chain`: one solve per stage, propagated from the last stage back.

With a_k = df/dθ_k* (the adjoint on what stage k trains) and b_k = the direct derivative of f through the block stage
k inherited fixed (Case 1 only), starting from a_N = ∇_θN f(T), b_N = ∇_SN f(T):

    v_k = H_k⁻¹ a_k;
    g_k = df/dc_k = b_k − H_{S,θ_k} v_k      (Case 1: the cross block ∂²F_k/∂S_k∂θ_k, one mixed HVP)
    g_k = df/dc_k = 2α·v_k[S_k]              (Case 2: ∂²F_k/∂θ_k∂c_k = −2α on the S_k rows)

and g_k, on stage k's names of the shared block, is mapped onto stage k−1's names: the part on parameters stage k−1
trains becomes a_{k−1}, the part on parameters it inherited through a Case 1 link becomes b_{k−1}. The recursion
ends with s = v_1 = H_1⁻¹ a_1, from which every stage-1 example's score is −∇ℓ_1(z)ᵀ s (derivation:
:mod:`influkit.chain`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from .curvature import hvp, hvp_bytes_per_example
from .links import StagePlan
from .memory import plan as memory_plan
from .memory import resolve as memory_budget
from .params import ParamSpace
from .solvers import Solution, Solver


def propagate(plans: Sequence[StagePlan], solvers: Sequence[Solver], a: dict, b: dict, *, per_test: bool,
              n_rhs: int, memory: int | None, progress: bool,
              factors: tuple[torch.Tensor, dict] | None = None) -> tuple[list[Solution], float]:
    """(each stage's :class:`~influkit.solvers.Solution`, seconds of the Case 1 cross products) of the recursion
    from the last stage's adjoint ``a`` (on what it trains) and ``b`` (on what it inherited fixed); with
    ``per_test`` each tensor has a leading dimension of ``n_rhs`` right-hand sides. factors: the last stage's
    right-hand side as (flat, token factors) for a factored solver (:mod:`influkit.factored.tokens`)."""
    solutions: list[Solution] = [None] * len(plans)  # type: ignore[list-item]
    cross_seconds = 0.0
    for k in range(len(plans) - 1, -1, -1):
        plan, solver = plans[k], solvers[k]
        space = ParamSpace(_values(plan.stage, plan.trained))
        tokens = factors if factors is not None and k == len(plans) - 1 else None
        rhs = tokens[0] if tokens is not None else space.flatten(a, batched=per_test)  # its names: trained only
        solutions[k] = solver.solve(rhs, progress=progress, factors=None if tokens is None else tokens[1])
        if k == 0:
            break
        v = space.unflatten(solutions[k].x)
        start = time.perf_counter()
        if plan.link.case == 1:
            tangent = {n: torch.zeros_like(b[n]) for n in plan.fixed} | v
            cross = hvp(plan.stage, tangent, indices=solver.operator.indices, batched=per_test,
                        batch_size=cross_batch(plan, list(tangent), n_rhs if per_test else 1, memory))
            g = {n: b[n] - cross[n] for n in plan.fixed}
        else:
            g = {n: 2 * plan.link.alpha * v[n] for n in plan.inherited}
        cross_seconds += time.perf_counter() - start
        a, b = pull_back(plans[k - 1], plan, g, n_rhs if per_test else None)
    return solutions, cross_seconds


def cross_batch(plan: StagePlan, names: list[str], n_rhs: int, memory: int | None) -> int:
    """Examples per batch of the Case 1 cross product ∂²F/∂S∂θ · v over ``names`` = S ∪ θ, from its own measured
    bytes per example (a double backward through the shared block, far more than the stage's own products over
    θ when θ is a small head) × the ``n_rhs`` tangents vmapped at once, under the budget ``memory``."""
    per = hvp_bytes_per_example(plan.stage, names) * max(n_rhs, 1)
    return memory_plan(memory_budget(memory), per, "cross products", most=max(len(plan.stage), 1),
                       default=memory is None)["batch"]


def pull_back(previous: StagePlan, plan: StagePlan, g: dict[str, torch.Tensor], n_rhs: int | None):
    """Map df/dc_k (``plan``'s names) onto the stage before it: (a on what it trains, b on what it inherited fixed)."""
    values = _values(previous.stage, previous.trained + previous.fixed)
    lead = () if n_rhs is None else (n_rhs,)
    total = {n: torch.zeros(*lead, *t.shape, dtype=t.dtype, device=t.device) for n, t in values.items()}
    for name, earlier in plan.inherited.items():
        total[earlier] = total[earlier] + g[name]
    return {n: total[n] for n in previous.trained}, {n: total[n] for n in previous.fixed}


def _values(stage, names: Sequence[str]) -> dict[str, torch.Tensor]:
    state = stage.state()
    return {n: state[n] for n in names}
