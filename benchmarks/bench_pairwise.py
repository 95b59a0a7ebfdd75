"""Pairwise scores at corpus scale: n_train × n_test influence scores streamed to disk by ``ik.pairwise`` under a
memory budget — peak resident memory, seconds per query block and per row chunk, disk written.

    python -m benchmarks.bench_pairwise                       # 200,000 × 1,000, budget 256 MiB, blocks of 250
    python -m benchmarks.bench_pairwise --n-train 20000 --n-test 100 --tag small

The model is a float32 MLP 64 → 32 → 10 (2,410 trained values) on synthetic Gaussian inputs labelled by a random
teacher (a throughput measurement: the data's meaning plays no part), untrained; the stage's Gauss-Newton matrix is
taken on a sample of 1,000 examples and solved directly (λ = 1e-3). The scores stream to ``--scratch`` (removed at the end unless
``--keep``): a rerun after a kill resumes there. The in-memory matrix would be n_train · n_test · 4 bytes
(800 MB at the default sizes); the measured peak resident growth over the process's resident memory before
scoring is reported beside the budget. kronfluence's pairwise scores are not run here (no benchmark environment
with kronfluence on this machine: scripts/bench-env.sh builds one).
"""

from __future__ import annotations

import argparse
import json
import warnings
import shutil
import time
from pathlib import Path

import torch
from torch import nn

import influkit as ik
from influkit import store

from .manifest import record
from .resident import Peak, rss_now

RESULTS = Path(__file__).resolve().parent / "results" / "bench_pairwise"


def problem(n_train: int, n_test: int, budget: int):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n_train + n_test, 64, generator=gen)
    teacher = torch.randn(64, 10, generator=gen)
    y = (x @ teacher + 0.5 * torch.randn(n_train + n_test, 10, generator=gen)).argmax(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10)).eval()
    stage = ik.Stage(model, nn.CrossEntropyLoss(reduction="none"), (x[:n_train], y[:n_train]))
    chain = ik.Chain([stage], solve=ik.SolveConfig(solver="direct", damping=1e-3),
                     curvature=ik.CurvatureConfig(matrix="gauss-newton", hessian_samples=1000), memory=budget,
                     progress=False)
    return chain, (x[n_train:], y[n_train:])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n-train", type=int, default=200_000)
    parser.add_argument("--n-test", type=int, default=1_000)
    parser.add_argument("--budget-mib", type=int, default=256)
    parser.add_argument("--query-block", type=int, default=250)
    parser.add_argument("--chunk-size", type=int, default=None)
    parser.add_argument("--k", type=int, default=10)
    parser.add_argument("--scratch", type=Path, default=Path("/tmp/influkit-bench-pairwise"))
    parser.add_argument("--keep", action="store_true")
    parser.add_argument("--tag", default="default")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=ik.StationarityWarning)  # untrained on purpose
    budget = args.budget_mib * 2**20
    chain, test = problem(args.n_train, args.n_test, budget)
    start = time.perf_counter()
    chain.fit()
    fit_seconds = time.perf_counter() - start
    blocks, chunks = [], []
    put = store.ScoreStore.put

    def timed_put(self, *a, **kw):  # the seconds between chunk files: one row chunk scored and written
        put(self, *a, **kw)
        chunks.append(time.perf_counter())

    store.ScoreStore.put = timed_put
    out = args.scratch / args.tag
    baseline = rss_now()
    with Peak() as peak:
        begin = time.perf_counter()
        result = ik.pairwise(chain, None, test, out=out, k=args.k, query_block=args.query_block,
                             chunk_size=args.chunk_size, progress=False)
        total = time.perf_counter() - begin
    store.ScoreStore.put = put
    for j, (a, b) in enumerate(result.blocks):
        files = sorted((out / f"block-{j:06d}" / "scores").glob("chunk-*.safetensors"))
        stamps = [f.stat().st_mtime for f in files]
        blocks.append({"block": j, "tests": b - a, "chunks": len(files),
                       "seconds_first_to_last_chunk": max(stamps) - min(stamps) if stamps else 0.0})
    gaps = [b - a for a, b in zip(chunks, chunks[1:])]
    disk = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    chunk_rows = json.loads((out / "block-000000" / "scores" / "manifest.json").read_text())["chunk_size"]
    summary = {
        "n_train": args.n_train, "n_test": args.n_test, "trained_values": chain.dims[0], "k": args.k,
        "budget_bytes": budget, "query_block": args.query_block, "row_chunk": chunk_rows,
        "in_memory_matrix_bytes": args.n_train * args.n_test * 4,
        "resident_before_scoring_bytes": baseline, "peak_resident_bytes": peak.peak,
        "peak_resident_growth_bytes": peak.peak - baseline,
        "fit_seconds": fit_seconds, "pairwise_seconds": total,
        "seconds_per_query_block": total / len(result.blocks),
        "seconds_per_row_chunk_median": sorted(gaps)[len(gaps) // 2] if gaps else None,
        "row_chunks_written": len(chunks), "disk_bytes": disk, "blocks": blocks,
        "note": "peak resident memory sampled every 10 ms (benchmarks/resident.py) while ik.pairwise ran; chunks "
                "reused from an earlier killed run are not timed",
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    name = f"bench_pairwise_{args.tag}.json"
    (RESULTS / name).write_text(json.dumps(summary, indent=1))
    record(RESULTS, [name], note="synthetic data (a throughput measurement); 1 torch thread")
    print(json.dumps({k: v for k, v in summary.items() if k != "blocks"}, indent=1))
    if not args.keep:
        shutil.rmtree(out, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
