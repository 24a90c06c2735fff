#!/usr/bin/env bash
# The outside clients' environment for bench/bench_lm_eval.py (not CI: heavy installs): .venv-clients,
# pdserve (its pinned dependencies, constraints.txt) with lm-evaluation-harness, torch (CPU) and
# transformers beside it: lm-eval's `hf` model runs the same weights in that process.
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
if [ ! -x .venv-clients/bin/python ]; then
  "$python" -m venv .venv-clients
fi
.venv-clients/bin/python -m pip install -q --upgrade pip
.venv-clients/bin/python -m pip install -q -c constraints.txt -e ".[reference]" "lm-eval[api]==0.4.13"
