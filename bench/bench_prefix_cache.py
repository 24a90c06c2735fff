"""Prefix caching, on vs off, measured in one run on this machine.

    .venv/bin/python bench/bench_prefix_cache.py [--quick] [--json OUT] [--smoke]

1. Multi-turn chat through a prefill-server + decode-server pair (real daemons): 8 conversations of 4
   turns, a 1,024-token system prompt shared by all, 64-token user turns, 32-token answers; each turn's
   prompt is the whole conversation so far. The same workload against a pair started with
   --no-prefix-caching. Reports TTFT p50 of turn 1 and of turns >= 2, and the prompt tokens the prefill
   server computed (looked up minus found, from its Admin stats), and the KV bytes the decode server
   received for turns >= 2; then the same against one decode-server prefilling locally (colocated, caching
   on). Targets: TTFT p50 of turns >= 2 at least 4x lower with caching; at least 70% fewer prompt tokens
   computed; KV bytes of turns >= 2 at least 70% fewer than full transfers (caching off); TTFT p50 of turns
   >= 2 disaggregated at most 1.15x colocated.
2. No reuse (random prompts), one engine per setting in this process, runs interleaved: prefill
   throughput (batches of 512-token prompts, one token each) and decode throughput (8 streams of 64
   tokens). Target: caching on within 3% of off.

--smoke: part 2 only (part 1 needs the daemons), the test model, one round.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from pdserve.bench.common import emit, ratio, report
from pdserve.bench.prompts import random_tokens
from pdserve.engine.loading.sources import DEFAULT_MODEL, fetch
from pdserve.services.client import Client
from pdserve.testing.launch import decode_server, prefill_server
from pdserve.testing.models import bench_model

ENGINE_ARGS = ["--max-model-len", "2048", "--num-blocks", "1024", "--max-num-seqs", "8"]


def conversations(
    client: Client, num: int, turns: int, system: list[int], seed: int, after_turn1=None
) -> list[list[dict]]:
    """Runs `num` conversations concurrently (turns in order within each); returns per-turn records.
    `after_turn1()` runs once every conversation has had its first turn (before any second turn)."""
    barrier = threading.Barrier(num, action=after_turn1)

    def one(c: int) -> list[dict]:
        rng = np.random.default_rng(seed * 1000 + c)
        history, out = list(system), []
        for turn in range(turns):
            if turn == 1:
                barrier.wait()
            history += random_tokens(64, rng)
            result = client.generate(history, max_tokens=32, ignore_eos=True, temperature=0.0)
            out.append({"turn": turn + 1, "ttft_s": result.ttft_s, "cached": result.cached_prompt_tokens})
            history += result.token_ids
        return out

    with concurrent.futures.ThreadPoolExecutor(num) as pool:
        return list(pool.map(one, range(num)))


def chat_study(gguf: Path, logs: Path, num: int, turns: int) -> dict:
    """Disaggregated with caching on and off, and colocated (`--prefill local`) with caching on."""
    results = {}
    settings = (
        ("caching_on", [], True),
        ("caching_off", ["--no-prefix-caching"], True),
        ("colocated_caching_on", [], False),
    )
    for setting, extra, disaggregated in settings:
        args = [*ENGINE_ARGS, *extra]
        pf = (
            prefill_server(gguf, logs, name=f"prefill-{setting}", engine_args=args) if disaggregated else None
        )
        target = pf.address if pf else "local"
        dc = decode_server(gguf, target, logs, name=f"decode-{setting}", engine_args=args)
        try:
            client, stats_of = Client(dc.address), Client((pf or dc).address)
            conversations(
                client, 2, 2, random_tokens(1024, np.random.default_rng(99)), seed=99
            )  # compile shapes
            marks = [stats_of.stats(), Client(dc.address).stats()]
            records = conversations(
                client,
                num,
                turns,
                random_tokens(1024, np.random.default_rng(1)),
                seed=1,
                after_turn1=lambda marks=marks, address=dc.address: marks.append(Client(address).stats()),
            )
            after, decode_after = stats_of.stats(), Client(dc.address).stats()
        finally:
            dc.terminate()
            if pf:
                pf.terminate()
        before, decode_before, decode_turn1 = marks
        flat = [r for conv in records for r in conv]
        looked_up = after.prefix_cache_queries_total - before.prefix_cache_queries_total
        found = after.prefix_cache_hits_total - before.prefix_cache_hits_total
        results[setting] = {
            "ttft_p50_turn1_s": statistics.median(r["ttft_s"] for r in flat if r["turn"] == 1),
            "ttft_p50_later_turns_s": statistics.median(r["ttft_s"] for r in flat if r["turn"] > 1),
            "prompt_tokens": looked_up,
            "prompt_tokens_computed": looked_up - found,
            "cached_tokens_reported": sum(r["cached"] for r in flat),
            "kv_bytes_turn1": decode_turn1.kv_transfer_bytes_total - decode_before.kv_transfer_bytes_total,
            "kv_bytes_later_turns": decode_after.kv_transfer_bytes_total
            - decode_turn1.kv_transfer_bytes_total,
        }
        emit({setting: results[setting]})
    on, off = results["caching_on"], results["caching_off"]
    results["ttft_later_turns_off_over_on"] = ratio(
        off["ttft_p50_later_turns_s"], on["ttft_p50_later_turns_s"]
    )
    results["prompt_tokens_computed_saved"] = 1 - on["prompt_tokens_computed"] / off["prompt_tokens_computed"]
    results["kv_bytes_later_turns_saved"] = 1 - on["kv_bytes_later_turns"] / off["kv_bytes_later_turns"]
    colocated = results["colocated_caching_on"]["ttft_p50_later_turns_s"]
    results["ttft_later_turns_disaggregated_over_colocated"] = ratio(on["ttft_p50_later_turns_s"], colocated)
    return results


def throughput_study(rounds: int, model_ref: str | None = None) -> dict:
    """Engines with caching on and off over the same random prompts (no prefix shared), interleaved."""
    from pdserve.engine.compile_cache import configure_jax
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.loading.sources import load_model
    from pdserve.engine.sampling_params import SamplingParams

    configure_jax()
    model = load_model(model_ref)
    config = EngineConfig(max_model_len=1024, num_blocks=512, max_num_seqs=8, max_num_batched_tokens=512)
    engines = {
        "on": LLMEngine(model, config),
        "off": LLMEngine(model, dataclasses.replace(config, enable_prefix_caching=False)),
    }
    rng = np.random.default_rng(5)
    prefill_params = SamplingParams(temperature=0, max_tokens=1)
    decode_params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    samples = {(k, s): [] for k in engines for s in ("prefill", "decode")}
    for engine in engines.values():  # compile every shape the runs use
        engine.generate([random_tokens(512, rng) for _ in range(4)], prefill_params)
        engine.generate([random_tokens(16, rng) for _ in range(8)], decode_params)
    for i in range(rounds):
        prefill_prompts = [random_tokens(512, rng) for _ in range(8)]
        decode_prompts = [random_tokens(16, rng) for _ in range(8)]
        order = list(engines.items())
        for key, engine in order if i % 2 else order[::-1]:  # alternate who goes first
            t = time.perf_counter()
            engine.generate(prefill_prompts, prefill_params)
            samples[key, "prefill"].append(8 * 512 / (time.perf_counter() - t))
            t = time.perf_counter()
            engine.generate(decode_prompts, decode_params)
            samples[key, "decode"].append(8 * 64 / (time.perf_counter() - t))
    out = {f"{kind}_tokens_per_s_{key}": statistics.median(v) for (key, kind), v in samples.items()}
    for kind in ("prefill", "decode"):
        out[f"{kind}_on_over_off"] = ratio(out[f"{kind}_tokens_per_s_on"], out[f"{kind}_tokens_per_s_off"])
    emit(out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument("--skip-chat", action="store_true")
    parser.add_argument("--skip-throughput", action="store_true")
    parser.add_argument("--smoke", action="store_true", help="the test model, one round, no daemons")
    args = parser.parse_args(argv)
    if args.smoke:
        args.skip_chat = True
    result = {}
    if not args.skip_chat:
        gguf = fetch(DEFAULT_MODEL, progress=False)
        logs = Path(tempfile.mkdtemp(prefix="bench-prefix-"))
        result["multi_turn_chat"] = chat_study(gguf, logs, 4 if args.quick else 8, 3 if args.quick else 4)
    if not args.skip_throughput:
        model = str(bench_model(True)) if args.smoke else None
        result["no_reuse"] = throughput_study(1 if args.smoke else 3 if args.quick else 7, model)
    report(result, args.json)


if __name__ == "__main__":
    main()
