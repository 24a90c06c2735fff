"""The engine of this tree against the engine of another commit, measured by one script in one run.

    .venv/bin/python bench/bench_vs_commit.py --baseline REV [--batches 1,32] [--contexts 32,480]
        [--prefill-tokens 1000] [--budget 512] [--rounds 2] [--served] [--json OUT]
    .venv/bin/python bench/bench_vs_commit.py --smoke [--json OUT]

Checks REV out into a git worktree, lays each tree's pdserve out as it installs (pdserve.testing.packaging:
so REV must be 9e8f3d1 or later, when engine/ became pdserve.engine), then runs, for each round, one worker
process per tree (the order alternating from round to round, so that the machine's drift falls on both):
the worker imports the `pdserve.engine` of its tree (its layout first on PYTHONPATH), builds the default
model's engine (`max_model_len` 1024 or the prompt's, `num_blocks` 1024, `max_num_seqs` the largest batch,
the token budget --budget), times its warmup with an empty compilation cache (every shape compiled), counts
the compiled variants, times a --prefill-tokens prompt's prefill (1000 at the budget of 512: two chunks),
then times decode steps (pdserve.bench.engine_timing's
decode_step_times: greedy, sampling included) at each batch and prompt length; with --served, also the
daemons' path (`served_path`: a 1000-token prompt's TTFT through services.decode.core, and the boundary
crossings of one request prefilled by a second engine). The measuring code is this tree's for both; only
`pdserve` differs: the worker loads pdserve/bench/common.py and engine_timing.py of this tree by their
paths (a baseline's pdserve may have no pdserve.bench). Prints each tree's best figures and the ratios
this tree / baseline. --smoke: one worker on this tree in this process, the test model, no warmup, batch 1,
2 steps; no baseline.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
SERVED_PROMPT = 600  # tokens of the request counted through the daemons' path (2 prefill chunks)


def this_tree(name: str):
    """pdserve/bench/`name`.py of this tree, loaded by its path: a worker imports the measured tree's
    `pdserve` (PYTHONPATH), which for a baseline may have no pdserve.bench, and measures with this tree's
    code (both modules import only numpy and the standard library at the top)."""
    spec = importlib.util.spec_from_file_location(
        f"this_tree_{name}", ROOT / "pdserve" / "bench" / f"{name}.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


common, engine_timing = this_tree("common"), this_tree("engine_timing")


def worker(
    batches: list[int],
    contexts: list[int],
    steps: int,
    served: bool = False,
    smoke: bool = False,
    prefill_tokens: int = 1000,
    budget_tokens: int = 512,
) -> dict:
    import time

    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.loading.sources import DEFAULT_MODEL, fetch

    budget = (
        "max_num_batched_tokens" if "max_num_batched_tokens" in EngineConfig.__dataclass_fields__ else None
    )
    model_len = max(1024, -(-(prefill_tokens + 1) // 1024) * 1024)
    sizes = dict(num_blocks=max(1024, model_len // 16), max_model_len=model_len, max_num_seqs=max(batches))
    sizes[budget or "max_prefill_tokens"] = budget_tokens
    if smoke:  # (this tree only: the test model)
        from pdserve.testing.models import small_model

        model_path = small_model()
    else:
        model_path = fetch(DEFAULT_MODEL, progress=False)
    engine = LLMEngine.from_model(str(model_path), EngineConfig(**sizes), warmup=False)
    t0 = time.perf_counter()
    variants = None if smoke else engine.runner.warmup(progress=False)  # smoke: shapes on first use
    result = {
        "warmup_s": time.perf_counter() - t0,
        "variants": variants,
        "step_shapes": len(engine.runner.step_shapes()),
        "decode_tokens_s": {},
    }
    prompt = list(range(1000, 1000 + prefill_tokens))  # (1000 at 512: chunks of 512 and 488 tokens)
    engine.prompt_logits(prompt)  # compiles what warmup left (the grid engine's continued-chunk shape)
    result["prefill_s"] = common.best_of(lambda: engine.prompt_logits(prompt), 3)
    for context in contexts:
        for batch in batches:
            times = sorted(engine_timing.decode_step_times(engine, batch, steps, prompt_len=context))
            result["decode_tokens_s"][f"b{batch}_ctx{context}"] = batch / times[len(times) // 2]
    if served:
        result.update(served_path(engine, sizes))
    return result


def served_path(engine, sizes: dict) -> dict:
    """Through the daemons' path (services.decode.core over an engine thread), in this process:
    - ttft_1000_s: a 1000-token prompt's first token, colocated (best of 3 prompts never seen before);
    - crossings of one request prefilled by a second engine (`pdserve serve`'s shape: its KV moved device
      to device) of SERVED_PROMPT tokens and 8 output tokens: calls down into the engine threads
      (EngineLoop.call / submit, by what was sent), hand-offs up to the event loop from them (by the
      callable handed), and the functions of services/ other than engine_loop.py that ran on an engine
      thread (code of the daemons executed inside the engine's loop: callbacks, closures)."""
    import asyncio
    import collections
    import threading
    import time

    import jax

    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.services import engine_loop
    from pdserve.services.decode.core import GenerationCore

    try:
        from pdserve.services.decode.local_prefiller import LocalPrefiller
    except ImportError:  # (a tree before issue 49's cut of prefill_pool)
        from pdserve.services.decode.prefill_pool import LocalPrefiller

    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    async def one(core, prompt) -> float:
        start = time.perf_counter()
        first = None
        async for _ in core.stream(core.make_request(prompt, greedy)):
            first = first or time.perf_counter() - start
        return first

    async def ttft() -> float:
        core = GenerationCore.for_engine(engine)
        await core.start()
        try:
            return min([await one(core, list(range(2000 + 1000 * i, 3000 + 1000 * i))) for i in range(4)][1:])
        finally:
            await core.close()

    result = {"ttft_1000_s": asyncio.run(ttft())}
    calls, ups, services = collections.Counter(), collections.Counter(), collections.Counter()
    engine_threads = ("prefill-engine", "decode-engine")

    def counted(method):
        def wrapper(self, what, *args, **kwargs):
            calls[type(what).__name__ if not callable(what) else f"closure {what.__qualname__}"] += 1
            return method(self, what, *args, **kwargs)

        return wrapper

    loop_cls = engine_loop.EngineLoop
    loop_cls.call, loop_cls.submit = counted(loop_cls.call), counted(loop_cls.submit)
    handoff = asyncio.BaseEventLoop.call_soon_threadsafe

    def call_soon_threadsafe(self, callback, *args, **kwargs):
        if threading.current_thread().name in engine_threads:
            ups[getattr(callback, "__name__", type(callback).__name__)] += 1
        return handoff(self, callback, *args, **kwargs)

    asyncio.BaseEventLoop.call_soon_threadsafe = call_soon_threadsafe

    def profile(frame, event, arg):
        if event == "call" and threading.current_thread().name in engine_threads:
            path = frame.f_code.co_filename
            if "/services/" in path and not path.endswith("engine_loop.py"):
                services[f"{Path(path).name}:{frame.f_code.co_name}"] += 1

    async def disaggregated() -> None:
        config = EngineConfig(**{**sizes, "max_num_seqs": 4})
        devices = jax.devices()
        decode = LLMEngine(engine.model, config, devices[:1])
        prefill = LLMEngine(engine.model, config, devices[1:2])
        layout = getattr(prefill, "kv_layout", None)
        if layout is None:  # before engine.kv_layout
            from pdserve.services.kv import engine_layout

            layout = engine_layout(prefill)
        prefill_loop = engine_loop.EngineLoop(prefill, name="prefill-engine")
        threading.setprofile(profile)  # the engine threads started from here on
        prefill_loop.start()
        core = GenerationCore.for_engine(decode, local_prefiller=LocalPrefiller(prefill_loop, layout))
        await core.start()
        threading.setprofile(None)
        try:
            await one(core, list(range(5000, 5000 + SERVED_PROMPT)))
        finally:
            await core.close()
            prefill_loop.stop()

    asyncio.run(disaggregated())
    result["crossings"] = {
        "calls_down": dict(calls),
        "handoffs_up": dict(ups),
        "services_code_on_engine_threads": dict(services),
    }
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--baseline", help="commit to compare with (checked out into a worktree)")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--contexts", default="32,480", help="prompt lengths of the decoding requests")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--prefill-tokens", type=int, default=1000, help="the timed prefill's prompt")
    parser.add_argument("--budget", type=int, default=512, help="the engines' max_num_batched_tokens")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--served", action="store_true", help="also TTFT and boundary crossings through the daemons' path"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # PYTHONPATH: the tree
    parser.add_argument("--smoke", action="store_true", help="one worker here, the test model; no baseline")
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    if args.worker:
        sizes = dict(prefill_tokens=args.prefill_tokens, budget_tokens=args.budget)
        print(json.dumps(worker(batches, contexts, args.steps, args.served, **sizes)))
        return
    if args.smoke:
        common.report({"this tree": worker([1], [32], 2, smoke=True)}, args.json)
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
                cmd += ["--prefill-tokens", str(args.prefill_tokens), "--budget", str(args.budget)]
                cmd += ["--served"] if args.served else []
                env = {**os.environ, "PYTHONPATH": str(layouts[name])}
                env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2"
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
            "prefill_s": min(x["prefill_s"] for x in rs),
            "variants": rs[0]["variants"],
            "step_shapes": rs[0]["step_shapes"],
            "decode_tokens_s": {
                k: max(x["decode_tokens_s"][k] for x in rs) for k in rs[0]["decode_tokens_s"]
            },
            **(
                {"ttft_1000_s": min(x["ttft_1000_s"] for x in rs), "crossings": rs[0]["crossings"]}
                if args.served
                else {}
            ),
        }
        for name, rs in runs.items()
    }
    new, old = best["this tree"], best["baseline"]
    result = {
        "baseline": args.baseline,
        "prefill_tokens": args.prefill_tokens,
        "budget": args.budget,
        "best": best,
        "ratios": {
            "warmup_this_over_baseline": common.ratio(new["warmup_s"], old["warmup_s"]),
            "prefill_this_over_baseline": common.ratio(new["prefill_s"], old["prefill_s"]),
            **{
                f"decode_tokens_s_{k}": common.ratio(new["decode_tokens_s"][k], old["decode_tokens_s"][k])
                for k in new["decode_tokens_s"]
            },
            **(
                {"ttft_1000_this_over_baseline": common.ratio(new["ttft_1000_s"], old["ttft_1000_s"])}
                if args.served
                else {}
            ),
        },
    }
    common.report(result, args.json)


if __name__ == "__main__":
    main()
