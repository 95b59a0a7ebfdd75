"""bench_transformer: BERT-base-size and GPT-2-small-size influence within a memory budget (issue 18), vs kronfluence.

Models from configs with random weights (cost, not fidelity), float32: ``BertForMaskedLM`` (hidden 768, 12 layers,
12 heads, vocabulary 30,522: 110 M parameters) and ``GPT2LMHeadModel`` (n_embd 768, 12 layers, vocabulary 50,257:
124 M; influkit takes its ``Conv1D`` layers as they are (registered by :mod:`influkit.hf`, full EK-FAC blocks);
kronfluence 1.0.1 tracks ``nn.Linear``/``nn.Conv2d`` only, so its copy has them replaced by the equivalent
``nn.Linear``). Data: random token ids, ``--sequences`` × ``--length``
(the issue asks ≥ 512 × 128; on this machine's 2 shared cores that is hours per configuration, so the committed run
is the full-size 12-layer models on fewer sequences — the reduction is printed with the table). Loss: the
token-summed cross-entropy per sequence (masked positions for BERT, next tokens for GPT-2, labels shifted in the
data), the same for both libraries.

Jobs, each in its own subprocess so peak RSS (``ru_maxrss``) is the job's own:

- ``influkit-ekfac`` single stage over the 72 encoder ``nn.Linear`` / GPT-2 ``Conv1D`` modules (the modules both
  libraries track;
  embeddings, LayerNorms and the tied 30k/50k-vocabulary decoder left out for both): ``SolveConfig(solver="ekfac")``
  with λ = 0.1 × the mean EK-FAC eigenvalue (kronfluence's heuristic scale, given to kronfluence as an absolute
  damping), the summed test loss of ``--test`` sequences, every training sequence scored by contraction with
  default settings (memory budget and chunk sizes from :mod:`influkit.memory`). Also: the same scores with
  ``autocast=torch.bfloat16`` (Pearson and relative error vs float32), and one batched forward + backward of a
  scoring chunk (the scoring-cost target). Its fit includes where the stage stands (:mod:`influkit.stationarity`,
  seconds and verdict reported); ``--fit-cache FILE`` saves the fit (or loads it, to time query and scoring again).
- ``influkit-minres``: the same stage, ``solver="minres"`` for ``--iterations`` steps on ``--hessian-samples``
  sequences; seconds per Hessian-vector product, and one HVP vs one gradient of the same batch.
- ``kronfluence``: kronfluence 1.0.1 EK-FAC on the same modules (GPT-2's Conv1D as ``nn.Linear``), data, λ and
  sampled labels (influkit's ``fisher="sampled"`` labels, given to kronfluence's task for its sampled passes), its
  scores negated.
- ``case1``: a Case 1 chain, the masked/causal-LM pretraining stage over all parameters (the tied decoder
  included: its Kronecker factors would be vocabulary² floats, so the memory policy gives it a diagonal block) →
  a classification head (``BertForSequenceClassification``/``GPT2ForSequenceClassification`` sharing the
  encoder, head trained), EK-FAC on stage 1, every pretraining sequence scored.
- ``case1-recorded`` / ``case1-unrolled`` (issue 26): the same Case 1 chain *trained and recorded*
  (``ik.unrolled.Record``: ``--unrolled-steps`` steps of SGD + momentum 0.9 with a decaying learning rate on
  mini-batches of ``--pretrain-batch`` (default half the) pretraining sequences, then as many on the head — a
  schedule to unroll, not a trained model), then in one subprocess each: the plain EK-FAC Case 1 query on the
  recorded final models (fit, query, scores: what ``case1`` times), and the approximate unrolling (``ik.unrolled.approximate``, ``--segments``
  pieces per stage, EK-FAC with ``basis="shared"``: one eigenbasis per stage fitted at its end, the eigenvalues
  re-estimated at each other piece's end — one full fit plus one streamed pass per further piece, instead of a fit
  per piece). Both with default memory budgets; seconds and peak RSS per job, and the Pearson correlation of the
  two score vectors (they estimate different things: the run as it went vs the optimum it did not reach).
  ``--unrolled-basis each`` fits EK-FAC per piece (SOURCE as published; the validation on a small model).
  ``--top`` is ``approximate``'s (default "auto": up to 20 Hessian eigenpairs per stage of ≤ 1 M trained parameters
  where ARPACK's workspace fits half the budget; ``--top 0`` is plain EK-FAC pieces), ``--top-curvature`` its
  ``top_curvature`` (``gauss-newton``: the Gauss-Newton matrix's); the summary says how many each stage took.
- ``case1-both``: both in one subprocess, the approximate unrolling taking the plain query's fitted stage-1
  EK-FAC (fitted at the same final parameters) as its last piece's curvature and shared eigenbasis
  (``basis=[curvature, None]``): the unrolling's marginal cost over the plain query, and the peak RSS after the
  plain query and after the unrolling (the chain and its query released in between). ``--memory`` sets the plain
  chain's budget (its default is a share of the memory free at the time, which a crowded machine shrinks below one
  Hessian-vector product's example); the unrolling keeps its default.

The ``case1-*`` jobs also record resident memory **by phase** (:class:`PhaseSampler`: a thread of the worker reads
RSS every 10 ms and which library functions the main thread is in — record, the plain query's stationarity check,
factor passes, query and scores, the unrolling's replay, piece fits, piece maps, shared-block adjoints and example
terms): each phase's RSS at entry, its peak and its working memory (peak − entry), beside the smallest budget the
memory plans of that phase reported; the table ends with the phases whose working memory exceeded their budget.

Run (kronfluence lives in /work/bench-venv): ``PYTHONPATH=. /work/bench-venv/bin/python
benchmarks/bench_transformer.py --sequences 16 --length 128`` (``--layers 2 --hidden 128`` for a quick check).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from torch import nn

from benchmarks.manifest import record
from benchmarks.resident import rss_now

RESULTS = Path(__file__).resolve().parent / "results" / "bench_transformer"
JOBS = ("influkit-ekfac", "influkit-minres", "kronfluence", "case1", "case1-recorded", "case1-unrolled", "case1-both")
IGNORE = -100


# ------------------------------------------------------------------------------------------------ models, data
def token_summed_losses(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """(B,) Σ_t −log softmax(logits_t)[labels_t] over the positions with a label (−100: none)."""
    logp = torch.log_softmax(logits.float() if logits.dtype in (torch.bfloat16, torch.float16) else logits, dim=-1)
    keep = labels != IGNORE
    picked = logp.gather(-1, labels.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return -(picked * keep.to(picked.dtype)).sum(1)


def classification_losses(logits, labels):
    return nn.functional.cross_entropy(logits, labels, reduction="none")


def linear_swapped(model: nn.Module) -> nn.Module:
    """For kronfluence (which tracks nn.Linear, not transformers' Conv1D): GPT-2's Conv1D (y = x W + b, W: in × out)
    replaced in place by the equivalent nn.Linear (weight Wᵀ)."""
    from transformers.pytorch_utils import Conv1D

    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, Conv1D):
                lin = nn.Linear(child.weight.shape[0], child.weight.shape[1])
                with torch.no_grad():
                    lin.weight.copy_(child.weight.T)
                    lin.bias.copy_(child.bias)
                setattr(module, child_name, lin)
    return model


def config_of(name: str, layers: int, hidden: int, length: int):
    import transformers

    heads = max(1, hidden // 64)
    if name == "bert":
        return transformers.BertConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                                       intermediate_size=4 * hidden, vocab_size=30522, max_position_embeddings=max(length, 512),
                                       num_labels=2)
    return transformers.GPT2Config(n_embd=hidden, n_layer=layers, n_head=heads, vocab_size=50257,
                                   n_positions=max(length, 1024), num_labels=2, pad_token_id=0)


def lm_model(name: str, config) -> nn.Module:
    import transformers

    torch.manual_seed(0)
    if name == "bert":
        return transformers.BertForMaskedLM(config).eval()
    return transformers.GPT2LMHeadModel(config).eval()


def classifier_model(name: str, config, pretrained: nn.Module) -> nn.Module:
    """The finetuning model: the pretrained encoder (shared, fixed in Case 1) and a new classification head."""
    import transformers

    torch.manual_seed(1)
    model = (transformers.BertForSequenceClassification(config) if name == "bert"
             else transformers.GPT2ForSequenceClassification(config)).eval()
    state = pretrained.state_dict()
    own = model.state_dict()
    model.load_state_dict({k: state.get(k, v) for k, v in own.items()})
    return model


def lm_data(name: str, n: int, length: int, seed: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed (input_ids, attention_mask) inputs (n, 2, length) and token labels: BERT 15% masked positions,
    GPT-2 the next token (shifted here, so the loss is a plain token sum whose sampled Fisher influkit recognises)."""
    from influkit import hf

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1000, vocab, (n, length), generator=gen)
    mask = torch.ones_like(ids)
    if name == "bert":
        ids[:, 0], ids[:, -1] = 101, 102
        batch = hf.masked_lm_batch({"input_ids": ids, "attention_mask": mask}, indices=torch.arange(n) + seed * 10**6,
                                   mask_token_id=103, vocab_size=vocab, special_token_ids=(0, 100, 101, 102, 103))
        return hf.pack(batch)
    labels = torch.cat([ids[:, 1:], torch.full((n, 1), IGNORE)], dim=1)
    return hf.pack({"input_ids": ids, "attention_mask": mask, "labels": labels})


