"""Exact metagradients: d measure(final model) / d w_z for every example of every recorded stage, by reverse mode.

Sign convention (docs/concepts.md, "Sign conventions"): the score of z is d f(T; θ_final(w)) / d w_z at w = 1,
through every recorded step of every stage; removing z (w_z: 1 → 0) predicts a change of **−score**
(``InfluenceResult.removal`` with ``removal_eps = −1``). For full-batch descent run to convergence the score
tends to I(z, T)/m, the influence function's value.

Where the derivative is taken (``at``): removing a set D moves w from 1 to 1_D̄ (0 on D); the prediction is
Δf ≈ −Σ_{z∈D} score_z(at), with score(at) = ∇_w f at w = ``at`` (the run replayed at those weights,
:func:`~.replay.reweighted`). At the midpoint m = (1 + 1_D̄)/2 this is exact for an f quadratic in w
(f(1_D̄) − f(1) = ∇f(m)·(1_D̄ − 1)): one ``at`` for every set of a fraction f, the mean midpoint (1 − f/2)·1,
predicts the size of each set's change. To *rank* random drop sets of a fraction f (what an LDS measures), take
the masks' mean w̄ = (1 − f)·1 instead (the mean rule): for f quadratic in w the residual of the linearization at
(1 − c)·1 has the part (f − c)·1ᵀ∇²f (m_D − f·1) linear in the mask's fluctuation, zero at c = f.
``at = 1`` (or None) is the plain linearization. This is for removal as w_z = 0 in each step's
(1/|B_t|) Σ w_z ℓ (the replay protocol); a re-training that averages over the kept set instead is
w = 1_D̄/(1 − f), whose mean is w = 1.

The reverse pass (MAGIC, Ilyas & Engstrom 2025, written here for chains of stages). A step is the pure map
(θ_{t+1}, s_{t+1}) = Φ_t(θ_t, s_t, S̄, w_{B_t}) of :meth:`StageRun.step`. With the adjoint (θ̄_{t+1}, s̄_{t+1}),
one vector-Jacobian product of Φ_t gives (θ̄_t, s̄_t), adds ∂/∂S̄ to the shared block's adjoint, and gives the
per-example terms ∂/∂w_z = (1/|B_t|) ∇ℓ(z; θ_t)·v_t for the whole batch at once (v_t: the adjoint pulled back
through the optimizer's update to the gradient; autograd's double backward through ∇_θ L_t gives them in the
same pass as the Hessian-vector product H_t v_t). Stages run last to first: the last stage starts from
θ̄_T = ∂f/∂θ_T; stage k's adjoint on its start and on its fixed or proximal shared block (S̄ = the previous
stage's final values) is handed across the boundary as the previous stage's θ̄_T (Case 1: the fixed block's
adjoint is accumulated over every finetuning step; Case 2: θ̄_0 of the finetuned block plus the proximal term's
∂/∂S̄; LoRA: the fixed base weights are a Case 1 block).

Memory (checkpointing): the record keeps (θ, state) every k steps. The reverse pass takes the segments last to
first: it replays one segment forward from its checkpoint keeping what each step's reverse needs — the gradient
g_t = ∇_θ L_t(θ_t; S̄, w_{B_t}) with its activations, and the update of (θ_t, state_t, g_t) — then pulls the
segment's steps backwards and drops them. It holds T/k checkpoints + k step graphs + the adjoints — O(√T) for
k = √T — and costs one forward replay of the run (a step's forward and backward: a training step) plus one double
backward per step (H_t v_t, the shared block's term and the batch's example terms in one pass;
``benchmarks/bench_unrolled.py`` measures the ratio to training). Each segment's recomputed end is compared with
the next checkpoint, so the pass also checks that replay reproduces the whole record (``diagnostics["replay"]``) and
refuses (:class:`~influkit.errors.NotReplayable`) a record it does not reproduce bit for bit (under ranks, within
√ε of the state's size: their summation order differs): its scores would describe a run that never happened.

The optimizer's update is not recorded as a graph: it runs forward without autograd (the very operations of the
recorded step, so the same values) and is pulled back in closed form — each rule's ``pullback``
(:mod:`.optimizers`), the clipping's through :meth:`StageRun.update_vjp` — a few fused elementwise operations over
every tensor at once (``torch._foreach_*``) with the adjoints' leading dimension q broadcast, where autograd's
backward through the update ran a dozen small kernels per tensor. Only the gradient's graph is kept.

A measure with q outputs (per-test losses) is differentiated for all q at once: the adjoints carry a leading
dimension q. The gradient's graph of a step is pulled back one of three ways. **Looped**: kept as a plain autograd
graph (the gradient taken with ``create_graph`` from leaf θ_t, S̄, w_{B_t}) and pulled by one ``autograd.grad`` per
output, the graph retained until the last. **Batched**: the same graph pulled for all q outputs by one
``autograd.grad(..., is_grads_batched=True)`` (the backward vmapped over the outputs). **Vmapped**: kept as a
``torch.func.vjp`` pullback of the step's gradient, vmapped over the q outputs. One output is always looped. For
q > 1 none wins everywhere: batching amortizes per-operation overhead on small models, while on a decoder whose
steps are bound by memory traffic over its (tokens × vocabulary) logits one double backward per output is faster
(``benchmarks/bench_unrolled.py``). So the first q > 1 pass through a stage times the three on one step, twice (from
the segment's checkpoint, results discarded: about six steps' work) and pulls every step the fastest way
(``diagnostics["pull"]``: the choice and the trial's seconds); ``pull=`` names one way instead, so that repeated
computations repeat their bits (the ways differ in the summation order). Forward over reverse — ``torch.func.jvp``
of θ ↦ ∇_{(θ, S̄, w)} L_t in the direction ḡ_t, which gives H_t ḡ_t, the shared block's term and the example terms in one
pass with no graph kept from the replay — runs through Llama's operations and peft's LoRA in torch 2.13 but was
slower than the ways above wherever it was measured, so it is not used.

Mixed precision (a run recorded under ``torch.autocast``, bf16): every step is replayed at the run's own precision,
so the trajectory θ_t is the recorded one bit for bit, and each step's gradient graph — H_t ḡ_t, the shared block's
and the examples' terms — is taken again in the parameters' dtype (float32) at that θ_t: the derivative of the
float32 training map along the bf16 trajectory (one more gradient per step). The optimizer's update is linearized
there too, at the float32 gradient: at the bf16 step's own gradient, a coordinate that bf16 rounding cancelled to
(nearly) 0 would give Adam's pullback its largest factor 1/ε (10⁸) where the float32 map's is ε/g² — one such
coordinate at a first step put a recorded bf16 Trainer's metagradient 10⁴ times off the float32 run's.

Ranks (``torch.distributed``, as :meth:`influkit.Query.scores`): a step is split into the gradient of the batch's
loss, g_t = Σ_r g_t^r with rank r's contiguous share of B_t (:func:`influkit.distributed.shard`; R(θ) and the
proximal term on the rank holding the batch's first example), summed by ``all_reduce``, and the optimizer's update
of g_t. Backwards the update's VJP gives ḡ_t (the same on every rank), each rank pulls ḡ_t back through its share —
its examples' terms and its part of H_t ḡ_t and of the shared block's adjoint, summed over the ranks — so every rank
holds the same adjoints and the terms of its own examples; the per-example scores are summed over the ranks at the
end. Equal to one process up to the summation order. Streaming (``out=DIR``, :mod:`.journal`): every finished
segment's terms and the adjoint after it go to disk, and a re-run resumes after the last finished segment.
"""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.func import vjp, vmap
from tqdm.auto import tqdm

