"""Time and memory of ``influkit.score`` as the pretraining set grows (issue: linear in m, flat memory).

The multi-stage paper's MNIST architecture (Table A: CONV 32 5×5 → MAX-POOL → CONV 64 5×5 → MAX-POOL, tanh,
FC heads), float32, random 28×28 inputs (a timing benchmark; weights are not trained). For m = 1k, 4k, 16k
pretraining examples, each in a fresh process: the finetuning solve, the pretraining solve (CG on H², fixed
iteration count, Hessian on 1,000 sampled examples as in the paper), the per-example part (one gradient per
pretraining example, streamed in chunks), the peak RSS growth of the per-example part, and the ratio of the
total to one full pretraining gradient pass.

    python -m benchmarks.bench_multistage            # m = 1000 4000 16000
    python -m benchmarks.bench_multistage --m 500 2000
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import pandas as pd


def one_size(m: int, iterations: int) -> dict:
    import torch

    import influkit as ik
    from influkit.gradients import total_grad
    from influkit.apps.models import mnist_classifier
    from influkit.apps.objectives import cross_entropy as ce

    torch.set_num_threads(1)
    torch.manual_seed(0)
    pre_model, fin_model = mnist_classifier(4).eval(), mnist_classifier(6).eval()
    fin_model.embedding.load_state_dict(pre_model.embedding.state_dict())
    pre = ik.Stage(pre_model, ce, (torch.randn(m, 784), torch.randint(0, 4, (m,))), batch_size=500)
    fin = ik.Stage(fin_model, ce, (torch.randn(1000, 784), torch.randint(0, 6, (1000,))), params="head", batch_size=500)
    test = (torch.randn(100, 784), torch.randint(0, 6, (100,)))

    start = time.perf_counter()
    total_grad(pre, *pre.data.take(torch.arange(m)))
    gradient_pass = time.perf_counter() - start

    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    start = time.perf_counter()
    solve = [ik.SolveConfig(solver="cg", damping=1e-2, max_iter=iterations),
             ik.SolveConfig(solver="cg", damping=1e-8, max_iter=iterations)]
    curvature = [ik.CurvatureConfig(hessian_samples=1000), ik.CurvatureConfig()]
    res = ik.score(pre, fin, torch.arange(m), test, shared="embedding", solve=solve, curvature=curvature, chunk_size=64)
    total = time.perf_counter() - start
    seconds = res.diagnostics["seconds"]
    return {
        "m": m,
        "finetune_solve_s": seconds["solve_stage1"],
        "pretrain_solve_s": seconds["solve_stage0"],
        "per_example_s": seconds["example_gradients"],
        "total_s": total,
        "total / gradient pass": total / gradient_pass,
        "peak_rss_growth_MB": (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024,
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--m", type=int, nargs="+", default=[1000, 4000, 16000])
    parser.add_argument("--iterations", type=int, default=10, help="CG iterations per solve (fixed, for timing)")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        import warnings

        warnings.simplefilter("ignore")
        print(json.dumps(one_size(args.child, args.iterations)))
        return
    from pathlib import Path

    from benchmarks.manifest import saved_output  # the parent runs as python -m benchmarks.bench_multistage

    with saved_output(Path(__file__).resolve().parent / "results" / "bench_multistage", "bench_multistage.txt"):
        rows = []
        for m in args.m:
            out = subprocess.run([sys.executable, __file__, "--child", str(m), "--iterations", str(args.iterations)],
                                 capture_output=True, text=True, check=True)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"m = {m}: done", flush=True)
        frame = pd.DataFrame(rows).set_index("m")
        growth = frame["per_example_s"] / frame["per_example_s"].shift(1)
        frame["per_example growth per step"] = growth
        print("\n# influkit.score on the MNIST CNN of Table A (float32, 1 thread, CG iterations fixed at "
              f"{args.iterations} per solve, pretraining Hessian on 1,000 samples)")
        print(frame.to_string(float_format=lambda v: f"{v:.3g}"))
        print("\nper-example part grows ≈ linearly in m (ideal growth = ratio of successive m); the solves do not "
              "grow with m because the pretraining Hessian is sampled; the RSS growth of a run stays flat because "
              "per-example gradients are streamed in chunks of 64 and only their dot products are kept.")


if __name__ == "__main__":
    main()
