"""``Chain``: influence through N training stages — fit once, query a test set, score examples in chunks.

Stage k minimizes F_k(θ_k; c_k) = (1/n_k) Σ_i ℓ_k(x_i; θ_k, c_k) + R_k(θ_k) [+ α‖S_k − c_k‖²], where c_k are
the values stage k inherits from stage k−1 through its incoming :class:`Link` (stage 1 inherits nothing):

- Case 1: the shared block S_k is *fixed* at c_k (S_k is part of the model, not of θ_k);
- Case 2: S_k ⊂ θ_k is finetuned, pulled towards c_k by the proximal term α‖S_k − c_k‖², which the chain adds.

Up-weighting a stage-1 example z (F_1 → F_1 + ε·ℓ_1(z)) moves every optimum; the score of z on the summed
test loss f(T) of the last stage is I(z, T) = df(T)/dε (positive = harmful; removing z is ε = −1/n_1).

Derivation (adjoint propagated backwards, one solve per stage; the recursion is :mod:`influkit.adjoint`).
Stationarity ∇_θk F_k(θ_k*, c_k) = 0 gives dθ_k*/dc_k = −H_k⁻¹ ∂²F_k/∂θ_k∂c_k, H_k = ∇²_θk F_k. Let a_k = df/dθ_k* (the adjoint on what stage k trains)
and b_k = the direct derivative of f with respect to c_k through the fixed block (Case 1 only). Then

    a_N = ∇_θN f(T),  b_N = ∇_SN f(T);     v_k = H_k⁻¹ a_k;
    g_k = df/dc_k = b_k − H_{S,θ_k} v_k      (Case 1: the cross block ∂²F_k/∂S_k∂θ_k, one mixed HVP)
    g_k = df/dc_k = 2α·v_k[S_k]              (Case 2: ∂²F_k/∂θ_k∂c_k = −2α on the S_k rows)

and g_k, which lives on stage k's names of the shared block, is mapped onto stage k−1's names: the part on
parameters stage k−1 trains becomes a_{k−1}, the part on parameters stage k−1 itself inherited through a Case 1
link becomes b_{k−1}. Finally s = v_1 = H_1⁻¹ a_1 and, since dθ_1*/dε = −H_1⁻¹∇ℓ_1(z),

    I(z, T) = −∇ℓ_1(z)ᵀ s     for every z at once (a batched per-example gradient dot product).

With N = 1 this is Koh & Liang's −∇f(T)ᵀ H⁻¹ ∇ℓ(z); with N = 2 the multi-stage paper's Case 1 and Case 2.
Everything that does not depend on T (dense Hessians and their factors) is built by :meth:`Chain.fit` and kept;
the N solves live in a :class:`Query`, which scores any examples without solving again.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

import torch

from . import adjoint, distributed, files, proximal, stationarity
from .auto import Choice
from .data import as_examples
from .errors import FileFormatError, InputError, LossError
from .factored.tokens import TokenGradient, token_gradient
from .gradients import per_example_grads, total_grad
from .operators import Operator
from .links import Link, StagePlan
from .params import ParamSpace
from .per_token import TokenScores, stage_token_scores
from .results import InfluenceResult
from .fitted import CurvatureConfig, FittedCurvature
from .memory import DEFAULT_EXAMPLES
from .memory import plan as memory_plan
from .memory import resolve as memory_budget
from .scoring import Rows, Scorer, score_rows, stream_rows
from .solvers import REGISTRY, Solution, SolveConfig, Solver
from .stationarity import Position
from .stage import Stage, check_example_shape
from .store import resumed_chunk_size

QUERY_KIND = "query"
FIT_KIND = "chain-fit"


Measure = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # measure(outputs, targets) -> (B,) values


class Chain:
    """N training stages joined by N − 1 links; influence of stage-1 examples on the last stage's test loss.

    ``Chain([stage])`` is single-stage influence (Koh & Liang); ``Chain([pre, fin], [Link("embedding")])`` the
    multi-stage paper's Case 1; longer chains (pretrain → adapt → finetune) follow the same adjoint recursion
    (module docstring). ``solve`` (how each system is solved) and ``curvature`` (which matrix, how its approximations
    are fitted) are each one config for every stage or one per stage. The chain owns each stage's
    :class:`~influkit.fitted.FittedCurvature` and hands it to that stage's solver. ``memory``: the budget in bytes
    every phase sizes its batches from, passed to each (default: a share of what is free).

    :meth:`fit` measures where each stage stands (:mod:`influkit.stationarity`, ``positions``; in every result's
    ``diagnostics["stages"]``, with one warning naming the stages not at a minimum; a stage solved by a named
    iterative solver with its damping is measured with the first query, from that solve's own products), then
    prepares each stage's solver as :func:`influkit.auto.decide` chooses from it (``solver="auto"``) or as
    configured. One config for
    every stage means exactly what a list of equal configs means. ``progress``: a bar on every phase that runs
    longer than :data:`influkit.progress.DELAY` seconds (the fit's passes and Lanczos steps, the solves, the
    scoring); ``False`` prints nothing. ``query`` and ``scores`` take it from the chain unless given.
    """

    def __init__(self, stages: Sequence[Stage], links: Sequence[Link] = (),
                 solve: SolveConfig | Sequence[SolveConfig] = SolveConfig(), *,
                 curvature: CurvatureConfig | str | Sequence[CurvatureConfig | str] = CurvatureConfig(),
                 memory: int | None = None,
                 progress: bool = True):
        stages, links = list(stages), list(links)
        if not stages:
            raise InputError("a Chain needs at least one Stage.")
        bad = [type(s).__name__ for s in stages if not isinstance(s, Stage)]
        if bad:
            raise InputError(f"Chain stages must be influkit.Stage objects, got {bad}.")
        if len(links) != len(stages) - 1:
            raise InputError(f"{len(stages)} stages need {len(stages) - 1} links, got {len(links)}.")
        bad = [type(link).__name__ for link in links if not isinstance(link, Link)]
        if bad:
            raise InputError(f"Chain links must be influkit.Link objects, got {bad}.")
        plain = [k + 1 for k, link in enumerate(links) if link.plain]
        if plain:
            raise InputError(
                f"the link into stage {plain[0]} is plain finetuning (Case 2 with alpha = 0). Influence functions take "
                "each stage at its minimum, and the minimum of a finetuning without a proximal term does not depend on "
                "the previous stage's shared block: only the run, which starts from it, does. Record the run "
                "(ik.unrolled.Record().watch(..., link=ik.Link.finetune(shared)) or "
                "influkit.hf.RecordCallback(record, link=...)) and take ik.unrolled.metagradients(record, test), "
                "which differentiates through that start exactly; or approximate the finetuning by a proximal one, "
                "Link(shared, case=2, alpha=α) with α the weight that explains the block's drift (the fit's "
                "diagnostics report it as alpha_fit).")
        self.stages, self.links = stages, links
        self.solve_configs = _per_stage(solve, SolveConfig, "solve", len(stages))
        self.curvature_configs = _per_stage(curvature, CurvatureConfig, "curvature", len(stages), by_name=True)
        self.progress = bool(progress)
        self.plans: list[StagePlan] = []
        for k, stage in enumerate(stages):
            self.plans.append(StagePlan(stage, links[k - 1] if k else None, self.plans[-1] if k else None))
        self._curvatures: list[FittedCurvature] | None = None
        self._handed: dict[int, FittedCurvature] = {}  # stage → the FittedCurvature another chain handed over (reuse)
        self._digests: list[str] | None = None  # each stage's parameter digest when it was fitted
        self.reused = 0  # how many leading stages were handed over by reuse()
        self._solvers: list[Solver] | None = None
        self._more_solvers: dict[tuple[int, str], Solver] = {}  # other choices for queries with many right-hand sides
        self._derived: dict[tuple[int, str], FittedCurvature] = {}  # (stage, matrix) auto chose besides the configured
        self._positions: dict[tuple, Position] = {}
        self._check_memory: dict[int, dict] = {}  # stage → the batch plan of its stationarity check's own products
        self._where: list[Position | None] | None = None  # each stage's position (None: waiting for its solve)
        self.drifts: list[proximal.Drift | None] | None = None  # each Case 2 stage's drift against its α
        self.fit_seconds: float | None = None
        self.memory = None if memory is None else memory_budget(memory)  # bytes; None: a share of what is free

    @property
    def positions(self) -> list[Position] | None:
        """Where each stage stands (:mod:`influkit.stationarity`; None before :meth:`fit`). A stage whose check waits
        for its solve (:meth:`_waits_for_solve`) is measured the first time this is read or a query runs: from the
        solve's first product when one ran, else by the full check then."""
        if self._where is not None and None in self._where:
            self._complete_positions()
        return self._where

    def __len__(self) -> int:
        return len(self.stages)

    def __repr__(self) -> str:
        cases = "-".join(str(link.case) for link in self.links) or "single"
        return f"Chain({len(self)} stages, links {cases}, trained {self.dims})"

    @property
    def dims(self) -> list[int]:
        """Number of trained parameters of each stage."""
        return [ParamSpace({n: p.stage.state()[n] for n in p.trained}).dim for p in self.plans]

    @property
    def method(self) -> str:
        if len(self) == 1:
            return "single-stage"
        if len(self) == 2:
            return f"multi-stage case {self.links[0].case}"
        return "chain case " + "-".join(str(link.case) for link in self.links)

    def operator(self, k: int) -> Operator:
        """The Hessian of stage k's objective (with its proximal term) over what it trains, as fitted."""
        return self.curvature(k).operator

    def curvature(self, k: int) -> FittedCurvature:
        """Stage k's :class:`~influkit.fitted.FittedCurvature` that its solver runs on (its operator and the
        approximations fitted on it: the configured matrix, or the one ``auto`` chose)."""
        return self.fit()._solvers[k].curvature

    def solver(self, k: int, n_rhs: int = 1) -> Solver:
        """Stage k's prepared :class:`~influkit.solvers.Solver` for ``n_rhs`` right-hand sides at a time (``auto``
        may choose differently for several: one factorization for all of them)."""
        return self.fit()._query_solver(k, n_rhs)

    def fit(self) -> "Chain":
        """Build what does not depend on the test set: each stage's :class:`~influkit.fitted.FittedCurvature`, where
        each stage stands (``positions``, :mod:`influkit.stationarity`: per-example gradients of a sample of 64 — a
        second gradient pass when the stage has more examples —, Lanczos steps on the exact Hessian only where the
        gradient leaves the verdict open, and on a sample's Hessian where ``auto``'s damping needs θ_max; for a stage
        whose solve fits a factored curvature, the light check: ∇L and the per-example gradient norms measured in that
        fit's data pass; for a stage solved by a named iterative solver with its damping, nothing now: ∇L comes with
        the first query from the solve's first product, :meth:`positions`; eigenvalues not measured come with a query
        from its solve's own iterations) and its prepared
        :class:`~influkit.solvers.Solver`, chosen by :func:`influkit.auto.decide` from that position (``solver="auto"``) or as configured, which fits on
        its curvature what it needs (a dense factorization for ``direct``, the factored curvature or Lanczos
        eigenpairs). Cached; :meth:`query` calls it when needed. Returns self."""
        if self._solvers is not None:
            return self
        start = time.perf_counter()
        self._digests = [parameters_digest(plan.stage) for plan in self.plans]
        self._curvatures = [self._handed.get(k) or self._new_curvature(plan, config)
                            for k, (plan, config) in enumerate(zip(self.plans, self.curvature_configs))]
        return self._prepare_all(start)

    def reuse(self, other: "Chain") -> "Chain":
        """Take what ``other`` fitted for the leading stages the two chains share, so that :meth:`fit` fits only the
        rest: a new finetune (a head, a LoRA adapter, another task) of a pretraining stage that another chain has
        already fitted. Stage k is shared when stages 0..k are the same :class:`Stage` objects joined by equal
        links, with equal curvature settings and the same memory budget; its parameters must be those ``other``
        was fitted on (refused otherwise, as is a chain sharing no stage). Handed over, per shared stage: its
        FittedCurvature (operator, factors, eigenpairs: a solve with other settings, e.g. another λ, reuses them),
        where it stands (:mod:`influkit.stationarity`) and the curvatures ``auto`` derived for it. Stage 0's
        Hessian and position depend on stage 0 alone, so the scores equal those of the same chain fitted from
        scratch. Call before :meth:`fit`; returns self."""
        if self._solvers is not None:
            raise InputError("this chain is already fitted; call chain.reuse(other) before fit() or query().")
        other.fit()
        shared, why = 0, None
        while why is None and shared < min(len(self), len(other)):
            k = shared
            if self.stages[k] is not other.stages[k]:
                why = f"stage {k} is another Stage object"
            elif k and self.links[k - 1] != other.links[k - 1]:
                why = f"the links into stage {k} differ"
            elif self.curvature_configs[k] != other.curvature_configs[k]:
                why = f"stage {k}'s CurvatureConfig differs"
            elif self.memory != other.memory:
                why = "the memory budgets differ"
            else:
                shared += 1
        if not shared:
            raise InputError(f"chain.reuse(other): the chains share no leading stage ({why}); a stage is shared when "
                             f"it is the same Stage object with the same CurvatureConfig and memory budget. Fit this "
                             f"chain on its own.")
        changed = [k for k in range(shared) if parameters_digest(self.stages[k]) != other._digests[k]]
        if changed:
            raise InputError(f"chain.reuse(other): the parameters of stage(s) {changed} changed since the other chain "
                             f"was fitted; fit this chain on its own (or fit the other chain again first).")
        self._handed = {k: other._curvatures[k] for k in range(shared)}
        self._derived.update({key: fitted for key, fitted in other._derived.items() if key[0] < shared})
        self._positions.update({key: position for key, position in other._positions.items() if key[0] < shared})
        self._check_memory.update({k: plan for k, plan in other._check_memory.items() if k < shared})
        self._more_solvers.update({key: solver for key, solver in other._more_solvers.items()
                                   if key[0] < shared and self.solve_configs[key[0]] == other.solve_configs[key[0]]})
        self.reused = shared
        return self

    def with_solve(self, solve: SolveConfig | Sequence[SolveConfig] | None = None, *,
                   curvature: CurvatureConfig | str | Sequence[CurvatureConfig | str] | None = None) -> "Chain":
        """This chain with other settings (None: keep this chain's), fitted from what this one fitted: a stage whose
        CurvatureConfig is unchanged is handed the same FittedCurvature, so its operator, dense Hessian, factors and
        eigenpairs are reused (e.g. a damping sweep of EK-FAC or Arnoldi without refitting; ``direct`` factors the
        kept dense Hessian for the new λ) and only an approximation not fitted yet is fitted; a stage whose
        CurvatureConfig changed gets :meth:`FittedCurvature.derive`: what read only unchanged settings is kept (a new
        ``rank`` keeps the operator and the factors; a new ``fisher`` the operator and the eigenpairs), the rest is
        fitted for what its solver needs. Where each stage stands is kept when its Hessian sample is."""
        other = Chain(self.stages, self.links, self.solve_configs if solve is None else solve,
                      curvature=self.curvature_configs if curvature is None else curvature, memory=self.memory,
                      progress=self.progress)
        if self._solvers is None:
            return other
        start = time.perf_counter()
        other._curvatures = [old.derive(config) for config, old in zip(other.curvature_configs, self._curvatures)]
        other._digests = self._digests
        other._derived = {key: fitted.derive(replace(other.curvature_configs[key[0]], matrix=key[1]))
                          for key, fitted in self._derived.items()}
        other._positions = dict(self._positions)
        other.drifts = self.drifts
        other._check_memory = dict(self._check_memory)
        return other._prepare_all(start)

    def _new_curvature(self, plan: StagePlan, config: CurvatureConfig) -> FittedCurvature:
        return FittedCurvature.of_stage(plan.stage, plan.trained, config, extra=plan.proximal, memory=self.memory)

    def _prepare_all(self, start: float) -> "Chain":
        """Where each stage stands, then each stage's solver prepared on the curvature its choice names (fitting there
        only what is missing); the fit's seconds counted from ``start``."""
        self._where = [self._positions.get(self._position_key(k)) if self._waits_for_solve(k) else self._position(k)
                       for k in range(len(self))]
        if self.drifts is None:
            self.drifts = proximal.check(self.plans, memory=self.memory)
        self._solvers = [self._prepare(k, self._choice(k)) for k in range(len(self))]
        self.fit_seconds = time.perf_counter() - start
        self._warn_positions([k for k, where in enumerate(self._where) if where is not None])
        return self

    def _curvature_for(self, k: int, matrix: str) -> FittedCurvature:
        """Stage k's curvature on ``matrix``: the configured one, or (auto off a minimum) one derived from it."""
        configured = self._curvatures[k]
        if matrix == configured.config.matrix:
            return configured
        if (k, matrix) not in self._derived:
            self._derived[k, matrix] = configured.derive(replace(configured.config, matrix=matrix))
        return self._derived[k, matrix]

    def _position(self, k: int) -> Position:
        """Where stage k stands, measured on its exact Hessian (the configured sample), kept per sample, seed,
        whether the check is the light one (:meth:`_factored_fit`) and what its solve needs of the eigenvalues
        (:attr:`influkit.solvers.SolveConfig.spectrum`: none when the user named the solver or the damping)."""
        key = self._position_key(k)
        if key not in self._positions:
            plan, fitted = self.plans[k], key[3]
            hessian = self._check_operator(k, self._curvature_for(k, "hessian").operator)
            factored = None if fitted is None else (lambda: self._factored_curvature(k, fitted))
            graphs = self._curvature_for(k, "gauss-newton").operator if key[4] == "largest" and fitted is None else None
            self._positions[key] = stationarity.assess(
                plan.stage, plan.trained, hessian, extra=plan.proximal, seed=key[2], memory=self.memory,
                least=1 if self._lean_check(k) else DEFAULT_EXAMPLES, factored=factored, spectrum=key[4],
                progress=self.progress, gauss_newton=graphs)
        return self._positions[key]

    def _waits_for_solve(self, k: int) -> bool:
        """Whether stage k's check waits for its solve (:func:`influkit.stationarity.from_solve`): a named solver
        that multiplies by the stage's operator (every one but ``identity`` and the factored ones), with its damping
        (its choice reads no position), over every example, no factored fit; its first product gives ∇L."""
        config = self.solve_configs[k]
        return (config.solver != "auto" and REGISTRY[config.solver].multiplies and self._factored_fit(k) is None
                and self.curvature_configs[k].hessian_samples is None)

    def _complete_positions(self) -> None:
        """Measure the positions that waited for their solve: from the first product of the operator it multiplies
        by, else (no product ran yet, or the sample leaves the verdict open) by the full check now; then warn of
        those not at a minimum."""
        done = [k for k, where in enumerate(self._where) if where is None]
        for k in done:
            plan, key = self.plans[k], self._position_key(k)
            found = stationarity.from_solve(plan.stage, plan.trained, self._solvers[k].curvature.operator, seed=key[2])
            if found is not None:
                self._positions[key] = found
            self._where[k] = found if found is not None else self._position(k)
        self._warn_positions(done)

    def _position_key(self, k: int) -> tuple:
        config = self.curvature_configs[k]
        return k, config.hessian_samples, config.seed, self._factored_fit(k), self.solve_configs[k].spectrum

    def _factored_fit(self, k: int) -> str | None:
        """The factored curvature (``"kfac"``/``"ekfac"``) stage k's solve fits off a minimum, whose cost the
        stationarity check is sized to (:meth:`influkit.solvers.SolveConfig.factored_fit`), or None."""
        return self.solve_configs[k].factored_fit(self.dims[k])

    def _factored_curvature(self, k: int, name: str):
        """Stage k's fitted factored curvature ``name`` on the matrix its solve uses off a minimum, fitted now if not
        yet (the solve fits it anyway), its data pass measuring the objective's gradient for the check."""
        auto = self.solve_configs[k].solver == "auto"
        return self._curvature_for(k, self._factored_matrix(k)).approximation(name, progress=self.progress,
                                                                              fallback=auto, gradient=True)

    def _factored_matrix(self, k: int) -> str:
        """The matrix whose FittedCurvature holds stage k's factored fit (:meth:`_factored_curvature`)."""
        return "gauss-newton" if self.solve_configs[k].solver == "auto" else self.curvature_configs[k].matrix

    def _lean_check(self, k: int) -> bool:
        """The rule: without ``memory=``, the light stationarity check of a stage whose solve fits a factored
        curvature (:meth:`_factored_fit`: its fit has no Hessian-vector product nor per-example gradient rows, so the
        check's would set its peak memory) runs its per-example gradient passes and its Hessian-vector products in
        batches of at most ``memory.DEFAULT_WORKING`` (× SAFETY), at least one example
        (:func:`influkit.memory.default_count` with ``least=1``), not the ``DEFAULT_EXAMPLES`` floor — the least
        working memory a default phase holds. The results are the same: sums over batches."""
        return self.memory is None and self._factored_fit(k) is not None

    def _check_operator(self, k: int, operator: Operator) -> Operator:
        """The operator stage k's stationarity check multiplies with: streamed in the batches of :meth:`_lean_check`
        (same H: a product is a sum over batches; the plan is in :meth:`memory_plans`), else the chain's own."""
        record = operator.memory
        if not self._lean_check(k) or "bytes_per_example" not in record:
            return operator
        plan = memory_plan(record["budget"], record["bytes_per_example"], "stationarity check", most=record["batch"],
                           fixed=record["fixed_bytes"], default=True, least=1)
        if plan["batch"] >= record["batch"]:
            return operator
        self._check_memory[k] = plan | {"cache_graph": False}
        return operator.streamed(self._check_memory[k])

    def _choice(self, k: int, n_rhs: int = 1) -> Choice:
        """Stage k's solve for ``n_rhs`` right-hand sides: :func:`influkit.auto.decide` on its position."""
        values = _values(self.plans[k].stage, self.plans[k].trained)
        dim = sum(t.numel() for t in values.values())
        itemsize = next(iter(values.values())).element_size()
        return self.solve_configs[k].decide(self._where[k], dim, matrix=self.curvature_configs[k].matrix,
                                            n_rhs=n_rhs, memory=memory_budget(self.memory), itemsize=itemsize)

    def _prepare(self, k: int, choice: Choice) -> Solver:
        """Stage k's solver for ``choice``, on the curvature of its matrix. A preconditioner that is the stationarity
        check's factored fit, held by another matrix's curvature (``auto`` at a stationary point: fitted on G by the
        check, the solve on H), is shared from there, not fitted again (:meth:`FittedCurvature.share`)."""
        curvature = self._curvature_for(k, choice.matrix)
        factored = self._factored_fit(k)
        if factored is not None and choice.preconditioner == factored:
            matrix, configured = self._factored_matrix(k), self._curvatures[k]
            checked = configured if matrix == configured.config.matrix else self._derived.get((k, matrix))
            if checked is not None and checked is not curvature:
                curvature.share(factored, checked)
        return self.solve_configs[k].prepare(curvature, choice=choice, progress=self.progress)

    def _query_solver(self, k: int, n_rhs: int) -> Solver:
        """The fitted solver of stage k, or the one auto chooses for ``n_rhs`` > 1 right-hand sides (kept)."""
        fitted = self._solvers[k]
        if n_rhs == 1:
            return fitted
        choice = self._choice(k, n_rhs)
        if choice.solver == fitted.name:
            return fitted
        if (k, choice.solver) not in self._more_solvers:
            self._more_solvers[k, choice.solver] = self._prepare(k, choice)
        return self._more_solvers[k, choice.solver]

    def _warn_positions(self, stages: Sequence[int]) -> None:
        """Warn of the ``stages`` not at a minimum."""
        remedies = []
        for solver in self._solvers:
            config, matrix = solver.config, solver.curvature.config.matrix
            how = (f"{config.solver} on the {'Gauss-Newton matrix' if matrix == 'gauss-newton' else 'Hessian'}"
                   f" + λI, λ = {config.damping:.3g}")
            remedies.append(f"solver='auto' solves it with {how}" if solver.automatic else
                            f"it is solved as configured ({how}); solver='auto' decides from where it stands")
        names = [type(plan.stage.model).__name__ for plan in self.plans]
        stationarity.warn_not_at_minimum([where if k in stages else None for k, where in enumerate(self._where)], names,
                                         remedies)

    def memory_plans(self) -> list[dict]:
        """The batch sizes each fitted stage chose from the memory budget (Hessian-vector products, factors, and the
        stationarity check's own products where :meth:`_check_operator` sized them)."""
        fitted = [{"stage": k} | plan for k, solver in enumerate(self._solvers or []) for plan in solver.curvature.memory_plans()]
        return fitted + [{"stage": k} | plan for k, plan in sorted(self._check_memory.items())]

    def fingerprint(self) -> str:
        """A digest of what the scores depend on: every stage's model, parameters, data size, trained names,
        the links, the solve and curvature settings. A saved Query or fit is only loaded into a chain with the same digest."""
        digest = hashlib.sha256()
        for plan, config, curvature in zip(self.plans, self.solve_configs, self.curvature_configs):
            stage = plan.stage
            digest.update(f"{type(stage.model).__name__}|{len(stage)}|{plan.trained}|{plan.inherited}".encode())
            digest.update(parameters_digest(stage).encode())
            digest.update(repr(sorted(config.summary().items())).encode())
            digest.update(repr(sorted(curvature.summary().items())).encode())
        for link in self.links:
            digest.update(repr((dict(link.shared) if isinstance(link.shared, Mapping) else link.shared, link.case, link.alpha)).encode())
        return digest.hexdigest()

    def save(self, path: str | Path) -> Path:
        """Write the fitted state (each stage's FittedCurvature: dense Hessian, factored curvature, eigenpairs) to
        ``path``; :meth:`load` restores it bit for bit."""
        self.fit()
        tensors, fitted = {}, {}
        for k, solver in enumerate(self._solvers):
            extra, fitted[str(k)] = solver.curvature.state(f"stage{k}.")
            tensors.update(extra)
        return files.write(path, FIT_KIND, tensors, {"fingerprint": self.fingerprint(), "fit_seconds": self.fit_seconds,
                                                     "fitted": fitted,
                                                     "positions": [p and p.summary() for p in self._where]})

    def load(self, path: str | Path) -> "Chain":
        """Restore a fit written by :meth:`save` for this same chain (refused otherwise). Returns self."""
        tensors, meta = files.read(path, FIT_KIND)
        if meta["fingerprint"] != self.fingerprint():
            raise FileFormatError(f"{path} was fitted for another chain (models, data sizes or settings differ).")
        self._digests = [parameters_digest(plan.stage) for plan in self.plans]
        self._curvatures = [self._new_curvature(plan, config) for plan, config in zip(self.plans, self.curvature_configs)]
        self._where = [p and Position.from_summary(p) for p in meta["positions"]]
        for k, position in enumerate(self._where):
            if position is not None:
                self._positions[self._position_key(k)] = position
        for k in range(len(self)):
            self._curvature_for(k, self._choice(k).matrix).load(tensors, meta.get("fitted", {}).get(str(k), {}),
                                                                 f"stage{k}.")
        self._prepare_all(time.perf_counter())  # finds what was just restored: nothing is fitted again
        self.fit_seconds = meta["fit_seconds"]
        return self

    def query(self, x_test, *, measure: Measure | None = None, per_test: bool = False, chunk_size: int | None = None,
              progress: bool | None = None) -> "Query":
        """The N solves for the test function f(T) = Σ_t m(x_t) of the last stage (one per test point with ``per_test``).

        x_test: (inputs, targets) tensors, or 1-D indices into the last stage's data.
        measure: m as ``measure(outputs, targets) -> (B,)``, one differentiable value per test example, taken of the
        last stage's model outputs on the test inputs (default: the last stage's loss, so f(T) is the summed test
        loss). The scores are then I(z, T) = df(T)/dε: positive means up-weighting z *raises* the measure — harmful
        for a loss, helpful for a margin or a log-probability. In a chain the Case 1 term b (the direct derivative
        through the fixed shared block) is the measure's derivative too. Two examples::

            def margin(logits, y):          # logit of the true class minus the largest other logit
                true = torch.arange(logits.shape[-1], device=logits.device) == y[:, None]
                other = logits.masked_fill(true, float("-inf")).amax(-1)
                return logits.gather(-1, y[:, None]).squeeze(-1) - other

            def completion_nll(logits, labels):   # labels = -100 on the prompt's tokens (and padding)
                return F.cross_entropy(logits[:, :-1].transpose(1, 2), labels[:, 1:], ignore_index=-100,
                                       reduction="none").sum(-1)

        chunk_size: test examples per gradient batch (default: sized from the chain's memory budget).
        When the last stage is solved by ``kfac``/``ekfac`` (no ``residual``), the test gradient's Kronecker blocks are
        kept as token factors where that is cheaper (:mod:`influkit.factored.tokens`); the query's last solve lists
        them (``solves[-1]["token_factors"]``). The test set and ``measure`` are checked before anything is fitted.
        progress: bars on the solves (default: the chain's ``progress``).
        """
        progress = self.progress if progress is None else progress
        last = self.plans[-1]
        (tx, ty), _ = as_examples(x_test, last.stage.data, "x_test")
        check_example_shape(last.stage, tx, "x_test")
        measured = last.stage if measure is None else _measure_stage(last.stage, measure)
        self.fit()
        start = time.perf_counter()
        names = last.trained + last.fixed
        tokens = self._token_gradient(measured, tx, ty, chunk_size) if not per_test else None
        flat = tokens.flat if tokens is not None else \
            per_example_grads(measured, tx, ty, names, chunk_size=chunk_size, memory=self.memory).T if per_test \
            else total_grad(measured, tx, ty, names, chunk_size=chunk_size, memory=self.memory)
        grads = ParamSpace(_values(last.stage, names)).unflatten(flat)
        a = {n: grads[n] for n in last.trained}
        b = {n: grads[n] for n in last.fixed}
        seconds = {"test_gradient": time.perf_counter() - start}
        n_rhs = flat.shape[1] if per_test else 1
        solvers = [self._query_solver(k, n_rhs) for k in range(len(self))]
        solutions, seconds["cross_products"] = adjoint.propagate(
            self.plans, solvers, a, b, per_test=per_test, n_rhs=n_rhs, memory=self.memory, progress=progress,
            factors=None if tokens is None else (tokens.flat, tokens.factors))
        seconds.update({f"solve_stage{k}": sol.seconds for k, sol in enumerate(solutions)})
        test_digest = Rows(last.stage, torch.arange(tx.shape[0]), (tx, ty)).digest()
        if measure is not None:
            test_digest += f"|measure={_qualname(measure)}"
        solved = [position.solved(solver.name, solver.curvature.config.matrix, solution.eigenvalues)
                  for position, solver, solution in zip(self.positions, solvers, solutions)]  # completed by the solves
        stages = [position.summary() | ({"proximal": drift.summary()} if drift else {})
                  for position, drift in zip(solved, self.drifts)]
        query = Query(self, solutions[0].x, per_test, tx.shape[0], solutions, seconds, test_digest, stages)
        query.solves[-1]["token_factors"] = sorted(tokens.factors) if tokens is not None else []
        return query

    def _token_gradient(self, measured: Stage, tx, ty, chunk_size: int | None) -> TokenGradient | None:
        """The summed test gradient with its Kronecker blocks as token factors (:mod:`influkit.factored.tokens`)
        when the last stage is solved by ``kfac``/``ekfac`` (no residual) over all it differentiates; else None."""
        last, solver = self.plans[-1], self._query_solver(len(self) - 1, 1)
        if last.fixed or not solver.uses_token_factors:
            return None
        return token_gradient(measured, tx, ty, last.trained, solver.approximation, chunk_size=chunk_size,
                              memory=self.memory)


def _per_stage(given, kind: type, what: str, stages: int, *, by_name: bool = False) -> list:
    """One ``kind`` config per stage from one config or a sequence of them; with ``by_name`` a string is
    ``kind(string)`` (``curvature="gauss-newton"`` is ``CurvatureConfig("gauss-newton")``)."""
    def one(config):
        return kind(config) if by_name and isinstance(config, str) else config

    single = isinstance(given, kind) or isinstance(given, str)
    configs = [one(given)] * stages if single else [one(c) for c in given] if isinstance(given, Sequence) else [given]
    if len(configs) != stages or not all(isinstance(c, kind) for c in configs):
        raise InputError(f"{what} must be one {kind.__name__} or one per stage ({stages}).")
    return configs


def _measure_stage(stage: Stage, measure: Measure) -> Stage:
    """``stage`` with ``measure`` in place of its loss (the test function's per-example values)."""
    if not callable(measure):
        raise InputError("measure must be callable as measure(outputs, targets) -> (B,) values, one per test example.")
    try:
        return stage.with_(loss=measure)
    except LossError as exc:
        raise LossError(f"measure(outputs, targets) must return one finite value per example, shape (B,): {exc}") from None


def _qualname(fn) -> str:
    return getattr(fn, "__qualname__", type(fn).__name__)


def _values(stage: Stage, names: Sequence[str]) -> dict[str, torch.Tensor]:
    state = stage.state()
    return {n: state[n] for n in names}


class Query:
    """The solves of one test set: s = H_1⁻¹ a_1 on stage 1's trained parameters, with every solve's diagnostics.

    ``scores(z)`` turns s into influence scores of any stage-1 examples, in chunks, without solving again.
    """

    def __init__(self, chain: Chain, s: torch.Tensor, per_test: bool, n_test: int, solutions, seconds: dict, test_digest: str,
                 stages: Sequence[dict] = ()):
        self.chain, self.s, self.per_test, self.n_test = chain, s.contiguous(), per_test, n_test
        self.test_digest = test_digest
        self.solves = [
            {"stage": k, **(sol.summary() if isinstance(sol, Solution) else sol)} for k, sol in enumerate(solutions)
        ]
        self.seconds = dict(seconds)
        self.stages = [dict(stage) for stage in stages]  # where each stage stands (stationarity.Position.summary)

    def __repr__(self) -> str:
        return f"Query({self.chain.method}, n_test={self.n_test}, per_test={self.per_test}, s{tuple(self.s.shape)})"

    def fingerprint(self) -> str:
        """The chain's fingerprint combined with the test set's and ``per_test``: what the scores depend on."""
        return hashlib.sha256(f"{self.chain.fingerprint()}|{self.test_digest}|{self.per_test}".encode()).hexdigest()

    def scores(self, z=None, *, chunk_size: int | None = None, out: str | Path | None = None, progress: bool | None = None,
               gradients: str = "contraction", autocast: torch.dtype | None = None) -> InfluenceResult:
        """Influence I(z, T) = −∇ℓ_1(z)ᵀ s of stage-1 examples ``z`` (indices or (inputs, targets); default all).

        The inner products are contracted layer by layer (``gradients="contraction"``, :mod:`influkit.contraction`:
        memory O(chunk_size · activations), no per-example gradient matrix), or taken from per-example gradients
        (``"per-example"``, O(chunk_size · p)); ``chunk_size`` rows at a time, by default as many as the chain's
        memory budget holds (``diagnostics["scoring"]``). ``autocast``: torch.bfloat16 / float16 passes for the
        contraction. Scoring z in parts gives the same numbers as scoring it whole. Under ``torch.distributed`` the chunks are split
        over the ranks and every rank returns the whole result. ``out``: a directory to stream the scores to,
        chunk by chunk, resumable after a crash (a score store, :mod:`influkit.store`); the result is memory-mapped from it.
        progress: a bar over the chunks (default: the chain's ``progress``).
        """
        progress = self.chain.progress if progress is None else progress
        plan = self.chain.plans[0]
        rows = Rows.of(plan.stage, z)
        start = time.perf_counter()
        if chunk_size is None and out is not None:
            chunk_size = resumed_chunk_size(out)  # resuming: the chunks already on disk decide
        scorer = Scorer(plan.stage, plan.trained, self.s, rows, gradients=gradients, chunk_size=chunk_size,
                        memory=self.chain.memory, autocast=autocast)
        chunk_size = scorer.chunk_size
        if out is None:
            values, counts = score_rows(self.s, scorer, rows, progress=progress)
            index = rows.ids
        else:
            values, index, counts = stream_rows(self.fingerprint(), self.s, scorer, rows, out=out, progress=progress)
        seconds = self.seconds | {"example_gradients": time.perf_counter() - start}
        if self.chain.fit_seconds is not None:
            seconds["fit"] = self.chain.fit_seconds
        return InfluenceResult(
            values=values if self.per_test else values.reshape(-1),
            n_train=len(plan.stage),
            index=index,
            method=self.chain.method,
            diagnostics={"stages": self.stages, "solves": self.solves, "seconds": seconds, "settings": self.settings(),
                         "chunks": counts | {"chunk_size": chunk_size, "ranks": distributed.world_size()},
                         "scoring": scorer.describe(), "memory": self.chain.memory_plans() + [scorer.memory]},
        )

    def token_scores(self, z=None, *, chunk_size: int | None = None, progress: bool | None = None) -> TokenScores:
        """Per-token influence I_t(z, T) = −⟨∇ℓ_t(z), s⟩ of stage-1 sequences ``z`` (indices or (inputs, targets);
        default all), ℓ_t the token terms the stage's loss declares (:mod:`influkit.per_token`; the language-model
        stages of :mod:`influkit.hf` do): values (n, L), or (n, L, n_test) per test point, aligned with the tokens;
        values.sum(1) equals :meth:`scores`' values. ``chunk_size`` sequences at a time (default: from the chain's
        memory budget); one forward pass with tangents per chunk and test column, no gradient formed."""
        progress = self.chain.progress if progress is None else progress
        plan = self.chain.plans[0]
        return stage_token_scores(plan.stage, plan.trained, self.s, Rows.of(plan.stage, z), per_test=self.per_test,
                                  chunk_size=chunk_size, memory=self.chain.memory, progress=progress,
                                  method=f"{self.chain.method} (per token)")

    def settings(self) -> dict:
        """The chain's links and solve settings, JSON-friendly."""
        return {
            "links": [
                {"shared": plan.inherited, "case": plan.link.case, "alpha": plan.link.alpha if plan.link.case == 2 else None}
                for plan in self.chain.plans[1:]
            ],
            "solve": [config.summary() for config in self.chain.solve_configs],
            "curvature": [config.summary() for config in self.chain.curvature_configs],
            "per_test": self.per_test,
            "n_test": self.n_test,
        }

    def save(self, path: str | Path) -> Path:
        """Write s and the diagnostics to ``path`` (safetensors + JSON); :func:`load_query` reads it back."""
        meta = {"fingerprint": self.chain.fingerprint(), "per_test": self.per_test, "n_test": self.n_test,
                "solves": self.solves, "seconds": self.seconds, "test_digest": self.test_digest, "stages": self.stages}
        return files.write(path, QUERY_KIND, {"s": self.s}, meta)


def load_query(path: str | Path, chain: Chain) -> Query:
    """Read a :class:`Query` written by :meth:`Query.save`, for the same ``chain`` (refused otherwise; never unpickles)."""
    tensors, meta = files.read(path, QUERY_KIND)
    if meta["fingerprint"] != chain.fingerprint():
        raise FileFormatError(
            f"{path} was computed for another chain (models, parameters, data sizes, links or solve settings differ)."
        )
    s = tensors["s"].to(chain.plans[0].stage.device)
    return Query(chain, s, meta["per_test"], meta["n_test"], meta["solves"], meta["seconds"], meta["test_digest"],
                 meta.get("stages", []))


def parameters_digest(stage: Stage) -> str:
    """A SHA-256 digest of every parameter and buffer of the stage's model (names, dtypes, shapes and values)."""
    digest = hashlib.sha256()
    for name, tensor in sorted(stage.state().items()):
        t = tensor.detach().cpu().contiguous()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