from .. import distributed
from ..chain import Measure
from ..errors import InputError
from ..per_token import TokenScores
from ..results import InfluenceResult
from .boundary import describe_at, hand_over, measure_adjoint, reweighted_at
from .journal import Journal, fingerprint
from .record import Record, stage_weights, token_weights
from .run import StageRun, tensor_bytes
from .replay import as_measure, deviation, refuse_unreproduced, reweighted, start, unit_weights

METHOD = "unrolled exact (replay)"
LOOPED, BATCHED, VMAPPED = "looped", "batched", "vmapped"  # how a step is pulled back for q outputs (module docstring)
PULLS = ("auto", LOOPED, BATCHED, VMAPPED)


def metagradients(record: Record, test, *, measure: Measure | None = None, per_test: bool = False,
                  out: str | Path | None = None, at=None, per_token: bool = False, pull: str = "auto",
                  progress: bool = False) -> list[InfluenceResult | TokenScores]:
    """One :class:`InfluenceResult` per recorded stage: values[z] = d measure(final model) / d w_z at w = ``at``.

    test: an (inputs, targets) test set (its per-test values ``measure(outputs, targets)`` under the last stage in
    eval mode; ``measure`` is what ``Chain.query(x_test, measure=)`` takes, default the stage's loss, so one measure
    object gives both methods the same test function), a callable params → scalar or (q,) tensor of the last
    stage's final values (trained θ_T and fixed shared block), or an :class:`Adjoint` (d measure / d those final
    values, computed outside the record).
    per_test: keep one column per measure output, values (n_k, q); else the outputs are summed.
    out: a directory journaling the pass (each finished segment's example terms and the adjoint after it,
    :mod:`.journal`): a re-run of the same call resumes after the last finished segment.
    at: the data weights at which the derivative is taken — None (w = 1, the recorded run), a float for every
    example of every stage, one tensor (stage 0's; later stages as recorded) or one entry (tensor, float or None)
    per stage. The record is first re-run at them (:func:`~.replay.reweighted`: one forward replay) and the
    reverse pass differentiates that run. A set D removed predicts Δ measure ≈ −Σ_{z∈D} values[z]; for
    dropping a fraction f of the pretraining examples, at = [1 − f, None] ranks random drop sets best and
    at = [1 − f/2, None] predicts each one's change (module docstring).
    per_token: split every language-model stage's scores over its tokens (:mod:`influkit.per_token`): each token
    term ℓ_t(z) gets its own weight w_{z,t} in the step's loss, and that stage's result is a
    :class:`~influkit.per_token.TokenScores` of d measure / d w_{z,t}, values (n, L) or (n, L, q), whose sums over
    the tokens are the per-example scores (stages whose loss declares no split keep their InfluenceResult). Not
    with ``out`` nor for a Trainer's recorded batches.
    ``results[0]`` scores the pretraining examples, ``results[-1]`` the finetuning examples (the same pass).
    removal = −values (removal_eps = −1): a score is d measure / d w_z, so removing z predicts a change of −score.
    Under ``torch.distributed`` each step's batch is split over the ranks (module docstring) and every rank
    returns the whole result. diagnostics: seconds (this pass, and the recorded training, whose first steps
    include torch.func's warm-up), the replay check, the memory held (checkpoints, adjoints, one segment's step
    graphs), the segments computed and reused, and ``settings["at"]`` (None, the float, or per stage None or the
    weights' min / mean / max).
    pull: how each step's gradient graph is pulled back for q > 1 measure outputs — ``"auto"`` (a timed trial on
    one step per stage picks the fastest), ``"looped"``, ``"batched"`` or ``"vmapped"`` (module docstring).
    """
    if pull not in PULLS:
        raise InputError(f"unknown pull {pull!r}; choose one of {PULLS}.")
    start_time = time.perf_counter()
    if distributed.world_size() > 1 and any(run.rngs for run in record.runs):
        raise InputError("a watched run replays each micro-batch from its own generator state, which splitting its "
                         "batches over ranks would change; compute its metagradient in one process.")
    record = reweighted_at(record, test, at, progress)
    if per_token:
        if out is not None:
            raise InputError("per_token=True keeps its (n, L, q) terms in memory; drop out= (the journal holds "
                             "per-example terms).")
        record = token_weights(record)
        if all(run.weights is None or run.weights.dim() == 1 for run in record.runs):
            raise InputError("per_token=True needs a stage whose loss declares token terms on the stage's own data "
                             "(influkit.hf.causal_lm_stage / masked_lm_stage); a Trainer run's collated batches "
                             "have no fixed token positions: score per example instead.")
    adjoint, q, outputs = measure_adjoint(record, test, per_test, measure)
    journal = Journal(out, "" if out is None else fingerprint(record, adjoint), q)
    settings = {"measure_outputs": int(outputs), "per_test": per_test, "at": describe_at(at, record)}
    return _backward(record, adjoint, q, per_test, settings, start_time, progress, journal, pull)


