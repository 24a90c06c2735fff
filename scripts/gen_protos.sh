#!/usr/bin/env bash
# Regenerates the Python code of every proto in protos/pdserve/v1 into pdserve/v1 (checked in), with the
# pinned grpcio-tools of the dev extra. `--check`: regenerate into a temporary folder and fail when the
# checked-in code differs (CI runs this). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
out=.
if [ "${1:-}" = "--check" ]; then
  out=$(mktemp -d)
  trap 'rm -rf "$out"' EXIT
fi
mkdir -p "$out/pdserve/v1"
.venv/bin/python -m grpc_tools.protoc -Iprotos --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  protos/pdserve/v1/*.proto
if [ "$out" != . ]; then
  for f in "$out"/pdserve/v1/*.py*; do
    if ! cmp -s "$f" "pdserve/v1/$(basename "$f")"; then
      echo "generated code is stale: pdserve/v1/$(basename "$f") (run scripts/gen_protos.sh)" >&2
      exit 1
    fi
  done
  echo "generated protobuf code is up to date"
fi
