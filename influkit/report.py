"""A self-contained HTML page of an :class:`~influkit.results.InfluenceResult` (``influkit report``).

The page shows, per query, the most harmful (largest score: up-weighting them raises that query's loss) and the
most helpful (smallest score) training examples rendered as they are — images as thumbnails, text as text —,
the distribution of the scores, where each stage stands (a banner names every stage not at a minimum and every
Case 2 stage whose drift disagrees with its α), the solve diagnostics and settings as tables, and the validation
(predicted vs actual change of the test loss on removal) when there is one: a leave-out scatter, or a check
against retraining (:func:`influkit.validation.check_retraining`) with its table and the noise floor drawn. Nothing is fetched when it opens: the CSS is inline and every
picture is a base64 PNG ``data:`` URI, so the file can be mailed or archived alone.

The report only reads a result. What the page needs beyond the scores — the renderings of the examples it
shows, the queries, the validation pairs (JSON: texts and small PNGs) — :func:`attach` puts into the
``diagnostics["report"]`` of a *copy* of the result, so that copy, saved, renders the same page again from the
file alone (``influkit report RESULT -o page.html``); :func:`write_report` never changes the result it is given.
"""

from __future__ import annotations

import base64
import html
import io
import math
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import torch

from .errors import InputError
from .extras import require
from .results import InfluenceResult

if TYPE_CHECKING:  # annotations only: matplotlib is the `plot` extra, loaded when a page is written
    from matplotlib.figure import Figure

MAX_TEXT = 600  # characters of a text example shown
STRIP = 16  # test examples shown in the strip of a summed result; the rest behind "all N test examples"
MAX_QUERIES_STORED = 500  # test examples rendered into the page at most
LONG_CELL = 60  # characters of a table cell shown before it is collapsed into <details> (one line of its start)

_CSS = """
body { font-family: system-ui, -apple-system, 'Segoe UI', sans-serif; margin: 24px auto; max-width: 1100px;
       color: #1d232b; background: #fff; line-height: 1.4; padding: 0 16px; }
h1 { font-size: 1.5em; margin-bottom: 0.2em; } h2 { font-size: 1.2em; border-bottom: 1px solid #d6dbe1;
     padding-bottom: 4px; margin-top: 1.4em; } h3 { font-size: 1em; margin: 0.7em 0 0.3em; }
.note { color: #56606b; font-size: 0.9em; }
.query { border: 1px solid #d6dbe1; border-radius: 6px; padding: 8px 12px; margin: 12px 0; }
.row { display: flex; flex-wrap: wrap; gap: 8px; }
.card { border-radius: 4px; padding: 4px; width: 108px; font-size: 0.72em; background: #f6f7f9; white-space: nowrap; }
.card.wide { width: 250px; white-space: normal; }
.harmful .card { border-top: 4px solid #c0392b; } .helpful .card { border-top: 4px solid #2471a3; }
.card img, .queryitem img { width: 88px; height: 88px; image-rendering: pixelated; display: block;
                            margin: 2px auto; background: #fff; object-fit: contain; }
.strip { display: flex; flex-wrap: wrap; gap: 6px 4px; align-items: flex-start; }
.strip .queryitem img { width: 48px; height: 48px; }
.strip .queryitem { font-size: 0.72em; margin: 0; text-align: center; width: 64px; max-width: 64px; }
.strip .queryitem.textitem { width: 220px; max-width: 220px; text-align: left; }
.strip .queryitem .note { white-space: normal; overflow-wrap: anywhere; line-height: 1.2; }
details.more { margin: 6px 0; } details.more > summary { cursor: pointer; color: #2471a3; font-size: 0.85em; }
details.cell > summary { cursor: pointer; white-space: nowrap; overflow: hidden; text-overflow: ellipsis;
                         max-width: 260px; } details.cell[open] { min-width: 360px; }
.tablewrap { overflow-x: auto; max-width: 100%; }
.banner { border: 1px solid #e0b252; background: #fdf3dc; border-radius: 6px; padding: 8px 12px; margin: 10px 0; }
.banner b { color: #8a5a00; }
.card .text, .queryitem .text { white-space: pre-wrap; word-break: break-word; font-family: ui-monospace,
                                 'DejaVu Sans Mono', monospace; }
.queryitem { display: inline-block; vertical-align: top; max-width: 420px; margin-right: 8px; }
.qbody { display: flex; gap: 12px; align-items: flex-start; }
.panels { display: flex; flex-wrap: wrap; gap: 24px; } .panels > div { flex: 1 1 420px; }
table { border-collapse: collapse; font-size: 0.85em; margin: 6px 0; }
td, th { border: 1px solid #d6dbe1; padding: 3px 8px; text-align: left; } th { background: #f0f2f5; }
img.plot { max-width: 100%; }
"""