def _backward(record: Record, adjoint: dict, q: int, per_test: bool, settings: dict, start_time: float,
              progress: bool, journal: Journal, pull: str) -> list[InfluenceResult]:
    """Reverse mode through every stage, last to first, from θ̄_T = ``adjoint`` ((q, *shape) per name)."""
    checkpoint_bytes = sum(run.checkpoint_bytes() for run in record.runs)
    stats = new_stats(record)
    scores, _ = _stages(record, adjoint, q, stats, progress, journal, pull)
    seconds = time.perf_counter() - start_time
    training = sum(run.seconds for run in record.runs)
    diagnostics = {
        "seconds": {"metagradient": seconds, "training (recorded)": training},
        "settings": settings | {"steps": [run.steps for run in record.runs],
                                "checkpoint_every": [run.every for run in record.runs],
                                "optimizers": [repr(run.optimizer) for run in record.runs]},
        "replay": {"max_error": stats["replay_error"], "checked": "every computed segment's recomputed end vs its "
                   "checkpoint"},
        "memory": {"checkpoint_bytes": checkpoint_bytes, "adjoint_bytes": stats["adjoint_bytes"],
                   "segment_steps": max(run.every for run in record.runs),
                   "segment_resident_growth_bytes": stats["segment_growth"],
                   "note": "checkpoints and adjoints counted exactly; one segment's step graphs measured as the "
                           "growth of resident memory while it is held (0 where the allocator reused freed pages)"},
        "segments": {"computed": stats["computed"], "reused": stats["reused"], "ranks": distributed.world_size()},
        "pull": {"stages": stats["pulls"], "note": "per stage, how each step's gradient was pulled back for the q "
                 "measure outputs (looped: one autograd double backward per output; batched: one double backward "
                 "batched over the outputs; vmapped: torch.func pullbacks vmapped over the outputs): q = 1 looped; "
                 "q > 1 the fastest on a timed trial step (trial: its seconds, the looped way's stopped once past the "
                 "fastest before it; inf: the model cannot be batched; None where pull= named the way); None: "
                 "every segment reused"},
        "ratio_to_recorded_training": seconds / training if training > 0 else None,
    }
    results = []
    for k, run in enumerate(record.runs):
        values = scores[k] if per_test else scores[k][..., 0]
        if values.dim() == (3 if per_test else 2):  # per-token weights: (n, L[, q])
            results.append(TokenScores(values, torch.arange(len(run.stage)), f"{METHOD}, stage {k} (per token)",
                                       diagnostics | {"stage": k}))
            continue
        results.append(InfluenceResult(values=values, n_train=len(run.stage), method=f"{METHOD}, stage {k}",
                                       diagnostics=diagnostics | {"stage": k}, removal_eps=-1.0))
    return results


