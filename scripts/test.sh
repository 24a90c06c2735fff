#!/usr/bin/env bash
# Quick start, command 2: set up with the dev + reference + plots extras, lint, check generated code and
# import layering, fetch the default model, then run the tests in three tiers, each in its own pytest
# process (fast: model-free units; model: real weights in the test process; daemon: real processes): fast
# beside model, then daemon. It prints the XLA cache's size before each tier and every tier's time.
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
times=$(mktemp -d)
mkdir "$times/logs"
run() { # TIER [ARGS...]: one tier in its own pytest process; its line of the summary goes to $times/TIER
  local tier=$1 start=$SECONDS rc=0
  shift
  .venv/bin/python -m pytest -m "$tier" --no-unexpected-skips --durations=25 "$@" || rc=$?
  echo "$tier $((SECONDS - start)) s$([ "$rc" -eq 0 ] || echo " (exit $rc)")" >"$times/$tier"
  return "$rc"
}
summary() {
  echo "=== tier times: $(cat "$times"/fast "$times"/model "$times"/daemon 2>/dev/null | paste -sd ';' -)" \
    "(XLA cache after: $(cache_state))" >&2
}
trap 'summary; rm -rf "$times"' EXIT
if [ "${#tiers[@]}" -eq 1 ]; then
  echo "=== tier: ${tiers[0]} (XLA cache: $(cache_state))" >&2
  run "${tiers[0]}" "$@"
else
  # The fast tier runs beside the model tier, whose compiling leaves part of the second core idle (its
  # output follows the model tier's); the daemon tier runs alone afterwards, loading what both compiled.
  echo "=== tier: model, with the fast tier beside it (XLA cache: $(cache_state))" >&2
  run fast "$@" >"$times/logs/fast" 2>&1 &
  fast=$!
  rc=0
  run model "$@" || rc=1
  wait "$fast" || rc=1
  echo "=== tier: fast (ran beside model)" >&2
  cat "$times/logs/fast"
  [ "$rc" -eq 0 ]
  echo "=== tier: daemon (XLA cache: $(cache_state))" >&2
  run daemon "$@"
fi
