"""The host-memory KV tier (--kv-offloading-size), on vs off, measured in one run on this machine.

    .venv/bin/python bench/bench_host_tier.py [--quick] [--json OUT] [--smoke]

1. Multi-turn chat against a decode-server that prefills locally (the default model, real daemons):
   16 conversations of 6 turns, each with its own 1,024-token system prompt, 64-token user turns and
   32-token answers; each turn's prompt is the whole conversation so far. 4 client threads each own 4
   conversations and take their turns round-robin, so the requests in flight (at most 4 histories of up
   to 100 blocks) fit a device pool of 512 blocks, but the 16 conversations (1,700 blocks) do not: between
   two turns of a conversation the others' KV pushes it out (`--quick`: 8 conversations, 2 threads, 3
   turns, 512-token system prompts, 128 blocks). The same against a daemon with a host tier that holds
   every conversation. Reports TTFT p50 and p90 of turns >= 2, the prompt tokens computed (looked up minus
   found, Admin stats) and TPOT p50 of the whole run. Goals: TTFT p50 of turns >= 2 <= 0.5x without the
   tier, prompt tokens computed <= 0.2x. (The issue's example, 32 x 6 with 1K-token prompts: `--shape
   32,8,6,1024,1024`; its run without the tier recomputes 260K prompt tokens, about half an hour here.)
2. Decode alone, tier on vs off, on the same two daemons (their pools full of cached blocks from the
   chat: each new block evicts one, which the tier copies out): 8 concurrent streams of 64 tokens after
   128-token random prompts, TPOT p50 of rounds interleaved. Goal: within 5%.
3. The copies themselves, in this process on the default model's cache shape: blocks to host slots and
   back (engine/host_kv.py), GB/s and milliseconds per 1,024 tokens of KV, against prefilling 1,024
   tokens in the same run (what a host hit saves).

--smoke: part 3 only (parts 1 and 2 need the daemons), the test model, one repeat.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from pdserve.bench.common import emit, ratio, report
from pdserve.bench.prompts import random_tokens
from pdserve.engine.loading.sources import DEFAULT_MODEL, fetch
from pdserve.services.client import Client
from pdserve.testing.launch import decode_server
from pdserve.testing.models import bench_model

ENGINE_ARGS = ["--max-model-len", "4096", "--max-num-seqs", "8"]
HOST_TIER_GIB = "3"  # up to 32 conversations of ~100 blocks of 0.7 MiB (float32 on a CPU)


def chat(client: Client, conversations: int, turns: int, threads: int, system_tokens: int) -> list[dict]:
    """Runs the conversations: thread t owns conversations t, t + threads, ...; it takes turn 1 of each,
    then turn 2 of each, ... Returns a record per turn."""

    def one_thread(t: int) -> list[dict]:
        mine = list(range(t, conversations, threads))
        histories = {c: random_tokens(system_tokens, np.random.default_rng(1000 + c)) for c in mine}
        rngs = {c: np.random.default_rng(2000 + c) for c in mine}
        records = []
        for turn in range(turns):
            for c in mine:
                histories[c] += random_tokens(64, rngs[c])
                result = client.generate(histories[c], max_tokens=32, ignore_eos=True, temperature=0.0)
                histories[c] += result.token_ids
                records.append(
                    {
                        "turn": turn + 1,
                        "ttft_s": result.ttft_s,
                        "tpot_s": result.tpot_s,
                        "tokens": result.token_ids,
                    }
                )
        return records

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        return [r for records in pool.map(one_thread, range(threads)) for r in records]


def decode_tpot(client: Client, rng: np.random.Generator) -> float:
    """TPOT p50 of 8 concurrent 64-token streams after random 128-token prompts."""
    prompts = [random_tokens(128, rng) for _ in range(8)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda p: client.generate(p, max_tokens=64, ignore_eos=True), prompts))
    return statistics.median(r.tpot_s for r in results)


def p(values: list[float], q: float) -> float:
    return float(np.percentile(values, q))


def serving_study(
    gguf: Path,
    logs: Path,
    conversations: int,
    threads: int,
    turns: int,
    system_tokens: int,
    num_blocks: int,
    rounds: int,
):
    settings = {"off": [], "on": ["--kv-offloading-size", HOST_TIER_GIB]}
    engine_args = [*ENGINE_ARGS, "--num-blocks", str(num_blocks)]
    daemons = {
        k: decode_server(gguf, "local", logs, name=f"decode-tier-{k}", engine_args=[*engine_args, *extra])
        for k, extra in settings.items()
    }
    results: dict = {}
    try:
        clients = {k: Client(d.address) for k, d in daemons.items()}
        for client in clients.values():  # compile the shapes the runs use
            chat(client, 2, 2, 2, system_tokens)
            decode_tpot(client, np.random.default_rng(0))
        tokens_out = {}
        for k, client in clients.items():
            before = client.stats()
            start = time.perf_counter()
            records = chat(client, conversations, turns, threads, system_tokens)
            wall = time.perf_counter() - start
            after = client.stats()
            later = [r["ttft_s"] for r in records if r["turn"] > 1]
            looked_up = after.prefix_cache_queries_total - before.prefix_cache_queries_total
            found = after.prefix_cache_hits_total - before.prefix_cache_hits_total
            results[k] = {
                "wall_s": wall,
                "ttft_p50_turn1_s": statistics.median(r["ttft_s"] for r in records if r["turn"] == 1),
                "ttft_p50_later_turns_s": statistics.median(later),
                "ttft_p90_later_turns_s": p(later, 90),
                "tpot_p50_s": statistics.median(r["tpot_s"] for r in records),
                "prompt_tokens": looked_up,
                "prompt_tokens_computed": looked_up - found,
                "host_hit_tokens": after.prefix_cache_host_hits_total - before.prefix_cache_host_hits_total,
                "device_evictions": after.prefix_cache_evictions_total - before.prefix_cache_evictions_total,
                "host_offloads": after.num_host_offloads_total - before.num_host_offloads_total,
            }
            tokens_out[k] = sorted((r["turn"], r["tokens"]) for r in records)
            emit({k: results[k]})
        results["same_tokens"] = tokens_out["on"] == tokens_out["off"]
        on, off = results["on"], results["off"]
        results["ttft_p50_later_turns_on_over_off"] = ratio(
            on["ttft_p50_later_turns_s"], off["ttft_p50_later_turns_s"]
        )
        results["ttft_p90_later_turns_on_over_off"] = ratio(
            on["ttft_p90_later_turns_s"], off["ttft_p90_later_turns_s"]
        )
        results["prompt_tokens_computed_on_over_off"] = ratio(
            on["prompt_tokens_computed"], off["prompt_tokens_computed"]
        )
        samples = {k: [] for k in clients}
        rng = np.random.default_rng(7)
        for i in range(rounds):
            order = list(clients.items())
            for k, client in order if i % 2 else order[::-1]:  # alternate who goes first
                samples[k].append(decode_tpot(client, rng))
        results["decode_tpot_p50_s"] = {k: statistics.median(v) for k, v in samples.items()}
        results["decode_tpot_on_over_off"] = ratio(
            statistics.median(samples["on"]), statistics.median(samples["off"])
        )
    finally:
        for daemon in daemons.values():
            daemon.terminate()
    emit({k: v for k, v in results.items() if k not in ("on", "off")})
    return results


def copy_study(repeats: int, model_ref: str | None = None) -> dict:
    """Host tier copies on the default model's cache (its float32 rows on this CPU), against a prefill of
    as many tokens in the same process."""
    import jax

    from pdserve.engine.compile_cache import configure_jax
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.loading.sources import load_model
    from pdserve.engine.sampling_params import SamplingParams

    configure_jax()
    config = EngineConfig(max_model_len=2048, num_blocks=512, max_num_seqs=8, kv_offloading_size=0.5)
    engine = LLMEngine(load_model(model_ref), config)
    runner, store = engine.runner, engine.host_tier.store
    blocks = list(range(64))  # 1,024 tokens
    pairs = list(zip(blocks, blocks, strict=True))
    rng = np.random.default_rng(3)
    params = SamplingParams(temperature=0, max_tokens=1)
    engine.generate([random_tokens(1024, rng)], params)  # compile
    # (blocks 0-63 hold cached prompts: their bytes go out and come back unchanged; nothing is evicted, so
    # the host slots written are ones the engine does not use)
    out_s, in_s, prefill_s = [], [], []
    for _ in range(repeats + 1):
        t = time.perf_counter()
        store.offload(runner.cache, pairs)
        store.landed(wait=True)
        out_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        runner.cache = store.finish_load(runner.cache, store.start_load(pairs))
        jax.block_until_ready(runner.cache)
        in_s.append(time.perf_counter() - t)
        engine.scheduler.kv.pool.check()
        t = time.perf_counter()
        engine.generate([random_tokens(1024, rng)], params)  # a new prompt: computed in full
        prefill_s.append(time.perf_counter() - t)
    bytes_moved = len(blocks) * store.slot_bytes
    out = {
        "block_bytes": store.slot_bytes,
        "kv_bytes_per_1024_tokens": bytes_moved,
        "to_host_ms": 1e3 * statistics.median(out_s[1:]),
        "to_device_ms": 1e3 * statistics.median(in_s[1:]),
        "prefill_1024_tokens_ms": 1e3 * statistics.median(prefill_s[1:]),
    }
    out["to_host_gb_per_s"] = bytes_moved / out["to_host_ms"] / 1e6
    out["to_device_gb_per_s"] = bytes_moved / out["to_device_ms"] / 1e6
    out["load_over_prefill"] = ratio(out["to_device_ms"], out["prefill_1024_tokens_ms"])
    emit(out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--quick",
        action="store_true",
        help="8 conversations of 3 turns, 512-token systems, 128 device blocks",
    )
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--shape",
        default=None,
        help="conversations,threads,turns,system tokens,device blocks (of the chat study)",
    )
    parser.add_argument("--skip-serving", action="store_true")
    parser.add_argument("--skip-copies", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="the copies only, the test model, one repeat")
    args = parser.parse_args(argv)
    if args.smoke:
        args.skip_serving = True
    result = {}
    if not args.skip_serving:
        gguf = fetch(DEFAULT_MODEL, progress=False)
        logs = Path(tempfile.mkdtemp(prefix="bench-host-tier-"))
        shape = [
            int(x) for x in (args.shape or ("8,2,3,512,128" if args.quick else "16,4,6,1024,512")).split(",")
        ]
        result["serving"] = serving_study(gguf, logs, *shape, rounds=3 if args.quick else 7)
    if not args.skip_copies:
        model = str(bench_model(True)) if args.smoke else None
        result["copies"] = copy_study(1 if args.smoke else 3 if args.quick else 7, model)
    report(result, args.json)


if __name__ == "__main__":
    main()