def tracked_linears(model: nn.Module) -> list[str]:
    """The encoder's linear modules (attention, MLP; nn.Linear or GPT-2's Conv1D): what both libraries track; no
    decoder, no classifier."""
    from transformers.pytorch_utils import Conv1D

    return [n for n, m in model.named_modules()
            if isinstance(m, (nn.Linear, Conv1D)) and (".layer." in n or ".h." in n)]


# ------------------------------------------------------------------------------------------------ measurement
def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# Phases of the case1-* jobs, named by the functions on the main thread's stack (code qualname → label); a phase is
# the path of the named functions it runs in, e.g. "unrolled › piece fit › statistics pass".
PHASES = {
    "recorded_case1": "record", "plain_case1_query": "plain", "approximate": "unrolled",
    "assess": "stationarity check", "Chain._prepare": "prepare solver", "Chain.query": "query", "Query.scores": "scores",
    "FactorFit.__init__": "factor probe", "FactorFit.statistics_pass": "statistics pass",
    "FactorFit.eigendecomposition": "eigendecomposition", "FactorFit.correction_pass": "correction pass",
    "FactorFit.eigenvalues_in_kept_basis": "eigenvalues in kept basis", "FactorFit.assemble": "assemble",
    "measure_adjoint": "measure adjoint", "_stage": "stage", "_parameters_at": "replay to piece ends",
    "_fit": "piece fit", "_factored_piece": "piece map", "_anchor_adjoint": "shared-block adjoint",
    "hand_over": "hand over", "Terms.compute": "example terms",
}


class PhaseSampler:
    """Resident memory per phase: a thread reads RSS every ``every`` s and which :data:`PHASES` functions the main
    thread is in; each phase entry gets its RSS at entry (first sample), its peak and seconds. Working memory of a
    phase = peak − RSS at its entry (what it added to what the process already held)."""

    def __init__(self, every: float = 0.01):
        import threading

        self.every, self.entries, self.key = every, [], None
        self.main = threading.main_thread().ident
        self.t0 = time.perf_counter()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _where(self):
        frame, path = sys._current_frames().get(self.main), []
        while frame is not None:
            label = PHASES.get(frame.f_code.co_qualname)
            if label is not None:
                path.append((id(frame), label))
            frame = frame.f_back
        return tuple(path[::-1])

    def _run(self):
        while not self._stop.is_set():
            where, rss, now = self._where(), rss_now(), time.perf_counter() - self.t0
            key = tuple(i for i, _ in where)
            if key != self.key:
                self.key = key
                self.entries.append({"phase": " › ".join(label for _, label in where) or "(job)", "start_s": now,
                                     "rss_start": rss, "peak": rss, "end_s": now})
            entry = self.entries[-1]
            entry["peak"], entry["end_s"] = max(entry["peak"], rss), now
            self._stop.wait(self.every)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def table(self, least_s: float = 0.05) -> list[dict]:
        """The entries (those of ≥ least_s seconds, or whose working memory is ≥ 10 MB): phase, seconds, RSS at
        entry, peak, working = peak − entry, in bytes."""
        rows = []
        for e in self.entries:
            work = e["peak"] - e["rss_start"]
            if e["end_s"] - e["start_s"] >= least_s or work >= 10**7:
                rows.append({"phase": e["phase"], "start_s": round(e["start_s"], 2),
                             "seconds": round(e["end_s"] - e["start_s"], 2), "rss_start": e["rss_start"],
                             "peak": e["peak"], "working": work})
        return rows


