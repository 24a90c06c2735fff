"""Where a decode step's time goes: the compiled step and sampling kernel against the host work around them.

    .venv/bin/python bench/bench_step_host.py [--batches 1,8,32] [--steps 32] [--json OUT] [--smoke]

One engine (default model, float32, the default step buckets), `batch` running requests of 32-token
prompts, greedy, then `steps` decode steps through `LLMEngine.step()`. Each part of a step is timed by
wrapping it here (the engine is not changed): scheduling (`Scheduler.schedule`), the compiled step (the
jitted call, waited for), the host work of building its inputs (the rest of `ModelRunner.forward`), the
sampling kernel (waited for) and its host bookkeeping (the rest of `ModelRunner.sample`: building the
batch, copying results to host), and `update_from_output` (tokens appended, blocks registered,
detokenizing, stop checks). Host share = 1 - (compiled step + sampling kernel) / step. Waiting for each
kernel removes the little overlap JAX's asynchronous dispatch gives today; the step totals are measured
in a separate pass without the waits. Streaming to clients (the daemons' EngineLoop and gRPC) is not
included. Issue 14's baseline: the grid engine before ragged steps. --smoke: the test model, small sizes,
batches 1 and 2, 2 steps, no warmup.
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import jax

from pdserve.bench.common import emit, report
from pdserve.bench.engine_timing import decode_step_times


def timed(table: dict, key: str, fn, wait: bool = False):
    def run(*args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        if wait:
            jax.block_until_ready(out)
        table[key].append(time.perf_counter() - t0)
        return out

    return run


def breakdown(engine, batch: int, steps: int) -> dict:
    import pdserve.engine.model_runner as runner_module

    runner, scheduler = engine.runner, engine.scheduler
    plain = decode_step_times(engine, batch, steps)  # no waits: the step as it runs
    parts = collections.defaultdict(list)
    originals = (scheduler.schedule, scheduler.update_from_output, runner.step_program, runner.forward)
    original_sample_fn, original_sample = runner_module.sample, runner.sample
    scheduler.schedule = timed(parts, "schedule", scheduler.schedule)
    scheduler.update_from_output = timed(parts, "update_from_output", scheduler.update_from_output)
    runner.step_program = timed(parts, "compiled_step", runner.step_program, wait=True)
    runner.forward = timed(parts, "forward", runner.forward)
    runner_module.sample = timed(parts, "sampling_kernel", runner_module.sample, wait=True)
    runner.sample = timed(parts, "sample", runner.sample)
    try:
        waited = decode_step_times(engine, batch, steps)
    finally:
        scheduler.schedule, scheduler.update_from_output, runner.step_program, runner.forward = originals
        runner_module.sample, runner.sample = original_sample_fn, original_sample
    n = steps  # the last `steps` entries of each part are the timed decode steps
    med = {k: statistics.median(v[-n:]) for k, v in parts.items()}
    step = statistics.median(waited)
    device = med["compiled_step"] + med["sampling_kernel"]
    out = {
        "step_s": statistics.median(plain),
        "step_with_waits_s": step,
        "schedule_s": med["schedule"],
        "build_inputs_s": med["forward"] - med["compiled_step"],
        "compiled_step_s": med["compiled_step"],
        "sampling_kernel_s": med["sampling_kernel"],
        "sampling_host_s": med["sample"] - med["sampling_kernel"],
        "update_from_output_s": med["update_from_output"],
        "host_share": 1 - device / step,
    }
    emit({"batch": batch, **out})
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--json", default=None)
    parser.add_argument("--smoke", action="store_true", help="the test model, small sizes, 2 steps")
    args = parser.parse_args(argv)
    if args.smoke:
        args.batches, args.steps = "1,2", 2

    from pdserve.engine.compile_cache import configure_jax
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.testing.models import bench_model

    configure_jax()
    batches = [int(b) for b in args.batches.split(",")]
    sizes = dict(num_blocks=64, max_model_len=256, max_num_batched_tokens=64) if args.smoke else {}
    config = EngineConfig(
        **{"num_blocks": 1024, "max_model_len": 1024, **sizes, "max_num_seqs": max(batches)}
    )
    engine = LLMEngine.from_model(str(bench_model(args.smoke)), config, warmup=False)
    t0 = time.perf_counter()
    variants = None if args.smoke else engine.runner.warmup(progress=False)  # smoke: shapes on first use
    result = {
        "warmup": {
            "variants": variants,
            "step_shapes": len(engine.runner.step_shapes()),
            "s": time.perf_counter() - t0,
        },
        "decode": {str(b): breakdown(engine, b, args.steps) for b in batches},
    }
    report(result, args.json)


if __name__ == "__main__":
    main()
