#!/usr/bin/env bash
# Installs what it needs (./.venv), then runs the whole test suite with pytest, listing its 25 slowest tests.
# The test files run in parallel, one worker per core (pytest-xdist; each file's tests in one worker, so a module's
# fixtures are built once); each test uses one torch thread (tests/conftest.py).
source "$(dirname "$0")/env.sh"
python -m pytest -q -p no:cacheprovider -n auto --dist loadfile --durations=25 "$@"  # the 25 slowest in the log
