#!/usr/bin/env bash
# Creates a venv (default ./.bench-venv) with every optional extra — the benchmark peers (captum, pyDVL, TRAK,
# dattri, kronfluence) beside transformers and peft — on the CPU wheel torch==2.13.0, then checks that they all
# import (tests/test_extras.py with INFLUKIT_REQUIRE_PEERS=1: a missing peer fails instead of being skipped).
# kronfluence 1.0.1 goes in with --no-deps: it declares torchvision but never imports it, and PyPI's torchvision
# for torch 2.13.0 is built against the CUDA torch, fails to import beside the CPU wheel and takes
# `from transformers import BertForMaskedLM` down with it (pyproject.toml, the bench extra).
# Usage: bash scripts/bench-env.sh [VENV_DIR]   then   VENV_DIR/bin/python -m benchmarks.bench_peers --quick
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-$root/.bench-venv}"
python3 -m venv "$venv"
"$venv/bin/pip" install --quiet torch==2.13.0                 # the CPU wheel first: nothing pulls the CUDA build
"$venv/bin/pip" install --quiet -e "$root[bench,hf,dev]"
"$venv/bin/pip" install --quiet --no-deps kronfluence==1.0.1
cd "$root"
INFLUKIT_REQUIRE_PEERS=1 MPLBACKEND=Agg "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/test_extras.py
"$venv/bin/python" -c "import torch; print(f'bench venv ready: {torch.__version__}, every peer imports')"