def _png(array: np.ndarray) -> str:
    """A base64 PNG of a (H, W) grey image (min–max scaled, dark = high) or a (H, W, 3|4) colour image."""
    mpimg = require("matplotlib.image", "the report page")

    buffer = io.BytesIO()
    lo, hi = float(array.min()), float(array.max())
    if array.ndim == 2:
        mpimg.imsave(buffer, array, cmap="gray_r", vmin=lo, vmax=hi if hi > lo else lo + 1, format="png")
    else:
        scaled = array if lo >= 0 and hi <= 1 else (array - lo) / (hi - lo if hi > lo else 1.0)
        mpimg.imsave(buffer, np.clip(scaled, 0, 1), format="png")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _figure_png(fig: Figure) -> str:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def render_example(item, image_shape: Sequence[int] | None = None) -> dict[str, str]:
    """{"text": ...} for a string, {"png": base64} for an image ((H, W), (C, H, W) or (H, W, C), C ∈ {1, 3, 4};
    a flat vector with ``image_shape``); other arrays are shown as text."""
    if isinstance(item, str):
        return {"text": item[:MAX_TEXT] + ("…" if len(item) > MAX_TEXT else "")}
    array = item.detach().cpu().double().numpy() if torch.is_tensor(item) else np.asarray(item, dtype=float)
    if image_shape is not None:
        array = array.reshape(tuple(image_shape))
    if array.ndim == 3 and array.shape[0] in (1, 3, 4) and array.shape[-1] not in (1, 3, 4):
        array = np.moveaxis(array, 0, -1)
    if array.ndim == 3 and array.shape[-1] == 1:
        array = array[..., 0]
    if array.ndim == 2 or (array.ndim == 3 and array.shape[-1] in (3, 4)):
        return {"png": _png(array)}
    flat = array.reshape(-1)
    shown = ", ".join(f"{v:.3g}" for v in flat[:12])
    return {"text": f"[{shown}{', …' if flat.size > 12 else ''}] ({'×'.join(map(str, array.shape))})"}


def _sections(result: InfluenceResult, k: int, max_queries: int) -> list[dict[str, Any]]:
    """Per query (a test column, or the summed test set): the k largest and k smallest scores with their ids."""
    values = result.values.detach().cpu().double()
    columns = [(j, values[:, j]) for j in range(min(values.shape[1], max_queries))] if result.per_test \
        else [(None, values)]
    sections = []
    for j, scores in columns:
        order = torch.argsort(scores, descending=True)
        kk = min(k, scores.numel())
        sections.append({
            "query": j,
            "harmful": [(int(result.index[i]), float(scores[i])) for i in order[:kk]],
            "helpful": [(int(result.index[i]), float(scores[i])) for i in order.flip(0)[:kk]],
        })
    return sections


