#!/usr/bin/env bash
# Installs what it needs (./.venv, then the docs extra: Sphinx, furo, myst-parser, myst-nb), then builds the
# documentation into docs/_build/html in strict mode: any warning — a broken link, an unresolved reference, a
# docstring Sphinx cannot parse, a notebook cell that raises — fails the build. The Results pages are generated
# from the committed MANIFEST.json files (docs/results_page.py); the notebooks are executed at their reduced size.
source "$(dirname "$0")/env.sh"
stamp="$venv/.influkit-docs-installed"
if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ]; then
  pip install --quiet -e "$root[docs]"
  touch "$stamp"
fi
python -m sphinx -W --keep-going -b html docs docs/_build/html "$@"
echo "docs: $root/docs/_build/html/index.html"