def new_stats(record: Record) -> dict:
    """The reverse pass's running statistics (replay error, memory, segments, pulls), all empty."""
    return {"replay_error": 0.0, "segment_growth": 0, "adjoint_bytes": 0, "segment": 0, "computed": 0, "reused": 0,
            "pulls": [None] * len(record)}


def _stages(record: Record, adjoint: dict, q: int, stats: dict, progress: bool, journal: Journal, pull: str,
            first: int = 0) -> tuple[list, dict | None]:
    """Reverse mode through stages len(record) − 1 … ``first`` from ``adjoint`` on the last stage's final values:
    (per stage the (n_k, q) scores summed over the ranks, None below ``first``; the adjoint handed to stage
    first − 1, None for first = 0)."""
    scores: list = [None] * len(record)
    for k in range(len(record) - 1, first - 1, -1):
        run = record.runs[k]
        theta_bar = {n: adjoint.get(n, torch.zeros(q, *v.shape, dtype=v.dtype, device=v.device))
                     for n, v in run.checkpoints[run.steps][0].items()}
        anchor_bar = {n: adjoint.get(n, torch.zeros(q, *v.shape, dtype=v.dtype, device=v.device))
                      if n in run.frozen else torch.zeros(q, *v.shape, dtype=v.dtype, device=v.device)
                      for n, v in run.anchors.items()}
        theta_bar, anchor_bar, scores[k] = _reverse(k, run, theta_bar, anchor_bar, q, stats, progress, journal, pull)
        adjoint = hand_over(record, k, theta_bar, anchor_bar, q) if k else None
    for k in range(first, len(record)):  # each rank holds the terms of its own share of every batch
        distributed.all_reduce_(scores[k])
    return scores, adjoint


