"""Scoring seconds on the fidelity benchmark's digits CNN, runnable on any checkout (put it first on PYTHONPATH).

Measures what the layer cost rule (influkit.layers.Layer.forms_rows) changes: ``Query.scores`` of the identity chain
of digits-case1 member 0 (200 pretraining examples × 100 per-test directions) and each influkit fidelity method's
seconds at K = 1 (``fidelity_methods.influkit_scores``: fit, query and scores, no score cache). One line per round::

    cd CHECKOUT && PYTHONPATH=$PWD:$PWD/benchmarks python /copy/of/bench_scoring_rows.py --cache DIR --label mine

``--cache``: a fidelity cache holding digits-case1's trained member 0 (``studies/results/fidelity/cache``), read
only. ``$PWD/benchmarks`` on the path serves older checkouts (885c1da), whose benchmarks import each other flat.
Alternate checkouts by running this once per checkout per round (results/bench_scoring_rows/scoring_rows.txt).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache", required=True)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--label", default="")
    parser.add_argument("--no-methods", action="store_true", help="only Query.scores")
    args = parser.parse_args()
    torch.set_num_threads(1)
    import influkit
    from benchmarks import fidelity_methods as fm
    from studies.fidelity_tasks import TASKS, Task
    from influkit import SolveConfig

    task = Task(TASKS["digits-case1"], args.cache)
    identity = task.chain(0, SolveConfig(solver="identity"))
    query = identity.query(task.split.test, per_test=True)
    query.scores()  # warm-up
    times, methods = [], {}
    for _ in range(args.rounds):
        start = time.perf_counter()
        result = query.scores()
        times.append(time.perf_counter() - start)
        if not args.no_methods:
            for name in fm.INFLUKIT:
                start = time.perf_counter()
                fm.influkit_scores(task, name, [0])
                methods.setdefault(name, []).append(time.perf_counter() - start)
    scoring = result.diagnostics["scoring"]
    print(f"{args.label} influkit {os.path.dirname(influkit.__file__)} benchmarks {os.path.dirname(fm.__file__)} | load {os.getloadavg()[0]:.1f} | "
          f"Query.scores {result.values.shape[0]}x{result.values.shape[1]} s {[round(t, 3) for t in times]} "
          f"median {statistics.median(times):.3f} | contracted {scoring.get('contracted')} "
          f"modules {scoring.get('modules')} formed_rows {scoring.get('formed_rows')}", flush=True)
    for name, seconds in methods.items():
        print(f"{args.label}   {name:38s} s {[round(t, 2) for t in seconds]} median {statistics.median(seconds):.2f}",
              flush=True)


if __name__ == "__main__":
    main()