def _validation(validation) -> dict[str, Any]:
    """What the page shows of a validation (finite rows only): ``predicted`` and ``actual`` lists, and, from a
    :func:`~influkit.validation.check_retraining` check or its table, ``group``, ``size``, ``actual_sd``, ``seeds``
    and the ``noise_floor`` (also taken from a leave-out frame or dict that carries one)."""
    frame = getattr(validation, "table", validation)  # a RetrainingCheck: its table
    if isinstance(frame, dict):
        frame = pd.DataFrame({k: list(v) if isinstance(v, (list, tuple, np.ndarray)) else [v] * len(frame["predicted"])
                              for k, v in frame.items()}) if "predicted" in frame else pd.DataFrame(frame)
    if not isinstance(frame, pd.DataFrame):
        raise InputError(f"validation must be a check_retraining result or table, a leave-out DataFrame (e.g. "
                         f"influkit.validation.leave_out_retrain's) or a dict with 'predicted' and 'actual', got "
                         f"{type(validation).__name__}.")
    missing = {"predicted", "actual"} - set(frame.columns)
    if missing:
        raise InputError(f"validation lacks the column(s) {sorted(missing)}: give the predicted and the actual change "
                         "of the test loss for each removal (leave_out_retrain(..., predicted=result) has both, "
                         "influkit.validation.check_retraining's table too).")
    frame = frame[np.isfinite(frame["predicted"].astype(float)) & np.isfinite(frame["actual"].astype(float))]
    stored: dict[str, Any] = {"predicted": frame["predicted"].astype(float).tolist(),
                              "actual": frame["actual"].astype(float).tolist()}
    if "group" in frame.columns:
        stored["group"] = [str(g) for g in frame["group"]]
        for column in ("size", "seeds"):
            if column in frame.columns:
                stored[column] = [int(v) for v in frame[column]]
        if "actual_sd" in frame.columns:
            stored["actual_sd"] = [float(v) for v in frame["actual_sd"]]
    if "noise_floor" in frame.columns and len(frame) and np.isfinite(float(frame["noise_floor"].iloc[0])):
        stored["noise_floor"] = float(frame["noise_floor"].iloc[0])
    return stored


def attach(
    result: InfluenceResult,
    *,
    examples=None,
    queries=None,
    validation=None,
    labels: Sequence | None = None,
    query_labels: Sequence | None = None,
    image_shape: Sequence[int] | None = None,
    k: int | None = None,
    max_queries: int | None = None,
    title: str | None = None,
) -> InfluenceResult:
    """A copy of ``result`` whose ``diagnostics["report"]`` holds what the page shows beyond the scores.

    examples: the training examples, indexable by the result's example ids (``result.index``): a list of
    strings, or images as an (N, H, W), (N, C, H, W), (N, H, W, C) tensor/array (or (N, D) with
    ``image_shape``); only the ones shown are rendered and kept. queries: the test examples, one per column of a
    per-test result (else a strip of the test set, up to ``MAX_QUERIES_STORED``). validation: a
    :func:`~influkit.validation.check_retraining` check (or its table: groups, spread over seeds, noise floor), or a
    leave-out frame with ``predicted`` and ``actual`` (and ``noise_floor`` when known). labels / query_labels: a caption per training / test example (e.g. the class).
    k: examples per list (default 8); max_queries: test columns shown of a per-test result (default 12).
    Arguments left None keep what an earlier :func:`attach` stored. ``result`` itself is not changed.
    """
    stored = dict(result.diagnostics.get("report") or {})
    k = int(stored.get("k", 8) if k is None else k)
    max_queries = int(stored.get("max_queries", 12) if max_queries is None else max_queries)
    if k < 1 or max_queries < 1:
        raise InputError(f"k and max_queries must be positive, got k={k}, max_queries={max_queries}.")
    stored.update({"k": k, "max_queries": max_queries})
    if title is not None:
        stored["title"] = str(title)
    sections = _sections(result, k, max_queries)
    shown = sorted({i for s in sections for i, _ in s["harmful"] + s["helpful"]})
    if examples is not None:
        if len(examples) <= max(shown, default=-1):
            raise InputError(f"examples has {len(examples)} entries but the result names example {max(shown)}: pass "
                             "every training example, indexable by the result's example ids (result.index).")
        rendered = dict(stored.get("examples") or {})
        rendered.update({str(i): render_example(examples[i], image_shape) for i in shown})
        stored["examples"] = rendered
    if labels is not None:
        if len(labels) <= max(shown, default=-1):
            raise InputError(f"labels has {len(labels)} entries but the result names example {max(shown)}.")
        stored["labels"] = dict(stored.get("labels") or {}) | {str(i): str(labels[i]) for i in shown}
    if queries is not None:
        count = min(result.values.shape[1], max_queries) if result.per_test else min(len(queries), MAX_QUERIES_STORED)
        if result.per_test and len(queries) < count:
            raise InputError(f"queries has {len(queries)} entries for a result with {result.values.shape[1]} test "
                             "columns: pass one test example per column.")
        stored["queries"] = [render_example(queries[j], image_shape) for j in range(count)]
        stored["n_queries"] = len(queries)
    if query_labels is not None:
        stored["query_labels"] = [str(v) for v in list(query_labels)[: max(max_queries, MAX_QUERIES_STORED)]]
    if validation is not None:
        stored["validation"] = _validation(validation)
    return replace(result, diagnostics=dict(result.diagnostics) | {"report": stored})


