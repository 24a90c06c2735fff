"""The engine of this tree against the engine of another commit, measured by one script in one run.

    .venv/bin/python bench/bench_vs_commit.py --baseline REV [--batches 1,32] [--contexts 32,480]
        [--rounds 2] [--json OUT]

Checks REV out into a git worktree, lays each tree's pdserve out as it installs (pdserve.testing.packaging:
so REV must be 9e8f3d1 or later, when engine/ became pdserve.engine), then runs, for each round, one worker
process per tree (the order alternating from round to round, so that the machine's drift falls on both):
the worker imports the `pdserve.engine` of its tree (its layout first on PYTHONPATH), builds the default
model's engine (`max_model_len` 1024, `num_blocks` 1024, `max_num_seqs` the largest batch), times its
warmup with an empty compilation cache (every shape compiled), counts the compiled variants, times a
1000-token prompt's prefill (two chunks), then times decode steps (bench_engine.decode_step_times:
greedy, sampling included) at each batch and prompt length. The measuring code is this tree's bench/ for
both; only `pdserve` differs. Prints each tree's best figures and the ratios this tree / baseline.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_engine import decode_step_times, report  # bench/ is on the path when a script of it runs

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def _timed(fn, *args) -> float:
    import time

    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def worker(batches: list[int], contexts: list[int], steps: int) -> dict:
    import time

    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.loading.sources import DEFAULT_MODEL, fetch

    budget = (
        "max_num_batched_tokens" if "max_num_batched_tokens" in EngineConfig.__dataclass_fields__ else None
    )
    sizes = dict(num_blocks=1024, max_model_len=1024, max_num_seqs=max(batches))
    sizes[budget or "max_prefill_tokens"] = 512
    engine = LLMEngine.from_model(
        str(fetch(DEFAULT_MODEL, progress=False)), EngineConfig(**sizes), warmup=False
    )
    t0 = time.perf_counter()
    variants = engine.runner.warmup(progress=False)
    result = {
        "warmup_s": time.perf_counter() - t0,
        "variants": variants,
        "step_shapes": len(engine.runner.step_shapes()),
        "decode_tokens_s": {},
    }
    prompt = list(range(1000, 1000 + 1000))  # two chunks of 512 and 488 tokens, the second after a past
    engine.prompt_logits(prompt)  # compiles what warmup left (the grid engine's continued-chunk shape)
    result["prefill_1000_s"] = min(_timed(engine.prompt_logits, prompt) for _ in range(3))
    for context in contexts:
        for batch in batches:
            times = sorted(decode_step_times(engine, batch, steps, prompt_len=context))
            result["decode_tokens_s"][f"b{batch}_ctx{context}"] = batch / times[len(times) // 2]
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--baseline", help="commit to compare with (checked out into a worktree)")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--contexts", default="32,480", help="prompt lengths of the decoding requests")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # PYTHONPATH: the tree
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    if args.worker:
        print(json.dumps(worker(batches, contexts, args.steps)))
        return
    if not args.baseline:
        parser.error("--baseline is required")
    from pdserve.testing.packaging import stage  # not in the worker: its pdserve is the measured tree's

    base = Path(tempfile.mkdtemp(prefix="bench-baseline-")) / "tree"
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(base), args.baseline], check=True
    )
    trees = {"baseline": base, "this tree": ROOT}
    runs: dict[str, list[dict]] = {name: [] for name in trees}
    try:
        layouts = {
            name: stage(Path(tempfile.mkdtemp(prefix="bench-layout-")), tree) for name, tree in trees.items()
        }
        for r in range(args.rounds):
            for name in list(trees)[:: 1 if r % 2 == 0 else -1]:
                cmd = [sys.executable, __file__, "--worker", "--batches", args.batches]
                cmd += ["--contexts", args.contexts, "--steps", str(args.steps)]
                env = {**os.environ, "PYTHONPATH": str(layouts[name])}
                out = subprocess.run(
                    cmd, check=True, capture_output=True, text=True, env=env, cwd=trees[name]
                )
                runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(f"round {r + 1} {name}: {runs[name][-1]}", flush=True)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base)], check=False)
    best = {
        name: {
            "warmup_s": min(x["warmup_s"] for x in rs),
            "prefill_1000_s": min(x["prefill_1000_s"] for x in rs),
            "variants": rs[0]["variants"],
            "step_shapes": rs[0]["step_shapes"],
            "decode_tokens_s": {
                k: max(x["decode_tokens_s"][k] for x in rs) for k in rs[0]["decode_tokens_s"]
            },
        }
        for name, rs in runs.items()
    }
    new, old = best["this tree"], best["baseline"]
    result = {
        "baseline": args.baseline,
        "best": best,
        "ratios": {
            "warmup_this_over_baseline": new["warmup_s"] / old["warmup_s"],
            "prefill_1000_this_over_baseline": new["prefill_1000_s"] / old["prefill_1000_s"],
            **{
                f"decode_tokens_s_{k}": new["decode_tokens_s"][k] / old["decode_tokens_s"][k]
                for k in new["decode_tokens_s"]
            },
        },
    }
    report(result, args.json)


if __name__ == "__main__":
    main()
