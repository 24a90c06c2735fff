"""Start-up of a daemon: cold (empty persistent XLA cache) and restarted (the cache filled by the first run).

    .venv/bin/python bench/bench_startup.py [--role prefill|decode] [--json OUT]

Starts a real prefill-server (or a colocated decode-server) with its default engine sizes and the warmup
on, the XLA compilation cache in a fresh folder (PDSERVE_CACHE_DIR), and times it from launch to "ready"
(the daemon prints it once every serving shape has run; health is NOT_SERVING until then); stops it; then
starts it again over the same cache. Issue 14's targets concern these two figures (warmup at most a third
of today's, a restart ready in <= 20 s).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from pdserve.engine.loading.sources import DEFAULT_MODEL, fetch
from pdserve.testing.launch import EPHEMERAL_HTTP, EPHEMERAL_KV_EVENTS, Daemon


def start(role: str, gguf: Path, logs: Path, name: str) -> float:
    argv = [f"{role}-server", "--model", str(gguf), "--port", "0", *EPHEMERAL_KV_EVENTS]
    if role == "decode":
        argv += ["--prefill", "local", *EPHEMERAL_HTTP]
    t0 = time.perf_counter()
    daemon = Daemon(argv, name, logs, timeout=1800)
    ready = time.perf_counter() - t0
    daemon.terminate()
    return ready


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--role", choices=["prefill", "decode"], default="prefill")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    gguf = fetch(DEFAULT_MODEL, progress=False)  # the model stays in the usual cache folder
    logs = Path(tempfile.mkdtemp(prefix="bench-startup-"))
    xla = Path(tempfile.mkdtemp(prefix="bench-startup-cache-"))
    os.environ["PDSERVE_CACHE_DIR"] = str(xla)
    try:
        cold = start(args.role, gguf, logs, "cold")
        warm = start(args.role, gguf, logs, "restart")
    finally:
        shutil.rmtree(xla, ignore_errors=True)
    result = {
        "role": args.role,
        "cold_ready_s": cold,
        "restart_ready_s": warm,
        "restart_over_cold": warm / cold,
    }
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
