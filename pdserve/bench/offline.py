"""`pdserve bench throughput` and `pdserve bench latency`: the engine in this process, no server.

- throughput: `--num-prompts` random prompts of `--input-len` tokens, all submitted at once, each
  generating exactly `--output-len` tokens (greedy, EOS ignored); requests/s and tokens/s over the run;
- latency: one batch of `--batch-size` such requests run to the end, `--num-iters` times after
  `--num-iters-warmup` untimed runs; the distribution of the batch's end-to-end seconds.

The engine is built from the engine flags of `pdserve generate` (`--model` and EngineConfig's flags).
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from pdserve.bench.common import report
from pdserve.bench.stats import distribution
from pdserve.bench.workload import PROMPT_ID_RANGE
from pdserve.flags import add_engine_args, engine_config, load_adapters


def run_batch(engine, prompts: list[list[int]], output_len: int) -> int:
    """Runs `prompts` together to the end (greedy, exactly `output_len` tokens each); returns the output
    tokens generated."""
    from pdserve.engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for prompt in prompts:
        engine.add_request(prompt, params)
    generated = 0
    while engine.has_unfinished:
        generated += sum(len(output.new_token_ids) for output in engine.step().tokens)
    return generated


def random_prompts(count: int, length: int, seed: int) -> list[list[int]]:
    """`count` random token-id prompts of `length` tokens (the load generator's id range)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(*PROMPT_ID_RANGE, length).tolist() for _ in range(count)]


def throughput(engine, num_prompts: int, input_len: int, output_len: int, seed: int = 0) -> dict:
    """Requests/s, output tokens/s and total tokens/s of `num_prompts` requests submitted at once."""
    prompts = random_prompts(num_prompts, input_len, seed)
    t0 = time.perf_counter()
    generated = run_batch(engine, prompts, output_len)
    elapsed = time.perf_counter() - t0
    return {
        "elapsed_s": elapsed,
        "requests": num_prompts,
        "output_tokens": generated,
        "request_throughput": num_prompts / elapsed,
        "output_token_throughput": generated / elapsed,
        "total_token_throughput": (generated + num_prompts * input_len) / elapsed,
    }


def latency(
    engine, batch_size: int, input_len: int, output_len: int, iters_warmup: int, iters: int, seed: int = 0
) -> dict:
    """The end-to-end seconds of one batch, `iters` times after `iters_warmup` untimed runs."""
    prompts = random_prompts(batch_size, input_len, seed)
    for _ in range(iters_warmup):
        run_batch(engine, prompts, output_len)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        run_batch(engine, prompts, output_len)
        times.append(time.perf_counter() - t0)
    return {"latency_s": distribution(times), "latencies_s": times}


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """The engine flags (`--model`, EngineConfig's), the requests' lengths, the seed and --json."""
    add_engine_args(parser)
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens of each request")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens of each request")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", action="store_true", help="compile every serving shape first")
    parser.add_argument("--json", dest="json_path", metavar="OUT", help="write the result as JSON")


def add_throughput_args(parser: argparse.ArgumentParser) -> None:
    """The flags of `pdserve bench throughput`."""
    add_common_args(parser)
    parser.add_argument("--num-prompts", type=int, default=100, help="requests, submitted at once")


def add_latency_args(parser: argparse.ArgumentParser) -> None:
    """The flags of `pdserve bench latency`."""
    add_common_args(parser)
    parser.add_argument("--batch-size", type=int, default=8, help="requests in the batch")
    parser.add_argument("--num-iters-warmup", type=int, default=1, help="untimed runs first")
    parser.add_argument("--num-iters", type=int, default=3, help="timed runs")


def engine_of(args: argparse.Namespace):
    """The engine of add_engine_args' flags in this process (`--warmup`: every shape compiled first)."""
    from pdserve.engine.compile_cache import configure_jax
    from pdserve.engine.llm_engine import LLMEngine

    configure_jax()
    engine = LLMEngine.from_model(args.model, engine_config(args), warmup=args.warmup, progress=False)
    load_adapters(engine, args.lora)
    return engine


def _positive(args: argparse.Namespace, *names: str) -> bool:
    bad = [name for name in names if getattr(args, name) < 1]
    for name in bad:
        print(f"error: --{name.replace('_', '-')} must be >= 1", file=sys.stderr)
    return not bad


def cmd_throughput(args: argparse.Namespace) -> int:
    """Runs `pdserve bench throughput` and prints its JSON result; exit status 2 on bad sizes."""
    if not _positive(args, "num_prompts", "input_len", "output_len"):
        return 2
    result = {
        "config": {k: getattr(args, k) for k in ("model", "num_prompts", "input_len", "output_len", "seed")},
        "stats": throughput(engine_of(args), args.num_prompts, args.input_len, args.output_len, args.seed),
    }
    report(result, args.json_path)
    return 0


def cmd_latency(args: argparse.Namespace) -> int:
    """Runs `pdserve bench latency` and prints its JSON result; exit status 2 on bad sizes."""
    if not _positive(args, "batch_size", "input_len", "output_len", "num_iters"):
        return 2
    keys = ("model", "batch_size", "input_len", "output_len", "num_iters_warmup", "num_iters", "seed")
    stats = latency(
        engine_of(args),
        args.batch_size,
        args.input_len,
        args.output_len,
        args.num_iters_warmup,
        args.num_iters,
        args.seed,
    )
    report({"config": {k: getattr(args, k) for k in keys}, "stats": stats}, args.json_path)
    return 0