def _example_card(example_id: int, score: float, removal: float, stored: dict, wide: bool) -> str:
    shown = (stored.get("examples") or {}).get(str(example_id))
    label = (stored.get("labels") or {}).get(str(example_id))
    body = ""
    if shown and "png" in shown:
        body = f'<img alt="example {example_id}" src="data:image/png;base64,{shown["png"]}">'
    elif shown:
        body = f'<div class="text">{html.escape(shown["text"])}</div>'
    caption = f"#{example_id}" + (f" · {html.escape(label)}" if label is not None else "")
    return (f'<div class="card{" wide" if wide else ""}">{body}<div><b>{caption}</b></div>'
            f'<div>score {score:+.3g}</div><div>removal {removal:+.3g}</div></div>')


def _query_item(j: int, stored: dict, compact: bool = False) -> str:
    queries, labels = stored.get("queries") or [], stored.get("query_labels") or []
    if j >= len(queries):
        return ""
    item = queries[j]
    body = (f'<img alt="query {j}" src="data:image/png;base64,{item["png"]}">' if "png" in item
            else f'<div class="text">{html.escape(item["text"])}</div>')
    label = html.escape(labels[j]) if j < len(labels) else ""
    if compact:  # a strip: the caption on lines of its own, inside the item's fixed width
        caption = f"#{j}" + (f"<br>{label}" if label else "")
        kind = "queryitem" if "png" in item else "queryitem textitem"
        return f'<div class="{kind}">{body}<div class="note">{caption}</div></div>'
    return f'<div class="queryitem">{body}<div class="note">test example {j}{" · " + label if label else ""}</div></div>'


def _test_strip(stored: dict) -> str:
    """The test set of a summed result: the first ``STRIP`` examples, the others (all stored) behind <details>."""
    items, total = stored["queries"], int(stored.get("n_queries", len(stored["queries"])))
    first = "".join(_query_item(i, stored, compact=True) for i in range(min(STRIP, len(items))))
    out = [f'<p class="note">test set ({total} examples):</p><div class="strip">{first}</div>']
    if len(items) > STRIP:
        rest = "".join(_query_item(i, stored, compact=True) for i in range(STRIP, len(items)))
        what = f"the other {len(items) - STRIP} test examples" + ("" if len(items) == total else
                                                                  f" (the first {len(items)} of {total} are stored)")
        out.append(f'<details class="more"><summary>{what}</summary><div class="strip">{rest}</div></details>')
    elif total > len(items):
        out.append(f'<p class="note">the first {len(items)} of {total} test examples</p>')
    return "".join(out)


def _removal_eps(result: InfluenceResult, example_id: int) -> float:
    eps = result.removal_eps
    if torch.is_tensor(eps):
        row = int((result.index == example_id).nonzero()[0])
        return float(eps[row])
    return float(eps)