PLANNED = {"stationarity check": "stationarity check", "factor probe": "factor fitting",
           "statistics pass": "factor fitting", "correction pass": "factor fitting",
           "eigenvalues in kept basis": "factor fitting", "scores": "scoring", "example terms": "scoring",
           "shared-block adjoint": "shared block's adjoint"}  # a sampled phase → the memory plan that sizes it


def phase_plans(result: dict) -> dict[str, list[dict]]:
    """The memory plans a case1-* job reported, by the part of the job they belong to ("plain", "unrolled"), in the
    order their phases ran: the unrolling's per stage last to first (its reverse pass), then its example terms."""
    def unrolled(stages):
        stages = stages or []
        return [p for plans in stages[::-1] for p in plans if p["phase"] != "scoring"] + \
            [p for plans in stages for p in plans if p["phase"] == "scoring"]

    if result["job"] == "case1-both":
        return {"plain": list(result.get("plain_memory") or []), "unrolled": unrolled(result.get("unrolled_memory"))}
    if result["job"] == "case1-recorded":
        return {"plain": list(result.get("memory") or [])}
    return {"unrolled": unrolled(result.get("memory"))}


def phase_table(result: dict) -> str:
    """The sampled phases as a text table (MB), each beside the budget of the memory plan that sized it (plans
    matched in order per kind: a factor fit starts at its probe, another phase at a change of phase), and the phases
    whose working memory exceeded it."""
    queues = {part: {} for part in ("plain", "unrolled")}
    for part, plans in phase_plans(result).items():
        for plan in plans:
            queues[part].setdefault(plan["phase"], []).append(plan)
    rows, over, current, previous = [], [], {}, None
    for r in result["phases"]:
        part, last = r["phase"].split(" › ")[0], r["phase"].split(" › ")[-1]
        kind = PLANNED.get(last)
        starts = (last == "factor probe" or (part, kind) not in current) if kind == "factor fitting" else \
            r["phase"] != previous
        if kind is not None and starts:
            pending = queues.get(part, {}).get(kind, [])
            current[part, kind] = pending.pop(0) if pending else None
        previous = r["phase"]
        plan = current.get((part, kind)) if kind is not None else None
        budget = plan["budget"] if plan else None
        rows.append({"phase": r["phase"], "at s": r["start_s"], "s": r["seconds"], "RSS at entry MB": r["rss_start"] / 1e6,
                     "peak MB": r["peak"] / 1e6, "working MB": r["working"] / 1e6,
                     "budget MB": budget / 1e6 if budget else float("nan")})
        if budget is not None and r["working"] > budget:
            over.append(r["phase"])
    table = pd.DataFrame(rows).to_string(index=False, na_rep="-",
                                         float_format=lambda v: f"{v:.0f}" if abs(v) >= 10 else f"{v:.2f}")
    return table + f"\nphases whose working memory (peak − RSS at entry) exceeded their budget: {over or 'none'}"


def pearson(a, b) -> float:
    return float(np.corrcoef(np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64))[0, 1])