def exact_down_to(record: Record, adjoint: dict, q: int, first: int, progress: bool) -> tuple[list, dict | None]:
    """The exact reverse pass (no journal, pulls chosen by trial) through stages len(record) − 1 … ``first`` only:
    (per stage the (n_k, q) scores, None below ``first``; the adjoint handed to stage first − 1)."""
    return _stages(record, adjoint, q, new_stats(record), progress, Journal(None, "", q), "auto", first)


@dataclass
class _Graph:
    """One step's plain autograd graph: ``outputs`` as functions of the leaf tensors ``inputs``, both keyed
    ("gradient", name), ("theta", name), ("anchor", name) or "w"; ``batched``: pull q > 1 columns in one batched
    backward (:data:`BATCHED`), else one backward per column."""

    outputs: dict
    inputs: dict
    batched: bool = False

    def pull(self, cotangents: dict, deadline: float | None = None) -> dict | None:
        """{input key: Σ_out cotangent[out] · ∂out/∂input} for cotangents with a leading dimension q: one backward
        per column, the graph kept until the last (which frees it), or all q columns in one backward vmapped over
        them (``batched``, autograd's ``is_grads_batched``). None once ``time.perf_counter()`` passes ``deadline``
        between columns (the pull trial's slower way)."""
        wanted = [k for k, o in self.outputs.items() if o.requires_grad]
        q, columns = cotangents[wanted[0]].shape[0], []
        if self.batched and q > 1:
            with warnings.catch_warnings():  # an operation without a batching rule runs per column: the trial judges
                warnings.filterwarnings("ignore", message="There is a performance drop")
                pulled = torch.autograd.grad([self.outputs[k] for k in wanted], list(self.inputs.values()),
                                             [cotangents[k] for k in wanted], allow_unused=True,
                                             materialize_grads=True, is_grads_batched=True)
            # an input the outputs do not reach comes back as unbatched zeros: give it the leading q as well
            return {k: v if v.dim() > leaf.dim() else v.expand(q, *v.shape)
                    for (k, leaf), v in zip(self.inputs.items(), pulled)}
        for j in range(q):
            if deadline is not None and time.perf_counter() > deadline:
                return None
            columns.append(torch.autograd.grad([self.outputs[k] for k in wanted], list(self.inputs.values()),
                                               [cotangents[k][j] for k in wanted], allow_unused=True,
                                               materialize_grads=True, retain_graph=j < q - 1))
        if q == 1:
            return {k: columns[0][i].unsqueeze(0) for i, k in enumerate(self.inputs)}
        return {k: torch.stack([column[i] for column in columns]) for i, k in enumerate(self.inputs)}


class _Update:
    """One step's optimizer update pulled back in closed form (:meth:`StageRun.update_vjp`)."""

    def __init__(self, pullback):
        self._pullback = pullback

    def pull(self, theta_bar: dict, state_bar: dict) -> tuple[dict, dict, dict]:
        """(θ̄_t, s̄_t, ḡ_t) from (θ̄_{t+1}, s̄_{t+1}), each with the leading dimension q."""
        return self._pullback(theta_bar, state_bar)


