"""Static type check of the public API as users call it: the README's and the getting-started page's python blocks,
and an import of every module of influkit by its path, checked by mypy against this checkout.

    python scripts/typecheck.py            # exit 1 on any type error (.ci/run runs it)

Each page's blocks are written, in order, into one module (as tests/test_docs_snippets.py runs them), so a wrong
argument type in a documented call (``ik.Link("embedding", case="one")``) fails the check. A second generated module
imports every ``influkit`` module by its dotted name, so a module that a path-based resolver cannot find fails it
too. mypy reads influkit itself with ``follow_imports = silent`` (its types are used, its own findings not reported)
— the settings are ``[tool.mypy]`` in pyproject.toml.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = (ROOT / "README.md", ROOT / "docs" / "getting-started.md")
FENCE = re.compile(r"^```python[^\n]*\n(.*?)^```", re.S | re.M)


def page_module(text: str) -> str:
    """The python blocks of one page joined into one module, each after a comment naming its line."""
    parts = []
    for match in FENCE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        parts.append(f"# --- line {line}\n{match.group(1)}")
    return "\n".join(parts)


def every_module_import(root: Path = ROOT) -> str:
    """``import influkit.x.y`` for every .py file under ``root/influkit`` (its path is its module's name)."""
    names = []
    for path in sorted((root / "influkit").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts[-1] != "__main__":
            names.append(".".join(parts))
    return "".join(f"import {name}\n" for name in names)


def check(sources: dict[str, str], root: Path = ROOT) -> subprocess.CompletedProcess:
    """Run mypy (settings: root/pyproject.toml) on ``sources`` ({file name: text}) written to a temporary folder."""
    with tempfile.TemporaryDirectory() as folder:
        files = []
        for name, text in sources.items():
            (Path(folder) / name).write_text(text)
            files.append(str(Path(folder) / name))
        return subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(root / "pyproject.toml"), *files],
                              cwd=root, capture_output=True, text=True)


def main() -> int:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    sources = {f"page_{page.stem.replace('-', '_').lower()}.py": page_module(page.read_text()) for page in PAGES}
    sources["every_module.py"] = every_module_import()
    done = check(sources)
    print(done.stdout + done.stderr, end="")
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
