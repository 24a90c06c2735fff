#!/usr/bin/env bash
# Quick start, command 2: set up with the dev + reference + plots extras, lint, check generated code and
# import layering, fetch the default model, then run the tests tier by tier, each tier in its own pytest
# process (fast: model-free units; model: real weights in the test process; daemon: real processes).
#   bash scripts/test.sh                  # everything (what CI runs)
#   bash scripts/test.sh fast [ARGS...]   # one tier (fast, model or daemon); ARGS go to pytest
set -euo pipefail
cd "$(dirname "$0")/.."
tiers=(fast model daemon)
case "${1:-}" in
  fast | model | daemon) tiers=("$1"); shift ;;
esac
bash scripts/setup.sh dev,reference,plots
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/python scripts/lint_imports.py  # layers, the two roles apart, no import cycles
bash scripts/gen_protos.sh --check
.venv/bin/pdserve models fetch
xla_cache="$(.venv/bin/python -c 'from pdserve.engine.loading.sources import cache_dir; print(cache_dir() / "xla")')"
cache_state() { # the persistent XLA compilation cache that tests and daemons share
  local n=0
  [ -d "$xla_cache" ] && n=$(find "$xla_cache" -type f | wc -l)
  echo "$n executables in $xla_cache"
}
summary=()
for tier in "${tiers[@]}"; do
  echo "=== tier: $tier (XLA cache: $(cache_state))" >&2
  start=$SECONDS
  .venv/bin/python -m pytest -m "$tier" --no-unexpected-skips --durations=25 "$@"
  summary+=("$tier $((SECONDS - start)) s")
done
echo "=== tier times: ${summary[*]} (XLA cache after: $(cache_state))" >&2
