#!/usr/bin/env bash
# Installs what it needs (./.venv), then runs the main demo: `influkit demo` (about a minute; `--full` for the
# paper-size run, ~4–6 min; all options: influkit demo --help).
source "$(dirname "$0")/env.sh"
influkit demo "$@"
