#!/usr/bin/env bash
# The outside clients' environments (not CI: heavy installs).
#   bash bench/clients_env.sh          .venv-clients for bench/bench_lm_eval.py: pdserve (its pinned
#                                      dependencies, constraints.txt) with lm-evaluation-harness, torch (CPU)
#                                      and transformers beside it: lm-eval's `hf` model runs the same weights
#   bash bench/clients_env.sh loadgen  for bench/bench_clients.py: .venv-loadgen with guidellm, .venv-aiperf
#                                      with aiperf (each alone; torch CPU first, so nothing pulls a CUDA build)
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
if [ "${1:-}" = loadgen ]; then
  [ -x .venv-loadgen/bin/python ] || "$python" -m venv .venv-loadgen
  .venv-loadgen/bin/python -m pip install -q --upgrade pip
  .venv-loadgen/bin/python -m pip install -q torch==2.13.0
  .venv-loadgen/bin/python -m pip install -q "guidellm==0.8.1"
  [ -x .venv-aiperf/bin/python ] || "$python" -m venv .venv-aiperf
  .venv-aiperf/bin/python -m pip install -q --upgrade pip
  .venv-aiperf/bin/python -m pip install -q torch==2.13.0
  .venv-aiperf/bin/python -m pip install -q "aiperf==0.13.0"
  exit 0
fi
if [ ! -x .venv-clients/bin/python ]; then
  "$python" -m venv .venv-clients
fi
.venv-clients/bin/python -m pip install -q --upgrade pip
.venv-clients/bin/python -m pip install -q -c constraints.txt -e ".[reference]" "lm-eval[api]==0.4.13"
