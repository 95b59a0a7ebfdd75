"""Gradients and Hessian-vector products of a stage objective by double backprop with ``torch.func``.

For the objective L(θ) = (1/n) Σ_i ℓ_i(θ) + R(θ) of a :class:`~influkit.stage.Stage`,
``hvp`` returns H·v = ∇²L(θ)·v without forming H: reverse-over-reverse ``vjp(grad(L))`` by default, or
forward-over-reverse ``jvp(grad(L))`` (``mode="fwd-rev"``; on CPU with torch 2.13 its forward-mode rules
run through Python decompositions, slower for small models — ``benchmarks/bench_core.py`` measures both). The data are streamed in batches and the products summed, so memory does not
grow with n.

Mixed second derivatives are the same product taken over the union of two parameter blocks: with the
tangent non-zero only in block B, the A-part of the result is ∂²L/∂A∂B · v_B.

``HessianOperator(curvature="gauss-newton")`` applies the generalized Gauss-Newton matrix instead,
G = (1/n) Σ_i J_iᵀ ∇²_f ℓ(f_i, y_i) J_i + ∇²R (J_i = ∂f(x_i; θ)/∂θ, the model outputs' Jacobian): H without the
term Σ_i Σ_c ∂ℓ/∂f_c · ∇²f_c that makes H indefinite away from a minimum. G ⪰ 0 for convex losses
(cross-entropy, squared error), it is what K-FAC/EK-FAC approximate, and it equals H for a model linear in θ.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from collections.abc import Mapping, Sequence

import torch
from torch.func import grad, jvp, vjp

from . import distributed
from .errors import InputError, MemoryBudgetError, NumericalError
from .gradients import backward_bytes
from .memory import PROBE_EXAMPLES, Probe, available_bytes
from .memory import plan as memory_plan
from .memory import given as memory_given
from .memory import resolve as memory_budget
from .operators import DenseOperator, SymmetricFactor
from .params import Params, ParamSpace, point
from .progress import steps as progress_steps
from .stage import Stage
from .vectorize import vmap_or_loop

HVP_MODES = ("fwd-rev", "rev-rev")
CURVATURES = ("hessian", "gauss-newton")
DENSE_COPIES = 4  # p×p matrices held at once while dense() builds H: the identity, the product columns, their
# concatenation and its symmetrization


def sample_indices(n: int, samples: int | None, seed: int = 0) -> torch.Tensor | None:
    """A seeded random subset of ``samples`` of ``range(n)``, or None for all of it (``samples`` None or n)."""
    if samples is None or samples == n:
        return None
    if samples <= 0:
        raise InputError(f"hessian_samples must be positive, got {samples}.")
    if samples > n:
        raise InputError(f"hessian_samples={samples} is larger than the stage's data (n = {n} examples): "
                         f"pass hessian_samples <= {n}, or None to use all of them.")
    gen = torch.Generator().manual_seed(seed)
    return torch.randperm(n, generator=gen)[:samples].sort().values


def _penalty(stage: Stage, extra=None):
    """p ↦ R(p) + extra(p), the objective's data-free part, or None when the stage has neither."""
    if stage.regularizer is None and extra is None:
        return None

    def penalty(params: Params):
        reg = stage.regularization(params)
        value = reg if reg is not None else 0.0
        return value + extra(params) if extra is not None else value

    return penalty


def _batch_objective(stage: Stage, extra=None):
    """f(p; x, y, scale, with_reg) = scale·Σ_batch ℓ + [R(p) + extra(p)]: one batch's share of the objective."""
    penalty = _penalty(stage, extra)

    def term(params: Params, inputs, targets, scale: float, with_reg: bool):
        value = stage.losses(params, inputs, targets).sum() * scale
        return value + penalty(params) if with_reg and penalty is not None else value

    return term


