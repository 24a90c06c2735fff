"""Prefix-aware vs least-outstanding routing over two prefill replicas, measured in one run with real daemons.

    .venv/bin/python bench/bench_routing.py [--quick] [--json OUT] [--smoke]

Shared-prefix workload: 16 system prompts of 512 tokens (8 with --quick), each asked 12 times (6) with its own
48-token question, in a shuffled order, 4 requests at a time, through one decode-server over two
prefill-servers whose caches hold about 60% of the system prompts each (--num-blocks). Each policy runs
on freshly started daemons (empty caches) with its own prompts. Reports the prefill-side prefix-cache hit
rate (prompt tokens found / looked up, over both replicas, from their Admin stats), TTFT p50 and p90, and
for the prefix policy the prompt tokens the chosen replicas were expected to hold (their KV events) against
those they held. Targets: hit rate at least 2x least-outstanding's; TTFT p50 lower. --smoke: the test
model, 2 system prompts asked twice each.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import tempfile
from pathlib import Path

import numpy as np

from pdserve.bench.common import emit, ratio, report
from pdserve.services.client import Client
from pdserve.testing.launch import decode_server, prefill_server
from pdserve.testing.models import bench_model

ENGINE_ARGS = ["--max-model-len", "1024", "--max-num-seqs", "8"]
IN_FLIGHT_BLOCKS = 3 * 36  # requests of 560 tokens in flight on a replica (4 in all, on 2 replicas)


def prefill_blocks(num_prefixes: int) -> int:
    """A replica's cache: room for its requests in flight and half the system prompts (the working set
    fits the two replicas' caches together, not one replica's)."""
    return IN_FLIGHT_BLOCKS + num_prefixes * 512 // 16 // 2


def workload(num_prefixes: int, asks: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    systems = [rng.integers(100, 40000, 512).tolist() for _ in range(num_prefixes)]
    prompts = [system + rng.integers(100, 40000, 48).tolist() for system in systems for _ in range(asks)]
    order = rng.permutation(len(prompts))
    return [prompts[i] for i in order]


def run_policy(gguf: Path, logs: Path, policy: str, prompts: list[list[int]], num_prefixes: int) -> dict:
    args = [*ENGINE_ARGS, "--num-blocks", str(prefill_blocks(num_prefixes))]
    replicas = [prefill_server(gguf, logs, name=f"prefill-{policy}-{i}", engine_args=args) for i in (0, 1)]
    targets = ",".join(r.address for r in replicas)
    extra = ["--prefill-routing", policy]
    decode = decode_server(gguf, targets, logs, name=f"decode-{policy}", engine_args=args, extra=extra)
    try:
        client = Client(decode.address)
        rng = np.random.default_rng(12345)
        for _ in range(4):  # compile the shapes on every daemon (prompts unlike the workload's)
            client.generate(rng.integers(100, 40000, 560).tolist(), max_tokens=2, ignore_eos=True)
        before = [Client(r.address).stats() for r in replicas]
        decode_before = client.stats()
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            ttfts = list(
                pool.map(lambda p: client.generate(p, max_tokens=2, ignore_eos=True).ttft_s, prompts)
            )
        after = [Client(r.address).stats() for r in replicas]
        decode_after = client.stats()
    finally:
        decode.terminate()
        for r in replicas:
            r.terminate()
    looked_up = sum(
        a.prefix_cache_queries_total - b.prefix_cache_queries_total
        for a, b in zip(after, before, strict=True)
    )
    found = sum(
        a.prefix_cache_hits_total - b.prefix_cache_hits_total for a, b in zip(after, before, strict=True)
    )
    served = [a.num_requests_total - b.num_requests_total for a, b in zip(after, before, strict=True)]
    expected = decode_after.route_expected_hit_tokens_total - decode_before.route_expected_hit_tokens_total
    actual = decode_after.route_actual_hit_tokens_total - decode_before.route_actual_hit_tokens_total
    result = {
        "requests": len(prompts),
        "requests_per_replica": served,
        "prefill_hit_rate": ratio(found, looked_up),
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p90_s": float(np.percentile(ttfts, 90)),
        "expected_hit_tokens": expected,
        "actual_hit_tokens": actual,
    }
    emit({policy: result})
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument("--smoke", action="store_true", help="the test model, 2 prefixes asked twice")
    args = parser.parse_args(argv)
    gguf = bench_model(args.smoke)
    logs = Path(tempfile.mkdtemp(prefix="bench-routing-"))
    num_prefixes, asks = (2, 2) if args.smoke else (8, 6) if args.quick else (16, 12)
    result = {
        policy: run_policy(gguf, logs, policy, workload(num_prefixes, asks, seed), num_prefixes)
        for seed, policy in enumerate(("least-outstanding", "prefix"), start=1)
    }
    lo, px = result["least-outstanding"], result["prefix"]
    result["hit_rate_prefix_over_least_outstanding"] = ratio(px["prefill_hit_rate"], lo["prefill_hit_rate"])
    result["ttft_p50_prefix_over_least_outstanding"] = ratio(px["ttft_p50_s"], lo["ttft_p50_s"])
    report(result, args.json)


if __name__ == "__main__":
    main()
