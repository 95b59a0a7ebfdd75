"""Pairwise scores at corpus scale: n_train × n_test influence scores streamed to disk by ``ik.pairwise`` under a
memory budget — peak resident memory, seconds per query block and per row chunk, disk written.

    python -m benchmarks.bench_pairwise                       # 200,000 × 1,000, budget 256 MiB, blocks of 250
    python -m benchmarks.bench_pairwise --n-train 20000 --n-test 100 --tag small
    .bench-venv/bin/python -m benchmarks.bench_pairwise --peer kronfluence          # the same sizes, kronfluence

The model is a float32 MLP 64 → 32 → 10 (2,410 trained values) on synthetic Gaussian inputs labelled by a random
teacher (a throughput measurement: the data's meaning plays no part), untrained; the stage's Gauss-Newton matrix is
taken on a sample of 1,000 examples and solved directly (λ = 1e-3). The scores stream to ``--scratch`` (removed at the end unless
``--keep``): a rerun after a kill resumes there. The in-memory matrix would be n_train · n_test · 4 bytes
(800 MB at the default sizes); the measured peak resident growth over the process's resident memory before
scoring is reported beside the budget.

``--peer kronfluence`` (in the bench venv) runs kronfluence 1.0.1's ``compute_pairwise_scores`` instead
(:mod:`benchmarks.kronfluence_pairwise`) on the same model, data and λ = 1e-3 (absolute), its EK-FAC factors fitted
on the same 1,000 examples, query batches of ``--query-block`` and training batches of ``--train-batch``; it has no
memory budget and holds the whole matrix. ``--agreement`` also computes influkit's matrix in memory in the same
process and reports the Pearson correlation of −influkit's scores with kronfluence's (overall and the median over
queries; the curvatures differ: the exact Gauss-Newton matrix here, EK-FAC of a sampled Fisher there).
Every run writes ``bench_pairwise_<peer>_<tag>.json`` (influkit's: ``bench_pairwise_<tag>.json``) and rewrites
the side-by-side table ``pairwise_table.md`` from every results file in the folder.
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
DAMPING = 1e-3


def problem(n_train: int, n_test: int, budget: int):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n_train + n_test, 64, generator=gen)
    teacher = torch.randn(64, 10, generator=gen)
    y = (x @ teacher + 0.5 * torch.randn(n_train + n_test, 10, generator=gen)).argmax(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10)).eval()
    stage = ik.Stage(model, nn.CrossEntropyLoss(reduction="none"), (x[:n_train], y[:n_train]))
    chain = ik.Chain([stage], solve=ik.SolveConfig(solver="direct", damping=DAMPING),
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
    parser.add_argument("--peer", choices=["kronfluence"], default=None)
    parser.add_argument("--train-batch", type=int, default=4096, help="kronfluence's training batch")
    parser.add_argument("--agreement", action="store_true", help="with --peer: also influkit's matrix, in memory")
    parser.add_argument("--table-only", action="store_true", help="only rewrite the table from the results files")
    args = parser.parse_args(argv)
    if args.table_only:
        (RESULTS / TABLE).write_text(table())
        record(RESULTS, [TABLE], note="from the results files beside it")
        return 0
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=ik.StationarityWarning)  # untrained on purpose
    budget = args.budget_mib * 2**20
    chain, test = problem(args.n_train, args.n_test, budget)
    if args.peer:
        return run_peer(args, chain, test)
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
    save(f"bench_pairwise_{args.tag}.json", summary)
    if not args.keep:
        shutil.rmtree(out, ignore_errors=True)
    return 0


def run_peer(args, chain: ik.Chain, test) -> int:
    """kronfluence's pairwise scores of the same problem (and, with ``--agreement``, their correlation with
    influkit's in-memory matrix)."""
    from .kronfluence_pairwise import pairwise_scores

    stage = chain.stages[0]
    train = stage.data.take(torch.arange(len(stage)))
    run = pairwise_scores(stage.model, train, test, damping=DAMPING, fit_examples=1000,
                          query_batch=args.query_block, train_batch=args.train_batch)
    n_blocks = -(-args.n_test // args.query_block)
    summary = {
        "peer": f"kronfluence {run.version}", "n_train": args.n_train, "n_test": args.n_test,
        "trained_values": chain.dims[0], "damping": DAMPING, "fit_examples": 1000,
        "query_block": args.query_block, "train_batch": args.train_batch,
        "in_memory_matrix_bytes": args.n_train * args.n_test * 4,
        "resident_before_scoring_bytes": run.resident_before, "peak_resident_bytes": run.peak_resident,
        "peak_resident_growth_bytes": run.peak_resident - run.resident_before,
        "fit_seconds": run.fit_seconds, "pairwise_seconds": run.pairwise_seconds,
        "seconds_per_query_block": run.pairwise_seconds / n_blocks,
        "note": "EK-FAC factors (covariances, eigenvalue correction) on the first 1,000 examples with labels "
                "sampled from the model; pairwise_seconds and the peak span compute_pairwise_scores (which writes "
                "the matrix to disk) and load_pairwise_scores; seconds_per_query_block is their mean over blocks",
    }
    if args.agreement:
        chain.fit()
        ours = ik.pairwise(chain, None, test, out=None, k=args.k, query_block=args.query_block,
                           progress=False).matrix()
        theirs = run.scores.T.double()
        summary["agreement"] = {
            "pearson_overall": pearson(-ours.double().reshape(-1), theirs.reshape(-1)),
            "pearson_per_query_median": float(torch.tensor(
                [pearson(-ours[:, j].double(), theirs[:, j]) for j in range(args.n_test)]).median()),
            "what": "Pearson of −influkit I(z, q) (exact Gauss-Newton, λ = 1e-3) with kronfluence's score[q, z] "
                    "(EK-FAC, λ = 1e-3)",
        }
    save(f"bench_pairwise_kronfluence_{args.tag}.json", summary)
    return 0


def pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a - a.mean(), b - b.mean()
    return float(a @ b / (a.norm() * b.norm()))


def save(name: str, summary: dict) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / name).write_text(json.dumps(summary, indent=1))
    record(RESULTS, [name], note="synthetic data (a throughput measurement); 1 torch thread")
    (RESULTS / TABLE).write_text(table())
    record(RESULTS, [TABLE], note="from the results files beside it")
    print(json.dumps({k: v for k, v in summary.items() if k != "blocks"}, indent=1))


