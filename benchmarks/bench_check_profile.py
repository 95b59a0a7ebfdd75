"""bench_check_profile: where the stationarity check's seconds go on a chain's stages, against one plain gradient
pass and one Hessian-vector product over the same data, and what the check's seeded sample would say of r, all in
one process (a loaded machine's seconds are comparable only within a run).

Per stage of ``bench_fit_phases --chain``'s BERT (9.5 M) or MiniLM chain: the check's hooked pass
(:func:`influkit.factored.fit.objective_gradient`), the sampled per-example norms of the parameters no hook reaches
(a tied decoder: one backward per example, :func:`influkit.stationarity._example_squares`, and vmap's batched rows
of the same sample, the way before), a plain gradient pass (:func:`influkit.curvature.gradient`), one product with
the exact Hessian (:class:`influkit.curvature.HessianOperator`, the chain's batch plan) twice (a cached graph makes
the second free), and the light sample's r̂ ± b with the size that would settle it; each timed whole. Rows in
``profile.json``, written as each stage finishes.

    PYTHONPATH=. python -m benchmarks.bench_check_profile --model bert
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

from benchmarks.manifest import record


def timed(fn):
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def profile_stage(stage, names) -> dict:
    from influkit import stationarity
    from influkit.curvature import HessianOperator, gradient
    from influkit.factored.fit import objective_gradient

    row = {"examples": len(stage), "load_at_start": os.getloadavg()}
    measured, row["hooked_pass_s"] = timed(lambda: objective_gradient(stage, names))
    row["unmeasured"] = list(measured.unmeasured)
    if measured.unmeasured:
        (_, size), row["unmeasured_sample_s"] = timed(lambda: stationarity._completed_typical(stage, measured, 0))
        row["unmeasured_sample"] = size
        row["unmeasured_vmap_s"] = vmap_rows_seconds(stage, list(measured.unmeasured), size)
    _, row["gradient_pass_s"] = timed(lambda: gradient(stage, names))
    operator = HessianOperator(stage, names)
    v = torch.randn(operator.dim, generator=torch.Generator().manual_seed(0), dtype=operator.dtype)
    _, row["hvp_s"] = timed(lambda: operator.matvec(v))
    _, row["hvp_again_s"] = timed(lambda: operator.matvec(v))
    (estimate, settles), row["light_sample_s"] = timed(lambda: sample_estimate(stage, names))
    row |= estimate | {"sample_settles": settles, "r_exact": measured.norm / measured.typical
                       if not measured.unmeasured else None}
    row["load_at_end"] = os.getloadavg()
    return row


def vmap_rows_seconds(stage, names, size: int) -> float:
    """Seconds of the same sample's per-example rows over ``names`` by vmap (the check's way before issue 49's
    one-backward-per-example :func:`influkit.stationarity._example_squares`)."""
    from influkit.gradients import chunk_for, per_example_grad_rows
    from influkit.memory import DEFAULT_EXAMPLES
    from influkit.params import point

    order = torch.randperm(len(stage), generator=torch.Generator().manual_seed(0))[:size].sort().values
    x, y = stage.data.take(order)
    row = 2 * sum(t.numel() * t.element_size() for t in point(stage.state(), names).values())
    chunk = chunk_for(stage, x, y, names, None, row, "profile", None, DEFAULT_EXAMPLES)
    _, seconds = timed(lambda: [rows.pow(2).sum(1) for rows in per_example_grad_rows(stage, x, y, names, chunk_size=chunk)])
    return seconds


def sample_estimate(stage, names) -> tuple[dict, bool]:
    """What the check's seeded sample of light_sample(n) examples says of r: r̂ = ‖ĝ‖/ĝ_typical, its half-width b at
    ≈95 %, and the sample size s' that would settle non-stationarity (``stationarity._settling_size``)."""
    from influkit import stationarity
    from influkit.gradients import chunk_for
    from influkit.params import point

    n = len(stage)
    size = stationarity.light_sample(n)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(0))[:size].sort().values
    x, y = stage.data.take(order)
    row = 2 * sum(t.numel() * t.element_size() for t in point(stage.state(), names).values())
    chunk = chunk_for(stage, x, y, names, None, row, "profile", None, 8)
    sums = stationarity._SampleSums()
    sums.add(stage, x, y, names, chunk, False)
    norm, typical, bound = float(sums.mean().norm()), sums.typical(), sums.bound(n)
    grown = stationarity._settling_size(sums, norm, n)
    settles = (norm - bound) / typical > stationarity.GRADIENT_TOL
    return {"light_sample": size, "r_sample": norm / typical, "r_sample_bound": bound / typical,
            "settling_size": grown}, settles


def main(argv=None) -> None:
    from benchmarks.bench_fit_phases import bert_chain, minilm_chain

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="bert", choices=("bert", "minilm"))
    parser.add_argument("--n", type=int, default=128)
    parser.add_argument("--length", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--head-n", type=int, default=32)
    parser.add_argument("--test", type=int, default=8)
    parser.add_argument("--out", default="benchmarks/results/bench_check_profile")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import influkit as ik

    pre, fin, link, _ = bert_chain(args) if args.model == "bert" else minilm_chain(args)
    chain = ik.Chain([pre, fin], [link], progress=False)
    file = out / "profile.json"
    rows = json.loads(file.read_text()) if file.exists() else []
    for k, plan in enumerate(chain.plans):
        row = {"model": args.model, "stage": k, "trained": chain.dims[k]} | profile_stage(plan.stage, plan.trained)
        rows = [r for r in rows if (r["model"], r["stage"]) != (args.model, k)] + [row]
        file.write_text(json.dumps(rows, indent=1))
        print(json.dumps(row), flush=True)
    record(out, ["profile.json"], note="2 shared CPU cores, five agents and two replay jobs, 1 torch thread; "
                                       "compare seconds within a row (one process)")


if __name__ == "__main__":
    main()