class _Pullback:
    """One step's ``torch.func`` pullback: the vjp of ``fn`` (keyed dict → keyed dict, keys as :class:`_Graph`'s) at
    ``inputs``, applied to cotangents with a leading dimension q under ``vmap``."""

    def __init__(self, fn, inputs: dict):
        self.outputs, self._pullback = vjp(fn, inputs)

    def pull(self, cotangents: dict, deadline: float | None = None) -> dict:
        return vmap(self._pullback)({k: cotangents[k] for k in self.outputs})[0]


def _detached(tensors: dict) -> dict:
    """The values without their autograd history."""
    return {n: v.detach() for n, v in tensors.items()}


def _leaves(tensors: dict) -> dict:
    """Detached copies (sharing storage) that autograd records from: one step's inputs."""
    return {n: v.detach().requires_grad_() for n, v in tensors.items()}


def _forward_step(run: StageRun, t: int, theta, state, anchors, pull: str):
    """Step t forward, keeping what its reverse needs: (θ_{t+1}, state_{t+1}, (this rank's batch ids, the update's
    pullback, the gradient's graph or None)) — the update run without autograd and pulled back in closed form
    (:class:`_Update`); the gradient's plain autograd graph for ``pull`` = "looped" or "batched", its ``torch.func``
    pullback for "vmapped" (module docstring). The gradient is this rank's share of the batch, summed over the
    ranks; its values are the recorded step's (the same operations; the segment's replay check compares them)."""
    idx, x, y = run.batch(t)
    if distributed.active():
        part = distributed.shard(torch.arange(idx.numel()))
        ids, xs, ys = idx[part], x[part.to(x.device)], y[part.to(y.device)]
        lead = part.numel() > 0 and int(part[0]) == 0  # the rank holding the batch's first example adds R and prox
    else:
        ids, xs, ys, lead = idx, x, y, True
    if pull != VMAPPED:
        theta = _leaves(theta)
    gradient_graph = None
    with torch.enable_grad():
        if ids.numel():
            w = unit_weights(run, ids, None, xs)  # the run's weights
            if pull != VMAPPED:
                leaf_anchors, w = _leaves(anchors), w.detach().requires_grad_()
                rows = _leaves(_padding_rows(run, theta, anchors))  # inputs of their own (.padding)
                g = run.gradient(t, theta, leaf_anchors, (xs, ys, w), size=idx.numel(), penalties=lead, graph=True,
                                 rows=rows, mixed=run.autocast is None)
                gradient_graph = _Graph({("gradient", n): v for n, v in g.items()},
                                        {("theta", n): v for n, v in theta.items()}
                                        | {("anchor", n): v for n, v in leaf_anchors.items()} | {"w": w}
                                        | {("row", n): v for n, v in rows.items()},
                                        batched=pull == BATCHED)
            else:
                def gradient(inputs):
                    th, an = {n: inputs["theta", n] for n in theta}, {n: inputs["anchor", n] for n in anchors}
                    g = run.gradient(t, th, an, (xs, ys, inputs["w"]), size=idx.numel(), penalties=lead,
                                     rows=_padding_rows(run, th, an),  # functions of θ, S̄ outside the inner grad
                                     mixed=run.autocast is None)
                    return {("gradient", n): v for n, v in g.items()}

                gradient_graph = _Pullback(gradient, {("theta", n): v for n, v in theta.items()}
                                           | {("anchor", n): v for n, v in anchors.items()} | {"w": w})
                g = {n: gradient_graph.outputs["gradient", n] for n in theta}
            # the step's values at the run's own precision; the graph's, and the update's linearization, in float32
            recorded = None if run.autocast is None else \
                run.gradient(t, _detached(theta), anchors, (xs, ys, w.detach()), size=idx.numel(), penalties=lead)
        else:
            g = {n: torch.zeros_like(v) for n, v in theta.items()}
            recorded = None if run.autocast is None else g
    with torch.no_grad():
        g = {n: _summed(v.detach()) for n, v in g.items()}
        theta, state = _detached(theta), {slot: _detached(s) for slot, s in state.items()}
        new_theta, new_state, pullback = run.update_vjp(t, theta, state, g)
        if recorded is not None:
            new_theta, new_state = run.update(t, theta, state, {n: _summed(v.detach()) for n, v in recorded.items()})
    return new_theta, new_state, (ids, _Update(pullback), gradient_graph)


