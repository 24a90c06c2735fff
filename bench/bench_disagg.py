"""Disaggregated vs colocated serving, measured in one run on this machine with real daemons.

    .venv/bin/python bench/bench_disagg.py [--quick] [--json OUT] [--kv-cache-dtype fp8|int8] [--lengths 2048]
        [--smoke]

1. TTFT for prompts of 128, 512, 2048 and 4096 tokens: decode-server -> prefill-server (disaggregated)
   against a decode-server prefilling locally (colocated), both sharing the machine's cores; median of the
   runs. KV transfer time (first frame's arrival to the request's start, from the decode server's admin
   stats: frames stream while later prompt chunks compute) as a fraction of the disaggregated TTFT, and the
   KV frames the prefill server had left to send when a prompt's last chunk was computed, against the
   frames of one chunk (512 tokens). Targets: <= 1.03x at 2048 and 4096, <= 1.25x at 128; at most one
   chunk's frames in flight after the last chunk.
2. Interference: TPOT p50/p99 of running requests (8 streams of 96 tokens) while 1024-token prompts
   arrive as a Poisson stream; colocated on both cores (at each `--budgets` step token budget) vs
   disaggregated with each role pinned to its own core (taskset). Issue 14's target: colocated TPOT
   p99 / p50 <= 2.5 at equal or better throughput (tokens streamed in the window).

--smoke: the test model, TTFT of one 128-token prompt, one run; no interference study (its windows are
fixed at tens of seconds).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from pdserve.bench.common import emit, ratio, report
from pdserve.bench.prompts import random_prompt
from pdserve.engine.config import EngineConfig
from pdserve.engine.loading.sources import load_model
from pdserve.engine.model.kv_cache import kv_layout
from pdserve.kvtransfer import plan_frames
from pdserve.services.client import Client
from pdserve.testing.launch import decode_server, prefill_server
from pdserve.testing.models import bench_model

ENGINE_ARGS = ["--max-model-len", "4352", "--num-blocks", "640", "--max-num-seqs", "16"]
CHUNK_TOKENS = 512  # --max-num-batched-tokens (the default): the prefill server's chunk


def ttft_study(gguf: Path, logs: Path, lengths: list[int], runs: int, kv_cache_dtype: str = "auto") -> dict:
    """`kv_cache_dtype`: every daemon's --kv-cache-dtype (fp8, int8: a frame holds about four times the
    tokens)."""
    engine_args = [*ENGINE_ARGS, "--kv-cache-dtype", kv_cache_dtype]
    layout = kv_layout(
        load_model(gguf).config, EngineConfig(kv_cache_dtype=kv_cache_dtype).on_platform("cpu")
    )
    pf = prefill_server(gguf, logs, engine_args=engine_args)
    disagg = decode_server(gguf, pf.address, logs, name="decode-remote", engine_args=engine_args)
    coloc = decode_server(gguf, "local", logs, name="decode-local", engine_args=engine_args)
    try:
        remote, local = Client(disagg.address), Client(coloc.address)
        for length in lengths:  # compile every shape once on both sides
            for client in (remote, local):
                client.generate(random_prompt(length, 0), max_tokens=2, ignore_eos=True)
        results = {}
        for length in lengths:
            ttft = {"disaggregated": [], "colocated": []}
            transfer, tail = [], []
            for run in range(runs):
                before, sender = Client(disagg.address).stats(), Client(pf.address).stats()
                ttft["disaggregated"].append(
                    remote.generate(random_prompt(length, run + 1), max_tokens=1).ttft_s
                )
                after, sent = Client(disagg.address).stats(), Client(pf.address).stats()
                transfer.append(after.kv_transfer_seconds_total - before.kv_transfer_seconds_total)
                tail.append(sent.kv_frames_after_compute_total - sender.kv_frames_after_compute_total)
                ttft["colocated"].append(local.generate(random_prompt(length, run + 1), max_tokens=1).ttft_s)
            d, c = statistics.median(ttft["disaggregated"]), statistics.median(ttft["colocated"])
            results[length] = {
                "ttft_disaggregated_s": d,
                "ttft_colocated_s": c,
                "ratio": ratio(d, c),
                "kv_transfer_s": statistics.median(transfer),
                "kv_transfer_fraction_of_ttft": ratio(statistics.median(transfer), d),
                "frames_after_last_chunk": max(tail),
                "frames_of_one_chunk": len(plan_frames(layout, min(length, CHUNK_TOKENS))),
                "kv_transfer_bytes": after.kv_transfer_bytes_total - before.kv_transfer_bytes_total,
            }
            emit({"prompt_tokens": length, **results[length]})
        return results
    finally:
        for daemon in (disagg, coloc, pf):
            daemon.terminate()


def interference_run(client: Client, duration_s: float, rate: float, long_len: int, salt: int = 0) -> dict:
    """8 running streams; Poisson arrivals of long prompts meanwhile; returns TPOT percentiles."""
    gaps: list[float] = []
    lock = threading.Lock()
    stop = threading.Event()

    def runner(i: int):
        while not stop.is_set():
            result = client.generate(random_prompt(24, 1000 + i), max_tokens=96, ignore_eos=True)
            times = result.token_times_s
            with lock:
                gaps.extend(np.diff(times).tolist())

    def arrivals():
        rng = np.random.default_rng(7)
        pool = concurrent.futures.ThreadPoolExecutor(8)
        deadline = time.monotonic() + duration_s
        n = 0
        while time.monotonic() < deadline:
            time.sleep(rng.exponential(1 / rate))
            pool.submit(client.generate, random_prompt(long_len, 5000 + salt + n), max_tokens=1)
            n += 1
        pool.shutdown(wait=True)
        return n

    threads = [threading.Thread(target=runner, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    time.sleep(3)  # running requests first
    with lock:
        gaps.clear()
    num_long = arrivals()
    stop.set()
    for t in threads:
        t.join()
    return {
        "tpot_p50_ms": float(np.percentile(gaps, 50) * 1e3),
        "tpot_p99_ms": float(np.percentile(gaps, 99) * 1e3),
        "tokens": len(gaps),
        "long_prompts": num_long,
    }


def warmed(address: str, long_len: int, rate: float) -> Client:
    """A client of a daemon that has compiled the shapes of the interference run: the daemons start
    without warmup (--no-warmup), so a 15 s pass of the same workload runs first, unmeasured (otherwise
    the compilations of shapes first met during the run land in the TPOT tail: the grid engine met
    several)."""
    client = Client(address)
    client.generate(random_prompt(long_len, 0), max_tokens=2)
    client.generate(random_prompt(24, 0), max_tokens=4)
    interference_run(client, 15, rate, long_len, salt=100_000)  # other long prompts: none cached
    return client


def interference_study(
    gguf: Path, logs: Path, duration_s: float, rate: float, long_len: int, budgets: list[int], disagg: bool
) -> dict:
    """Colocated on both cores at each step token budget, then (`disagg`) disaggregated at the default."""
    out = {}
    for budget in budgets:
        engine_args = [*ENGINE_ARGS, *(["--max-num-batched-tokens", str(budget)] if budget else [])]
        coloc = decode_server(
            gguf, "local", logs, name=f"coloc-{budget}", engine_args=engine_args, cpus="0,1"
        )
        try:
            out[f"colocated_2_cores_budget_{budget}"] = interference_run(
                warmed(coloc.address, long_len, rate), duration_s, rate, long_len
            )
            emit(out)
        finally:
            coloc.terminate()
    if not disagg:
        return out
    pf = prefill_server(gguf, logs, name="prefill-core0", engine_args=ENGINE_ARGS, cpus="0")
    dc = decode_server(gguf, pf.address, logs, name="decode-core1", engine_args=ENGINE_ARGS, cpus="1")
    try:
        out["disaggregated_1_core_each"] = interference_run(
            warmed(dc.address, long_len, rate), duration_s, rate, long_len
        )
    finally:
        dc.terminate()
        pf.terminate()
    emit(out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument("--skip-ttft", action="store_true")
    parser.add_argument("--skip-interference", action="store_true")
    parser.add_argument("--kv-cache-dtype", default="auto", help="TTFT: every daemon's --kv-cache-dtype")
    parser.add_argument("--lengths", default="128,512,2048,4096", help="TTFT: prompt lengths")
    parser.add_argument(
        "--budgets",
        default="512",
        help="step token budgets of the colocated interference runs (comma-separated; 0: the daemon's "
        "default, without the flag, e.g. an older commit's daemons run from its worktree)",
    )
    parser.add_argument(
        "--colocated-only", action="store_true", help="interference: skip the disaggregated run"
    )
    parser.add_argument("--smoke", action="store_true", help="the test model, one short TTFT run")
    args = parser.parse_args(argv)
    if args.smoke:
        args.lengths, args.skip_interference = "128", True
    gguf = bench_model(args.smoke)
    logs = Path(tempfile.mkdtemp(prefix="bench-disagg-"))
    result = {}
    if not args.skip_ttft:
        lengths = [int(n) for n in args.lengths.split(",")]
        runs = 1 if args.smoke else 2 if args.quick else 5
        result["ttft"] = ttft_study(gguf, logs, lengths, runs, args.kv_cache_dtype)
    if not args.skip_interference:
        budgets = [int(b) for b in args.budgets.split(",")]
        result["interference"] = interference_study(
            gguf, logs, 15 if args.quick else 40, 0.5, 1024, budgets, not args.colocated_only
        )
    report(result, args.json)


if __name__ == "__main__":
    main()