def _share(stage: Stage, indices: torch.Tensor | None) -> tuple[torch.Tensor | None, int, bool]:
    """(this process's example indices, n of the whole objective, whether this process adds the regularizer).

    On one process: all of ``indices``. Under ``torch.distributed``: this rank's contiguous slice; rank 0 adds R.
    """
    n = len(stage) if indices is None else len(indices)
    if not distributed.active():
        return indices, n, True
    local = distributed.shard(torch.arange(len(stage)) if indices is None else torch.as_tensor(indices))
    return local, n, distributed.rank() == 0


def penalty_gradient(stage: Stage, names: Sequence[str], at: Params | None = None, extra=None) -> Params | None:
    """∇ over ``names`` of the objective's data-free part R (+ ``extra``), or None when the stage has neither."""
    penalty = _penalty(stage, extra)
    return None if penalty is None else grad(penalty)(point(stage.state(), names, at))


def gradient(
    stage: Stage,
    names: Sequence[str],
    indices: torch.Tensor | None = None,
    at: Params | None = None,
    extra=None,
    batch_size: int | None = None,
    *,
    memory: int | None = None,
    progress: bool = False,
) -> Params:
    """∇ over ``names`` of the objective mean loss + R (+ ``extra``), over ``indices`` (default: all data)
    (``progress``: a bar over the batches).

    In batches of ``batch_size`` when given, else sized from the measured bytes of one example's forward and
    backward under the budget ``memory`` (bytes; None: the default rule of :mod:`influkit.memory`, which never fills
    it): the stage's own batches can hold its whole data set, every example's activations at once (a large vocabulary's logits for every
    sequence)."""
    params = point(stage.state(), names, at)
    local, n, owns_regularizer = _share(stage, indices)
    term = _batch_objective(stage, extra)
    total = {k: torch.zeros_like(v) for k, v in params.items()}
    size = batch_size
    if size is None:
        n_local = len(stage) if local is None else len(local)
        probe = stage.data.take(torch.arange(min(PROBE_EXAMPLES, len(stage))) if local is None else local[:PROBE_EXAMPLES])
        size = memory_plan(memory_budget(memory, next(iter(params.values())).device),
                           backward_bytes(stage, *probe, names, at), "the gradient pass", most=max(n_local, 1),
                           default=not memory_given(memory))["batch"]
    n_local = len(stage) if local is None else len(local)
    batches = progress_steps(stage.batches(local, size), "gradient pass", progress, -(-n_local // size))
    for b, (x, y) in enumerate(batches):
        g = grad(term)(params, x, y, 1.0 / n, owns_regularizer and b == 0)
        for k in total:
            total[k] += g[k]
    return {k: distributed.all_reduce_(v) for k, v in total.items()}


def hvp(
    stage: Stage,
    tangents: Mapping[str, torch.Tensor],
    *,
    indices: torch.Tensor | None = None,
    at: Params | None = None,
    batched: bool = False,
    mode: str = "rev-rev",
    extra=None,
    batch_size: int | None = None,
    data_weight: float = 1.0,
    gradient: Params | None = None,
) -> Params:
    """H·v over the parameter block named by ``tangents``' keys, for the objective over ``indices``.

    tangents: dict name -> v (same shape as the parameter), or (k, *shape) with ``batched`` for k products.
    at: parameter values to differentiate at (default: the model's current values).
    extra: an additional term extra(params) -> scalar in the objective (e.g. a proximal penalty).
    batch_size: examples per streamed batch (default: the stage's).
    data_weight: c of the objective (c/n) Σ ℓ_i + R + extra (``HessianOperator``).
    gradient: (not ``batched``) zeros shaped like ``tangents``, to which each batch's gradient of the objective is
    added — the product's by-product (the primal of ``vjp(grad)`` / ``jvp(grad)``), so they end as ∇ of the objective
    on this process's share of the data.
    """
    if mode not in HVP_MODES:
        raise InputError(f"unknown HVP mode {mode!r}; use one of {HVP_MODES}.")
    names = list(tangents)
    params = point(stage.state(), names, at)
    local, n, owns_regularizer = _share(stage, indices)
    term = _batch_objective(stage, extra)

    def with_gradient(p, v, x, y, with_reg):  # (the batch's gradient of the objective, H_batch·v)
        g = lambda q: grad(term)(q, x, y, data_weight / n, with_reg)  # noqa: E731
        if mode == "fwd-rev":
            return jvp(g, (p,), (v,))
        value, pull = vjp(g, p)
        return value, pull(v)[0]

    def product(p, v, x, y, with_reg):
        return with_gradient(p, v, x, y, with_reg)[1]

    total = {k: torch.zeros_like(v) for k, v in tangents.items()}
    for b, (x, y) in enumerate(stage.batches(local, batch_size)):
        args = (params, dict(tangents), x, y, owns_regularizer and b == 0)
        if batched:
            out = vmap_or_loop(product, (None, 0, None, None, None), stage, *args)
        else:
            value, out = with_gradient(*args)
            for k in gradient or ():
                gradient[k] += value[k].detach()
        for k in total:
            total[k] += out[k]
    for k, v in total.items():
        distributed.all_reduce_(v)
        if not torch.isfinite(v).all():
            raise NumericalError(
                f"the Hessian-vector product is not finite in {k!r}; check the model for overflow "
                "(e.g. train in float64) and the inputs for extreme values."
            )
    return total


HVP_TRANSIENT = 2.0


def hvp_bytes_per_example(stage: Stage, names: Sequence[str], at: Params | None = None, extra=None) -> int:
    """Bytes one example adds to a Hessian-vector product: what autograd keeps of the forward and of the
    create_graph backward (the cached gradient graph), measured on a probe of two examples
    (:class:`influkit.memory.Probe`), × :data:`HVP_TRANSIENT` for the buffers a product's backward through that
    graph allocates (not saved tensors; the factor was measured as resident growth over saved bytes on a BERT-base-width model)."""
    count = min(PROBE_EXAMPLES, len(stage))
    x, y = stage.data.take(torch.arange(count))
    leaves = {n: t.detach().clone().requires_grad_(True) for n, t in point(stage.state(), names, at).items()}
    term = _batch_objective(stage, extra)

    with Probe(stage.model, count) as probe, torch.enable_grad():  # the parameter-sized gradient is not per example
        torch.autograd.grad(term(leaves, x, y, 1.0, False), list(leaves.values()), create_graph=True, allow_unused=True)
    return int(HVP_TRANSIENT * probe.per_example)


class _GaussNewtonBatch:
    """G·v on one batch by three backward passes through graphs built once: J·v by the double-backward trick
    (Jv = ∂(uᵀJ v)/∂u), then ∇²_f ℓ · Jv, then Jᵀ(·). No forward-mode AD, so any model autograd handles works."""

    def __init__(self, stage: Stage, leaves: dict[str, torch.Tensor], inputs, targets, scale: float):
        self.leaves = leaves
        with torch.enable_grad():
            self.out = stage.outputs(leaves, inputs)
            self.probe = torch.zeros_like(self.out, requires_grad=True)
            jtu = torch.autograd.grad(self.out, list(leaves.values()), grad_outputs=self.probe, create_graph=True,
                                      allow_unused=True)
            self.used = [k for k, g in enumerate(jtu) if g is not None and g.requires_grad]
            self.jtu = [jtu[k] for k in self.used]
            self.at = self.out.detach().requires_grad_(True)
            self.loss_grad = torch.autograd.grad(stage.loss(self.at, targets).sum() * scale, self.at, create_graph=True)[0]

    def gradient(self) -> list[torch.Tensor]:
        """[the batch's gradient of scale·Σ ℓ] per leaf: Jᵀ ∂ℓ/∂f, one backward through the kept forward graph."""
        if not self.out.requires_grad:  # outputs constant in θ
            return [torch.zeros_like(t) for t in self.leaves.values()]
        back = torch.autograd.grad(self.out, list(self.leaves.values()), grad_outputs=self.loss_grad.detach(),
                                   retain_graph=True, allow_unused=True)
        return [b if b is not None else torch.zeros_like(t) for b, t in zip(back, self.leaves.values())]

    def product(self, tangents: list[torch.Tensor]) -> list[torch.Tensor]:
        """[G_batch · v] per leaf, for v given per leaf (same order as ``leaves``)."""
        zero = [torch.zeros_like(t) for t in tangents]
        if not self.used or not self.loss_grad.requires_grad:  # outputs constant in θ, or a loss linear in f
            return zero
        jv = torch.autograd.grad(self.jtu, self.probe, grad_outputs=[tangents[k] for k in self.used], retain_graph=True)[0]
        hjv = torch.autograd.grad(self.loss_grad, self.at, grad_outputs=jv, retain_graph=True)[0]
        back = torch.autograd.grad(self.out, list(self.leaves.values()), grad_outputs=hjv, retain_graph=True,
                                   allow_unused=True)
        return [b if b is not None else z for b, z in zip(back, zero)]


@dataclass(frozen=True)
class ProductSettings:
    """How a :class:`HessianOperator` forms its products. cache_graph: keep the gradient graph over the data (None:
    when it fits the memory budget); mode: the streamed products' order, reverse-over-reverse ``"rev-rev"`` or
    forward-over-reverse ``"fwd-rev"``."""

    cache_graph: bool | None = None
    mode: str = "rev-rev"


class HessianOperator:
    """The Hessian of a stage objective over a parameter block, as a linear operator on flat vectors.

    H = ∇²_θ [(c/s) Σ_{i∈S} ℓ_i(θ) + R(θ) + extra(θ)], with S all data or a seeded sample of ``samples``
    examples (``hessian_samples``) and c = ``data_weight`` (default 1; another c: the objective of a run whose every
    example is weighted c, R and extra unscaled). ``matvec`` takes (p,) or (p, k); ``dense`` builds the p×p matrix.

    With ``product.cache_graph`` (:class:`ProductSettings`; default: when the graph fits the memory budget ``memory``, bytes, :mod:`influkit.memory`:
    len(S) × the measured bytes of one example's double-backward graph, :func:`hvp_bytes_per_example`), the
    gradient graph ∇L(θ) over S is built once and every product is a single backward pass through it
    (H·v = ∂(∇Lᵀv)/∂θ); otherwise the data are streamed in batches sized from the same budget;
    under ``torch.distributed`` each rank holds the graph of its slice of S and the products are all-reduced;
    larger data are streamed batch by batch with ``torch.func`` (``product.mode``: reverse-over-reverse
    ``vjp(grad)``, measured fastest on CPU, or forward-over-reverse ``jvp(grad)``). Either way H is
    taken at the parameter values of the first product.

    curvature: ``"hessian"`` (default) or ``"gauss-newton"`` — the generalized Gauss-Newton matrix G of the same
    objective (module docstring), by three backward passes per product through batch graphs that are cached
    under the same rule (else rebuilt batch by batch); the regularizer and ``extra`` keep their exact Hessian.

    ``objective_gradient``: the flat gradient ∇ of that objective over S at H's point, recorded by the first
    single-vector product (None before): a by-product of the pass that product makes — the cached graph's ∇L, the
    streamed batches' ``vjp(grad)`` / ``jvp(grad)`` primals, and on G one more backward per batch through the batch's
    kept forward graph (Jᵀ ∂ℓ/∂f, no forward), its seconds in ``gradient_seconds``. The stationarity check of a stage
    whose named solve multiplies by H reads it (:func:`influkit.stationarity.from_solve`) instead of a pass of its own.
    """

    def __init__(
        self,
        stage: Stage,
        names: Sequence[str] | None = None,
        *,
        samples: int | None = None,
        seed: int = 0,
        extra=None,
        at: Params | None = None,
        product: ProductSettings = ProductSettings(),
        curvature: str = "hessian",
        memory: int | None = None,
        data_weight: float = 1.0,
    ):
        if curvature not in CURVATURES:
            raise InputError(f"unknown curvature {curvature!r}; choose one of {CURVATURES}.")
        self.curvature = curvature
        self.stage = stage
        self.names = list(stage.param_names if names is None else names)
        self.at = at
        self.space = ParamSpace(point(stage.state(), self.names, at))
        self.indices = sample_indices(len(stage), samples, seed)
        self.mode = product.mode
        cache_graph = product.cache_graph
        self.extra = extra
        self.data_weight = float(data_weight)
        self.products = 0
        n_used = len(stage) if self.indices is None else len(self.indices)
        n_local = -(-n_used // distributed.world_size())
        self.batch_size: int | None = None
        self.memory: dict = {"phase": "hessian-vector products", "cache_graph": cache_graph, "given": True}
        if cache_graph is None:
            budget = memory_budget(memory, self.device)
            per = hvp_bytes_per_example(stage, self.names, at, extra)
            vectors = 4 * self.space.dim * torch.empty(0, dtype=self.space.dtype).element_size()  # ∇L, H·v, v, grads
            self.memory = memory_plan(budget, per, "Hessian-vector products", most=max(n_local, 1), fixed=vectors,
                                      default=not memory_given(memory))
            cache_graph = self.memory["batch"] >= n_local
            self.memory["cache_graph"] = cache_graph
            self.batch_size = None if cache_graph else self.memory["batch"]
        self._use_graph = cache_graph
        self._graph: tuple[list[torch.Tensor], torch.Tensor] | None = None
        self._gauss_newton_graphs: list[_GaussNewtonBatch] | None = None
        self._dense: DenseOperator | None = None
        self.objective_gradient: torch.Tensor | None = None
        self.gradient_seconds = 0.0

    def streamed(self, plan: dict) -> "HessianOperator":
        """This operator with products streamed in batches of ``plan["batch"]`` examples (``plan``: its memory
        record) and no cached graph of its own: the same H (a product is a sum over batches), in less memory."""
        out = copy.copy(self)
        out.batch_size, out.memory, out._use_graph, out.products = plan["batch"], plan, False, 0
        out._graph, out._gauss_newton_graphs, out._dense = None, None, None
        out.objective_gradient, out.gradient_seconds = None, 0.0
        return out

    @property
    def dim(self) -> int:
        return self.space.dim

    @property
    def dtype(self) -> torch.dtype:
        return self.space.dtype

    @property
    def device(self) -> torch.device:
        return self.space.device

    def _gradient_graph(self) -> tuple[list[torch.Tensor], torch.Tensor]:
        """(leaf parameters, flat ∇L(θ) with its graph kept) over the whole (sampled) data, built once."""
        if self._graph is None:
            leaves = {n: t.detach().clone().requires_grad_(True) for n, t in point(self.stage.state(), self.names, self.at).items()}
            local, n, owns_regularizer = _share(self.stage, self.indices)
            n_local = n if local is None else len(local)
            batches = list(self.stage.batches(local, batch_size=max(n_local, 1)))
            with torch.enable_grad():
                term = _batch_objective(self.stage, self.extra)
                if batches:
                    value = term(leaves, *batches[0], self.data_weight / n, owns_regularizer)
                else:  # a rank with no examples of its own (fewer examples than ranks)
                    value = sum((t * 0.0).sum() for t in leaves.values())
                grads = torch.autograd.grad(value, list(leaves.values()), create_graph=True, allow_unused=True)
            flat = torch.cat([(g if g is not None else torch.zeros_like(t)).reshape(-1) for g, t in zip(grads, leaves.values())])
            self._graph = (list(leaves.values()), flat)
        return self._graph

    def _graph_product(self, vec: torch.Tensor) -> torch.Tensor:
        leaves, flat = self._gradient_graph()
        if not flat.requires_grad:  # the gradient does not depend on θ: H = 0
            return torch.zeros_like(vec)
        if vec.dim() == 2:
            # one backward pass per column: measured 1.3-2.6x faster per column than is_grads_batched (vmap) on
            # the digits MLPs (p = 610-9,610) and the bench_scale CNN and head, and no k-fold graph memory
            return torch.stack([self._graph_product(vec[:, j]) for j in range(vec.shape[1])], dim=1)
        grads = torch.autograd.grad(flat, leaves, grad_outputs=vec, retain_graph=True, allow_unused=True)
        parts = [g if g is not None else torch.zeros_like(t) for g, t in zip(grads, leaves)]
        return torch.cat([g.reshape(-1) for g in parts]).detach()

    def _gauss_newton_batches(self):
        """The batch graphs of G over this process's share of the (sampled) data: kept when cached, else streamed."""
        if self._gauss_newton_graphs is not None:
            yield from self._gauss_newton_graphs
            return
        local, n, _ = _share(self.stage, self.indices)
        n_local = n if local is None else len(local)
        leaves = {k: t.detach().clone().requires_grad_(True) for k, t in point(self.stage.state(), self.names, self.at).items()}
        size = max(n_local, 1) if self._use_graph else self.batch_size
        graphs = (_GaussNewtonBatch(self.stage, leaves, x, y, self.data_weight / n)
                  for x, y in self.stage.batches(local, batch_size=size))
        if self._use_graph:
            self._gauss_newton_graphs = list(graphs)
            yield from self._gauss_newton_graphs
        else:
            yield from graphs

    def kept_gradient(self) -> torch.Tensor | None:
        """``objective_gradient`` from the graphs this operator keeps, built now if not yet (its products reuse them),
        or None when it streams its products (there a gradient would be a pass of its own): on H the cached graph's
        ∇L, on G one backward per batch through the kept forward graphs (Jᵀ ∂ℓ/∂f) and ∇(R + extra)."""
        if self.objective_gradient is None and self._use_graph:
            if self.curvature == "gauss-newton":
                record = torch.zeros(self.dim, dtype=self.dtype, device=self.device)
                for batch in self._gauss_newton_batches():
                    record += self._batch_gradient(batch)
                self.objective_gradient = self._with_penalty(record)
            else:
                self.objective_gradient = distributed.all_reduce_(self._gradient_graph()[1].detach().clone())
        return self.objective_gradient

    def _batch_gradient(self, batch: _GaussNewtonBatch) -> torch.Tensor:
        """One G batch's flat gradient of its share of the data term (timed into ``gradient_seconds``)."""
        start = time.perf_counter()
        flat = torch.cat([g.reshape(-1) for g in batch.gradient()])
        self.gradient_seconds += time.perf_counter() - start
        return flat

    def _with_penalty(self, record: torch.Tensor) -> torch.Tensor:
        """This rank's summed batch gradients + ∇(R + extra) (on the rank that adds R), summed over the ranks."""
        _, _, owns_regularizer = _share(self.stage, self.indices)
        penalty = _penalty(self.stage, self.extra)
        if owns_regularizer and penalty is not None:
            record += self.space.flatten(grad(penalty)(point(self.stage.state(), self.names, self.at)))
        return distributed.all_reduce_(record)

    def _gauss_newton_product(self, vec: torch.Tensor) -> torch.Tensor:
        """G·vec, (p, k), before the sum over ranks: the data part of this rank plus, on rank 0, ∇²(R + extra)·vec.
        The first product also records ``objective_gradient``."""
        cols = [self.space.unflatten(vec[:, j]) for j in range(vec.shape[1])]
        out = torch.zeros_like(vec)
        record = torch.zeros(self.dim, dtype=self.dtype, device=self.device) if self.objective_gradient is None else None
        for batch in self._gauss_newton_batches():
            for j, tangent in enumerate(cols):
                parts = batch.product([tangent[k] for k in self.names])
                out[:, j] += torch.cat([t.reshape(-1) for t in parts])
            if record is not None:
                record += self._batch_gradient(batch)
        _, _, owns_regularizer = _share(self.stage, self.indices)
        penalty = _penalty(self.stage, self.extra)
        if owns_regularizer and penalty is not None:
            params = point(self.stage.state(), self.names, self.at)
            for j, tangent in enumerate(cols):
                out[:, j] += self.space.flatten(vjp(grad(penalty), params)[1](tangent)[0])
        if record is not None:
            self.objective_gradient = self._with_penalty(record)
        return out

    def matvec(self, vec: torch.Tensor) -> torch.Tensor:
        """H·vec (or G·vec) for vec of shape (p,) or (p, k)."""
        batched = vec.dim() == 2
        if self.curvature == "gauss-newton":
            self.products += vec.shape[1] if batched else 1
            out = distributed.all_reduce_(self._gauss_newton_product(vec if batched else vec[:, None]))
            if not torch.isfinite(out).all():
                raise NumericalError("the Gauss-Newton-vector product is not finite; check the model for overflow.")
            return out if batched else out[:, 0]
        if batched and vec.shape[1] == 1:
            # one column (every single-rhs Krylov step): the plain product, not a batch of one through vmap /
            # is_grads_batched, which measured 1.35x slower on the bench_scale CNN (p = 39,109, n = 5,000)
            return self.matvec(vec[:, 0]).unsqueeze(1)
        if batched and self.objective_gradient is None and not self._use_graph:  # the first column records ∇L
            first = self.matvec(vec[:, 0])
            return torch.cat([first[:, None], self.matvec(vec[:, 1:])], dim=1)
        self.products += vec.shape[1] if batched else 1
        if self._use_graph:
            out = distributed.all_reduce_(self._graph_product(vec))
            self.kept_gradient()
            if not torch.isfinite(out).all():
                raise NumericalError("the Hessian-vector product is not finite; check the model for overflow.")
            return out
        record = None if batched or self.objective_gradient is not None else \
            {k: torch.zeros_like(v) for k, v in self.space.unflatten(vec).items()}
        out = hvp(
            self.stage,
            self.space.unflatten(vec),
            indices=self.indices,
            at=self.at,
            batched=batched,
            mode=self.mode,
            extra=self.extra,
            batch_size=self.batch_size,
            data_weight=self.data_weight,
            gradient=record,
        )
        if record is not None:
            self.objective_gradient = distributed.all_reduce_(self.space.flatten(record))
        return self.space.flatten(out, batched=batched)

    __call__ = matvec

    def dense(self, chunk: int = 256, progress: bool = False) -> torch.Tensor:
        """The explicit p×p Hessian, built once from products with blocks of unit vectors (O(p) HVPs), then kept
        (``progress``: a bar over the blocks)."""
        if self._dense is None:
            p = self.dim
            needed = DENSE_COPIES * p * p * torch.empty(0, dtype=self.dtype).element_size()
            free = available_bytes(self.device)
            if needed > free:
                raise MemoryBudgetError(
                    f"the dense Hessian of {p:,} parameters needs about {needed / 2**30:,.1f} GiB ({DENSE_COPIES} "
                    f"p×p matrices while it is built) and {free / 2**30:,.1f} GiB are free: a dense H (solver='direct', "
                    "dense()) is for up to some ten thousand parameters. Use solver='minres' or 'cg' (or 'auto'), "
                    "which multiply by H without forming it, or train fewer parameters (Stage(params=...)).")
            eye = torch.eye(p, dtype=self.dtype, device=self.device)
            starts = progress_steps(range(0, p, chunk), "dense Hessian", progress, -(-p // chunk))
            cols = [self.matvec(eye[:, s : s + chunk]) for s in starts]
            h = torch.cat(cols, dim=1)
            self._dense = DenseOperator(0.5 * (h + h.T))
        return self._dense.matrix

    def factor(self, damping: float = 0.0, progress: bool = False) -> SymmetricFactor:
        """The factorization of the dense H + λI (built and kept on first use), for repeated ``direct`` solves."""
        self.dense(progress=progress)
        return self._dense.factor(damping)

    def restore_dense(self, matrix: torch.Tensor) -> None:
        """Use ``matrix`` (a saved :meth:`dense` of this same operator) instead of building it again."""
        if matrix.shape != (self.dim, self.dim):
            raise InputError(f"a saved Hessian of shape {tuple(matrix.shape)} does not fit this {self.dim}×{self.dim} operator.")
        self._dense = DenseOperator(matrix.to(self.device, self.dtype))

    @property
    def has_dense(self) -> bool:
        """True once :meth:`dense` has been built (or restored)."""
        return self._dense is not None
