"""Start-up of a daemon: cold (empty persistent XLA cache) and restarted (the cache filled by the first run).

    .venv/bin/python bench/bench_startup.py [--role prefill|decode] [--json OUT] [--smoke]

Starts a real prefill-server (or a colocated decode-server) with its default engine sizes and the warmup
on, the XLA compilation cache in a fresh folder (PDSERVE_CACHE_DIR), and times it from launch to "ready"
(the daemon prints it once every serving shape has run; health is NOT_SERVING until then); stops it; then
starts it again over the same cache. Issue 14's targets concern these two figures (warmup at most a third
of today's, a restart ready in <= 20 s). --smoke: the test model, the tests' engine sizes, no warmup.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

from pdserve.bench.common import ratio, report
from pdserve.testing.launch import ENGINE_ARGS, EPHEMERAL_HTTP, EPHEMERAL_KV_EVENTS, Daemon
from pdserve.testing.models import bench_model


def start(role: str, gguf: Path, logs: Path, name: str, extra: list[str]) -> float:
    argv = [f"{role}-server", "--model", str(gguf), "--port", "0", *EPHEMERAL_KV_EVENTS, *extra]
    if role == "decode":
        argv += ["--prefill", "local", *EPHEMERAL_HTTP]
    t0 = time.perf_counter()
    daemon = Daemon(argv, name, logs, timeout=1800)
    ready = time.perf_counter() - t0
    daemon.terminate()
    return ready


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--role", choices=["prefill", "decode"], default="prefill")
    parser.add_argument("--json", default=None)
    parser.add_argument("--smoke", action="store_true", help="the test model, small sizes, no warmup")
    args = parser.parse_args(argv)
    gguf = bench_model(args.smoke)  # the model stays in the usual cache folder
    extra = [*ENGINE_ARGS, "--no-warmup"] if args.smoke else []
    logs = Path(tempfile.mkdtemp(prefix="bench-startup-"))
    xla = Path(tempfile.mkdtemp(prefix="bench-startup-cache-"))
    before = os.environ.get("PDSERVE_CACHE_DIR")
    os.environ["PDSERVE_CACHE_DIR"] = str(xla)
    try:
        cold = start(args.role, gguf, logs, "cold", extra)
        warm = start(args.role, gguf, logs, "restart", extra)
    finally:
        shutil.rmtree(xla, ignore_errors=True)
        if before is None:
            os.environ.pop("PDSERVE_CACHE_DIR")
        else:
            os.environ["PDSERVE_CACHE_DIR"] = before
    result = {
        "role": args.role,
        "cold_ready_s": cold,
        "restart_ready_s": warm,
        "restart_over_cold": ratio(warm, cold),
    }
    report(result, args.json)


if __name__ == "__main__":
    main()
