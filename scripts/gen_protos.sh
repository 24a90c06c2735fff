#!/usr/bin/env bash
# Regenerates the Python code of every proto in protos/pdserve/v1 into pdserve/v1 (checked in).
# Idempotent: running it twice leaves the tree unchanged. CI can verify with `git diff --exit-code pdserve/v1`.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p pdserve/v1
[ -f pdserve/v1/__init__.py ] || echo '"""Generated protobuf and gRPC code of the pdserve.v1 protos (scripts/gen_protos.sh)."""' > pdserve/v1/__init__.py
.venv/bin/python -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. protos/pdserve/v1/*.proto
