"""Why the approximate unrolling's row of ``studies/minilm_replay.py`` is low: its approximations taken one at a time.

All rows score the masked-LM stage's corpus snippets of the recorded MiniLM run (:func:`studies.minilm_replay.train`)
against the exact metagradient's scores (``scores.npz``: Pearson and Spearman per test snippet, their mean; the
norm ratio ‖approx‖/‖exact‖) and against the stored replayed drop sets (``replayed_{1,5,10}.npz``: the replay LDS).
Stage 0 is isolated by starting every row from the **exact** adjoint that the finetuning stage hands across the
boundary (d test loss / d final masked-LM parameters, captured from ``ik.unrolled.metagradients``' stage-1 pass),
so a row's error is the masked-LM stage's alone.

- ``approximate``: ``ik.unrolled.approximate`` on the masked-LM stage (EK-FAC, one eigenbasis, ``--segments``), and
  the same with the curvature set to zero (``curvature 0``: every eigenvalue 0, the pieces' zeroth order only).
- ``curvature 0, steps``: the curvature dropped (the gradient's dependence on θ cut) but every step's optimizer
  Jacobian kept, each fed row at its own step with its recorded dropout mask: the adjoint pulled back through each
  recorded AdamW + clipping update (``StageRun.update_vjp``), row terms d(ḡ_t · ∇L_t(θ_t; w))/dw. Then, one at a
  time, the approximate unrolling's choices: ``frozen P`` (the pullback without the second moment's response),
  ``constant gain`` (clipping's Jacobian as its factor alone), ``spread`` (each row forced at every step: the steps'
  mean ḡ_t in place of its own step's).

    python -m studies.minilm_approximate_diagnosis        # → studies/results/minilm_replay/approximate_diagnosis.csv
"""

from __future__ import annotations

import argparse
import inspect
import textwrap
import time

import numpy as np
import pandas as pd
import torch
from scipy import stats
from tqdm.auto import tqdm

import influkit as ik
import influkit.unrolled.metagradient as metagradient
import influkit.unrolled.optimizers as optimizers
import influkit.unrolled.segments as segments
from influkit.unrolled.replay import start, unit_weights
from influkit.validation.lds import lds_per_query
from studies import minilm_replay as study

RESULTS = study.RESULTS
STEP_CHOICES = ((), ("frozen P",), ("constant gain",), ("frozen P", "constant gain"),
                ("frozen P", "constant gain", "spread"), ("spread",))


class _Captured(Exception):
    pass


def handed_adjoint(record: ik.unrolled.Record, test) -> dict:
    """{name: (q, *shape)}: the exact adjoint the finetuning stage hands to the masked-LM stage's final values (the
    exact reverse pass stopped at the boundary)."""
    original, kept = metagradient.hand_over, {}

    def capture(record_, k, theta_bar, anchor_bar, q):
        kept.update({n: v.detach().clone() for n, v in original(record_, k, theta_bar, anchor_bar, q).items()})
        raise _Captured

    metagradient.hand_over = capture
    try:
        ik.unrolled.metagradients(record, test, per_test=True, progress=False)
    except _Captured:
        pass
    finally:
        metagradient.hand_over = original
    return kept


def first_stage(record: ik.unrolled.Record) -> ik.unrolled.Record:
    alone = ik.unrolled.Record()
    alone.runs = [record.runs[0]]
    return alone


def approximate_row(record, adjoint: dict, segments_: int, flat: bool) -> np.ndarray:
    """(n, q) approximate-unrolling scores of the masked-LM stage from ``adjoint``; ``flat``: every eigenvalue 0."""
    maps = segments._maps
    if flat:
        segments._maps = lambda lam, d, *a, **k: maps(lam * 0, d, *a, **k)
    try:
        result = ik.unrolled.approximate(first_stage(record), ik.unrolled.Adjoint(adjoint, batched=True),
                                         segments=segments_, per_test=True, curvature="ekfac", basis="shared",
                                         progress=False)[0]
    finally:
        segments._maps = maps
    return result.values.detach().double().numpy()


def _without_second_moment_response():
    """Adam's pullback with the second moment's response removed (its v̄ terms), P = 1/(√v̂ + ε) of each step frozen."""
    code = textwrap.dedent(inspect.getsource(optimizers.Adam.pullback))
    for line in ("v_bar = torch._foreach_addcmul(v_bar, scaled, slope, value=step_size * 0.5 / correction2)",
                 "torch._foreach_addcmul_(d_bar, d, v_bar, value=2 * (1 - beta2))"):
        assert line in code, line
        code = code.replace(line, "pass")
    namespace = dict(vars(optimizers))
    exec(code, namespace)  # noqa: S102 - the library's own source, two lines removed
    return namespace["pullback"]


