#!/usr/bin/env bash
# Quick start, command 1: set up, fetch the default model, start a prefill-server and a decode-server on
# this machine, stream an answer through them, and stop both (SIGTERM).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/pdserve models fetch
prefill_port=${PREFILL_PORT:-50051}
decode_port=${DECODE_PORT:-50052}
logs=$(mktemp -d)
# --no-warmup: compile shapes on first use, for a quick demo (daemons in production warm up at start).
common=(--no-warmup --max-model-len 2048 --max-num-seqs 8)
.venv/bin/prefill-server --port "$prefill_port" "${common[@]}" >"$logs/prefill.log" 2>&1 &
prefill_pid=$!
.venv/bin/decode-server --port "$decode_port" --prefill "127.0.0.1:$prefill_port" "${common[@]}" \
  >"$logs/decode.log" 2>&1 &
decode_pid=$!
trap 'kill -TERM $prefill_pid $decode_pid 2>/dev/null; wait $prefill_pid $decode_pid 2>/dev/null || true' EXIT
for log in "$logs/prefill.log" "$logs/decode.log"; do
  until grep -q "ready on" "$log"; do
    if ! kill -0 $prefill_pid $decode_pid 2>/dev/null; then cat "$logs"/*.log; exit 1; fi
    sleep 1
  done
done
echo "prefill-server on :$prefill_port, decode-server on :$decode_port (logs in $logs)" >&2
.venv/bin/pdserve generate --server "127.0.0.1:$decode_port" --chat "${1:-What is the capital of France?}"
