"""``Chain``: influence through N training stages — fit once, query a test set, score examples in chunks.

Stage k minimizes F_k(θ_k; c_k) = (1/n_k) Σ_i ℓ_k(x_i; θ_k, c_k) + R_k(θ_k) [+ α‖S_k − c_k‖²], where c_k are
the values stage k inherits from stage k−1 through its incoming :class:`Link` (stage 1 inherits nothing):

- Case 1: the shared block S_k is *fixed* at c_k (S_k is part of the model, not of θ_k);
- Case 2: S_k ⊂ θ_k is finetuned, pulled towards c_k by the proximal term α‖S_k − c_k‖², which the chain adds.

Up-weighting a stage-1 example z (F_1 → F_1 + ε·ℓ_1(z)) moves every optimum; the score of z on the summed
test loss f(T) of the last stage is I(z, T) = df(T)/dε (positive = harmful; removing z is ε = −1/n_1).

Derivation (adjoint propagated backwards, one solve per stage). Stationarity ∇_θk F_k(θ_k*, c_k) = 0 gives
dθ_k*/dc_k = −H_k⁻¹ ∂²F_k/∂θ_k∂c_k, H_k = ∇²_θk F_k. Let a_k = df/dθ_k* (the adjoint on what stage k trains)
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
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from . import distributed, files, stationarity
from .auto import Choice
from .curvature import HessianOperator, hvp
from .data import as_examples
from .errors import FileFormatError, InputError, LossError, ParameterError
from .gradients import per_example_grads, total_grad
from .operators import Operator
from .params import ParamSpace, shared_parameters
from .results import InfluenceResult
from .memory import resolve as memory_budget
from .memory import scope as memory_scope
from .scoring import Rows, Scorer, resumed_chunk_size, score_rows, stream_rows
from .solvers import Solution, SolveConfig, Solver
from .stationarity import Position
from .stage import Stage, check_example_shape

QUERY_KIND = "query"
FIT_KIND = "chain-fit"


Measure = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # measure(outputs, targets) -> (B,) values


@dataclass(frozen=True)
class Link:
    """How a stage inherits the shared block S from the previous stage.

    shared: a module prefix present in both models, or {this_stage_name: previous_stage_name} (names or prefixes).
    case: 1 keeps S fixed at the previous stage's values; 2 finetunes S with the proximal term α‖S − S̄‖².
    alpha: the proximal weight α > 0 of Case 2 (the multi-stage paper uses 0.01).
    """

    shared: str | Mapping[str, str]
    case: int = 1
    alpha: float = 0.01

    def __post_init__(self) -> None:
        if self.case not in (1, 2):
            raise InputError(f"case must be 1 (shared block fixed) or 2 (finetuned), got {self.case!r}.")
        if self.case == 2 and not self.alpha > 0:
            raise InputError(
                f"Case 2 needs a proximal weight alpha > 0 (the paper uses 0.01), got {self.alpha!r}; with alpha = 0 "
                "the later stage does not depend on the earlier stage's shared block at all."
            )
        if not self.shared:
            raise ParameterError("shared is empty: name the shared block (a module prefix or a name mapping).")


class _StagePlan:
    """What the chain needs of one stage: trained names θ, inherited names S ({name: previous name}), proximal term."""

    def __init__(self, stage: Stage, link: Link | None, previous: "_StagePlan | None"):
        self.stage = stage
        self.link = link
        self.inherited: dict[str, str] = {}
        if link is not None:
            self.inherited = shared_parameters(previous.stage.model, stage.model, link.shared)
            live = set(previous.trained) | set(previous.inherited)
            dead = [p for p in self.inherited.values() if p not in live]
            if dead:
                raise ParameterError(
                    f"shared parameters {dead} are neither trained in the previous stage nor inherited by it, so "
                    "they cannot carry influence; include them in that stage's params."
                )
        order = [n for n, _ in stage.model.named_parameters()]
        if link is not None and link.case == 1:
            self.trained = [n for n in stage.param_names if n not in self.inherited]
            if not self.trained:
                raise ParameterError(
                    f"stage {type(stage.model).__name__} trains nothing besides the shared block; a Case 1 link needs "
                    "parameters the stage trains on top of it."
                )
        elif link is not None:
            chosen = set(stage.param_names) | set(self.inherited)
            self.trained = [n for n in order if n in chosen]
        else:
            self.trained = list(stage.param_names)
        self.fixed = list(self.inherited) if link is not None and link.case == 1 else []
        self.proximal = None
        if link is not None and link.case == 2:
            previous_state = previous.stage.state()
            centre = {n: previous_state[p].detach() for n, p in self.inherited.items()}
            alpha = link.alpha
            self.proximal = lambda params: alpha * sum(((params[n] - c) ** 2).sum() for n, c in centre.items())
        if link is not None and link.case == 1:
            state, previous_state = stage.state(), previous.stage.state()
            drift = max(float((state[n] - previous_state[p]).abs().max()) for n, p in self.inherited.items())
            if drift > 0:
                warnings.warn(
                    f"a Case 1 link assumes the stage keeps the previous stage's shared block, but they differ by up "
                    f"to {drift:.2e}: the block was not fixed. Use Link(..., case=2) if it was finetuned.",
                    UserWarning,
                    stacklevel=4,
                )


class Chain:
    """N training stages joined by N − 1 links; influence of stage-1 examples on the last stage's test loss.

    ``Chain([stage])`` is single-stage influence (Koh & Liang); ``Chain([pre, fin], [Link("embedding")])`` the
    multi-stage paper's Case 1; longer chains (pretrain → adapt → finetune) follow the same adjoint recursion
    (module docstring). ``solve`` is one :class:`SolveConfig` for every stage or one per stage.

    :meth:`fit` first measures where each stage stands (:mod:`influkit.stationarity`, ``positions``; in every
    result's ``diagnostics["stages"]``, with one warning naming the stages not at a minimum), then prepares each
    stage's solver as :func:`influkit.auto.decide` chooses from it (``solver="auto"``) or as configured.
    """

    def __init__(self, stages: Sequence[Stage], links: Sequence[Link] = (), solve: SolveConfig | Sequence[SolveConfig] = SolveConfig(),
                 *, memory: int | None = None):
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
        configs = [solve] * len(stages) if isinstance(solve, SolveConfig) else list(solve)
        if len(configs) != len(stages) or not all(isinstance(c, SolveConfig) for c in configs):
            raise InputError(f"solve must be one SolveConfig or one per stage ({len(stages)}).")
        self.stages, self.links, self.configs = stages, links, configs
        self._shared = isinstance(solve, SolveConfig)  # one config for every stage (auto.decide's ``shared``)
        self.plans: list[_StagePlan] = []
        for k, stage in enumerate(stages):
            self.plans.append(_StagePlan(stage, links[k - 1] if k else None, self.plans[-1] if k else None))
        self._solvers: list[Solver] | None = None
        self._more_solvers: dict[tuple[int, str], Solver] = {}  # other choices for queries with many right-hand sides
        self._operators: dict[tuple, HessianOperator] = {}
        self._positions: dict[tuple, Position] = {}
        self.positions: list[Position] | None = None
        self.fit_seconds: float | None = None
        self.memory = None if memory is None else memory_budget(memory)  # bytes; None: a share of what is free

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
        return self.fit()._solvers[k].operator

    def solver(self, k: int, n_rhs: int = 1) -> Solver:
        """Stage k's prepared :class:`~influkit.solvers.Solver` for ``n_rhs`` right-hand sides at a time (``auto``
        may choose differently for several: one factorization for all of them)."""
        return self.fit()._query_solver(k, n_rhs)

    def fit(self) -> "Chain":
        """Build what does not depend on the test set: where each stage stands (``positions``: one gradient pass,
        per-example gradients of a sample of 64, 20 Hessian-vector products per stage), each stage's operator and
        its prepared :class:`~influkit.solvers.Solver` (a dense factorization for ``direct``, the factored curvature
        or Lanczos eigenpairs its SolveConfig asks for). Cached; :meth:`query` calls it when needed. Returns self."""
        if self._solvers is not None:
            return self
        start = time.perf_counter()
        with memory_scope(self.memory):  # factor fitting sizes its batches from the same budget
            self.positions = [self._position(k) for k in range(len(self))]
            self._solvers = [self._prepare(k, self._choice(k)) for k in range(len(self))]
        used = {id(solver.operator) for solver in self._solvers}  # an exact Hessian only measured: free its graph
        self._operators = {key: op for key, op in self._operators.items() if id(op) in used}
        self.fit_seconds = time.perf_counter() - start
        self._warn_positions()
        return self

    def _position(self, k: int) -> Position:
        """Where stage k stands, measured on its exact Hessian (the configured sample), kept per sample and seed."""
        config = self.configs[k]
        key = (k, config.hessian_samples, config.seed)
        if key not in self._positions:
            plan = self.plans[k]
            hessian = self._operator(k, replace(config, curvature="hessian"))
            self._positions[key] = stationarity.assess(plan.stage, plan.trained, hessian, extra=plan.proximal,
                                                       seed=config.seed)
        return self._positions[key]

    def _choice(self, k: int, n_rhs: int = 1) -> Choice:
        """Stage k's solve for ``n_rhs`` right-hand sides: :func:`influkit.auto.decide` on its position."""
        values = _values(self.plans[k].stage, self.plans[k].trained)
        dim = sum(t.numel() for t in values.values())
        itemsize = next(iter(values.values())).element_size()
        return self.configs[k].decide(self.positions[k], dim, n_rhs=n_rhs, memory=memory_budget(self.memory),
                                      shared=self._shared, itemsize=itemsize)

    def _prepare(self, k: int, choice: Choice) -> Solver:
        config = self.configs[k]
        return config.prepare(self._operator(k, config.chosen(choice)), choice)

    def _query_solver(self, k: int, n_rhs: int) -> Solver:
        """The fitted solver of stage k, or the one auto chooses for ``n_rhs`` > 1 right-hand sides (kept)."""
        fitted = self._solvers[k]
        if n_rhs == 1:
            return fitted
        choice = self._choice(k, n_rhs)
        if choice.solver == fitted.name:
            return fitted
        if (k, choice.solver) not in self._more_solvers:
            with memory_scope(self.memory):
                self._more_solvers[k, choice.solver] = self._prepare(k, choice)
        return self._more_solvers[k, choice.solver]

    def _warn_positions(self) -> None:
        remedies = []
        for solver in self._solvers:
            config = solver.config
            how = (f"{config.solver} on the {'Gauss-Newton matrix' if config.curvature == 'gauss-newton' else 'Hessian'}"
                   f" + λI, λ = {config.damping:.3g}")
            remedies.append(f"solver='auto' solves it with {how}" if solver.automatic else
                            f"it is solved as configured ({how}); solver='auto' decides from where it stands")
        names = [type(plan.stage.model).__name__ for plan in self.plans]
        stationarity.warn_not_at_minimum(self.positions, names, remedies)

    def with_solve(self, solve: SolveConfig | Sequence[SolveConfig]) -> "Chain":
        """This chain with other solve settings, fitted from what this one fitted where they allow: a stage whose
        Hessian is the same (same ``curvature``, ``hessian_samples``, ``seed``) keeps its operator, and with it the
        factored curvature and eigenpairs fitted on it (e.g. a damping sweep of EK-FAC or Arnoldi without refitting;
        ``direct`` factors the kept dense Hessian for the new λ), and its position. Other stages are fitted anew."""
        other = Chain(self.stages, self.links, solve, memory=self.memory)
        if self._solvers is None:
            return other
        other._operators, other._positions = dict(self._operators), dict(self._positions)
        other.fit()
        return other

    def _operator(self, k: int, config: SolveConfig) -> HessianOperator:
        """Stage k's operator for ``config``'s matrix, sample and seed (built once, shared by every solver on it)."""
        key = (k, config.curvature, config.hessian_samples, config.seed)
        if key not in self._operators:
            plan = self.plans[k]
            self._operators[key] = HessianOperator(plan.stage, plan.trained, samples=config.hessian_samples,
                                                   seed=config.seed, extra=plan.proximal, curvature=config.curvature,
                                                   memory=self.memory)
        return self._operators[key]

    def memory_plans(self) -> list[dict]:
        """The batch sizes each fitted stage chose from the memory budget (Hessian-vector products, factors)."""
        plans = []
        for k, solver in enumerate(self._solvers or []):
            op = solver.operator
            plans.append({"stage": k} | dict(getattr(op, "memory", {})))
            curvature = getattr(op, "fitted", {}).get("curvature")
            if curvature is not None and "memory" in curvature.info:
                plans.append({"stage": k} | curvature.info["memory"])
        return plans

    def fingerprint(self) -> str:
        """A digest of what the scores depend on: every stage's model, parameters, data size, trained names,
        the links and the solve settings. A saved Query or fit is only loaded into a chain with the same digest."""
        digest = hashlib.sha256()
        for plan, config in zip(self.plans, self.configs):
            stage = plan.stage
            digest.update(f"{type(stage.model).__name__}|{len(stage)}|{plan.trained}|{plan.inherited}".encode())
            for name, tensor in sorted(stage.state().items()):
                t = tensor.detach().cpu().contiguous()
                digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
                digest.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
            digest.update(repr(sorted(config.summary().items())).encode())
        for link in self.links:
            digest.update(repr((dict(link.shared) if isinstance(link.shared, Mapping) else link.shared, link.case, link.alpha)).encode())
        return digest.hexdigest()

    def save(self, path: str | Path) -> Path:
        """Write the fitted state (each stage's solver state: dense Hessians, factored curvature, eigenpairs) to
        ``path``; :meth:`load` restores it bit for bit."""
        self.fit()
        tensors, fitted = {}, {}
        for k, solver in enumerate(self._solvers):
            extra, fitted[str(k)] = solver.state(f"stage{k}.")
            tensors.update(extra)
        return files.write(path, FIT_KIND, tensors, {"fingerprint": self.fingerprint(), "fit_seconds": self.fit_seconds,
                                                     "fitted": fitted,
                                                     "positions": [p.summary() for p in self.positions]})

    def load(self, path: str | Path) -> "Chain":
        """Restore a fit written by :meth:`save` for this same chain (refused otherwise). Returns self."""
        tensors, meta = files.read(path, FIT_KIND)
        if meta["fingerprint"] != self.fingerprint():
            raise FileFormatError(f"{path} was fitted for another chain (models, data sizes or solve settings differ).")
        self.positions = [Position.from_summary(p) for p in meta["positions"]]
        choices = [self._choice(k) for k in range(len(self))]
        self._solvers = [
            config.build(self._operator(k, config.chosen(choice)), choice).load(
                tensors, meta.get("fitted", {}).get(str(k), {}), f"stage{k}.")
            for k, (config, choice) in enumerate(zip(self.configs, choices))
        ]
        self.fit_seconds = meta["fit_seconds"]
        return self

    def query(self, x_test, *, measure: Measure | None = None, per_test: bool = False, chunk_size: int | None = None,
              progress: bool = False) -> "Query":
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
        """
        self.fit()
        last = self.plans[-1]
        (tx, ty), _ = as_examples(x_test, last.stage.data, "x_test")
        check_example_shape(last.stage, tx, "x_test")
        measured = last.stage if measure is None else _measure_stage(last.stage, measure)
        start = time.perf_counter()
        names = last.trained + last.fixed
        with memory_scope(self.memory):
            flat = per_example_grads(measured, tx, ty, names, chunk_size=chunk_size).T if per_test else \
                total_grad(measured, tx, ty, names, chunk_size=chunk_size)
        grads = ParamSpace(_values(last.stage, names)).unflatten(flat)
        a = {n: grads[n] for n in last.trained}
        b = {n: grads[n] for n in last.fixed}
        seconds = {"test_gradient": time.perf_counter() - start, "cross_products": 0.0}
        solutions: list[Solution] = [None] * len(self)  # type: ignore[list-item]
        for k in range(len(self) - 1, -1, -1):
            plan, solver = self.plans[k], self._query_solver(k, flat.shape[1] if per_test else 1)
            op = solver.operator
            space = ParamSpace(_values(plan.stage, plan.trained))
            solutions[k] = solver.solve(space.flatten(a, batched=per_test), progress=progress)
            v = space.unflatten(solutions[k].x)
            if k == 0:
                break
            start = time.perf_counter()
            if plan.link.case == 1:
                tangent = {n: torch.zeros_like(b[n]) for n in plan.fixed} | v
                cross = hvp(plan.stage, tangent, indices=op.indices, batched=per_test, batch_size=getattr(op, "batch_size", None))
                g = {n: b[n] - cross[n] for n in plan.fixed}
            else:
                g = {n: 2 * plan.link.alpha * v[n] for n in plan.inherited}
            seconds["cross_products"] += time.perf_counter() - start
            a, b = self._pull_back(k, g, per_test, flat.shape[1] if per_test else None)
        seconds.update({f"solve_stage{k}": sol.seconds for k, sol in enumerate(solutions)})
        test_digest = Rows(last.stage, torch.arange(tx.shape[0]), (tx, ty)).digest()
        if measure is not None:
            test_digest += f"|measure={_qualname(measure)}"
        stages = [position.summary() for position in self.positions]
        return Query(self, solutions[0].x, per_test, tx.shape[0], solutions, seconds, test_digest, stages)

    def _pull_back(self, k: int, g: dict[str, torch.Tensor], per_test: bool, n_rhs: int | None):
        """Map df/dc_k (stage k's names) onto stage k−1: (a on what it trains, b on what it inherited fixed)."""
        previous = self.plans[k - 1]
        values = _values(previous.stage, previous.trained + previous.fixed)
        lead = () if n_rhs is None else (n_rhs,)
        total = {n: torch.zeros(*lead, *t.shape, dtype=t.dtype, device=t.device) for n, t in values.items()}
        for name, earlier in self.plans[k].inherited.items():
            total[earlier] = total[earlier] + g[name]
        return {n: total[n] for n in previous.trained}, {n: total[n] for n in previous.fixed}


def _measure_stage(stage: Stage, measure: Measure) -> Stage:
    """``stage`` with ``measure`` in place of its loss (the test function's per-example values)."""
    if not callable(measure):
        raise InputError("measure must be callable as measure(outputs, targets) -> (B,) values, one per test example.")
    try:
        return Stage(stage.model, measure, stage._data, params=stage.param_names, batch_size=stage.data.batch_size)
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

    def scores(self, z=None, *, chunk_size: int | None = None, out: str | Path | None = None, progress: bool = False,
               method: str = "contraction", autocast: torch.dtype | None = None) -> InfluenceResult:
        """Influence I(z, T) = −∇ℓ_1(z)ᵀ s of stage-1 examples ``z`` (indices or (inputs, targets); default all).

        The inner products are contracted layer by layer (``method="contraction"``, :mod:`influkit.contraction`:
        memory O(chunk_size · activations), no per-example gradient matrix), or taken from per-example gradients
        (``"per-example"``, O(chunk_size · p)); ``chunk_size`` rows at a time, by default as many as the chain's
        memory budget holds (``diagnostics["scoring"]``). ``autocast``: torch.bfloat16 / float16 passes for the
        contraction. Scoring z in parts gives the same numbers as scoring it whole. Under ``torch.distributed`` the chunks are split
        over the ranks and every rank returns the whole result. ``out``: a directory to stream the scores to,
        chunk by chunk, resumable after a crash (:mod:`influkit.scoring`); the result is memory-mapped from it.
        """
        plan = self.chain.plans[0]
        rows = Rows.of(plan.stage, z)
        start = time.perf_counter()
        if chunk_size is None and out is not None:
            chunk_size = resumed_chunk_size(out)  # resuming: the chunks already on disk decide
        scorer = Scorer(plan.stage, plan.trained, self.s, rows, method=method, chunk_size=chunk_size,
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

    def settings(self) -> dict:
        """The chain's links and solve settings, JSON-friendly."""
        return {
            "links": [
                {"shared": plan.inherited, "case": plan.link.case, "alpha": plan.link.alpha if plan.link.case == 2 else None}
                for plan in self.chain.plans[1:]
            ],
            "solve": [config.summary() for config in self.chain.configs],
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
