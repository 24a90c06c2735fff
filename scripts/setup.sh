#!/usr/bin/env bash
# Creates .venv (if missing, or made with another Python) and installs pdserve into it with the given extras,
# e.g. `scripts/setup.sh dev,reference`, every package at its version in constraints.txt (pyproject.toml
# states the ranges pdserve runs with). The pinned set is Python 3.12 with JAX 0.12: its XLA:CPU computes
# bfloat16 matmuls natively, 1.5x faster decode steps on a CPU than JAX 0.10.2 (the last release for
# Python 3.11, which scripts/compat.sh still checks). Python 3.12 is python3.12 on PATH, or pyenv's.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
source scripts/python.sh
python=$(find_python 3.12) || {
  echo "setup: no Python 3.12 on this host (python3.12 on PATH, or pyenv's)" >&2
  exit 1
}
if [ -x .venv/bin/python ] && ! .venv/bin/python -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
  echo "setup: .venv was made with another Python; making it again with $python" >&2
  rm -rf .venv
fi
if [ ! -x .venv/bin/python ]; then
  "$python" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
if [ -n "$extras" ]; then
  .venv/bin/python -m pip install -q -c constraints.txt -e ".[${extras}]"
else
  .venv/bin/python -m pip install -q -c constraints.txt -e .
fi
