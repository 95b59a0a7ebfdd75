#!/usr/bin/env bash
# Creates a venv (default ./.bench-venv) with every optional extra — the benchmark peers (captum, pyDVL, TRAK,
# dattri, kronfluence) beside transformers and peft — on the CPU wheel torch==2.13.0, then checks that they all
# import (tests/test_extras.py with INFLUKIT_REQUIRE_PEERS=1: a missing peer fails instead of being skipped).
# kronfluence 1.0.1 goes in with --no-deps: it declares torchvision but never imports it, and PyPI's torchvision
# for torch 2.13.0 is built against the CUDA torch, fails to import beside the CPU wheel and takes
# `from transformers import BertForMaskedLM` down with it (pyproject.toml, the bench extra).
# bergson 2.5.1 (EleutherAI; benchmarks/bergson_peer.py) goes in with --no-deps for the same reason (it declares
# torchvision, torchaudio and bitsandbytes and imports none of them on this path), followed by what `import bergson`,
# its MAGIC trainer and its query modules do import; pyarrow < 26 and ml_dtypes < 0.6 because both newer ones need
# NumPy 2 and pyDVL 0.10 pins NumPy < 2; faiss-cpu for its FAISS path.
# Usage: bash scripts/bench-env.sh [VENV_DIR]   then   VENV_DIR/bin/python -m benchmarks.bench_peers --quick
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${1:-$root/.bench-venv}"
python3 -m venv "$venv"
"$venv/bin/pip" install --quiet torch==2.13.0                 # the CPU wheel first: nothing pulls the CUDA build
"$venv/bin/pip" install --quiet -e "$root[bench,hf,dev]"
"$venv/bin/pip" install --quiet --no-deps kronfluence==1.0.1
"$venv/bin/pip" install --quiet --no-deps bergson==2.5.1
"$venv/bin/pip" install --quiet datasets "pyarrow<26" "ml_dtypes<0.6" simple-parsing petname jaxtyping torchopt faiss-cpu \
    "numpy<2"
cd "$root"
INFLUKIT_REQUIRE_PEERS=1 MPLBACKEND=Agg "$venv/bin/python" -m pytest -q -p no:cacheprovider tests/test_extras.py
"$venv/bin/python" -c "import torch; print(f'bench venv ready: {torch.__version__}, every peer imports')"