def _padding_rows(run: StageRun, theta: dict, anchors: dict) -> dict:
    """The embeddings' padding rows of θ and the fixed block, fed to the step's gradient as inputs of their own
    ({} for a model without one)."""
    return {} if run.padding is None else run.padding.values(anchors | theta)


def _summed(tensor: torch.Tensor) -> torch.Tensor:
    """A dense copy of ``tensor`` summed over the ranks (a backward's output may be an expanded view)."""
    if not distributed.active():
        return tensor
    return distributed.all_reduce_(tensor.clone(memory_format=torch.contiguous_format))


def _reverse(k: int, run: StageRun, theta_bar, anchor_bar, q: int, stats: dict, progress: bool, journal: Journal,
             pull: str):
    """Reverse mode through one stage: (θ̄_0, S̄̄ accumulated, (n, q) scores of this rank's batch shares)."""
    anchors = run.anchors
    first = next(iter(theta_bar.values()))
    tokens = () if run.weights is None else tuple(run.weights.shape[1:])  # (L,) for per-token weights
    scores = torch.zeros(len(run.stage), *tokens, q, dtype=first.dtype, device=first.device)
    state_bar, pull = None, (LOOPED if q == 1 else None if pull == "auto" else pull)
    if pull is not None:
        stats["pulls"][k] = {"pull": pull, "trial": None}
    for a, b in tqdm(list(reversed(run.segments())), desc="metagradient", disable=not progress, leave=False):
        j = stats["segment"]
        stats["segment"] += 1
        if journal.done(j):  # finished by an earlier run: its terms from disk, and the adjoint after the last one
            ids, values = journal.terms(j)
            scores.index_add_(0, ids.to(scores.device), values.to(scores.device, scores.dtype))
            if j == journal.finished - 1:  # in the record's name order
                theta, state, anchor = journal.adjoint()
                theta_bar, anchor_bar = {n: theta[n] for n in theta_bar}, {n: anchor[n] for n in anchor_bar}
                slots = run.checkpoints[a][1]
                state_bar = {slot: {n: state[slot][n] for n in slots[slot]} for slot in slots}
            stats["reused"] += 1
            continue
        theta, state = run.checkpoints[a]
        if a == 0:
            theta = start(run, anchors)
        if state_bar is None:
            state_bar = {slot: {n: torch.zeros(q, *v.shape, dtype=v.dtype, device=v.device) for n, v in s.items()}
                         for slot, s in state.items()}
        if pull is None:
            pull, trial = _faster_pull(run, a, theta, state, anchors, theta_bar, state_bar)
            stats["pulls"][k] = {"pull": pull, "trial": trial}
        held, before = [], _resident_bytes()
        for t in range(a, b):  # forward through the segment, keeping each step's autograd graphs
            theta, state, graphs = _forward_step(run, t, theta, state, anchors, pull)
            held.append(graphs)
        replayed = (_detached(theta), {slot: _detached(s) for slot, s in state.items()})
        error = deviation(replayed, run.checkpoints[b])
        refuse_unreproduced(k, b, error, _tolerance(replayed) if distributed.active() else 0.0)
        stats["replay_error"] = max(stats["replay_error"], error)
        stats["segment_growth"] = max(stats["segment_growth"], _resident_bytes() - before)
        terms_ids, terms = [], []
        while held:
            ids, update, gradient_graph = held.pop()
            theta_bar, state_bar, gradient_bar = update.pull(theta_bar, state_bar)
            # through the gradient: H_t ḡ_t, the shared block's term and the batch's example terms (this rank's
            # share of the batch; an empty share adds 0 to the sums over the ranks)
            through = {} if gradient_graph is None else \
                gradient_graph.pull({("gradient", n): v for n, v in gradient_bar.items()})
            if through and not distributed.active():  # one process: nothing to sum over ranks
                theta_bar = dict(zip(theta_bar, torch._foreach_add(list(theta_bar.values()),
                                                                   [through["theta", n] for n in theta_bar])))
                if anchor_bar:
                    anchor_bar = dict(zip(anchor_bar, torch._foreach_add(list(anchor_bar.values()),
                                                                         [through["anchor", n] for n in anchor_bar])))
            else:
                for n in theta_bar:
                    theta_bar[n] = theta_bar[n] + _summed(through["theta", n] if through else
                                                          torch.zeros_like(theta_bar[n]))
                for n in anchor_bar:
                    anchor_bar[n] = anchor_bar[n] + _summed(through["anchor", n] if through else
                                                            torch.zeros_like(anchor_bar[n]))
            rows = {key[1]: _summed(v) for key, v in through.items() if isinstance(key, tuple) and key[0] == "row"}
            if rows:  # the padding rows' cotangents to their rows (.padding; the vmapped pull has them already)
                theta_bar, anchor_bar = run.padding.add(theta_bar, rows), run.padding.add(anchor_bar, rows)
            if through:
                w_grad = through["w"].movedim(0, -1).to(scores.dtype)  # (B, q), or (B, L, q) per token
                scores.index_add_(0, ids.to(scores.device), w_grad)
                terms_ids.append(ids)
                terms.append(w_grad)
        stats["adjoint_bytes"] = max(stats["adjoint_bytes"], tensor_bytes((theta_bar, state_bar, anchor_bar)))
        empty = torch.zeros(0, q, dtype=scores.dtype)
        journal.finish(j, torch.cat(terms_ids) if terms_ids else torch.zeros(0, dtype=torch.long),
                       torch.cat(terms) if terms else empty, theta_bar, state_bar, anchor_bar)
        stats["computed"] += 1
    return theta_bar, anchor_bar, scores


