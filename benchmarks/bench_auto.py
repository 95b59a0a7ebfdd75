"""Benchmark behind ``SolveConfig(solver="auto")``: when is ``direct`` faster than ``minres`` through a Chain?

``auto`` runs ``direct`` for p ≤ ``influkit.auto.DIRECT_MAX`` and ``minres`` above it. This script
measures the two on real data (the 1,797 scikit-learn digits) with trained models of growing size — tanh MLPs
64→h→10 and the repo's digits CNN (``influkit.models.digits_classifier``) — each trained to near stationarity
with ``influkit.training.fit_lbfgs`` in float64 and in float32 (L2 weight 1e-4, which keeps the optimum
isolated but ill-conditioned, as real networks are).

For each model, through a fitted ``ik.Chain([stage], solve=ik.SolveConfig(solver=...))``:

- ``direct``: ``chain.fit()`` builds the dense Hessian from p Hessian-vector products
  (``HessianOperator.dense``) and factorizes it (Cholesky; eigh — ``factor`` — if H is not numerically
  positive definite); each ``chain.query`` is then
  one test gradient and two triangular solves. Time for one query = fit + one query, for 10 queries = fit +
  10 queries. Above ``--direct-max`` (the O(p²) memory and p HVPs take too long for this budget) the fit is
  *estimated* (rows marked ``est``): the measured time of ``dense()``'s first and second 256-column blocks
  scaled to ⌈p/256⌉ blocks, plus a Cholesky time c·p³ fitted on random SPD matrices of this dtype. The
  estimate (``direct_fit_est_s``) is printed for every model, so it can be checked against the measured fit.
- ``minres``: no fit; each query runs MINRES to the default tolerance (1e-10 in float64, 1e-5 in float32;
  at most min(10p, 2,000) iterations). Reported: iterations, HVPs, the relative residual, convergence, and
  the relative error of s = H⁻¹∇f(T) against ``direct``'s where that was measured. MINRES queries share
  nothing, so the 10-query time is 10 × the mean over the queries measured (all 10 when they are cheap, fewer
  when the rest would exceed the per-model budget; ``minres_measured`` says how many).

Queries are 10 disjoint sets of 20 test digits (the summed test loss of each). The crossover p (where the two
times are equal, log-log interpolation between neighbouring sizes) is derived per model family and dtype for
one query and for 10 queries, and the rule is stated at the end.

Run: ``nice -n 10 python -m benchmarks.bench_auto`` (~10 min) or ``--quick`` (n_train = 300, the two
smallest MLPs, < 2 min). Single-threaded (torch.set_num_threads(1)); writes ``results/bench_auto/bench_auto[_quick].txt``.
"""

from __future__ import annotations

import argparse
import math
import os
import time
import warnings

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

import influkit as ik
from benchmarks.common import Tee, banner, cross_entropy, digits, digits_cnn, l2, rel_err, setup, tanh_mlp, timed
from influkit.curvature import HessianOperator
from influkit.auto import DIRECT_MAX
from influkit.training import fit_lbfgs

L2_WEIGHT = 1e-4
N_TRAIN = 500
QUERY_SIZE, N_QUERIES = 20, 10
BLOCK = 256  # HessianOperator.dense builds H from blocks of this many unit vectors


def models(quick: bool, cnn: bool = False) -> list[tuple[str, str, callable, tuple[torch.dtype, ...]]]:
    """(family, label, factory(dtype) -> nn.Module, dtypes) of growing size. The CNN's Hessian-vector products
    cost ~20× an MLP's of the same p on one CPU thread, so only its smallest size is offered (``--cnn``)."""
    both = (torch.float64, torch.float32)
    hidden = (8, 32) if quick else (8, 32, 64, 128, 256)
    out = [("mlp", f"mlp 64-{h}-10", lambda dtype, h=h: tanh_mlp(hidden=h, dtype=dtype), both) for h in hidden]
    if cnn:
        out.append(("cnn", "cnn 4-8", lambda dtype: digits_cnn(channels=(4, 8), dtype=dtype), (torch.float64,)))
    return out


