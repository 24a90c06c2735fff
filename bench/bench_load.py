"""Loading a ~1B-parameter bfloat16 checkpoint: host memory and speed of the streaming loader.

    .venv/bin/python bench/bench_load.py [--dir DIR] [--layers 22] [--dtype bfloat16] [--json OUT] [--smoke]

Writes a random Llama-architecture checkpoint (TinyLlama-1.1B's shapes by default: hidden 2048,
intermediate 5632, 22 layers, 32 heads, 4 KV heads, vocabulary 32000, untied head; about 2.2 GB of
bfloat16 in 4 safetensors shards with an index) into DIR (default: a temporary folder; nothing is kept),
then in a fresh process loads it into an engine (pdserve.testing.load_probe) and prefills a prompt.
Reported against references measured in the same run:

- peak RSS growth / checkpoint bytes (goal <= 1.3): the process's high-water mark (VmHWM) less its
  resident memory once JAX was up. On a CPU the devices' memory is host memory, so the weights' own copy
  (1.0x in bfloat16) is part of it;
- steady RSS growth once loaded, and after a prefill has run, / checkpoint bytes, less the KV cache (goal
  <= 1.1). The second includes what XLA keeps of the compiled step and the step's temporaries, which
  are reported too (XLA's memory analysis of the largest step);
- load GB/s against reading the same shard files from disk in the same run (the page cache warm for
  both: the loader's own cost over the bytes it must read), at a first start (the loader's writes
  compiled) and at a restart (read back from pdserve's compilation cache, a folder of the run's own).

--smoke: a 2-layer random Llama of hidden size 64 (the figures mean nothing; the script runs).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pdserve.bench.common import ratio, write_json

SMOKE_SIZES = dict(hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=32000)  # and 2 layers


def read_files(folder: Path) -> float:
    """GB/s of reading every shard once, in 64 MiB reads (the reference of the load's speed)."""
    files = sorted(folder.glob("*.safetensors"))
    start, total = time.perf_counter(), 0
    for file in files:
        with file.open("rb") as f:
            while chunk := f.read(64 * 2**20):
                total += len(chunk)
    return total / 1e9 / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--layers", type=int, default=22)
    parser.add_argument("--dtype", default="bfloat16", help="the engine's (the checkpoint is bfloat16)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--smoke", action="store_true", help="a tiny random Llama")
    args = parser.parse_args(argv)
    sizes = dict(hidden=2048, intermediate=5632, heads=32, kv_heads=4, vocab=32000)
    if args.smoke:
        sizes, args.layers = SMOKE_SIZES, 2

    from pdserve.testing.load_probe import write_random_llama

    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        folder = Path(tmp) / "random-llama-1b"
        start = time.perf_counter()
        stored = write_random_llama(folder, shards=4, layers=args.layers, **sizes)
        print(f"wrote {stored / 1e9:.2f} GB in {time.perf_counter() - start:.0f} s", file=sys.stderr)
        disk = max(read_files(folder) for _ in range(2))  # the second read: page cache warm, as the load's
        # pdserve's compilation cache, in a folder of the run's own: the first start compiles the loader's
        # writes, a restart (the second probe) reads them back, as a daemon's restart does
        env = {**os.environ, "PDSERVE_CACHE_DIR": str(Path(tmp) / "cache")}
        command = [sys.executable, "-m", "pdserve.testing.load_probe", str(folder), "--dtype", args.dtype]
        cost, restart = (
            json.loads(
                subprocess.run(
                    [*command, "--compile-cache"], capture_output=True, text=True, check=True, env=env
                ).stdout.splitlines()[-1]
            )
            for _ in range(2)
        )
    ckpt = cost["checkpoint_bytes"]
    growth = lambda key: (cost[key] - cost["rss_before"] - cost["kv_bytes"]) / ckpt  # noqa: E731
    result = {
        "checkpoint_gb": ckpt / 1e9,
        "dtype": args.dtype,
        "weights_on_devices_gb": cost["weight_bytes"] / 1e9,
        "peak_rss_growth_over_checkpoint": (cost["rss_peak"] - cost["rss_before"]) / ckpt,
        "loaded_rss_growth_less_kv_over_checkpoint": growth("rss_loaded"),
        "served_rss_growth_less_kv_over_checkpoint": growth("rss_serving"),
        "step_temporaries_over_checkpoint": cost["step_temp_bytes"] / ckpt,
        "traced_peak_over_checkpoint": cost["traced_peak"] / ckpt,
        "traced_after_load_mb": cost["traced_after"] / 1e6,
        "load_seconds": cost["load_seconds"],
        "load_gb_per_s": ckpt / 1e9 / cost["load_seconds"],
        "restart_load_seconds": restart["load_seconds"],
        "restart_load_gb_per_s": ckpt / 1e9 / restart["load_seconds"],
        "read_files_gb_per_s": disk,
    }
    result["load_over_read_speed"] = ratio(result["load_gb_per_s"], disk)
    result["restart_load_over_read_speed"] = ratio(result["restart_load_gb_per_s"], disk)
    for key, value in result.items():
        print(f"{key:45s} {value:.3f}" if isinstance(value, float) else f"{key:45s} {value}")
    write_json(result, args.json)


if __name__ == "__main__":
    main()
