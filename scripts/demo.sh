#!/usr/bin/env bash
# Quick start, command 1: set up, fetch the default model, generate a completion with it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/pdserve models fetch
.venv/bin/pdserve generate --chat "${1:-What is the capital of France?}"