def _histogram(result: InfluenceResult) -> str:
    scores = result.total.detach().cpu().double().numpy()
    fig = require("matplotlib.figure", "the report page").Figure(figsize=(5.2, 4.2))
    ax = fig.add_subplot()
    ax.hist(scores, bins=min(60, max(10, int(math.sqrt(scores.size)) * 2)), color="#5d6d7e")
    ax.axvline(0, color="black", lw=0.8)
    ax.set_yscale("log")
    ax.set_xlabel("influence score summed over the test set (positive = harmful)")
    ax.set_ylabel("training examples")
    ax.set_title(f"{scores.size} examples · mean {scores.mean():+.3g} · median |score| {np.median(np.abs(scores)):.3g}",
                 fontsize=9)
    fig.tight_layout()
    return _figure_png(fig)


def _mean_tied_ranks(v: np.ndarray) -> np.ndarray:
    ordered = np.sort(v)
    return (np.searchsorted(ordered, v, "left") + np.searchsorted(ordered, v, "right") + 1) / 2.0


def _scatter(pairs: dict[str, Any]) -> tuple[str, str]:
    """The leave-out scatter (predicted vs actual per removal), the noise floor as a band around 0 when known."""
    p, a = np.asarray(pairs["predicted"], float), np.asarray(pairs["actual"], float)
    floor = pairs.get("noise_floor")
    if p.size >= 2 and p.std() > 0 and a.std() > 0:
        r, rho = np.corrcoef(p, a)[0, 1], np.corrcoef(_mean_tied_ranks(p), _mean_tied_ranks(a))[0, 1]
        stats = f"Pearson r = {r:.3f}, Spearman ρ = {rho:.3f}, {p.size} removals"
    else:
        stats = f"{p.size} removals (no correlation: fewer than two distinct predicted or actual values)"
    if floor is not None:
        stats += f"; noise floor ±{floor:.3g} (retraining with nothing removed)"
    fig = require("matplotlib.figure", "the report page").Figure(figsize=(4.8, 4.2))
    ax = fig.add_subplot()
    if floor is not None:
        ax.axhspan(-floor, floor, color="#d5d8dc", alpha=0.7, lw=0, label="noise floor")
    ax.scatter(p, a, s=16, alpha=0.8)
    if p.size:
        lo, hi = min(p.min(), a.min()), max(p.max(), a.max())
        ax.plot([lo, hi], [lo, hi], color="grey", lw=0.8, ls="--")
    ax.set_xlabel("predicted change of the test loss")
    ax.set_ylabel("actual change (leave-out retraining)")
    ax.set_title(stats if floor is None else stats.split(";")[0], fontsize=9)
    fig.tight_layout()
    return _figure_png(fig), stats


def _check(stored: dict[str, Any]) -> tuple[str, str, str]:
    """A check against retraining: (figure PNG, its one-line summary, its table as HTML)."""
    from .validation.check import COLUMNS, plot_check

    table = pd.DataFrame({column: stored[column] for column in COLUMNS if column in stored})
    if "noise_floor" in stored:
        table["noise_floor"] = stored["noise_floor"]
    seeds = max(stored.get("seeds") or [1])
    floor = stored.get("noise_floor")
    stats = (f"{len(table)} groups removed, each retrained with {seeds} seed{'s' if seeds > 1 else ''}; noise floor "
             + (f"±{floor:.3g} (sd of the measure over seeds with nothing removed)" if floor is not None else
                "unknown (one seed)"))
    fig = plot_check(table)
    return _figure_png(fig), stats, _table(table)


def _table(frame: pd.DataFrame) -> str:
    return frame.to_html(index=False, border=0, float_format=lambda v: f"{v:.4g}", na_rep="")


