"""The unrolled methods on the **warm** and **scratch** protocols: which recorded run each one differentiates.

Both protocols re-train with float64 L-BFGS then Newton to a stationary point (``fidelity_tasks.Task.retrain``) —
not a run of pure update rules that ``influkit.unrolled`` can record and replay. So each protocol's unrolled rows
differentiate a recorded run that stands for the protocol's training (the decision this module makes):

- **warm — the recorded continued training.** From member 0's trained weights (the model every influence row
  scores), pretraining continues on all of Z by full-batch heavy-ball gradient descent, then finetuning continues
  from member 0's finetuned head on the continued embedding (Case 1: head only, embedding fixed; Case 2: embedding
  and head with α‖W − W̄‖², starting at W̄, as the protocol's re-training does), with the replay record's optimizers
  and step counts (``fidelity_replay``: SGD, momentum 0.9, lr 0.05 — Fashion pretraining 0.02 —, 150 + 100 steps).
  At w = 1 pretraining stays at the trained (stationary) model (final ‖∇‖ ≤ 2e-13), and so does Case 1's finetuning;
  Case 2's finetuning moves from W̄ back towards W* (final ‖∇‖ 0.009 on digits). Dropping z is w_z = 0 in every
  full-batch step — what the protocol's continuation on S does, with gradient descent for a fixed horizon in place of
  L-BFGS/Newton to convergence. On a quadratic this truncated descent moves θ by −[I − A_T] H⁻¹ ∇ (A_T the heavy-ball propagator):
  the exact influence damped below curvatures ≈ (1 − μ)/(η T); as T → ∞ (H ≻ 0) the score tends to I(z, T)/m.
- **scratch — the recorded from-scratch run.** The replay protocol's record (``fidelity_replay.record_task``):
  member 0's *initialization*, SGD + momentum on seeded mini-batches of 32, 150 + 100 steps, stopped away from a
  stationary point — a from-scratch run a user would record; the protocol's re-trainings start from other seeds.

Methods (per test point, K = 1): the exact metagradient (``ik.unrolled.metagradients``) and the approximate
unrolling (``ik.unrolled.approximate``, the replay protocol's 5 segments per stage) with the dense Hessian at each
segment's end, and with EK-FAC fitted there (SOURCE's curvature at scale; ``CurvatureConfig()``, the curvature of
the "influkit EK-FAC" influence row), and with that EK-FAC completed by each stage's top 20 Hessian eigenpairs
(``top=20``, the default's matrix) or Gauss-Newton eigenpairs (``top_curvature="gauss-newton"``). Sign: each keeps its own, score = d test loss_t(θ_final(w)) / d w_z at w = 1
— positive = up-weighting z raises the test loss, influkit's sign, which the LDS ranks directly (removing z predicts
−score; the influence rows' I(z, t) = m·score in the limit, the same sign). Seconds: the
reverse (or segment) pass; recording the run is training and is reported apart, as the other rows leave training out.

Scored against the committed re-trainings (``results/fidelity/<task>_<protocol>_outputs.csv.gz``) after checking
that today's code reproduces them: the first committed subset is re-trained (seed 0) and compared.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from safetensors.torch import load_file, save_file

import influkit as ik
from studies.fidelity_replay import (APPROXIMATE_SEGMENTS, APPROXIMATE_SETTINGS, EXACT, FINETUNE, PRETRAIN,
                                        pretrain_optimizer, record_task, settings_digest)
from studies.fidelity_tasks import Task, subsets_for
from influkit import Link
from influkit.validation import lds_per_query

METHODS = (EXACT, *APPROXIMATE_SETTINGS)
REPRODUCED = 1e-6
"""Largest |Δ test loss| between today's re-training of a committed subset and its committed output (written to 10
significant digits) for which the committed outputs count as this code's."""


def record_continuation(task: Task, scale: int = 1) -> ik.unrolled.Record:
    """The warm protocol's run: member 0's trained chain continued by full-batch descent (module docstring), for
    ``scale`` times the replay record's steps."""
    pre0, fin0 = task.member(0)
    pre_model, fin_model = copy.deepcopy(pre0.model), copy.deepcopy(fin0.model)
    pre, fin = task.pretrain_stage(pre_model), task.finetune_stage(fin_model)
    record = ik.unrolled.Record()
    record.train(pre, pretrain_optimizer(task), steps=scale * PRETRAIN["steps"], batch_size=len(pre))
    record.train(fin, FINETUNE["optimizer"], steps=scale * FINETUNE["steps"], batch_size=len(fin),
                 link=Link("embedding", case=task.config.case, alpha=task.config.alpha))
    return record