def rel_err(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def sampled_labels(stage) -> torch.Tensor:
    """influkit's ``fisher="sampled"`` labels ŷ_it (seed 0) for every training sequence and position (−100 where
    no loss): u = softmax(f) − onehot(ŷ), so ŷ = argmin u. Given to kronfluence so both fit the same Fisher sample."""
    from influkit.factored.fisher import PseudoGradients

    out = []
    pseudo = None
    for start in range(0, len(stage), 4):
        idx = torch.arange(start, min(start + 4, len(stage)))
        x, y = stage.data.take(idx)
        with torch.no_grad():
            f = stage.model(x)
        pseudo = pseudo or PseudoGradients(stage.loss, "sampled", f, y, seed=0)
        u = pseudo(f, y, index=idx)[0]
        out.append(torch.where(y != IGNORE, u.argmin(-1), torch.full_like(y, IGNORE)))
    return torch.cat(out)


# ------------------------------------------------------------------------------------------------ jobs
def single_stage(args):
    import influkit as ik
    from influkit import hf

    config = config_of(args.model, args.layers, args.hidden, args.length)
    model = lm_model(args.model, config)
    wrapped = hf.HFModel(model)
    x, y = lm_data(args.model, args.sequences, args.length, 0, config.vocab_size)
    names = [f"{m}.{p}" for m in tracked_linears(wrapped) for p in ("weight", "bias")]
    stage = ik.Stage(wrapped, token_summed_losses, (x, y), params=names)
    test = lm_data(args.model, args.test, args.length, 1, config.vocab_size)
    return stage, test


def job_influkit_ekfac(args, out: dict, work: Path):
    import influkit as ik

    stage, test = single_stage(args)
    out["parameters"] = sum(p.numel() for p in stage.model.parameters())
    out["trained"] = stage.num_trained
    out["rss_model"] = rss_now()
    chain = ik.Chain([stage], solve=ik.SolveConfig(solver="ekfac", residual=args.residual), memory=args.memory)
    cache = Path(args.fit_cache) if args.fit_cache else None
    if cache is not None and cache.exists():  # an earlier run's fit (its seconds): query and scoring measured again
        chain.load(cache)
        fit_cpu_s = json.loads(cache.with_suffix(".json").read_text())["fit_cpu_s"]
        out["fit_cached"] = str(cache)
    else:
        c0 = time.process_time()
        chain.fit()
        fit_cpu_s = time.process_time() - c0
    fitted = chain
    curvature = chain.curvature(0).approximations["ekfac"]
    damping = 0.1 * curvature.mean_eigenvalue()
    fit_s = chain.fit_seconds
    chain = chain.with_solve(replace(chain.solve_configs[0], damping=damping))  # the fitted factors kept, λ set
    t0, c0 = time.perf_counter(), time.process_time()
    query = chain.query(test)
    query_s, query_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    t0, c0 = time.perf_counter(), time.process_time()
    res = query.scores()
    score_s, score_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    chunk = res.diagnostics["chunks"]["chunk_size"]
    out.update(damping=damping, fit_s=fit_s, fit_cpu_s=fit_cpu_s, stationarity=chain.positions[0].summary(),
               query_s=query_s, score_s=score_s, query_cpu_s=query_cpu_s,
               score_cpu_s=score_cpu_s,
               scored_per_s=len(stage) / score_s, chunk=chunk, memory=res.diagnostics["memory"],
               scoring=res.diagnostics["scoring"], factor_memory=curvature.info["memory"],
               fit_detail=curvature.info["seconds"],
               kronecker_blocks={kind: sum(layer["kind"] == kind for layer in curvature.info["layers"])
                                 for kind in sorted({layer["kind"] for layer in curvature.info["layers"]})})
    out["peak_rss"] = peak_rss()
    np.save(work / f"influkit_ekfac{args.tag}.npy", res.values.numpy())
    # the scoring-cost reference: one batched forward + backward of a chunk of the same size
    x, y = stage.data.take(torch.arange(min(chunk, len(stage))))
    leaves = [p for n, p in stage.model.named_parameters() if n in stage.param_names]
    t0 = time.perf_counter()
    torch.autograd.grad(stage.loss(stage.model(x), y).sum(), leaves)
    out["fwd_bwd_per_example_s"] = (time.perf_counter() - t0) / x.shape[0]
    # mixed precision: the same scores with bfloat16 passes
    t0 = time.perf_counter()
    half = query.scores(autocast=torch.bfloat16)
    out["bf16_score_s"] = time.perf_counter() - t0
    out["bf16_pearson"] = pearson(half.values, res.values)
    out["bf16_rel_err"] = rel_err(half.values, res.values)
    if not args.tag:
        torch.save({"labels": sampled_labels(stage)}, work / "labels.pt")
    if cache is not None and "fit_cached" not in out:  # last: writing it counts in no timing and no peak
        fitted.save(cache)
        cache.with_suffix(".json").write_text(json.dumps({"fit_cpu_s": fit_cpu_s}))


def job_influkit_minres(args, out: dict, work: Path):
    import influkit as ik
    from influkit.curvature import HessianOperator, gradient

    stage, test = single_stage(args)
    damping = json.loads((work / "influkit-ekfac.json").read_text())["damping"]
    config = ik.SolveConfig(solver="minres", max_iter=args.iterations, damping=damping)
    chain = ik.Chain([stage], solve=config, curvature=ik.CurvatureConfig(hessian_samples=args.hessian_samples))
    chain.fit()
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        query = chain.query(test)
    query_s = time.perf_counter() - t0
    sol = query.solves[0]
    t0 = time.perf_counter()
    res = query.scores()
    score_s = time.perf_counter() - t0
    op = chain.operator(0)
    out.update(damping=damping, fit_s=chain.fit_seconds, query_s=query_s, solve_s=sol["seconds"],
               hvps=op.products, hvp_s=sol["seconds"] / max(op.products, 1), score_s=score_s,
               scored_per_s=len(stage) / score_s, hvp_memory=op.memory)
    np.save(work / "influkit_minres.npy", res.values.numpy())
    # one HVP vs one gradient of the same batch (the Hessian sample)
    batch = HessianOperator(stage, samples=args.hessian_samples, memory=chain.memory)
    v = torch.randn(batch.dim)
    batch.matvec(v)  # builds the cached graph (or not): the product itself is timed next
    t0 = time.perf_counter()
    batch.matvec(v)
    out["one_hvp_s"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    gradient(stage, stage.param_names, indices=batch.indices)
    out["one_gradient_s"] = time.perf_counter() - t0
    out["hvp_batch"] = args.hessian_samples
    out["peak_rss"] = peak_rss()


def kronfluence_lm_task(modules: list[str]):
    """kronfluence's Task for the token-summed masked-LM loss: batches (inputs, targets, sampled labels) for the
    factors (the sampled labels when kronfluence asks for sampled Fisher), (inputs, targets) for the measurement."""
    from kronfluence.task import Task

    class LM(Task):
        def compute_train_loss(self, batch, model, sample=False):
            inputs, targets, sampled = batch
            return token_summed_losses(model(inputs), sampled if sample else targets).sum()

        def compute_measurement(self, batch, model):
            inputs, targets = batch
            return token_summed_losses(model(inputs), targets).sum()

        def get_influence_tracked_modules(self):
            return modules

    return LM()


def job_kronfluence(args, out: dict, work: Path):
    import kronfluence
    from kronfluence.analyzer import Analyzer, prepare_model
    from kronfluence.arguments import FactorArguments, ScoreArguments
    from torch.utils.data import TensorDataset

    stage, test = single_stage(args)
    model = linear_swapped(stage.model)
    damping = json.loads((work / "influkit-ekfac.json").read_text())["damping"]
    labels = torch.load(work / "labels.pt")["labels"]
    x, y = stage.data.take(torch.arange(len(stage)))
    modules = tracked_linears(model)

    task = kronfluence_lm_task(modules)
    out["rss_model"] = rss_now()
    start = time.perf_counter()
    model = prepare_model(model, task)
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        analyzer = Analyzer("bench_transformer", model=model, task=task, cpu=True, disable_tqdm=True, output_dir=tmp)
        analyzer.fit_all_factors("ekfac", dataset=TensorDataset(x, y, labels), per_device_batch_size=args.kron_batch,
                                 factor_args=FactorArguments(strategy="ekfac"), overwrite_output_dir=True)
        fit_s = time.perf_counter() - start
        t0, c0 = time.perf_counter(), time.process_time()
        analyzer.compute_pairwise_scores(
            "scores", "ekfac", query_dataset=TensorDataset(*test), train_dataset=TensorDataset(x, y, labels),
            per_device_query_batch_size=args.test, per_device_train_batch_size=args.kron_batch,
            score_args=ScoreArguments(damping_factor=damping, aggregate_query_gradients=True), overwrite_output_dir=True)
        score_s, score_cpu_s = time.perf_counter() - t0, time.process_time() - c0
        scores = analyzer.load_pairwise_scores("scores")["all_modules"]
    values = -scores.reshape(-1).double()
    np.save(work / f"kronfluence{args.tag}.npy", values.numpy())
    out.update(version=kronfluence.__version__, damping=damping, fit_s=fit_s, query_and_score_s=score_s,
               score_s=score_s, score_cpu_s=score_cpu_s, scored_per_s=len(stage) / score_s, peak_rss=peak_rss(),
               batch=args.kron_batch)


def job_case1(args, out: dict, work: Path):
    import influkit as ik
    from influkit import hf

    config = config_of(args.model, args.layers, args.hidden, args.length)
    model = lm_model(args.model, config)
    x, y = lm_data(args.model, args.sequences, args.length, 0, config.vocab_size)
    pre = ik.Stage(hf.HFModel(model), token_summed_losses, (x, y))
    fin_model = hf.HFModel(classifier_model(args.model, config, model))
    tx, _ = lm_data(args.model, 3 * args.test, args.length, 2, config.vocab_size)
    ty = torch.arange(tx.shape[0]) % 2
    head = "classifier" if args.model == "bert" else "score"
    fin = ik.Stage(fin_model, classification_losses, (tx, ty), params=head)
    shared = "bert" if args.model == "bert" else "transformer"
    out["parameters"] = sum(p.numel() for p in model.parameters())
    out["rss_model"] = rss_now()
    plain = plain_case1_query(pre, fin, shared, args)
    curvature = plain["curvature"]
    out.update(fit_s=plain["fit_s"], query_s=plain["query_s"], score_s=plain["score_s"],
               scored_per_s=len(pre) / plain["score_s"], warnings=plain["warnings"], chunk=plain["chunk"],
               scoring=plain["scoring"], memory=plain["memory"], diagonal=sorted(curvature.info["diagonal"]),
               diagonal_layers=curvature.info["memory"]["diagonal_layers"], peak_rss=peak_rss())


def recorded_case1(args, out: dict):
    """The Case 1 chain (masked-LM pretraining over all parameters → classification head on the fixed encoder)
    trained and recorded: ``--unrolled-steps`` SGD + momentum steps per stage, decaying learning rates."""
    import influkit as ik
    from influkit import hf
    from influkit.unrolled import SGD, Record

    config = config_of(args.model, args.layers, args.hidden, args.length)
    model = lm_model(args.model, config)
    x, y = lm_data(args.model, args.sequences, args.length, 0, config.vocab_size)
    pre = ik.Stage(hf.HFModel(model), token_summed_losses, (x, y))
    out["parameters"] = sum(p.numel() for p in model.parameters())
    out["rss_model"] = rss_now()
    steps = args.unrolled_steps
    record = Record()
    t0 = time.perf_counter()
    batch = args.pretrain_batch or max(1, args.sequences // 2)
    record.train(pre, SGD(lr=1e-4, momentum=0.9), steps=steps, batch_size=batch,
                 schedule=lambda t: 1e-4 * (1 - 0.5 * t / steps), checkpoint_every=steps)
    fin_model = hf.HFModel(classifier_model(args.model, config, model))  # the encoder as pretraining left it
    tx, _ = lm_data(args.model, 3 * args.test, args.length, 2, config.vocab_size)
    ty = torch.arange(tx.shape[0]) % 2
    fin = ik.Stage(fin_model, classification_losses, (tx, ty), params="classifier" if args.model == "bert" else "score")
    shared = "bert" if args.model == "bert" else "transformer"
    record.train(fin, SGD(lr=0.1, momentum=0.9), steps=steps, batch_size=tx.shape[0],
                 schedule=lambda t: 0.1 * (1 - 0.5 * t / steps), link=ik.Link(shared, case=1), checkpoint_every=steps)
    out["record_s"] = time.perf_counter() - t0
    out["recorded"] = {"steps": [run.steps for run in record.runs], "optimizer": [repr(run.optimizer) for run in record.runs],
                       "batch": [len(run.batches[0]) for run in record.runs],
                       "checkpoint_bytes": sum(run.checkpoint_bytes() for run in record.runs)}
    return record, pre, fin, shared


def plain_case1_query(pre, fin, shared: str, args, memory=None) -> dict:
    """The plain EK-FAC Case 1 query (fit, query, scores) on the stages' current models: seconds, scores, the
    stage-1 EK-FAC, the memory plans, the scoring chunk and record, the fit's warnings."""
    import influkit as ik

    chain = ik.Chain([pre, fin], [ik.Link(shared, case=1)], memory=memory,
                     solve=[ik.SolveConfig(solver="ekfac"), ik.SolveConfig(solver="direct", damping=1e-3)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        chain.fit()
    curvature = chain.curvature(0).approximations["ekfac"]
    fit_s = chain.fit_seconds
    chain = chain.with_solve([replace(chain.solve_configs[0], damping=0.1 * curvature.mean_eigenvalue()),
                              chain.solve_configs[1]])  # the fitted factors kept, λ set
    t0 = time.perf_counter()
    query = chain.query(torch.arange(args.test))
    query_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    res = query.scores()
    score_s = time.perf_counter() - t0
    return {"fit_s": fit_s, "query_s": query_s, "score_s": score_s, "values": res.values.numpy(),
            "curvature": curvature, "memory": res.diagnostics["memory"], "chunk": res.diagnostics["chunks"]["chunk_size"],
            "scoring": res.diagnostics["scoring"], "warnings": sorted({str(w.message)[:160] for w in caught})}


def job_case1_recorded(args, out: dict, work: Path):
    """The plain EK-FAC Case 1 query (fit, query, scores with defaults) on the recorded chain's final models."""
    _, pre, fin, shared = recorded_case1(args, out)
    plain = plain_case1_query(pre, fin, shared, args, memory=args.memory)
    np.save(work / "case1_recorded.npy", plain["values"])
    out.update(fit_s=plain["fit_s"], query_s=plain["query_s"], score_s=plain["score_s"],
               total_s=plain["fit_s"] + plain["query_s"] + plain["score_s"], scored_per_s=len(pre) / plain["score_s"],
               memory=plain["memory"], peak_rss=peak_rss())


def job_case1_unrolled(args, out: dict, work: Path):
    """The approximate unrolling of the recorded chain (EK-FAC pieces, ``--unrolled-basis``), default budgets."""
    import influkit as ik

    record, _, fin, _ = recorded_case1(args, out)
    tx, ty = fin.data.take(torch.arange(args.test))
    t0 = time.perf_counter()
    results = ik.unrolled.approximate(record, (tx, ty), segments=args.segments, curvature="ekfac",
                                      basis=args.unrolled_basis, memory=args.memory, top=args.top,
                                      top_curvature=args.top_curvature)
    total_s = time.perf_counter() - t0
    tag = "" if args.unrolled_basis == "shared" else f"_{args.unrolled_basis}"
    np.save(work / f"case1_unrolled{tag}.npy", results[0].values.numpy())
    out.update(total_s=total_s, basis=args.unrolled_basis, segments=args.segments,
               pieces_s=results[0].diagnostics["seconds"]["approximate (pieces)"],
               score_s=sum(r.diagnostics["seconds"]["example terms"] for r in results),
               top=[r.diagnostics["top"] for r in results],
               memory=[r.diagnostics["memory"] for r in results], peak_rss=peak_rss())


def job_case1_both(args, out: dict, work: Path):
    """The plain EK-FAC Case 1 query, then the approximate unrolling reusing its stage-1 EK-FAC as the shared basis."""
    import gc

    import influkit as ik

    record, pre, fin, shared = recorded_case1(args, out)
    t0 = time.perf_counter()
    plain = plain_case1_query(pre, fin, shared, args, memory=args.memory)
    np.save(work / "case1_both_plain.npy", plain["values"])
    out.update(plain_fit_s=plain["fit_s"], plain_query_s=plain["query_s"], plain_score_s=plain["score_s"],
               plain_s=time.perf_counter() - t0, plain_memory=plain["memory"], peak_rss_plain=peak_rss())
    curvature = plain.pop("curvature")
    out["ekfac_fit_s"] = curvature.info["seconds"]  # the stage-1 EK-FAC alone (the chain's fit also places each stage)
    del plain
    gc.collect()
    out["rss_between"] = rss_now()
    tx, ty = fin.data.take(torch.arange(args.test))
    t0 = time.perf_counter()
    results = ik.unrolled.approximate(record, (tx, ty), segments=args.segments, curvature="ekfac",
                                      basis=[curvature, None], top=args.top, top_curvature=args.top_curvature)
    out["unrolled_marginal_s"] = time.perf_counter() - t0
    np.save(work / "case1_both_unrolled.npy", results[0].values.numpy())
    out.update(unrolled_pieces_s=results[0].diagnostics["seconds"]["approximate (pieces)"],
               unrolled_score_s=sum(r.diagnostics["seconds"]["example terms"] for r in results),
               unrolled_top=[r.diagnostics["top"] for r in results],
               unrolled_memory=[r.diagnostics["memory"] for r in results], segments=args.segments,
               unrolled_s=out["unrolled_marginal_s"] + out["ekfac_fit_s"]["total"], peak_rss=peak_rss())


def worker(args) -> None:
    torch.set_num_threads(1)
    work = Path(args.work)
    out = {"job": args.worker, "model": args.model, "start_rss": rss_now(),
           "load_start": " ".join(Path("/proc/loadavg").read_text().split()[:3])}
    t0 = time.perf_counter()
    sampled = args.worker.startswith("case1-")
    with PhaseSampler() if sampled else contextlib.nullcontext() as sampler:
        {"influkit-ekfac": job_influkit_ekfac, "influkit-minres": job_influkit_minres, "kronfluence": job_kronfluence,
         "case1": job_case1, "case1-recorded": job_case1_recorded, "case1-unrolled": job_case1_unrolled,
         "case1-both": job_case1_both}[args.worker](
            args, out, work)
    out["wall_s"] = time.perf_counter() - t0
    if sampled:
        out["phases"] = sampler.table()
    (work / f"{args.worker}{args.tag}.json").write_text(json.dumps(out, indent=1, default=str))


# ------------------------------------------------------------------------------------------------ main
def machine() -> str:
    cpu = "cpu"
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    load = Path("/proc/loadavg").read_text().split()[:3]
    return (f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC | {cpu} | {os.cpu_count()} cores, "
            f"load {' '.join(load)} | python {platform.python_version()} | torch {torch.__version__} | 1 torch thread")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="bert,gpt2")
    parser.add_argument("--jobs", default=",".join(JOBS))
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--test", type=int, default=4)
    parser.add_argument("--iterations", type=int, default=3, help="MINRES steps")
    parser.add_argument("--hessian-samples", type=int, default=4)
    parser.add_argument("--kron-batch", type=int, default=4)
    parser.add_argument("--name", default="bench_transformer")
    parser.add_argument("--work", default=None)
    parser.add_argument("--reuse", action="store_true", help="take jobs whose result is in --work from there")
    parser.add_argument("--memory", type=float, default=None,
                        help="memory= bytes of influkit-ekfac, case1-both's plain chain and case1-unrolled (default None)")
    parser.add_argument("--tag", default="", help="suffix of a worker's result files (a second setting of a job)")
    parser.add_argument("--fit-cache", default=None,
                        help="influkit-ekfac: a file its fit is saved to, or loaded from when present (fit seconds then "
                             "the saving run's; query and scoring measured again)")
    parser.add_argument("--residual", action="store_true",
                        help="influkit-ekfac with SolveConfig(residual=True): one exact HVP checks the EK-FAC solve")
    parser.add_argument("--unrolled-steps", type=int, default=4, help="recorded SGD steps per stage (case1-*)")
    parser.add_argument("--pretrain-batch", type=int, default=None,
                        help="case1-*: sequences per recorded pretraining step (default half of --sequences)")
    parser.add_argument("--segments", type=int, default=2, help="pieces per stage of case1-unrolled")
    parser.add_argument("--unrolled-basis", default="shared", choices=("shared", "each"),
                        help="case1-unrolled: one EK-FAC eigenbasis per stage, or a fit per piece")
    parser.add_argument("--top", default="auto", type=lambda v: v if v == "auto" else int(v),
                        help="case1-unrolled, case1-both: approximate(top=): eigenpairs per stage")
    parser.add_argument("--top-curvature", default="hessian", choices=("hessian", "gauss-newton"),
                        help="case1-unrolled, case1-both: approximate(top_curvature=): whose eigenpairs")
    parser.add_argument("--model", default="bert")
    parser.add_argument("--worker", default=None)
    args = parser.parse_args(argv)
    if args.worker:
        return worker(args)
    work = Path(args.work or tempfile.mkdtemp(prefix="bench_transformer_"))
    log = io.StringIO()

    def say(*parts):
        text = " ".join(str(p) for p in parts)
        print(text, flush=True)
        log.write(text + "\n")

    say(f"# bench_transformer — {machine()}")
    say(f"{args.layers} layers, hidden {args.hidden}, {args.sequences} training sequences × {args.length} tokens, "
        f"{args.test} test sequences (the issue's 512 × 128 reduced to {args.sequences} × {args.length} for 2 shared "
        f"CPU cores{'; full-size models' if (args.layers, args.hidden) == (12, 768) else ''})")
    rows = []
    for model in args.models.split(","):
        mwork = work / model
        mwork.mkdir(parents=True, exist_ok=True)
        for job in args.jobs.split(","):
            cmd = [sys.executable, __file__, "--worker", job, "--model", model, "--work", str(mwork)] + [
                f"--{k.replace('_', '-')}={getattr(args, k)}" for k in
                ("layers", "hidden", "sequences", "length", "test", "iterations", "hessian_samples", "kron_batch",
                 "unrolled_steps", "segments", "unrolled_basis", "top", "top_curvature")] + (
                [f"--memory={args.memory}"] if args.memory else []) + (
                [f"--pretrain-batch={args.pretrain_batch}"] if args.pretrain_batch else []) + (
                [f"--tag={args.tag}"] if args.tag else []) + (
                [f"--fit-cache={args.fit_cache}"] if args.fit_cache else []) + (
                ["--residual"] if args.residual else [])
            t0 = time.perf_counter()
            if args.reuse and (mwork / f"{job}{args.tag}.json").exists():  # finished in an earlier (interrupted) run
                result = json.loads((mwork / f"{job}{args.tag}.json").read_text())
                say(f"{model} {job} (reused): {json.dumps({k: v for k, v in result.items() if k != 'phases'}, default=str)}")
                if result.get("phases"):
                    say(f"{model} {job}: resident memory by phase (sampled every 10 ms)\n{phase_table(result)}")
                rows.append(result)
                continue
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                say(f"{model} {job}: FAILED after {time.perf_counter() - t0:.0f} s\n{done.stderr[-3000:]}")
                continue
            result = json.loads((mwork / f"{job}{args.tag}.json").read_text())
            say(f"{model} {job}: {json.dumps({k: v for k, v in result.items() if k != 'phases'}, default=str)}")
            if result.get("phases"):
                say(f"{model} {job}: resident memory by phase (sampled every 10 ms)\n{phase_table(result)}")
            rows.append(result)
            RESULTS.mkdir(parents=True, exist_ok=True)
            (RESULTS / f"{args.name}.txt").write_text(log.getvalue())  # partial results survive an interrupted run
        summarize(model, mwork, [r for r in rows if r["model"] == model], say)
    say(f"load at the end: {' '.join(Path('/proc/loadavg').read_text().split()[:3])}")
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.name}.txt").write_text(log.getvalue())
    record(RESULTS, [f"{args.name}.txt"])


def summarize(model: str, work: Path, rows: list[dict], say) -> None:
    by = {r["job"]: r for r in rows}
    table = []
    for job in JOBS:
        r = by.get(job)
        if r is None:
            continue
        table.append({"model": model, "job": job, "peak RSS GB": r["peak_rss"] / 1e9,
                      "fit s": r.get("fit_s"), "query s": r.get("query_s"), "score s": r.get("score_s"),
                      "total s": r.get("total_s"),
                      "scored/s": r.get("scored_per_s"), "s/HVP": r.get("hvp_s")})
    if table:
        say(pd.DataFrame(table).to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    ek, kr, mr = by.get("influkit-ekfac"), by.get("kronfluence"), by.get("influkit-minres")
    if ek and kr:
        a = np.load(work / "influkit_ekfac.npy")
        b = np.load(work / "kronfluence.npy") if (work / "kronfluence.npy").exists() else None  # a record without scores
        say(f"- peak RSS influkit EK-FAC / kronfluence: {ek['peak_rss'] / kr['peak_rss']:.2f} (target ≤ 1.5)")
        say(f"- scoring throughput influkit / kronfluence: {ek['scored_per_s'] / kr['scored_per_s']:.2f} (target ≥ 1; "
            "kronfluence's time includes its query gradient and preconditioning)")
        with_query = (len(a) / (ek["query_s"] + ek["score_s"])) / kr["scored_per_s"]
        say(f"- throughput with the query counted, influkit (query + scoring {ek['query_s'] + ek['score_s']:.1f} s) / "
            f"kronfluence ({kr['score_s']:.1f} s, its query gradient included): {with_query:.2f} (target ≥ 1)")
        if "score_cpu_s" in ek and "score_cpu_s" in kr:  # CPU seconds of the one torch thread: less load-dependent
            cpu = kr["score_cpu_s"] / (ek["query_cpu_s"] + ek["score_cpu_s"])
            say(f"- the same per CPU second (1 thread; wall time on a loaded machine counts other processes' time): "
                f"influkit {ek['query_cpu_s'] + ek['score_cpu_s']:.1f} CPU s, kronfluence {kr['score_cpu_s']:.1f} CPU s: "
                f"{cpu:.2f} (target ≥ 1)")
        say(f"- fit seconds influkit / kronfluence: {ek['fit_s'] / kr['fit_s']:.2f}")
        if "stationarity" in ek:
            where = ek["stationarity"]
            say(f"- influkit's fit includes where the stage stands (per-example gradients of {where['sample']} "
                f"examples, one more gradient pass when the stage has more, {where['lanczos_steps']} Lanczos "
                f"Hessian-vector products): {where['seconds']:.0f} s "
                f"of its {ek['fit_s']:.0f} s ({ek['fit_cpu_s']:.0f} CPU s); verdict {where['verdict']}")
        if b is None:
            say("- influkit EK-FAC vs kronfluence EK-FAC: not compared (kronfluence's reused record has no scores)")
        else:
            say(f"- influkit EK-FAC vs kronfluence EK-FAC: Pearson {pearson(a, b):.6f} (target ≥ 0.999), "
                f"relative error {rel_err(a, b):.3g}")
    if ek:
        say(f"- influkit EK-FAC Kronecker blocks by layer type: {ek['kronecker_blocks']} (diagonal blocks: "
            f"{len(ek['factor_memory']['diagonal_layers'])})")
        per = ek["score_s"] / max(1, len(np.load(work / "influkit_ekfac.npy")))
        say(f"- scoring per example / batched forward+backward per example: {per / ek['fwd_bwd_per_example_s']:.2f} "
            f"(target ≤ 2; chunk {ek['chunk']})")
        say(f"- bfloat16 autocast scores vs float32: Pearson {ek['bf16_pearson']:.4f}, relative error "
            f"{ek['bf16_rel_err']:.3g}, {ek['bf16_score_s']:.1f} s vs {ek['score_s']:.1f} s")
    rec, unr = by.get("case1-recorded"), by.get("case1-unrolled")
    if rec and unr:
        a = np.load(work / "case1_unrolled.npy") if (work / "case1_unrolled.npy").exists() else None
        b = np.load(work / "case1_recorded.npy")
        say(f"- approximate unrolling ({unr['segments']} segments per stage, EK-FAC basis {unr['basis']}) vs the plain "
            f"EK-FAC Case 1 query on the same recorded chain: {unr['total_s']:.0f} s vs {rec['total_s']:.0f} s "
            f"({unr['total_s'] / rec['total_s']:.2f}×), peak RSS {unr['peak_rss'] / 1e9:.2f} vs {rec['peak_rss'] / 1e9:.2f} GB "
            f"(recording {unr['record_s']:.0f} s, not counted)" + (f"; Pearson of the scores {pearson(a, b):.3f}" if a is not None else "")
            + "; top directions per stage: " + "; ".join(
                f"{t['directions']} ({t['curvature']}, {t['why']}" + (f", {t['products']} products, {t['seconds']:.0f} s)" if t["directions"] else ")")
                for t in unr.get("top", [])))
    both = by.get("case1-both")
    if both:
        a, b = np.load(work / "case1_both_unrolled.npy"), np.load(work / "case1_both_plain.npy")
        say(f"- one process, the plain EK-FAC Case 1 query then the approximate unrolling ({both['segments']} segments "
            f"per stage) reusing its stage-1 EK-FAC as the shared eigenbasis: plain {both['plain_s']:.0f} s (fit "
            f"{both['plain_fit_s']:.0f}, query {both['plain_query_s']:.0f}, scores {both['plain_score_s']:.0f}); "
            f"unrolling +{both['unrolled_marginal_s']:.0f} s (pieces {both['unrolled_pieces_s']:.0f}, example terms "
            f"{both['unrolled_score_s']:.0f}), standalone = its stage-1 EK-FAC fit ({both['ekfac_fit_s']['total']:.0f} s) "
            f"+ that = {both['unrolled_s']:.0f} s "
            f"({both['unrolled_s'] / both['plain_s']:.2f}× the plain query); peak RSS after the plain query "
            f"{both['peak_rss_plain'] / 1e9:.2f} GB, after the unrolling {both['peak_rss'] / 1e9:.2f} GB; Pearson of "
            f"the scores {pearson(a, b):.3f}")
    if both and unr and not rec:  # the unrolling alone in its own process vs case1-both's plain query
        a, b = np.load(work / "case1_unrolled.npy"), np.load(work / "case1_both_unrolled.npy")
        say(f"- the approximate unrolling in its own process (case1-unrolled: its own stage-1 EK-FAC fit, recording not "
            f"counted) {unr['total_s']:.0f} s (pieces {unr['pieces_s']:.0f}, example terms {unr['score_s']:.0f}) vs the "
            f"plain EK-FAC Case 1 query of case1-both {both['plain_s']:.0f} s: {unr['total_s'] / both['plain_s']:.2f}×; "
            f"peak RSS {unr['peak_rss'] / 1e9:.2f} vs {both['peak_rss_plain'] / 1e9:.2f} GB; its scores vs case1-both's "
            f"unrolling (the plain fit as the last piece's curvature): Pearson {pearson(a, b):.4f}, relative error "
            f"{rel_err(a, b):.3g}")
    each = work / "case1_unrolled_each.npy"
    if each.exists() and (work / "case1_unrolled.npy").exists():
        say(f"- shared eigenbasis vs a fit per piece: Pearson {pearson(np.load(work / 'case1_unrolled.npy'), np.load(each)):.4f}, "
            f"relative error {rel_err(np.load(work / 'case1_unrolled.npy'), np.load(each)):.3g}")
    if mr:
        say(f"- one HVP / one gradient of the same {mr['hvp_batch']} sequences: "
            f"{mr['one_hvp_s'] / mr['one_gradient_s']:.2f} (target ≤ 3; {mr['one_hvp_s']:.2f} s vs "
            f"{mr['one_gradient_s']:.2f} s; cached graph: {mr['hvp_memory'].get('cache_graph')})")


if __name__ == "__main__":
    main()