def _text(value) -> str:
    """A settings or diagnostics value as short readable text: numbers as %.4g, lists joined, mappings as k: v
    (a mapping of names to the same names as the names alone)."""
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        if all(k == v for k, v in value.items()):
            return ", ".join(map(str, value))
        return "; ".join(f"{k}: {_text(v)}" for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return ", ".join(_text(v) for v in value)
    return "" if value is None else str(value)


def _cell(value) -> str:
    """HTML of one table cell: escaped, and collapsed into <details> beyond ``LONG_CELL`` characters."""
    text = _text(value)
    if len(text) <= LONG_CELL:
        return html.escape(text)
    return f'<details class="cell"><summary>{html.escape(text[:LONG_CELL])}…</summary>{html.escape(text)}</details>'


def _html_table(rows: list[dict], columns: Sequence[str] | None = None) -> str:
    """Rows of dicts as an HTML table, every cell through :func:`_cell` (None and missing keys blank)."""
    columns = list(columns or dict.fromkeys(k for row in rows for k in row))
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{_cell(row.get(c))}</td>" for c in columns) + "</tr>" for row in rows)
    return f'<div class="tablewrap"><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'


def _settings(settings: dict) -> str:
    """The settings as tables: one row per stage of the per-stage lists (solve, curvature; links name the stage
    they lead into), the scalars as setting/value rows."""
    parts, scalars = [], []
    per_stage = {k: v for k, v in sorted(settings.items())  # sorted: a saved result's JSON may keep another order
                 if isinstance(v, list) and v and all(isinstance(x, dict) for x in v)}
    stages = max((len(v) + (1 if k == "links" else 0) for k, v in per_stage.items()), default=0)
    if stages:
        rows = [{"stage": k} for k in range(stages)]
        for key, entries in per_stage.items():
            offset = 1 if key == "links" else 0
            for j, entry in enumerate(entries):
                for name, value in sorted(entry.items()):
                    column = f"link {name}" if key == "links" else name if key == "solve" else f"{key} {name}"
                    rows[j + offset][column] = value
        parts.append(_html_table(rows))
    for key, value in sorted(settings.items()):
        if key not in per_stage:
            scalars.append({"setting": key, "value": value})
    if scalars:
        parts.append(_html_table(scalars, ["setting", "value"]))
    return "\n".join(parts)


def _convergence(solve: dict) -> dict:
    """A solve's ``converged`` as words: residual ≤ tol, above it, or no residual computed (None: not checked)."""
    if "converged" not in solve:
        return solve
    state = solve["converged"]
    return solve | {"converged": "not checked" if state is None else "converged" if state else "unconverged"}


def _stage_first(item: tuple[str, Any]) -> tuple[bool, str]:
    return item[0] != "stage", item[0]  # one column order, whatever order a saved file's JSON keeps


def _diagnostics(result: InfluenceResult) -> str:
    parts = []
    solves = [dict(sorted(_convergence(s).items(), key=_stage_first)) for s in result.diagnostics.get("solves") or []]
    parts.append(_html_table(solves) if solves else '<p class="note">no solves recorded</p>')
    seconds = dict(sorted((result.diagnostics.get("seconds") or {}).items()))
    if seconds:
        parts.append("<h3>time (s)</h3>" + _html_table([seconds]))
    settings = result.diagnostics.get("settings") or {}
    if settings:
        parts.append("<h3>settings</h3>" + _settings(settings))
    return "\n".join(parts)


def _banner(result: InfluenceResult) -> str:
    """A banner naming every stage not at a minimum (``diagnostics["stages"][k]["verdict"]``) and every Case 2
    stage whose drift disagrees with its α (``["proximal"]``); empty when there is none."""
    lines = []
    for k, stage in enumerate(result.diagnostics.get("stages") or []):
        verdict = stage.get("verdict")
        if verdict is not None and verdict != "minimum":
            spectrum = ("eigenvalues not measured: the gradient settles the verdict"
                        if stage.get("min_eigenvalue") is None and stage.get("max_eigenvalue") is None else
                        f"{'Gauss-Newton' if stage.get('eigenvalue_matrix') == 'gauss-newton' else 'Hessian'} "
                        f"eigenvalues within [{_text(stage.get('min_eigenvalue'))}, "
                        f"{_text(stage.get('max_eigenvalue'))}] ({html.escape(str(stage.get('eigenvalue_source', 'lanczos')))})")
            lines.append(f"<b>stage {k} is not at a minimum</b> ({html.escape(str(verdict))}: ‖∇L‖ = "
                         f"{_text(stage.get('gradient_norm'))} × the typical per-example gradient, {spectrum}). "
                         "Influence functions assume a minimum: read the scores as a local linearization and check "
                         "them against retraining (influkit.validation.check_retraining).")
        drift = stage.get("proximal") or {}
        if drift.get("agrees") is False:
            lines.append(f"<b>stage {k}: the Case 2 drift disagrees with α = {_text(drift.get('alpha'))}</b>: the α "
                         f"that explains the shared block's drift is α̂ = {_text(drift.get('alpha_fit'))} (influkit."
                         "proximal); for a finetuning without a proximal term use Link(..., case=2, alpha=α̂).")
    return "".join(f'<div class="banner">{line}</div>' for line in lines)


def _stages(stages: list[dict]) -> str:
    """The verdict of each stage with the numbers it rests on (:mod:`influkit.stationarity`)."""
    keys = ("verdict", "gradient_norm", "min_eigenvalue", "max_eigenvalue", "eigenvalue_source", "lanczos_steps")
    rows = [{"stage": k} | {key: stage.get(key) for key in keys} for k, stage in enumerate(stages)]
    for row, stage in zip(rows, stages):
        drift = stage.get("proximal")
        if drift:  # a Case 2 stage: the α the drift implies beside the link's (influkit.proximal)
            row |= {"alpha": drift["alpha"], "alpha_fit": drift["alpha_fit"], "drift_residual": drift["residual"]}
    tol = stages[0].get("gradient_tol")
    note = ('<p class="note">gradient_norm: ‖∇L‖ over the RMS per-example gradient norm (stationary at or below '
            f"{tol:g}); min/max_eigenvalue: Ritz values, estimates of the extreme eigenvalues from inside (a negative "
            "minimum is certain, a positive one is not proof of a minimum), from eigenvalue_source: a Lanczos run on "
            "the Hessian (lanczos; lanczos-sample: of a sample's), the fitted K-FAC/EK-FAC, or the solve's own "
            "iterations; none where the gradient alone settles the verdict and nothing needs them. Influence functions assume a minimum; "
            "<i>solver=auto</i> uses the damped Gauss-Newton matrix elsewhere (the solves' <i>choice</i>). A Case 2 stage "
            "adds alpha (its link's α), alpha_fit (α̂, the α that explains the shared block's drift) and "
            "drift_residual (how far ∇_W F = −2α(W − W̄) is from holding at α, 0 to 1).</p>")
    return note + _table(pd.DataFrame(rows))


def _meaning(result: InfluenceResult) -> str:
    """What a score of ``result`` is (HTML): an influence function's d/dε, or an unrolled result's d/dw_z."""
    if (result.method or "").startswith("unrolled"):
        return ("A score is d(test measure)/dw_z: the derivative with respect to z's data weight w_z (1 in the run) "
                "through the recorded training, every optimizer step of every stage: <b>positive = harmful</b> "
                "(up-weighting z raises the test loss), negative = helpful; removing z (w_z → 0) predicts a change "
                "of −score, the <i>removal</i> shown.")
    return ("A score is I(z, T) = d(test loss)/dε for training objective + ε·loss(z): <b>positive = harmful</b> "
            "(up-weighting z raises the test loss), negative = helpful; <i>removal</i> is the predicted change of "
            "the summed test loss when z is removed (removal_eps · score).")


def render(result: InfluenceResult) -> str:
    """The HTML page of ``result`` from its scores, diagnostics and what :func:`attach` stored."""
    stored = result.diagnostics.get("report") or {}
    k, max_queries = int(stored.get("k", 8)), int(stored.get("max_queries", 12))
    wide = any("text" in v for v in (stored.get("examples") or {}).values())
    title = stored.get("title") or f"influence report — {result.method or 'influence'}"
    out = [f"<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{html.escape(title)}</title>",
           f"<style>{_CSS}</style></head><body>", f"<h1>{html.escape(title)}</h1>"]
    n_test = (result.diagnostics.get("settings") or {}).get("n_test")
    on = (f"on each of {result.values.shape[1]} test examples" if result.per_test else
          f"summed over {n_test} test examples" if n_test is not None else "summed over the test set")
    out.append(f'<p class="note">{html.escape(result.method or "influence")} · scores of {result.values.shape[0]} '
               f"training examples {on} · n_train = {result.n_train}. {_meaning(result)}</p>")
    out.append(_banner(result))
    sections = _sections(result, k, max_queries)
    out.append("<h2>Most harmful and most helpful training examples</h2>")
    if result.per_test and result.values.shape[1] > len(sections):
        out.append(f'<p class="note">the first {len(sections)} of {result.values.shape[1]} queries</p>')
    for s in sections:
        j = s["query"]
        head = f"query {j}" if j is not None else "the whole test set (scores summed over it)"
        out.append(f'<div class="query"><h3>{head}</h3>')
        if j is None and stored.get("queries"):
            out.append(_test_strip(stored))
        out.append('<div class="qbody">' + (_query_item(j, stored) if j is not None else "") + "<div>")
        for kind, caption in (("harmful", "most harmful (largest score)"), ("helpful", "most helpful (smallest score)")):
            cards = "".join(_example_card(i, v, _removal_eps(result, i) * v, stored, wide) for i, v in s[kind])
            out.append(f'<div class="{kind}"><h3>{caption}</h3><div class="row">{cards}</div></div>')
        out.append("</div></div></div>")
    out.append('<div class="panels"><div><h2>Score distribution</h2>')
    out.append(f'<img class="plot" alt="histogram of scores" src="data:image/png;base64,{_histogram(result)}"></div>')
    validation = stored.get("validation")
    table = ""
    if validation and "group" in validation:
        png, stats, table = _check(validation)
        out.append("<div><h2>Validation: predicted vs actual change on retraining</h2>")
    elif validation:
        png, stats = _scatter(validation)
        out.append("<div><h2>Validation: predicted vs actual change on removal</h2>")
    if validation:
        out.append(f'<p class="note">{html.escape(stats)}</p>')
        out.append(f'<img class="plot" alt="validation scatter" src="data:image/png;base64,{png}"></div>')
    out.append("</div>")
    if table:
        out.append('<h3>checked against retraining</h3><p class="note">predicted: the sum of <i>removal</i> over the '
                   "group; actual: the change of the measure when the group is removed and every stage retrained, "
                   "mean and sd over seeds (paired with the same seed's run with nothing removed); noise floor: the "
                   "sd over seeds of that run. An actual change inside the noise floor is what retraining does by "
                   "chance.</p>" + table)
    stages = result.diagnostics.get("stages") or []
    if stages:
        out.append("<h2>Where each stage stands</h2>" + _stages(stages))
    out.append("<h2>Solve diagnostics</h2>" + _diagnostics(result))
    out.append('<p class="note">written by influkit · self-contained: no scripts, no network</p></body></html>')
    return "\n".join(out)


def write_report(result: InfluenceResult, path: str | Path, **attachments) -> Path:
    """Write the HTML page of ``result`` (with ``attachments`` as in :func:`attach`) to ``path``; return the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(attach(result, **attachments) if attachments else result), encoding="utf-8")
    return path


CHROMIUM_FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync")


def screenshot(page: str | Path, png: str | Path, *, size: tuple[int, int] = (1200, 1600),
               browser: str | None = None, timeout: float = 120) -> Path:
    """Render the HTML file ``page`` in headless Chromium to a ``size`` = (width, height) PNG screenshot.

    browser: the Chromium executable (default: ``chromium`` on PATH; ``apt-get install chromium``).
    """
    browser = browser or shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        raise InputError("no Chromium found for the screenshot: apt-get install chromium, or pass browser=PATH.")
    png = Path(png).resolve()
    png.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="influkit-chromium-") as profile:
        done = subprocess.run([browser, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--screenshot={png}",
                               f"--window-size={size[0]},{size[1]}", Path(page).resolve().as_uri()],
                              capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0 or not png.exists():
        raise RuntimeError(f"Chromium failed (exit {done.returncode}): {done.stderr[-1000:]}")
    return png