def train(factory, dtype: torch.dtype, data) -> tuple[ik.Stage, float, float]:
    """(stage, ‖∇L‖, seconds): the model trained by full-batch L-BFGS on the training digits."""
    model = factory(dtype).eval()
    stage = ik.Stage(model, cross_entropy, data, regularizer=l2(L2_WEIGHT), batch_size=len(data[0]))
    start = time.perf_counter()
    norm = fit_lbfgs(stage, max_iter=1000, tol=1e-8 if dtype == torch.float64 else 1e-5, restarts=1)
    return stage, norm, time.perf_counter() - start


def cholesky_model(dtype: torch.dtype, sizes=(1000, 2000, 3000)) -> float:
    """c in seconds(Cholesky of a p×p SPD matrix) ≈ c·p³, fitted on random SPD matrices of ``sizes``."""
    gen = torch.Generator().manual_seed(0)
    coefs = []
    for p in sizes:
        a = torch.randn(p, p, generator=gen, dtype=dtype) / math.sqrt(p)
        spd = a @ a.T + torch.eye(p, dtype=dtype)
        seconds, _ = timed(lambda: torch.linalg.cholesky_ex(spd), repeat=2)
        coefs.append(seconds / p**3)
    return float(np.median(coefs))


def run_queries(chain: ik.Chain, tests, budget: float) -> tuple[list[float], list[ik.Query]]:
    """Query-by-query wall-clock seconds (and the queries) for up to all ``tests``; stops early when the rest
    would take more than ``budget`` seconds."""
    seconds, queries = [], []
    for test in tests:
        t, q = timed(lambda: chain.query(test))
        seconds.append(t)
        queries.append(q)
        if np.mean(seconds) * (len(tests) - len(seconds)) > budget:
            break
    return seconds, queries


def iterative(stage: ik.Stage, tests, config: ik.SolveConfig, budget: float, prefix: str) -> tuple[dict, list]:
    """Columns ``prefix_*`` of one iterative solver through a fitted Chain: fit, iterations, residual, times."""
    chain = ik.Chain([stage], solve=config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ik.ConvergenceWarning)
        chain.fit()  # nothing for plain MINRES; the EK-FAC factors for the preconditioned one
        seconds, queries = run_queries(chain, tests, budget)
    solves = [q.solves[0] for q in queries]
    ten = float(np.sum(seconds)) if len(seconds) == N_QUERIES else N_QUERIES * float(np.mean(seconds))
    return {
        f"{prefix}_fit_s": chain.fit_seconds,
        f"{prefix}_it": float(np.mean([s["iterations"] for s in solves])),
        f"{prefix}_res": max(s["residual"] for s in solves),
        f"{prefix}_conv": all(s["converged"] for s in solves),
        f"{prefix}_n": len(seconds),
        f"{prefix}_1q_s": chain.fit_seconds + seconds[0],
        f"{prefix}_10q_s": chain.fit_seconds + ten,
        f"{prefix}_hvp_ms": 1e3 * float(np.sum(seconds)) / sum(s["products"] for s in solves),
    }, queries


