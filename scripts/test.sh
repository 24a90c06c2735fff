#!/usr/bin/env bash
# Quick start, command 2: set up with the dev + reference + plots extras, lint, check generated code and
# import layering, fetch the default model, then run the tests in three tiers, each in its own pytest
# process (fast: model-free units; model: real weights in the test process; daemon: real processes), in two
# lanes (see below), and scripts/compat.sh (pdserve on Python 3.11 and the oldest JAX it supports). It
# prints the XLA cache's size before the tiers and every tier's time.
#   bash scripts/test.sh                  # everything (what CI runs)
#   bash scripts/test.sh fast [ARGS...]   # one tier (fast, model or daemon); ARGS go to pytest
# The fast tier alone sets up with the dev extra only and fetches no model (it uses neither): no torch.
set -euo pipefail
cd "$(dirname "$0")/.."
tiers=(fast model daemon)
case "${1:-}" in
  fast | model | daemon) tiers=("$1"); shift ;;
esac
if [ "${tiers[*]}" = fast ]; then
  bash scripts/setup.sh dev # model-free: neither the reference extra (torch) nor the model
else
  bash scripts/setup.sh dev,reference,plots
fi
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/python scripts/lint_imports.py  # layers, the two roles apart, no import cycles
bash scripts/gen_protos.sh --check
[ "${tiers[*]}" = fast ] || .venv/bin/pdserve models fetch
xla_cache="$(.venv/bin/python -c 'from pdserve.engine.loading.sources import cache_dir; print(cache_dir() / "xla")')"
cache_state() { # the persistent XLA compilation cache that tests and daemons share
  local n=0
  [ -d "$xla_cache" ] && n=$(find "$xla_cache" -type f | wc -l)
  echo "$n executables in $xla_cache"
}
times=$(mktemp -d) # a file a run: its line of the summary
logs=$(mktemp -d)  # the output of what runs beside the model tier
run() { # NAME MARKERS [ARGS...]: one pytest process; its line of the summary goes to $times/NAME
  local name=$1 markers=$2 start=$SECONDS rc=0
  shift 2
  # the tier's -m comes last: it replaces pyproject.toml's `-m fast` (addopts) and any -m in ARGS
  .venv/bin/python -m pytest "$@" -m "$markers" --no-unexpected-skips --durations=25 || rc=$?
  echo "$name $((SECONDS - start)) s$([ "$rc" -eq 0 ] || echo " (exit $rc)")" >"$times/$name"
  return "$rc"
}
step() { # NAME COMMAND...: a step beside the tiers, timed like them
  local name=$1 start=$SECONDS rc=0
  shift
  "$@" || rc=$?
  echo "$name $((SECONDS - start)) s$([ "$rc" -eq 0 ] || echo " (exit $rc)")" >"$times/$name"
  return "$rc"
}
summary() {
  echo "=== tier times: $(cat "$times"/* 2>/dev/null | paste -sd ';' -)" \
    "(XLA cache after: $(cache_state))" >&2
}
trap 'summary; rm -rf "$times" "$logs"' EXIT
if [ "${#tiers[@]}" -eq 1 ]; then
  echo "=== tier: ${tiers[0]} (XLA cache: $(cache_state))" >&2
  run "${tiers[0]}" "${tiers[0]}" "$@"
else
  # Two lanes, so that both cores stay busy (each tier alone leaves part of the second one idle, compiling
  # or waiting on its daemons): the model tier, then the rest of the daemon tier (on the session's shared
  # daemons, loading what the model tier compiled); beside them the fast tier, the benchmark smokes, the
  # other standalone daemon tests (daemon tests marked standalone start every process they use) and compat.
  # The second lane's output follows the first's.
  smokes=tests/test_bench_smoke.py
  beside_tiers=(fast bench-smokes daemon-standalone compat)
  echo "=== tiers: model, daemon (the rest); beside them ${beside_tiers[*]} (XLA cache: $(cache_state))" >&2
  (
    rc=0
    run fast fast "$@" >"$logs/fast" 2>&1 || rc=1
    run bench-smokes "daemon and standalone" "$smokes" "$@" >"$logs/bench-smokes" 2>&1 || rc=1
    run daemon-standalone "daemon and standalone" --ignore="$smokes" "$@" >"$logs/daemon-standalone" 2>&1 || rc=1
    step compat bash scripts/compat.sh >"$logs/compat" 2>&1 || rc=1
    exit "$rc"
  ) &
  beside=$!
  rc=0
  run model model "$@" || rc=1
  echo "=== tier: daemon, the rest (XLA cache: $(cache_state))" >&2
  run daemon "daemon and not standalone" "$@" || rc=1
  wait "$beside" || rc=1
  for name in "${beside_tiers[@]}"; do
    if [ -f "$logs/$name" ]; then
      echo "=== tier: $name (ran beside the others)" >&2
      cat "$logs/$name"
    fi
  done
  [ "$rc" -eq 0 ]
fi
