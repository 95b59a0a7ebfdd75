"""A check of a result against the user's own retraining: removal groups and the noise floor of retraining itself.

The user gives ``retrain(keep, seed) -> float``: their whole pipeline (every stage, their own loops and
optimizers) re-run from stage-1 examples ``keep`` (a sorted 1-D LongTensor of indices into stage 1's data) with
``seed`` setting whatever their run draws (initialization, batch order, dropout), returning the measure the
result scored: the summed test loss f(T), or whatever ``measure`` the query took.

For seeds s = 1..S, with b_s = retrain(all, s) the baseline and G a group of removed examples:

- Δ_{G,s} = retrain(all ∖ G, s) − b_s, paired by seed (same seed, same draws where the user's loop makes them so);
  ``actual`` = mean_s Δ_{G,s}, ``actual_sd`` = their standard deviation over seeds (ddof = 1);
- ``predicted`` = Σ_{i∈G} removal_i, the result's linear prediction of the change (``InfluenceResult.removal``);
- the **noise floor** = sd_s(b_s) (ddof = 1): how much the measure moves when nothing is removed and only the
  seed (the batch order, the initialization) changes; zero for a deterministic retrainer. A |Δ| below it is what
  one retraining does by chance; the mean of S paired differences has standard error ``actual_sd``/√S.

Groups: the k most harmful (largest score: removing them should lower the loss), the k most helpful (smallest
score), ``random`` groups of k drawn with a seeded generator, and any the user names.

For a recorded run (``record=``, :mod:`influkit.unrolled`) the table also gets the **replayed** change: the record
replayed with the group's stage-1 examples weighted 0 — the same run (start, batches, masks, dropout, schedule),
only the group removed — minus the record replayed as it ran. That is the counterfactual an unrolled metagradient
predicts, with no retraining noise; the user's retraining beside it shows how far their own reruns (another batch
order, another seed) move the measure besides.

One seed gives no noise floor: the floor is a spread over seeds, so ``noise_floor`` and ``actual_sd`` are NaN and
:func:`check_retraining` warns, naming the fix (two or more seeds), rather than leave a NaN unexplained.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from ..errors import InputError, warn
from ..extras import require
from ..results import InfluenceResult

if TYPE_CHECKING:
    from matplotlib.figure import Figure

Retrain = Callable[[torch.Tensor, int], float]  # retrain(keep, seed) -> the measure after re-running every stage

COLUMNS = ("group", "size", "predicted", "actual", "actual_sd", "noise_floor", "seeds")  # the table's, in order
REPLAYED = "replayed"  # the column of a recorded run replayed without the group (module docstring)


@dataclass
class RetrainingCheck:
    """A result checked against the user's retraining (module docstring).

    table: one row per group: ``group``, ``size``, ``predicted``, ``actual`` (mean over seeds), ``actual_sd``,
    ``noise_floor``, ``seeds``, and ``replayed`` for a recorded run (the record replayed without the group). runs: one row per retraining: ``group``, ``seed``, ``value``, ``change``
    (the baseline's rows have group ``"none"`` and change 0). noise_floor: sd of the baseline over seeds.
    """

    table: pd.DataFrame
    runs: pd.DataFrame
    noise_floor: float

    def figure(self, title: str | None = None) -> Figure:
        """Predicted against actual change per group (mean ± sd over seeds), y = x, and the noise floor as a band."""
        return plot_check(self.table, title=title)

    def save(self, directory: str | Path, name: str = "check") -> list[Path]:
        """Write ``<name>.csv`` (the table), ``<name>_runs.csv`` and ``<name>.png`` (the figure) to ``directory``."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        paths = [directory / f"{name}.csv", directory / f"{name}_runs.csv", directory / f"{name}.png"]
        self.table.to_csv(paths[0], index=False)
        self.runs.to_csv(paths[1], index=False)
        fig = self.figure(title=name)
        fig.savefig(paths[2], dpi=110)
        return paths


def check_retraining(
    result: InfluenceResult,
    retrain: Retrain | None,
    *,
    k: int = 10,
    seeds: Sequence[int] | int = 3,
    random: int = 2,
    groups: Mapping[str, Sequence[int]] | None = None,
    seed: int = 0,
    record=None,
    test=None,
    measure=None,
    progress: bool = True,
) -> RetrainingCheck:
    """The result's predicted removal effects beside the user's own retraining, with its noise floor.

    result: scores of stage-1 examples (its ``index`` the example ids, its ``n_train`` the stage-1 size m).
    retrain: ``retrain(keep, seed) -> float``, the user's whole pipeline re-run on stage-1 examples ``keep`` (a
    sorted LongTensor) with ``seed``, returning the scored measure (the summed test loss for a default query);
    None with a ``record`` (the replayed column alone).
    record, test, measure: a recorded run (:class:`influkit.unrolled.Record`) and the test set and measure the
    result scored (as ``ik.unrolled.metagradients`` takes them): adds the ``replayed`` column, the record replayed
    with each group weighted 0 minus the record replayed as it ran (the measure summed over its outputs).
    k: size of the harmful, helpful and random groups. seeds: the seeds each group and the baseline are run with
    (an int S: 0..S−1); two or more give a noise floor and a spread. random: how many random groups of k (drawn
    from the scored examples by a generator seeded with ``seed``). groups: more groups, {name: example ids}.
    Returns a :class:`RetrainingCheck`; (len(groups) + 1)·S retrainings, a progress bar over them.
    """
    if retrain is None and record is None:
        raise InputError("give retrain (your pipeline re-run without a group), a record (the recorded run replayed "
                         "without it), or both.")
    if record is not None and test is None:
        raise InputError("a record needs the test set the result scored (test=, with measure= if it took one).")
    seeds = list(range(seeds)) if isinstance(seeds, int) else [int(s) for s in seeds]
    if retrain is None:
        seeds = []
    elif not seeds:
        raise InputError("seeds is empty: give at least one seed (two or more measure the noise floor).")
    if len(set(seeds)) != len(seeds):
        raise InputError(f"seeds {seeds} repeat a seed; give distinct seeds.")
    total = result.total.detach().cpu().double()
    ids = result.index.cpu().long()
    if not 0 < k <= len(ids):
        raise InputError(f"k must be in 1..{len(ids)} (the scored examples), got {k}.")
    if random < 0:
        raise InputError(f"random must be ≥ 0, got {random}.")
    order = torch.argsort(total, descending=True)
    chosen: dict[str, torch.Tensor] = {"most harmful": ids[order[:k]], "most helpful": ids[order.flip(0)[:k]]}
    gen = torch.Generator().manual_seed(int(seed))
    for r in range(random):
        chosen[f"random {r + 1}"] = ids[torch.randperm(len(ids), generator=gen)[:k]]
    m = int(result.n_train)
    for name, members in (groups or {}).items():
        members = torch.as_tensor(members, dtype=torch.long).reshape(-1)
        if name in chosen or name == "none":
            raise InputError(f"group name {name!r} is taken; name your groups otherwise.")
        if len(members) == 0 or not bool(((members >= 0) & (members < m)).all()):
            raise InputError(f"group {name!r} must be non-empty indices of the {m} stage-1 examples.")
        chosen[name] = members
    eps = result.removal_eps
    removal = total * (eps.cpu().double() if torch.is_tensor(eps) else float(eps))  # the result's own removal
    position = {int(i): j for j, i in enumerate(ids.tolist())}
    predicted = {}
    for name, members in chosen.items():
        missing = [int(i) for i in members if int(i) not in position]
        if missing:
            raise InputError(f"group {name!r} holds examples {missing[:5]} the result did not score; score them first.")
        predicted[name] = float(sum(removal[position[int(i)]] for i in members))

    replayed = _replayed(record, test, measure, chosen, m, progress) if record is not None else None
    if len(seeds) == 1:
        warn(f"one seed ({seeds[0]}) gives no noise floor: the floor is the spread over seeds of your retraining with "
             "nothing removed, so noise_floor and actual_sd are NaN; give seeds=2 or more to measure how far your "
             "reruns move the measure by chance.")
    everything = torch.arange(m)
    bar = tqdm(total=(len(chosen) + 1) * len(seeds), desc="retraining", disable=not progress)
    rows = []

    def run(name: str, keep: torch.Tensor, s: int) -> float:
        value = float(retrain(keep, s))
        bar.update()
        if not np.isfinite(value):
            raise InputError(f"retrain returned {value} for group {name!r}, seed {s}; it must return a finite measure.")
        return value

    baseline = {s: run("none", everything, s) for s in seeds}
    rows += [{"group": "none", "seed": s, "value": v, "change": 0.0} for s, v in baseline.items()]
    for name, members in chosen.items():
        mask = torch.ones(m, dtype=torch.bool)
        mask[members] = False
        keep = mask.nonzero().reshape(-1)
        for s in seeds:
            value = run(name, keep, s)
            rows.append({"group": name, "seed": s, "value": value, "change": value - baseline[s]})
    bar.close()
    runs = pd.DataFrame(rows, columns=["group", "seed", "value", "change"])
    floor = float(np.std(list(baseline.values()), ddof=1)) if len(seeds) > 1 else float("nan")
    changes = runs[runs["group"] != "none"].groupby("group", sort=False)["change"]
    table = pd.DataFrame({
        "group": list(chosen),
        "size": [len(members) for members in chosen.values()],
        "predicted": [predicted[name] for name in chosen],
        "actual": changes.mean().reindex(list(chosen)).to_numpy() if seeds else np.nan,
        "actual_sd": changes.std(ddof=1).reindex(list(chosen)).to_numpy() if len(seeds) > 1 else np.nan,
        "noise_floor": floor,
        "seeds": len(seeds),
    }, columns=list(COLUMNS))
    if replayed is not None:
        table[REPLAYED] = [replayed[name] for name in chosen]
    return RetrainingCheck(table=table, runs=runs, noise_floor=floor)


def _replayed(record, test, measure, chosen: Mapping[str, torch.Tensor], m: int, progress: bool) -> dict[str, float]:
    """{group: the record's summed measure replayed with the group's stage-1 examples weighted 0, minus as it ran}."""
    from ..unrolled import outputs

    if len(record.runs[0].stage) != m:
        raise InputError(f"the record's first stage has {len(record.runs[0].stage)} examples but the result scored "
                         f"{m}; pass the record the result was computed from.")
    dtype = next(iter(record.runs[0].final.values())).dtype
    base = float(outputs(record, test, measure=measure).sum())
    out = {}
    for name, members in tqdm(chosen.items(), desc="replaying", disable=not progress):
        weights = torch.ones(m, dtype=dtype)
        weights[members] = 0
        out[name] = float(outputs(record, test, [weights], measure=measure).sum()) - base
    return out


def plot_check(table: pd.DataFrame, title: str | None = None, ax=None) -> Figure:
    """Predicted (x) against actual (y, mean ± sd over seeds) change per group of a :func:`check_retraining` table,
    the line y = x, and the noise floor ±sd of retraining with nothing removed as a grey band around y = 0."""
    missing = {"group", "predicted", "actual"} - set(table.columns)
    if missing:
        raise InputError(f"the table lacks the column(s) {sorted(missing)}; plot a check_retraining table.")
    if ax is None:
        fig = require("matplotlib.figure", "the validation plot").Figure(figsize=(5.6, 4.6))
        ax = fig.add_subplot()
    else:
        fig = ax.figure
    p = table["predicted"].to_numpy(float)
    a = table["actual"].to_numpy(float)
    sd = table["actual_sd"].to_numpy(float) if "actual_sd" in table else np.zeros_like(a)
    floor = float(table["noise_floor"].iloc[0]) if "noise_floor" in table and len(table) else float("nan")
    lo = float(np.nanmin(np.concatenate([p, a - np.nan_to_num(sd)]))) if len(p) else -1.0
    hi = float(np.nanmax(np.concatenate([p, a + np.nan_to_num(sd)]))) if len(p) else 1.0
    if np.isfinite(floor):
        lo, hi = min(lo, -floor), max(hi, floor)
    pad = 0.08 * (hi - lo if hi > lo else 1.0)
    lo, hi = lo - pad, hi + pad
    if np.isfinite(floor):
        ax.axhspan(-floor, floor, color="#d5d8dc", alpha=0.7, lw=0,
                   label=f"noise floor ±{floor:.3g} (sd, nothing removed)")
    ax.plot([lo, hi], [lo, hi], color="grey", lw=0.8, ls="--", label="actual = predicted")
    ax.axhline(0, color="black", lw=0.5)
    ax.axvline(0, color="black", lw=0.5)
    colours = {"most harmful": "#c0392b", "most helpful": "#2471a3"}
    labelled = set()
    for j, name in enumerate(table["group"]):
        kind = name if name in colours else "random or named"
        ax.errorbar(p[j], a[j], yerr=None if np.isnan(sd[j]) else sd[j], fmt="o", ms=6, capsize=3,
                    color=colours.get(name, "#7d8c8d"), label=None if kind in labelled else kind)
        labelled.add(kind)
        ax.annotate(str(name), (p[j], a[j]), textcoords="offset points", xytext=(6, 4), fontsize=7)
    ax.set_xlim(lo, hi)
    ax.set_ylim(lo, hi)
    ax.set_xlabel("predicted change of the measure (sum of removal)")
    ax.set_ylabel("actual change, mean ± sd over seeds")
    ax.legend(fontsize=7, loc="upper left")
    if title:
        ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig
