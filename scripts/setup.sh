#!/usr/bin/env bash
# Creates .venv (if missing) and installs pdserve into it with the given extras, e.g. `scripts/setup.sh dev,reference`,
# every package at its version in constraints.txt (pyproject.toml states the ranges pdserve runs with).
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
if [ ! -x .venv/bin/python ]; then
  python3.11 -m venv .venv 2>/dev/null || python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
if [ -n "$extras" ]; then
  .venv/bin/python -m pip install -q -c constraints.txt -e ".[${extras}]"
else
  .venv/bin/python -m pip install -q -c constraints.txt -e .
fi
