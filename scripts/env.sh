# Sourced by demo.sh and test.sh: create ./.venv once with CPU torch 2.13.0 and influkit[dev], then activate it.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
stamp="$venv/.influkit-installed"
if [ ! -f "$stamp" ] || [ "$root/pyproject.toml" -nt "$stamp" ]; then
  python3 -m venv "$venv"
  # the CPU wheel first, so that no dependency pulls the multi-GB CUDA build
  "$venv/bin/pip" install --quiet torch==2.13.0
  "$venv/bin/pip" install --quiet -e "$root[dev,hf]"  # hf: transformers + tokenizers (CPU torch kept)
  touch "$stamp"
fi
export PATH="$venv/bin:$PATH"
export MPLBACKEND=Agg
cd "$root"
