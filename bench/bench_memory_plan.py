"""Does the memory plan hold at a real size? (issue 48)

    .venv/bin/python bench/bench_memory_plan.py [--dir DIR] [--json OUT] [--smoke]

Writes the random 1.2B-parameter bfloat16 Llama of bench/bench_load.py (2.2 GB in 4 safetensors shards, the
test model's tokenizer beside it), then serves it from a fresh process for each case
(pdserve.testing.memory_probe: the engine sized from memory as a daemon sizes it, then its largest work: a
prompt past the step's token budget with prompt logprobs, n = 4 sequences, decodes). Reported for each:
the plan (weights, the step's temporaries at the planned cache, the KV cache, the runtime's share), the
process's peak resident growth, and peak / planned (goal <= 1.0: the plan holds). Cases:

- `default`: no sizing flag, sized from the box's own available RAM (the CPU rule: the cache takes 0.1 of
  the RAM left after the weights and the step);
- `four_x`: no sizing flag on a host with 4x the checkpoint's bytes available (PDSERVE_AVAILABLE_RAM);
- `fraction_0.6`: the issue's decode-server, `--gpu-memory-utilization 0.6` of this box's available RAM
  (the plan before this fix counted 13.2 GiB and the process was killed at 23.9 GB).

`--max-num-batched-tokens` (default 512, the daemons') sets the largest step. --smoke: a 2-layer random
Llama of hidden size 64, the `four_x` case only.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from pdserve.bench.common import ratio, report

# The random checkpoint: TinyLlama-1.1B's shapes; --smoke: a tiny one of the same architecture
SIZES = dict(hidden=2048, intermediate=5632, layers=22, heads=32, kv_heads=4, vocab=32000)
SMOKE_SIZES = dict(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, vocab=32000)


def probe(folder: Path, step_tokens: int, env: dict | None = None, *extra: str) -> dict:
    done = subprocess.run(
        [sys.executable, "-m", "pdserve.testing.memory_probe", str(folder), "--max-num-batched-tokens",
         str(step_tokens), *extra],
        capture_output=True, text=True, env={**os.environ, **(env or {})}, check=True,
    )  # fmt: skip
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if "planned_bytes" in result:
        result["peak_over_planned"] = ratio(result["peak_growth"], result["planned_bytes"])
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--cases", nargs="+", default=["default", "four_x", "fraction_0.6"])
    parser.add_argument("--json", default=None)
    parser.add_argument("--smoke", action="store_true", help="a tiny random Llama, the four_x case only")
    args = parser.parse_args(argv)
    if args.smoke:
        args.cases, args.max_num_batched_tokens = ["four_x"], 64

    from pdserve.testing.load_probe import write_random_llama
    from pdserve.testing.models import small_model

    results = {}
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        folder = Path(tmp) / "random-llama-1b"
        nbytes = write_random_llama(folder, shards=4, **(SMOKE_SIZES if args.smoke else SIZES))
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(small_model() / name, folder / name)
        results["checkpoint_bytes"] = nbytes
        for case in args.cases:
            if case == "default":
                results[case] = probe(folder, args.max_num_batched_tokens)
            elif case == "four_x":
                env = {"PDSERVE_AVAILABLE_RAM": str(4 * nbytes)}
                results[case] = probe(folder, args.max_num_batched_tokens, env)
            elif case.startswith("fraction_"):
                fraction = case.removeprefix("fraction_")
                results[case] = probe(
                    folder, args.max_num_batched_tokens, None, "--gpu-memory-utilization", fraction
                )
    report(results, args.json)


if __name__ == "__main__":
    main()
