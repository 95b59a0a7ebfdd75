"""Sphinx configuration of influkit's documentation (built by scripts/docs.sh, strict: every warning is an error).

Sphinx with the furo theme, autodoc, myst-parser for the Markdown pages and myst-nb for the
notebooks, executed at build time at their reduced size. The Results page is generated here from the committed
MANIFEST.json files (docs/results_page.py)."""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

import results_page  # noqa: E402

project = "influkit"
author = "the influkit authors"
copyright = "2026, the influkit authors"

extensions = ["myst_nb", "sphinx.ext.autodoc", "sphinx.ext.autosummary", "sphinx.ext.napoleon", "sphinx_copybutton"]
source_suffix = {".md": "myst-nb", ".ipynb": "myst-nb", ".rst": "restructuredtext"}
exclude_patterns = ["_build", "screenshots", "README.md", "report.png", "**/.ipynb_checkpoints"]
html_theme = "furo"
html_title = "influkit"
html_static_path = []
myst_enable_extensions = ["dollarmath", "colon_fence", "deflist"]
myst_heading_anchors = 3

# autodoc: the docstrings carry the math and the contract; signatures as written
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_default_options = {"members": True, "undoc-members": False, "show-inheritance": False}
napoleon_google_docstring = False
napoleon_numpy_docstring = False

# Docstrings write absolute values and norms with bars (|x|, ‖g‖), which reStructuredText reads as substitution
# references: escape every bar outside inline literals and outside table lines before autodoc parses them.
_LITERAL = re.compile(r"(``.*?``)")


def _escape_bars(app, what, name, obj, options, lines):
    for i, line in enumerate(lines):
        bare = line.strip()
        if "|" not in line or bare.startswith("+") or (bare.startswith("|") and bare.endswith("|")):
            continue
        lines[i] = "".join(part if part.startswith("``") else part.replace("|", "\\|") for part in _LITERAL.split(line))


def setup(app):
    app.connect("autodoc-process-docstring", _escape_bars)


# The notebooks: copied next to the tutorials at each build and executed in a fresh kernel at the reduced size
# (INFLUKIT_NOTEBOOK_SIZE=reduced, under a minute each on one core).
nb_execution_mode = "force"
nb_execution_timeout = 600
nb_execution_raise_on_error = True
nb_output_stderr = "remove"  # progress-bar and deprecation chatter; errors still fail the build
os.environ.setdefault("INFLUKIT_NOTEBOOK_SIZE", "reduced")
os.environ["MPLBACKEND"] = "module://matplotlib_inline.backend_inline"  # the kernel's figures as images (not Agg)
for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
    shutil.copyfile(notebook, HERE / "tutorials" / notebook.name)

# The Results page, from the committed results folders and their manifests.
results_page.write(ROOT, HERE / "results.md")
