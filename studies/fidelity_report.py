"""Tables and plots of the fidelity benchmark, from the cached re-trainings and scores (nothing is re-computed).

LDS(t) = Spearman over subsets of (Σ_{i∈S_j} score_i(t), test loss of t after re-training on S_j); the table gives
its mean over the q test points ± the standard error (std/√q), and each method's seconds (K members in total).
Noise ceiling: the LDS one from-scratch re-training seed reaches when it "predicts" another seed's outputs on the
same subsets (mean over seed pairs); warm-start re-training is deterministic, so its ceiling is 1.
"""

from __future__ import annotations

import hashlib
import json
from itertools import combinations
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from safetensors.torch import load_file

from studies.fidelity_methods import PEERS, all_methods, scores_path
from studies.fidelity_replay import APPROXIMATE_SEGMENTS
from studies.fidelity_tasks import PROTOCOLS, Task, subsets_for
from influkit.validation import lds_per_query  # the metric (influkit.validation.lds)

ENSEMBLE_K = (1, 5)
UNROLLED_APPROXIMATE = f"unrolled approximate ({APPROXIMATE_SEGMENTS} segments per stage"
"""The prefix of the approximate-unrolling rows (dense-Hessian or EK-FAC segments, ``fidelity_unrolled``)."""


def load_outputs(task: Task, protocol: str, subsets: torch.Tensor, seeds: list[int]) -> tuple[np.ndarray, list[int]]:
    """((M', S, q) outputs, subset ids) from the cache only: the longest prefix of ``seeds`` whose re-trainings
    exist for every subset (an unfinished run reports its finished seeds), else the subsets finished for seed 0."""
    seeds = [0] if protocol == "warm" else seeds
    for count in range(len(seeds), 0, -1):
        outputs, ids = _stored(task, protocol, subsets, seeds[:count])
        if len(ids) == subsets.shape[0]:
            return outputs, ids
    return _stored(task, protocol, subsets, seeds[:1])


def _stored(task: Task, protocol: str, subsets: torch.Tensor, seeds: list[int]) -> tuple[np.ndarray, list[int]]:
    rows, ids = [], []
    for j in range(subsets.shape[0]):
        subset_hash = hashlib.sha256(subsets[j].numpy().tobytes()).hexdigest()[:8]
        paths = [task.directory / protocol / f"subset{j:04d}_seed{s}_{task.config.digest()}_{subset_hash}.safetensors"
                 for s in seeds]
        if all(p.exists() for p in paths):
            rows.append(np.stack([load_file(p)["outputs"].numpy() for p in paths]))
            ids.append(j)
    return (np.stack(rows) if rows else np.zeros((0, len(seeds), 0))), ids


def write_outputs(task: Task, protocol: str, subsets: torch.Tensor, seeds: list[int], path: Path) -> None:
    """The re-trainings' test losses in long format (subset, seed, test point, loss), gzip CSV: with the seeded
    subsets (``fidelity_tasks.subsets_for``) they reproduce every LDS without re-training."""
    outputs, ids = load_outputs(task, protocol, subsets, seeds)
    used = [0] if protocol == "warm" else seeds[: outputs.shape[1]]
    m, s, q = outputs.shape
    j, k, t = np.meshgrid(np.asarray(ids), np.arange(s), np.arange(q), indexing="ij")
    pd.DataFrame({"subset": j.reshape(-1), "seed": np.asarray(used)[k.reshape(-1)], "test": t.reshape(-1),
                  "loss": outputs.reshape(-1)}).to_csv(path, index=False, float_format="%.10g",
                                                    compression={"method": "gzip", "mtime": 0})  # same bytes each run


def noise_ceiling(outputs: np.ndarray) -> float:
    """Mean over seed pairs (a, b) and queries of Spearman_j(outputs[j, a, t], outputs[j, b, t])."""
    if outputs.shape[1] < 2:
        return float("nan")
    values = []
    for a, b in combinations(range(outputs.shape[1]), 2):
        values.append(np.nanmean(_spearman_columns(outputs[:, a], outputs[:, b])))
    return float(np.mean(values))


