#!/usr/bin/env bash
# A second environment beside the pinned one: the oldest Python and JAX pyproject.toml's ranges admit
# (Python 3.11, jax 0.10.2: the last JAX for 3.11), the rest unpinned, where the pinned set has Python 3.12
# and jax 0.12. Installs pdserve there (.venv-compat) and runs pdserve.testing.smoke: import, load the
# default model, its greedy tokens and logits on the reference prompts. scripts/test.sh runs it.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/python.sh
python=$(find_python 3.11) || {
  echo "compat: no Python 3.11 on this host (python3.11, or pyenv's)" >&2
  exit 1
}
if [ -x .venv-compat/bin/python ] && ! .venv-compat/bin/python -c 'import sys; assert sys.version_info[:2] == (3, 11)' 2>/dev/null; then
  rm -rf .venv-compat
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
quiet .venv-compat/bin/python -m pip install -e . "jax==0.10.2" "jaxlib==0.10.2"
.venv-compat/bin/python -m pdserve.testing.smoke