def _faster_pull(run: StageRun, a: int, theta, state, anchors, theta_bar, state_bar) -> tuple[str, dict]:
    """For q > 1 measure outputs: the fastest way to pull this stage's steps (:data:`VMAPPED`, :data:`BATCHED` or
    :data:`LOOPED`) and the trial — each way's seconds for step a (its forward and the pull of the current adjoints,
    from the step's checkpoint; the results are discarded), the faster of two rounds (the first pays each way's
    warm-up); a way stops once it has taken longer than the fastest so far, and a batched backward that an
    operation of the model cannot batch counts as infinitely slow. Rank 0's choice is every rank's."""
    seconds: dict[str, float] = {}
    for _ in range(2):
        for pull in (VMAPPED, BATCHED, LOOPED):
            if seconds.get(pull) == float("inf"):
                continue
            begin = time.perf_counter()
            deadline = begin + min(seconds.values()) if seconds else None
            failed = False
            try:
                _, _, (_, update, gradient_graph) = _forward_step(run, a, theta, state, anchors, pull)
                _, _, gradient_bar = update.pull(theta_bar, state_bar)
                if gradient_graph is not None:
                    gradient_graph.pull({("gradient", n): v for n, v in gradient_bar.items()}, deadline)
            except RuntimeError as error:
                if pull != BATCHED or isinstance(error, distributed.DistributedError):
                    raise
                failed = True
            if distributed.active():  # every rank drops the way if any rank could not batch it (same collectives)
                failed = bool(distributed.all_reduce_(torch.tensor([float(failed)])).item())
            if failed:
                seconds[pull] = float("inf")
                continue
            seconds[pull] = min(seconds.get(pull, float("inf")), time.perf_counter() - begin)
    return distributed.broadcast_object(min(seconds, key=seconds.get)), {"seconds": seconds}


def _tolerance(replayed) -> float:
    """How far a replay split over ranks may end from its checkpoint: √ε of the dtype times the state's largest
    magnitude (+1) — the ranks' summation order changes the last bits of every step's gradient; a loss that is not
    replay's moves the run by far more."""
    theta = replayed[0]
    first = next(iter(theta.values()))
    return torch.finfo(first.dtype).eps ** 0.5 * (1 + max(float(v.abs().max()) for v in theta.values() if v.numel()))


def _resident_bytes() -> int:
    """This process's resident memory (Linux ``/proc/self/statm``; 0 where unavailable)."""
    try:
        with open("/proc/self/statm") as handle:
            return int(handle.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0

