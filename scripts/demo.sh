#!/usr/bin/env bash
# Installs what it needs (./.venv), then runs the main demo: `influkit demo` (options: influkit demo --help).
source "$(dirname "$0")/env.sh"
influkit demo "$@"
