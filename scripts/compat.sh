#!/usr/bin/env bash
# A second environment beside the pinned one: Python 3.12 and the newest releases pyproject.toml's
# ranges admit (no constraints.txt: jax 0.12 and its numpy, where the pinned set has jax 0.10.2 on
# Python 3.11). Installs pdserve there (.venv-compat) and runs pdserve.testing.smoke: import, load the
# default model, its greedy tokens and logits on the reference prompts. scripts/test.sh runs it.
set -euo pipefail
cd "$(dirname "$0")/.."
python=""
for candidate in python3.12 "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12; do
  if "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
    python=$candidate
    break
  fi
done
if [ -z "$python" ]; then
  echo "compat: no Python 3.12 on this host (python3.12, or pyenv's)" >&2
  exit 1
fi
if [ ! -x .venv-compat/bin/python ]; then
  "$python" -m venv .venv-compat
fi
quiet() { # runs a command, showing its output only if it fails
  local log rc=0
  log=$(mktemp)
  "$@" >"$log" 2>&1 || rc=$?
  [ "$rc" -eq 0 ] || cat "$log" >&2
  rm -f "$log"
  return "$rc"
}
quiet .venv-compat/bin/python -m pip install --upgrade pip
quiet .venv-compat/bin/python -m pip install --upgrade --upgrade-strategy eager -e .
.venv-compat/bin/python -m pdserve.testing.smoke