def recorded_run(task: Task, protocol: str) -> ik.unrolled.Record:
    """The run the unrolled methods differentiate on ``protocol`` (module docstring)."""
    return record_continuation(task) if protocol == "warm" else record_task(task)


def _path(task: Task, protocol: str, method: str) -> Path:
    slug = hashlib.sha256(f"{protocol}|{method}".encode()).hexdigest()[:8]
    return task.directory / "unrolled" / f"{protocol}_{slug}_{settings_digest(task)}.safetensors"


def _compute(method: str, record: ik.unrolled.Record, test) -> ik.InfluenceResult:
    """Stage 0's per-test scores of ``method`` on ``record``."""
    if method == EXACT:
        return ik.unrolled.metagradients(record, test, per_test=True)[0]
    return ik.unrolled.approximate(record, test, segments=APPROXIMATE_SEGMENTS, per_test=True,
                                   **APPROXIMATE_SETTINGS[method])[0]


def unrolled_scores(task: Task, protocol: str) -> tuple[dict[str, tuple[np.ndarray, float]], dict]:
    """({method: ((n, q) scores, seconds)}, facts of the recorded run); each method's scores cached on its own under
    the task's cache (the run is recorded once when any is missing)."""
    paths = {m: _path(task, protocol, m) for m in METHODS}
    facts_path = task.directory / "unrolled" / f"{protocol}_facts_{settings_digest(task)}.json"
    facts_path.parent.mkdir(parents=True, exist_ok=True)
    missing = [m for m, p in paths.items() if not p.exists()]
    if missing or not facts_path.exists():
        torch.set_num_threads(1)
        start = time.perf_counter()
        record = recorded_run(task, protocol)
        record_seconds = time.perf_counter() - start
        test = task.split.test
        facts = json.loads(facts_path.read_text()) if facts_path.exists() else {
            "run": "continued training from member 0's trained chain (full batch)" if protocol == "warm"
            else "the replay protocol's from-scratch record (member 0's initialization, batches of 32)",
            "steps": [run.steps for run in record.runs], "optimizers": [repr(run.optimizer) for run in record.runs],
            "recording seconds (one run)": record_seconds, "final gradient norms": final_gradient_norms(record),
            "recorded test loss, summed": float(ik.unrolled.outputs(record, test).sum()),
            "load when scored (1 min)": os.getloadavg()[0]}
        for method in missing:
            start = time.perf_counter()
            result = _compute(method, record, test)
            seconds = time.perf_counter() - start
            if method == EXACT:
                facts["replay error (reverse pass, segment ends vs checkpoints)"] = result.diagnostics["replay"][
                    "max_error"]
            facts[f"load when scored (1 min): {method}"] = os.getloadavg()[0]
            save_file({"scores": result.values.double().contiguous(), "seconds": torch.tensor(seconds)},
                      str(paths[method]), metadata={"method": method, "protocol": protocol})
        facts_path.write_text(json.dumps(facts, indent=1))
    loaded = {m: load_file(p) for m, p in paths.items()}
    return ({m: (v["scores"].numpy(), float(v["seconds"])) for m, v in loaded.items()},
            json.loads(facts_path.read_text()))


def final_gradient_norms(record: ik.unrolled.Record) -> list[float]:
    """‖∇L‖ of each recorded stage's full objective at its recorded final values (w = 1)."""
    norms = []
    for run in record.runs:
        final = run.final
        theta = {n: final[n].clone().requires_grad_(True) for n in run.trained}
        idx = torch.arange(len(run.stage))
        x, y = run.stage.data.take(idx)
        value = run.objective(theta, run.anchors, x, y, torch.ones(len(idx), dtype=x.dtype))
        grads = torch.autograd.grad(value, list(theta.values()))
        norms.append(float(torch.sqrt(sum((g**2).sum() for g in grads))))
    return norms


def reproduction_gap(task: Task, protocol: str, frame: pd.DataFrame) -> tuple[int, float]:
    """(subset, max |Δ|) between today's re-training of the first committed subset (seed 0) and its committed
    outputs — a warm re-training starts from member 0, so this also checks that member 0 is the committed one."""
    j = int(frame.subset.min())
    committed = frame[(frame.subset == j) & (frame.seed == 0)].sort_values("test").loss.to_numpy()
    subset = subsets_for(task, j + 1)[j].nonzero().reshape(-1)
    out, _ = task.retrain(subset, protocol, 0)
    return j, float(np.abs(out.numpy() - committed).max())