def measure(family: str, label: str, stage: ik.Stage, tests, *, direct_max: int, chol_coef: float,
            budget: float) -> dict:
    """One table row: direct (measured or estimated), minres and EK-FAC-preconditioned minres through a Chain."""
    p = stage.num_trained
    dtype = next(iter(stage.trained().values())).dtype
    row: dict = {"family": family, "model": label, "dtype": str(dtype).replace("torch.", ""), "p": p}
    columns, m_queries = iterative(stage, tests, ik.SolveConfig(solver="minres"), budget, "minres")
    row.update(columns)
    columns, e_queries = iterative(stage, tests, ik.SolveConfig(solver="minres", preconditioner="ekfac"), budget, "ekfac")
    row.update(columns)

    # direct's fit estimated for every model (checked against the measured fit where there is one): the
    # gradient graph, then ⌈p/256⌉ blocks of 256 HVPs as HessianOperator.dense runs them, then a Cholesky
    op = HessianOperator(stage)
    graph, _ = timed(lambda: op.matvec(torch.zeros(p, dtype=dtype)))
    block, _ = timed(lambda: op.matvec(torch.eye(p, BLOCK, dtype=dtype)))
    row["col_ms"] = 1e3 * block / BLOCK
    row["direct_est_s"] = graph + math.ceil(p / BLOCK) * block + chol_coef * p**3
    if p <= direct_max:
        direct = ik.Chain([stage], solve=ik.SolveConfig(solver="direct"))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ik.ConvergenceWarning)  # a pseudo-inverse shows as factor = eigh
            direct.fit()
        d_seconds, d_queries = run_queries(direct, tests, budget=math.inf)
        row.update(
            factor="cholesky" if direct.operator(0).factor(0.0).cholesky is not None else "eigh",
            direct_fit_s=direct.fit_seconds,
            direct_query_s=float(np.mean(d_seconds)),
            direct_res=max(q.solves[0]["residual"] for q in d_queries),
            minres_err=max(rel_err(m.s, d.s) for m, d in zip(m_queries, d_queries)),
            ekfac_err=max(rel_err(e.s, d.s) for e, d in zip(e_queries, d_queries)),
        )
    else:  # a direct query is one test gradient (as minres') plus two p² triangular solves
        row.update(factor="est.", direct_fit_s=row["direct_est_s"],
                   direct_query_s=float(np.mean([q.seconds["test_gradient"] for q in m_queries])),
                   direct_res=float("nan"), minres_err=float("nan"), ekfac_err=float("nan"))
    row["direct_1q_s"] = row["direct_fit_s"] + row["direct_query_s"]
    row["direct_10q_s"] = row["direct_fit_s"] + N_QUERIES * row["direct_query_s"]
    for q in ("1q", "10q"):
        times = {m: row[f"{m}_{q}_s"] for m in ("direct", "minres", "ekfac")}
        row[f"fastest_{q}"] = min(times, key=times.get)
    return row


def crossover(rows: pd.DataFrame, direct: str, other: str) -> float:
    """The p at which the two columns' times are equal (log-log interpolation), over rows sorted by p: the first
    size where direct stops being faster; inf if it always is, 0 if it never is."""
    rows = rows.sort_values("p")
    p = rows.p.to_numpy(float)
    ratio = np.log(rows[direct].to_numpy() / rows[other].to_numpy())  # < 0: direct faster
    if ratio[0] >= 0:
        return 0.0
    for k in range(1, len(p)):
        if ratio[k] >= 0:
            t = ratio[k - 1] / (ratio[k - 1] - ratio[k])
            return float(np.exp(np.log(p[k - 1]) + t * (np.log(p[k]) - np.log(p[k - 1]))))
    return math.inf