def _spearman_columns(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    from scipy import stats

    ra, rb = stats.rankdata(a, axis=0), stats.rankdata(b, axis=0)
    ra, rb = ra - ra.mean(0), rb - rb.mean(0)
    return (ra * rb).sum(0) / np.sqrt((ra**2).sum(0) * (rb**2).sum(0))


def lds_rows(task: Task, protocol: str, subsets: torch.Tensor, seeds: list[int]) -> tuple[pd.DataFrame, dict]:
    """One row per (method, K) with cached scores: LDS, sem over test points, seconds; and the run's facts."""
    outputs, ids = load_outputs(task, protocol, subsets, seeds)
    facts = {"task": task.config.name, "protocol": protocol, "M": len(ids),
             "seeds": 1 if protocol == "warm" else outputs.shape[1], "q": int(outputs.shape[-1]),
             "n": int(subsets.shape[1]),
             "noise ceiling": 1.0 if protocol == "warm" else noise_ceiling(outputs) if len(ids) >= 3 else float("nan")}
    rows = []
    if len(ids) < 3:
        return pd.DataFrame(rows), facts
    masks = subsets[ids].numpy()
    actual = outputs.mean(1)
    for method in all_methods():
        for k in ENSEMBLE_K:
            path = scores_path(task, method, k)
            if not path.exists():
                continue
            stored = load_file(path)
            per_query = lds_per_query(stored["scores"].numpy(), masks, actual)
            valid = per_query[np.isfinite(per_query)]
            rows.append({"method": method, "K": k, "LDS": valid.mean(), "sem": valid.std(ddof=1) / np.sqrt(valid.size),
                         "seconds": float(stored["seconds"])})
    return pd.DataFrame(rows), facts


def markdown(frame: pd.DataFrame) -> str:
    """A GitHub table: LDS ± sem to 3 decimals, seconds to 1."""
    lines = ["| method | K | LDS ± sem | seconds |", "|---|---|---|---|"]
    for _, row in frame.iterrows():
        seconds = f"{row['seconds']:.2f}" if row["seconds"] < 10 else f"{row['seconds']:.1f}"
        lines.append(f"| {row['method']} | {row['K']} | {row['LDS']:.3f} ± {row['sem']:.3f} | {seconds} |")
    return "\n".join(lines)


def summary(tables: dict) -> str:
    """One GitHub table: a row per method, a column per (task, protocol), cells "LDS K=1 (K=5)"."""
    keys = [key for key, (frame, _) in tables.items() if not frame.empty]
    present = [m for key in keys for m in tables[key][0].method]
    methods = [m for m in dict.fromkeys(all_methods() + present) if m in present]
    header = "| method | " + " | ".join(f"{name} {protocol} (M = {tables[name, protocol][1]['M']})"
                                         for name, protocol in keys) + " |"
    lines = [header, "|---" * (len(keys) + 1) + "|"]
    for method in methods:
        cells = []
        for key in keys:
            frame = tables[key][0].set_index(["method", "K"])["LDS"]
            k1, k5 = frame.get((method, 1)), frame.get((method, 5))
            cells.append("—" if k1 is None else f"{k1:.3f}" + ("" if k5 is None else f" ({k5:.3f})"))
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    ceilings = [("1" if p == "warm" else f"{tables[n, p][1]['noise ceiling']:.3f}") for n, p in keys]
    lines.append("| noise ceiling | " + " | ".join(ceilings) + " |")
    return "\n".join(lines)


def targets(tables: dict) -> list[str]:
    """The issue's two targets, per task, as sentences with the measured gap."""
    lines = []
    for (name, protocol), (frame, facts) in tables.items():
        if frame.empty:
            continue
        k1 = frame[frame.K == 1].set_index("method")["LDS"]
        if "unrolled" in facts and not facts["unrolled"]["reproduction"]["reproduced"]:
            lines.append(f"- {name}, {protocol}: approximate unrolling vs EK-FAC not measured (the committed re-trainings "
                         "are not reproduced by today's code; see the table's note).")
        peers = k1[[m for m in k1.index if m in PEERS]]
        exact = k1.get("influkit exact (auto: direct on H)")
        if protocol == "warm" and exact is not None and len(peers):
            best = peers.idxmax()
            gap = exact - peers.max()
            lines.append(f"- {name}, warm start: influkit exact {exact:.3f} vs best peer {best} {peers.max():.3f}: "
                         f"margin {gap:+.3f} (target ≥ +0.10: {'met' if gap >= 0.10 else 'missed'}).")
        ekfac = k1.get("influkit EK-FAC")
        for method in [m for m in k1.index if m.startswith(UNROLLED_APPROXIMATE) and ekfac is not None]:
            approximate = k1[method]
            lines.append(f"- {name}, {protocol}: {method} {approximate:.3f} vs influkit EK-FAC {ekfac:.3f} "
                         f"(K = 1; target ≥ EK-FAC: {'met' if approximate >= ekfac else 'missed'}, "
                         f"gap {approximate - ekfac:+.3f}).")
        if protocol == "scratch":
            k5 = frame[frame.K == 5].set_index("method")["LDS"]
            ours = k5[[m for m in k5.index if m.startswith("influkit")]]
            trak = k5.get("TRAK (traker)")
            if len(ours) and trak is not None:
                best = ours.idxmax()
                exact5 = k5.get("influkit exact (auto: direct on H)", float("nan"))
                lines.append(f"- {name}, from scratch, K = 5: influkit exact {exact5:.3f} (best influkit: {best} "
                             f"{ours.max():.3f}) vs TRAK {trak:.3f}: exact {'≥' if exact5 >= trak else '<'} TRAK "
                             f"(target {'met' if exact5 >= trak else 'missed'}, gap {exact5 - trak:+.3f}).")
    return lines


def plot(tables: dict, path: Path) -> None:
    """LDS vs seconds (log) per method, one panel per (task, protocol); K = 5 hollow markers."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(name for (name, _), (frame, _) in tables.items() if not frame.empty))
    if not names:
        return
    fig, axes = plt.subplots(len(names), len(PROTOCOLS), figsize=(6 * len(PROTOCOLS), 4.2 * len(names)), squeeze=False)
    methods = list(dict.fromkeys(all_methods() + [m for frame, _ in tables.values() for m in frame.method]))
    colors = {m: plt.cm.tab20(i % 20) for i, m in enumerate(methods)}
    for r, name in enumerate(names):
        for c, protocol in enumerate(PROTOCOLS):
            ax = axes[r][c]
            frame, facts = tables[name, protocol]
            if frame.empty:
                ax.set_axis_off()
                ax.set_title(f"{name}, {protocol}: not run", fontsize=9)
                continue
            for _, row in frame.iterrows():
                ax.errorbar(row["seconds"], row["LDS"], yerr=row["sem"], fmt="o" if row["K"] == 1 else "s",
                            color=colors[row["method"]], mfc=colors[row["method"]] if row["K"] == 1 else "none",
                            label=row["method"] if row["K"] == 1 else None, ms=6, capsize=2)
            if protocol == "scratch" and np.isfinite(facts["noise ceiling"]):
                ax.axhline(facts["noise ceiling"], color="gray", ls=":", lw=1, label="noise ceiling (seed vs seed)")
            ax.axhline(0, color="k", lw=0.5)
            ax.set_xscale("log")
            ax.set_xlabel("seconds (K members; filled K = 1, hollow K = 5)")
            ax.set_ylabel("LDS (mean ± sem over test points)")
            ax.set_title(f"{name}, {protocol} (M = {facts['M']}, seeds {facts['seeds']})", fontsize=9)
    axes[0][0].legend(fontsize=6, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_tables(task: Task, m: int, seeds: list[int], results: Path, all_tasks: list[Task] | None = None) -> None:
    """Write results/fidelity/{task}_{protocol}.csv/.json/_outputs.csv.gz from the cache for every task, then the
    combined README_results.md and lds_vs_seconds.png. Rows of methods the cache lacks (the unrolled rows of
    ``fidelity_unrolled``, scored against the committed outputs) and the JSON's ``unrolled`` facts are kept."""
    results.mkdir(parents=True, exist_ok=True)
    tables = {}
    for t in all_tasks or [task]:
        subsets = subsets_for(t, m)
        for protocol in PROTOCOLS:
            frame, facts = lds_rows(t, protocol, subsets, seeds)
            stem = results / f"{t.config.name}_{protocol}"
            if not frame.empty and Path(f"{stem}.csv").exists():
                kept = pd.read_csv(f"{stem}.csv")
                frame = pd.concat([frame, kept[~kept.method.isin(frame.method)]], ignore_index=True)
                facts |= {k: v for k, v in json.loads(stem.with_suffix(".json").read_text()).items() if k == "unrolled"}
            tables[t.config.name, protocol] = (frame, facts)
            if frame.empty:
                continue
            frame.to_csv(f"{stem}.csv", index=False)
            write_outputs(t, protocol, subsets, seeds, Path(f"{stem}_outputs.csv.gz"))
            stem.with_suffix(".json").write_text(json.dumps(facts, indent=1))
    write_summary(tables, results)


def committed_tables(names: list[str], results: Path) -> dict:
    """{(task, protocol): (rows, facts)} read back from the committed results/<task>_<protocol>.csv and .json."""
    tables = {}
    for name in names:
        for protocol in PROTOCOLS:
            stem = results / f"{name}_{protocol}"
            if Path(f"{stem}.csv").exists():
                tables[name, protocol] = (pd.read_csv(f"{stem}.csv"), json.loads(stem.with_suffix(".json").read_text()))
    return tables


def unrolled_note(facts: dict) -> str:
    """One sentence on the run the unrolled rows differentiate (``fidelity_unrolled``), or '' without them."""
    info = facts.get("unrolled")
    if not info:
        return ""
    check = info["reproduction"]
    if not check["reproduced"]:
        return (f"Unrolled rows: not reported — today's re-training of subset {check['subset']} (seed 0) differs from "
                f"the committed outputs by up to {check['max |Δ test loss|']:.2g} in a test loss.")
    norms = ", ".join(f"{v:.1e}" for v in info["final gradient norms"])
    return (f"Unrolled rows (studies/fidelity_unrolled.py): they differentiate {info['run']}, "
            f"{' + '.join(map(str, info['steps']))} steps of {' / '.join(info['optimizers'])}; final ‖∇‖ {norms}; "
            f"recording {info['recording seconds (one run)']:.1f} s (seconds column: the reverse or segment pass); "
            f"today's re-training of subset {check['subset']} matches the committed outputs to "
            f"{check['max |Δ test loss|']:.1e}." + _horizon_note(info))


def _horizon_note(info: dict) -> str:
    scan = info.get("horizon: approximate unrolling's LDS vs the continuation's steps")
    if not scan:
        return ""
    return (" LDS of the approximate unrolling as the continuation lengthens: "
            + ", ".join(f"{steps} steps {lds:.3f}" for steps, lds in scan.items()) + ".")


def write_summary(tables: dict, results: Path) -> None:
    """README_results.md (summary table, one table per task and protocol, targets) and lds_vs_seconds.png."""
    sections = [
        "## LDS head to head (studies/fidelity.py)", "",
        "Linear datamodeling score of every method on the same trained chains, subsets (α = 0.5) and re-trainings; "
        "mean over test points ± standard error; seconds for all K members (1 torch thread, 2 shared cores under "
        "load 8-10, so seconds are noisy). Scores of the peers (single-stage tools) come from one model whose "
        "parameters are the pretraining model's and whose query is the finetuned model's test loss on the shared "
        "embedding (benchmarks/README.md, bench_fidelity). Warm: re-training continues from the trained weights "
        "(deterministic); scratch: fresh initializations, outputs averaged over the seeds. K = 5: scores "
        "averaged over 5 chains trained from different initializations (influkit.Ensemble).", "",
        "![LDS vs seconds](studies/results/fidelity/lds_vs_seconds.png)", "",
        "LDS with K = 1 (K = 5) members:", "", summary(tables), ""]
    for (name, protocol), (frame, facts) in tables.items():
        if frame.empty:
            sections.append(f"**{name}, {protocol}**: no re-trainings cached yet.\n")
            continue
        ceiling = "1 (deterministic)" if protocol == "warm" else f"{facts['noise ceiling']:.3f}"
        sections += [f"**{name}, {protocol} re-training** — M = {facts['M']} subsets (α = 0.5 of n = {facts['n']}), "
                     f"{facts['seeds']} seed(s) per subset, q = {facts['q']} test points; noise ceiling {ceiling}.", "",
                     markdown(frame), ""] + ([unrolled_note(facts), ""] if unrolled_note(facts) else [])
    sections += ["**Targets**", ""] + targets(tables) + [""]
    (results / "README_results.md").write_text("\n".join(sections))
    plot(tables, results / "lds_vs_seconds.png")
    print("\n".join(sections))