def committed(task: Task, frame: pd.DataFrame, m: int) -> tuple[np.ndarray, np.ndarray]:
    """((M', n) kept masks, (M', q) test losses averaged over seeds) of the committed outputs ``frame``."""
    table = frame.groupby(["subset", "test"]).loss.mean().unstack("test").sort_index()
    return subsets_for(task, m)[torch.tensor(table.index.to_numpy())].numpy(), table.to_numpy()


def protocol_rows(task: Task, protocol: str, results: Path, m: int) -> tuple[list[dict], dict]:
    """The unrolled rows (method, K = 1, LDS, sem, seconds) against the committed outputs, and the facts."""
    frame = pd.read_csv(results / f"{task.config.name}_{protocol}_outputs.csv.gz")
    j, gap = reproduction_gap(task, protocol, frame)
    facts = {"reproduction": {"subset": j, "seed": 0, "max |Δ test loss|": gap, "reproduced": gap <= REPRODUCED}}
    if gap > REPRODUCED:  # the committed outputs are not this code's: no LDS against them
        return [], facts
    masks, outputs = committed(task, frame, m)
    scores, run_facts = unrolled_scores(task, protocol)
    facts |= run_facts
    rows = []
    for method, (values, seconds) in scores.items():
        per_query = lds_per_query(values, masks, outputs)
        valid = per_query[np.isfinite(per_query)]
        rows.append({"method": method, "K": 1, "LDS": float(valid.mean()),
                     "sem": float(valid.std(ddof=1) / np.sqrt(valid.size)), "seconds": seconds})
    return rows, facts


HORIZONS = (1, 4, 16)


def horizon(task: Task, results: Path, m: int, scales=HORIZONS) -> dict[str, float]:
    """{steps: LDS} of the approximate unrolling of the warm continuation run ``scale`` times longer, against the
    committed warm outputs. Where the continuation does not move at w = 1 (Case 1: the trained chain is stationary)
    it equals the exact metagradient (1.9e-13 relative on digits Case 1 at scale 1); as the steps grow, both tend to
    the exact influence I(z, T)/m of the stationary chain (H ≻ 0; its warm LDS is the "influkit exact" row), slowly
    along the flattest directions (curvature ≲ (1 − μ)/(η T) is still damped)."""
    masks, outputs = committed(task, pd.read_csv(results / f"{task.config.name}_warm_outputs.csv.gz"), m)
    out = {}
    for scale in scales:
        record = record_continuation(task, scale)
        values = ik.unrolled.approximate(record, task.split.test, segments=APPROXIMATE_SEGMENTS, per_test=True)[0]
        per_query = lds_per_query(values.values.double().numpy(), masks, outputs)
        steps = " + ".join(str(run.steps) for run in record.runs)
        out[steps] = float(np.nanmean(per_query))
        print(f"{task.config.name} warm | approximate unrolling, continuation of {steps} steps | LDS {out[steps]:.3f}",
              flush=True)
    return out


def add_rows(task: Task, protocols, results: Path, m: int) -> None:
    """Upsert the unrolled rows into ``results/<task>_<protocol>.csv`` and their facts into its .json."""
    for protocol in protocols:
        rows, facts = protocol_rows(task, protocol, results, m)
        if not rows:
            print(f"{task.config.name} {protocol} | not reproduced: today's re-training of subset "
                  f"{facts['reproduction']['subset']} differs from the committed outputs by "
                  f"{facts['reproduction']['max |Δ test loss|']:.2e}; no unrolled LDS reported", flush=True)
        stem = results / f"{task.config.name}_{protocol}"
        table = pd.read_csv(f"{stem}.csv")
        table = pd.concat([table[~table.method.isin(METHODS)], pd.DataFrame(rows)], ignore_index=True)
        table.to_csv(f"{stem}.csv", index=False)
        summary = json.loads(Path(f"{stem}.json").read_text())
        key = "horizon: approximate unrolling's LDS vs the continuation's steps"
        if protocol == "warm" and rows:  # kept from the committed JSON once measured (it re-records 3 runs)
            facts[key] = summary.get("unrolled", {}).get(key) or horizon(task, results, m)
        summary["unrolled"] = facts
        Path(f"{stem}.json").write_text(json.dumps(summary, indent=1))
        for row in rows:
            load = facts.get(f"load when scored (1 min): {row['method']}", facts["load when scored (1 min)"])
            print(f"{task.config.name} {protocol} | {row['method']} | LDS {row['LDS']:.3f} ± {row['sem']:.3f} | "
                  f"{row['seconds']:.1f} s | reproduction Δ {facts['reproduction']['max |Δ test loss|']:.1e} | "
                  f"load when scored {load:.1f}", flush=True)