COLUMNS = {  # table column: header
    "model": "model", "dtype": "dtype", "p": "p", "grad_norm": "‖∇L‖", "factor": "factor",
    "col_ms": "dense ms/col", "minres_hvp_ms": "HVP ms", "direct_fit_s": "direct fit",
    "direct_est_s": "fit est.", "direct_1q_s": "direct 1q", "direct_10q_s": "direct 10q", "direct_res": "direct res",
    "minres_it": "minres it", "minres_res": "minres res", "minres_1q_s": "minres 1q", "minres_10q_s": "minres 10q",
    "minres_n": "n", "minres_err": "minres err", "ekfac_fit_s": "ekfac fit", "ekfac_it": "ekfac it",
    "ekfac_res": "ekfac res", "ekfac_1q_s": "ekfac 1q", "ekfac_10q_s": "ekfac 10q", "ekfac_err": "ekfac err",
    "fastest_1q": "fastest 1q", "fastest_10q": "fastest 10q",
}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="n_train=300, MLP hidden 8 and 32, no CNN")
    parser.add_argument("--cnn", action="store_true", help="add the digits CNN (p=666, float64; ~3 min more)")
    parser.add_argument("--direct-max", type=int, default=None,
                        help="largest p at which direct is measured rather than estimated (default 5000; quick 3000)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    setup(1)
    log = Tee()
    banner(log, "bench_auto: direct vs minres through a fitted Chain, as p grows (the rule of solver='auto')")
    n_train, budget = (300, 5.0) if args.quick else (N_TRAIN, 15.0)
    direct_max = args.direct_max or (3000 if args.quick else 5000)
    x, y = digits()
    train_idx = slice(0, n_train)
    test_idx = [slice(n_train + k * QUERY_SIZE, n_train + (k + 1) * QUERY_SIZE) for k in range(N_QUERIES)]
    log(f"n_train = {n_train} digits, {N_QUERIES} queries of {QUERY_SIZE} test digits each, L2 = {L2_WEIGHT:g}; "
        f"direct measured for p ≤ {direct_max}, estimated above; iterative queries measured while the rest fit in "
        f"{budget:g}s per model (column n); current influkit.auto.DIRECT_MAX = {DIRECT_MAX}; load average "
        f"{os.getloadavg()[0]:.1f}")

    rows = []
    for dtype in (torch.float64, torch.float32):
        chol_coef = cholesky_model(dtype, sizes=(500, 1000) if args.quick else (1000, 2000, 3000))
        log(f"\n[{dtype}] Cholesky of a random p×p SPD matrix ≈ {chol_coef * 1e9:.3g}e-9 · p³ s "
            f"(p = 5,000: {chol_coef * 5000**3:.1f}s, p = 20,000: {chol_coef * 20000**3:.0f}s)")
        data = (x[train_idx].to(dtype), y[train_idx])
        tests = [(x[s].to(dtype), y[s]) for s in test_idx]
        for family, label, factory, dtypes in tqdm(models(args.quick, args.cnn), desc=str(dtype), disable=args.no_progress):
            if dtype not in dtypes:
                continue
            stage, norm, train_s = train(factory, dtype, data)
            start = time.perf_counter()
            row = measure(family, label, stage, tests, direct_max=direct_max, chol_coef=chol_coef, budget=budget)
            row.update(grad_norm=norm, train_s=train_s)
            rows.append(row)
            log(f"  {label:13s} p={row['p']:6d} ‖∇L‖={norm:.1e} ({train_s:.0f}s) | direct {row['factor']} fit "
                f"{row['direct_fit_s']:.1f}s (est. {row['direct_est_s']:.1f}s) | minres {row['minres_it']:.0f} it "
                f"res {row['minres_res']:.0e} 1q {row['minres_1q_s']:.1f}s | ekfac {row['ekfac_it']:.0f} it "
                f"res {row['ekfac_res']:.0e} 1q {row['ekfac_1q_s']:.1f}s | {time.perf_counter() - start:.0f}s")

    table = pd.DataFrame(rows)
    log("\n## direct, minres and minres + EK-FAC through ik.Chain([stage]), seconds on one thread "
        "(1q: fit + one query; 10q: fit + 10 queries)")
    log.table(table[list(COLUMNS)].rename(columns=COLUMNS))

    log("\n## crossover p: direct is faster below it")
    cross = []
    for (family, dtype), group in table.groupby(["family", "dtype"], sort=False):
        cross.append({
            "family": family, "dtype": dtype, "p range": f"{group.p.min()}–{group.p.max()}",
            **{f"vs {m}, {q}": crossover(group, f"direct_{q}_s", f"{m}_{q}_s")
               for m in ("minres", "ekfac") for q in ("1q", "10q")},
        })
    cross = pd.DataFrame(cross)
    log.table(cross, floatfmt="{:.0f}")
    log("(0: direct slower at every size measured; inf: direct faster at every size measured)")
    path = log.save("bench_auto_quick" if args.quick else "bench_auto")
    log(f"# written to {path}")


if __name__ == "__main__":
    main()
