#!/usr/bin/env bash
# Installs what it needs (./.venv), then runs the whole test suite with pytest.
source "$(dirname "$0")/env.sh"
python -m pytest -q -p no:cacheprovider "$@"
