"""The Results pages of the documentation, generated at build time from the committed results folders.

Every folder of ``benchmarks/results/`` and ``studies/results/`` holds a ``MANIFEST.json`` written by
``benchmarks/manifest.py`` (command, commit, date, machine, device, load, note per group of files). This script writes
``docs/results.md`` (the index: one row per folder) and ``docs/results/<kind>-<folder>.md`` (one page per folder):
the manifest's entries as a table, then each file — small CSV files as tables, PNG files as pictures, text and
Markdown files verbatim, large or binary files by name and size. Nothing is measured here; the pages only show what
is committed. ``python docs/results_page.py`` writes them without building the site.
"""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path

KINDS = {"benchmarks": "speed and memory against the peers", "studies": "fidelity, leave-out and the papers' experiments"}
MAX_ROWS = 40  # a CSV longer than this is listed by name, not shown
MAX_COLUMNS = 14
MAX_TEXT = 60_000  # characters of a text file shown verbatim
TEXT = {".txt", ".md", ".log", ".json"}


def _cell(value: object) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def _table(header: list[str], rows: list[list[object]]) -> list[str]:
    lines = ["| " + " | ".join(_cell(h) for h in header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return lines + [""]


def _load(load: object) -> str:
    return " / ".join(f"{x:g}" for x in load) if isinstance(load, list) else str(load)


def _manifest(folder: Path) -> list[dict]:
    path = folder / "MANIFEST.json"
    return json.loads(path.read_text())["entries"] if path.exists() else []


def _fence(text: str, lang: str = "text") -> list[str]:
    ticks = "`" * max(3, max((len(run) for run in text.split("\n") if set(run) == {"`"}), default=0) + 1)
    while ticks in text:
        ticks += "`"
    return [f"{ticks}{lang}", text.rstrip("\n"), ticks, ""]


def _file(path: Path, page_dir: Path, root: Path) -> list[str]:
    rel = path.relative_to(root).as_posix()
    out = [f"### `{path.name}`", ""]
    if path.is_dir():
        count = sum(1 for p in path.rglob("*") if p.is_file())
        return out + [f"A folder of {count} files (`{rel}/`).", ""]
    size = path.stat().st_size
    if path.suffix == ".png":
        link = Path("../" * len(page_dir.relative_to(root).parts)) / rel
        return out + [f"![{path.name}]({link.as_posix()})", ""]
    if path.suffix == ".csv":
        with path.open(newline="") as handle:
            rows = list(csv.reader(handle))
        if rows and len(rows) - 1 <= MAX_ROWS and len(rows[0]) <= MAX_COLUMNS:
            return out + _table(rows[0], rows[1:])
        return out + [f"{len(rows) - 1} rows × {len(rows[0]) if rows else 0} columns ({size:,} bytes): `{rel}`.", ""]
    if path.suffix in TEXT:
        text = path.read_text(errors="replace")
        if len(text) > MAX_TEXT:
            return out + [f"{size:,} bytes, shown in part (the whole file: `{rel}`).", ""] + _fence(text[:MAX_TEXT])
        return out + _fence(text)
    return out + [f"{size:,} bytes (`{rel}`).", ""]


def _page(root: Path, kind: str, folder: Path, page: Path) -> None:
    entries = _manifest(folder)
    lines = [f"# {kind}/results/{folder.name}", "",
             f"Generated from `{kind}/results/{folder.name}/` and its `MANIFEST.json` when the documentation was built.",
             "Seconds were measured on shared machines: compare ratios within one file, and read each file's load.", "",
             "## Manifest", ""]
    for e in entries:
        lines += ["- " + ", ".join(f"`{f}`" for f in e["files"]) + f": written by `{e['command']}` at commit "
                  f"{e['commit']}, {e['date']}, on {e['machine']} ({e.get('device', 'unknown')}), load "
                  f"{_load(e['load'])}." + (f" *{e['note']}*" if e.get("note") else "")]
    lines += [""] if entries else ["No MANIFEST.json in this folder.", ""]
    lines += ["## Files", ""]
    for path in sorted(folder.iterdir()):
        if path.name != "MANIFEST.json" and not path.name.startswith("."):
            lines += _file(path, page.parent, root)
    page.write_text("\n".join(lines))


def write(root: Path, index: Path) -> list[Path]:
    """Write the index page ``index`` and one page per results folder beside it (in ``index.with_suffix('')``)."""
    pages_dir = index.with_suffix("")
    pages_dir.mkdir(exist_ok=True)
    for old in pages_dir.glob("*.md"):
        old.unlink()
    lines = ["# Results", "",
             "Every measurement influkit quotes, as committed, one page per results folder, each with its manifest "
             "(the command that wrote it, the commit, the date, the machine and the load). This page is generated from "
             "the `MANIFEST.json` files by `docs/results_page.py` at each build; the README and the guides quote no "
             "number that is not here.", ""]
    written, toc = [], []
    for kind, what in KINDS.items():
        base = root / kind / "results"
        folders = sorted(p for p in base.iterdir() if p.is_dir()) if base.exists() else []
        lines += [f"## {kind}: {what}", ""]
        rows = []
        for folder in folders:
            page = pages_dir / f"{kind}-{folder.name}.md"
            _page(root, kind, folder, page)
            written.append(page)
            toc.append(f"{pages_dir.name}/{page.stem}")
            entries = _manifest(folder)
            dates = sorted(e["date"] for e in entries if e["date"] != "unknown")
            rows.append([f"[{folder.name}]({pages_dir.name}/{page.stem}.md)", len(entries),
                         f"{dates[0][:10]} … {dates[-1][:10]}" if dates else "unknown"])
        lines += _table(["folder", "manifest entries", "dates"], rows)
    lines += ["```{toctree}", ":hidden:", "", *toc, "```", ""]
    index.write_text("\n".join(lines))
    return written


if __name__ == "__main__":
    here = Path(__file__).resolve().parent
    pages = write(here.parent, here / "results.md")
    print(f"wrote {here / 'results.md'} and {len(pages)} pages", file=sys.stderr)