TABLE = "pairwise_table.md"
MIB = 2**20


def table() -> str:
    """influkit's and the peer's runs side by side, one row per results file by size, then where the peer's
    memory stops fitting (its measured peak growth per byte of matrix, at its largest run)."""
    runs = sorted((json.loads(p.read_text()) | {"file": p.name} for p in RESULTS.glob("bench_pairwise_*.json")),
                  key=lambda r: (r["n_train"] * r["n_test"], r.get("peer", "")))
    lines = ["# Pairwise scores: influkit streamed vs kronfluence in memory", "",
             "Written by benchmarks/bench_pairwise.py from the JSON files beside it (1 torch thread, 2 shared cores; "
             "the load is in MANIFEST.json). Peak RSS growth: the peak resident memory while scoring over the "
             "resident memory before. Same model (MLP 64 → 32 → 10, 2,410 values), data and λ = 1e-3.", "",
             "| method | n_train × n_test | matrix MiB | budget MiB | peak RSS growth MiB | peak RSS MiB | fit s | "
             "pairwise s | s per query block | query block | Pearson vs influkit | file |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        agreement = r.get("agreement", {}).get("pearson_overall")
        lines.append("| " + " | ".join([
            r.get("peer", "influkit ik.pairwise"), f"{r['n_train']:,} × {r['n_test']:,}",
            f"{r['in_memory_matrix_bytes'] / MIB:.0f}",
            f"{r['budget_bytes'] / MIB:.0f}" if "budget_bytes" in r else "none",
            f"{r['peak_resident_growth_bytes'] / MIB:.0f}", f"{r['peak_resident_bytes'] / MIB:.0f}",
            f"{r['fit_seconds']:.1f}", f"{r['pairwise_seconds']:.1f}", f"{r['seconds_per_query_block']:.1f}",
            f"{r['query_block']}", "" if agreement is None else f"{agreement:.3f}", r["file"]]) + " |")
    peers = [r for r in runs if "peer" in r]
    if peers:
        largest = peers[-1]
        ratio = largest["peak_resident_growth_bytes"] / largest["in_memory_matrix_bytes"]
        budget = max(r.get("budget_bytes", 0) for r in runs) or 256 * MIB
        over = [r for r in peers if r["peak_resident_growth_bytes"] > budget]
        memory = machine_memory()
        lines += ["", f"Where {largest['peer']} stops fitting: it holds the whole matrix; at its largest run here "
                  f"({largest['n_train']:,} × {largest['n_test']:,}) its peak growth was {ratio:.2f}× the matrix's "
                  f"bytes. Within influkit's budget of {budget / MIB:.0f} MiB it does not fit from "
                  + (f"{over[0]['n_train']:,} × {over[0]['n_test']:,} (measured: "
                     f"{over[0]['peak_resident_growth_bytes'] / MIB:.0f} MiB)" if over else "no size run here")
                  + f"; at {ratio:.2f}× it would pass that budget at n_train · n_test > "
                  f"{budget / (4 * ratio):,.0f} and this machine's {memory / 2**30:.1f} GiB (MemTotal) at > "
                  f"{memory / (4 * ratio):,.0f} pairs, e.g. {memory / (4 * ratio * 1000):,.0f} × 1,000 "
                  "(extrapolated, not run: the machine is shared). influkit's measured growth stayed under its "
                  "budget at every size run here (its blocks and chunks are sized from the budget, not from "
                  "n_train · n_test)."]
    return "\n".join(lines) + "\n"


def machine_memory() -> int:
    """This machine's total memory in bytes (/proc/meminfo MemTotal)."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