def steps_row(record, adjoint: dict, choices: tuple[str, ...]) -> np.ndarray:
    """(n, q) scores of the masked-LM stage with the curvature dropped and each step's optimizer Jacobian kept (module
    docstring), with the approximate unrolling's ``choices`` of ``STEP_CHOICES``."""
    run = record.runs[0]
    names = list(run.trained)
    rule_type, clip_type = optimizers.Adam, type(run.optimizer)
    saved = rule_type.pullback, clip_type.clip_pullback
    if "frozen P" in choices:
        rule_type.pullback = _without_second_moment_response()
    if "constant gain" in choices:
        clip_type.clip_pullback = lambda self, grads, bar, max_norm, norm_type, order=None: {
            n: b * self.clip_coefficient(grads, max_norm, norm_type, order=order) for n, b in bar.items()}
    try:
        theta, state = start(run, run.anchors), run.checkpoints[0][1]
        thetas, pulls = [], []
        for t in range(run.steps):
            idx, x, y = run.batch(t)
            grads = run.gradient(t, theta, run.anchors, (x, y, unit_weights(run, idx, None, x)))
            thetas.append(theta)
            theta, state, pull = run.update_vjp(t, theta, state, grads)
            pulls.append(pull)
        theta_bar = {n: adjoint[n].to(run.final[n].dtype) for n in names}
        state_bar = {k: {n: torch.zeros_like(theta_bar[n]) for n in names} for k in ("m", "v")}
        g_bars = [None] * run.steps
        for t in reversed(range(run.steps)):
            theta_bar, state_bar, g_bars[t] = pulls[t](theta_bar, state_bar)
    finally:
        rule_type.pullback, clip_type.clip_pullback = saved
    if "spread" in choices:
        mean = {n: sum(g[n] for g in g_bars) / run.steps for n in names}
        g_bars = [mean] * run.steps
    q = next(iter(theta_bar.values())).shape[0]
    scores = torch.zeros(len(run.stage), q, dtype=torch.float64)
    for t in range(run.steps):
        idx, x, y = run.batch(t)
        w = unit_weights(run, idx, None, x).detach().clone().requires_grad_(True)
        at = {n: thetas[t][n].detach().requires_grad_(True) for n in names}
        grads = run.gradient(t, at, run.anchors, (x, y, w), graph=True)
        for j in range(q):
            dot = sum((grads[n] * g_bars[t][n][j]).sum() for n in names)
            scores[:, j].index_add_(0, idx, torch.autograd.grad(dot, w, retain_graph=j < q - 1)[0].double())
    return scores.numpy()


def measured(name: str, scores: np.ndarray, exact: np.ndarray, seconds: float, replays: dict) -> dict:
    pearson = np.mean([stats.pearsonr(exact[:, j], scores[:, j])[0] for j in range(exact.shape[1])])
    spearman = np.mean([stats.spearmanr(exact[:, j], scores[:, j])[0] for j in range(exact.shape[1])])
    row = {"row": name, "Pearson with exact": round(float(pearson), 3), "Spearman with exact": round(float(spearman), 3),
           "norm ratio": round(float(np.linalg.norm(scores) / np.linalg.norm(exact)), 2)}
    for f, (masks, actual) in replays.items():
        per = lds_per_query(scores, masks.numpy(), actual)
        per = per[np.isfinite(per)]
        row[f"LDS {f:.0%}"] = f"{per.mean():.3f} ± {per.std(ddof=1) / np.sqrt(len(per)):.3f}"
    return row | {"seconds": round(seconds, 1)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--segments", type=int, default=3)
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    run = study.train(study.SIZES)
    exact = np.load(RESULTS / "scores.npz")[f"{study.EXACT} stage 0"]
    replays = {f: study.replays_on_disk(RESULTS, f, 50) for f in study.FRACTIONS}
    began = time.perf_counter()
    adjoint = handed_adjoint(run.record, run.test)
    print(f"handed adjoint: {time.perf_counter() - began:.0f} s", flush=True)
    jobs = [(f"approximate, EK-FAC, {args.segments} segments", lambda: approximate_row(run.record, adjoint,
                                                                                      args.segments, False)),
            (f"approximate, curvature 0, {args.segments} segments",
             lambda: approximate_row(run.record, adjoint, args.segments, True))]
    jobs += [("curvature 0, steps: " + (", ".join(c) if c else "exact optimizer Jacobian"),
              lambda c=c: steps_row(run.record, adjoint, c)) for c in STEP_CHOICES]
    rows = []
    for name, job in tqdm(jobs, desc="rows", disable=args.no_progress):
        began = time.perf_counter()
        scores = job()
        rows.append(measured(name, scores, exact, time.perf_counter() - began, replays))
        print(rows[-1], flush=True)
    table = pd.DataFrame(rows)
    table.to_csv(RESULTS / "approximate_diagnosis.csv", index=False)
    print(table.to_string(index=False))
    from benchmarks.manifest import record
    record(RESULTS, ["approximate_diagnosis.csv"], note="shared machine (2 cores, several helpers), 1 torch thread; "
           "stage 0 from the exact handed adjoint")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
