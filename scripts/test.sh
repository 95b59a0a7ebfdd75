#!/usr/bin/env bash
# Installs what it needs (./.venv), then runs the whole test suite with pytest, listing its 25 slowest tests.
source "$(dirname "$0")/env.sh"
python -m pytest -q -p no:cacheprovider --durations=25 "$@"  # the 25 slowest tests in the log
