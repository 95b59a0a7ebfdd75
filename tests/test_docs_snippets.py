"""Every ```python block of the README, of docs/index.md, docs/getting-started.md and docs/guides/*.md runs as written.

The blocks of one page run in order in one fresh interpreter (a later block may use an earlier one's names), in an
empty working directory, with this checkout first on the import path. A block that must not run is preceded by
the line ``<!-- no-run: REASON -->`` (a reason is required: e.g. it needs a checkpoint package that the test
environment does not install); a page whose blocks need an optional package skips, naming the extra, when that
package is missing (the ``<!-- requires: MODULE -->`` line anywhere on the page).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "docs" / "index.md", ROOT / "docs" / "getting-started.md", *sorted((ROOT / "docs" / "guides").glob("*.md"))]
FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```", re.S | re.M)
NO_RUN = re.compile(r"<!--\s*no-run:\s*(\S.*?)\s*-->\s*$")
REQUIRES = re.compile(r"<!--\s*requires:\s*([\w.]+)\s*-->")


def blocks(text: str) -> list[tuple[int, str]]:
    """(line number, source) of each python block that runs; a block after a ``no-run`` line with no reason fails."""
    out = []
    for match in FENCE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        if "no-run" in before:
            assert NO_RUN.search(before), f"line {line}: a no-run marker must give its reason: <!-- no-run: why -->"
            continue
        out.append((line, match.group(1)))
    return out


def test_marker_parsing():
    text = "a\n```python\nx = 1\n```\n<!-- no-run: needs a GPU -->\n```python\nraise SystemExit(1)\n```\n"
    assert blocks(text) == [(2, "x = 1\n")]
    with pytest.raises(AssertionError, match="reason"):
        blocks("<!-- no-run: -->\n```python\nx = 1\n```\n")


@pytest.mark.parametrize("page", PAGES, ids=[p.relative_to(ROOT).as_posix() for p in PAGES])
def test_page_blocks_run(page, tmp_path):
    text = page.read_text()
    for module in REQUIRES.findall(text):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{page.name} needs {module}, which is not installed")
    found = blocks(text)
    if not found:
        pytest.skip(f"{page.name} has no python block that runs")
    script = "\n".join(f"# --- {page.name}:{line}\n{source}" for line, source in found)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "MPLBACKEND": "Agg", "INFLUKIT_REPO": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, f"{page.name}'s python blocks failed:\n{done.stderr[-4000:]}"


def test_api_reference_names_every_public_name():
    """docs/api.md documents every name of ``influkit.__all__``: a class or function among the top module's members,
    a lazily loaded package as a section of its own (documented there through its ``__all__``)."""
    import influkit

    text = (ROOT / "docs" / "api.md").read_text()
    members = re.search(r":members: (.*?)\n```", text, re.S).group(1)
    listed = {name.strip() for name in members.replace("\n", " ").split(",")}
    sections = set(re.findall(r"^## influkit\.(\w+)$", text, re.M))
    missing = [name for name in influkit.__all__ if name not in listed and name not in sections]
    assert not missing, f"docs/api.md does not document {missing}"
