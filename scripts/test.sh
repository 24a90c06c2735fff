#!/usr/bin/env bash
# Quick start, command 2: set up with the dev and reference extras, lint, check generated code, run all tests.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh dev,reference,plots
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/lint-imports --no-cache  # layers (cli > services > engine > kvtransfer) and no import cycles
bash scripts/gen_protos.sh --check
.venv/bin/pdserve models fetch
.venv/bin/python -m pytest "$@"
