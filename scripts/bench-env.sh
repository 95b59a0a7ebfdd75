#!/usr/bin/env bash
# Creates ./.bench-venv for the benchmarks that compare influkit with its peers (captum, pyDVL, kronfluence):
# the CPU wheel torch==2.13.0 first, then influkit[bench] (editable), whose pins keep that torch (no CUDA build).
# Usage: bash scripts/bench-env.sh [VENV_DIR]   then   VENV_DIR/bin/python benchmarks/bench_peers.py --quick
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-$root/.bench-venv}"
python3 -m venv "$venv"
"$venv/bin/pip" install --quiet torch==2.13.0
"$venv/bin/pip" install --quiet -e "$root[bench]"
"$venv/bin/python" - <<'PY'
import importlib, torch
for name in ("captum.influence", "pydvl.influence.torch", "kronfluence"):
    importlib.import_module(name)
print(f"bench venv ready: torch {torch.__version__}; captum, pyDVL, kronfluence import")
PY
