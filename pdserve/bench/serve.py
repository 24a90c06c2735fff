"""`pdserve bench serve` (and plain `pdserve bench`): the load generator against the Generation API of a
running decode-server.

Open loop (Poisson arrivals at `--rate`) or closed loop (`--concurrency` streams), prompt and output
lengths from distributions (`fixed:N`, `uniform:A:B`) or a JSONL dataset (`workload`); per request,
client-side timings (`clients`); mean/p50/p90/p99 of TTFT, TPOT, ITL and end-to-end latency, request and
token throughput and goodput (`stats`); plots with matplotlib installed (`plots`). `bench` is the Python
entry point that does all of it.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from pathlib import Path

from pdserve.bench.clients import run_chats, run_load
from pdserve.bench.common import write_json
from pdserve.bench.plots import plot_latency_cdfs, plot_throughput, pyplot
from pdserve.bench.stats import RequestRecord, compute_stats, format_summary, throughput_timeline
from pdserve.bench.workload import (
    LengthDist,
    SharedPrefix,
    add_burstiness_flag,
    add_chat_flags,
    load_dataset,
    make_chats,
    make_workload,
)
from pdserve.services.client import add_client_flags, client_from_flags


def bench(
    server: str,
    *,
    rate: float | None = None,
    burstiness: float = 1.0,
    concurrency: int | None = None,
    num_requests: int | None = 100,
    duration_s: float | None = None,
    prompt_len: str = "fixed:128",
    output_len: str = "fixed:64",
    dataset: str | Path | None = None,
    lora_adapters: Sequence[str] = (),
    shared_prefix: str = "",
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
    seed: int = 0,
    ignore_eos: bool = True,
    timeout_s: float | None = None,
    json_path: str | Path | None = None,
    plots_dir: str | Path | None = None,
    progress: bool = True,
    client=None,
    keep_records: bool = False,
    turns: int = 1,
    think_time_s: float = 0.0,
) -> dict:
    """Runs one benchmark against `server` (a decode-server's ADDR) and returns its result dict
    (`config`, `stats`, `timeline`, `requests`; with `keep_records`, also `records`: the RequestRecords).
    `client`: a services.client.Client to use instead of a new plaintext one (TLS, tokens). With `turns` > 1
    each of the `num_requests` is a conversation of that many turns (clients.run_chats: a turn's prompt
    the conversation so far, sent `think_time_s` after the answer before it), open loop at `rate`."""
    from tqdm import tqdm

    from pdserve.services.client import Client

    if rate is None and concurrency is None:
        rate = math.inf
    if turns > 1 and (concurrency is not None or dataset or lora_adapters or num_requests is None):
        raise ValueError("conversations (turns > 1) take a rate and a number of them, random prompts only")
    workload = make_workload(
        LengthDist.parse(prompt_len),
        LengthDist.parse(output_len),
        seed,
        load_dataset(dataset) if dataset else None,
        lora_adapters,
        SharedPrefix.parse(shared_prefix),
    )
    own_client = client is None
    client = client or Client(server)
    sent = num_requests * turns if num_requests is not None else None
    bar = tqdm(total=sent, desc="bench", unit="req", disable=not progress, file=sys.stderr)
    failures = 0

    def on_done(record: RequestRecord) -> None:
        nonlocal failures
        failures += not record.ok
        bar.update(1)
        if failures:
            bar.set_postfix(failed=failures, refresh=False)

    try:
        if turns > 1:
            chats = make_chats(
                LengthDist.parse(prompt_len),
                LengthDist.parse(output_len),
                turns,
                think_time_s,
                seed,
                SharedPrefix.parse(shared_prefix),
            )
            records, wall = run_chats(
                client,
                chats,
                num_requests,
                rate,
                seed=seed,
                ignore_eos=ignore_eos,
                timeout_s=timeout_s,
                on_done=on_done,
                burstiness=burstiness,
            )
        else:
            records, wall = run_load(
                client,
                workload,
                num_requests=num_requests,
                rate=rate,
                concurrency=concurrency,
                duration_s=duration_s,
                seed=seed,
                ignore_eos=ignore_eos,
                timeout_s=timeout_s,
                on_done=on_done,
                burstiness=burstiness,
            )
    finally:
        bar.close()
        if own_client:
            client.close()
    stats = compute_stats(records, wall, slo_ttft_ms, slo_tpot_ms)
    result = {
        "config": {
            "server": server,
            "rate": None if rate is None or math.isinf(rate) else rate,
            "burst": rate is not None and math.isinf(rate),
            "burstiness": burstiness,
            "turns": turns,
            "think_time_s": think_time_s,
            "concurrency": concurrency,
            "num_requests": num_requests,
            "duration_s": duration_s,
            "prompt_len": None if dataset else prompt_len,
            "output_len": output_len,
            "dataset": str(dataset) if dataset else None,
            "lora_adapters": list(lora_adapters),
            "shared_prefix": shared_prefix or None,
            "seed": seed,
            "ignore_eos": ignore_eos,
        },
        "stats": stats,
        "timeline": throughput_timeline(records),
        "requests": [r.summary() for r in records],
    }
    if plots_dir is not None:
        directory = Path(plots_dir)
        directory.mkdir(parents=True, exist_ok=True)
        result["plots"] = [
            str(plot_latency_cdfs({"bench": records}, directory / "latency_cdf.png")),
            str(plot_throughput({"bench": records}, directory / "throughput.png")),
        ]
    if json_path is not None:
        write_json(result, json_path)
    if keep_records:
        result["records"] = records
    return result


def add_bench_args(parser: argparse.ArgumentParser, required: bool = True) -> None:
    """The flags of `pdserve bench serve` (`required`: --server must be given)."""
    add_client_flags(parser, "ADDR of a decode-server (host:port)", required=required)
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--rate", type=float, help="Poisson arrivals, requests/s (default: all at once)")
    load.add_argument("--concurrency", type=int, help="this many requests in flight (closed loop)")
    add_burstiness_flag(parser)
    add_chat_flags(parser)
    parser.add_argument("--num-requests", type=int, default=None, help="default 100 (without --duration)")
    parser.add_argument("--duration", type=float, default=None, help="stop sending after S seconds")
    parser.add_argument("--prompt-len", default="fixed:128", help="fixed:N or uniform:A:B (token ids)")
    parser.add_argument("--output-len", default="fixed:64", help="fixed:N or uniform:A:B (max_tokens)")
    parser.add_argument(
        "--shared-prefix",
        default="",
        metavar="TOKENS:COUNT",
        help="every prompt after one of COUNT shared prefixes of TOKENS ids, in turn (default: none)",
    )
    parser.add_argument(
        "--dataset", help="JSONL: prompt or prompt_ids, optional max_tokens and lora_adapter, a line"
    )
    parser.add_argument(
        "--lora-adapters",
        default="",
        metavar="A,B,...",
        help="LoRA adapters given to requests in turn (an empty name: the base model; e.g. ',sql,chat')",
    )
    parser.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput: TTFT at most this")
    parser.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput: TPOT at most this")
    parser.add_argument("--json", dest="json_path", metavar="OUT", help="write the result as JSON")
    parser.add_argument("--plots", metavar="DIR", help="write latency_cdf.png, throughput.png")
    parser.add_argument("--seed", type=int, default=0)
    eos = parser.add_mutually_exclusive_group()
    eos.add_argument(
        "--ignore-eos",
        dest="ignore_eos",
        action="store_true",
        default=True,
        help="generate exactly max_tokens (the default)",
    )
    eos.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false", help="stop at EOS")
    parser.add_argument("--timeout", type=float, default=None, help="deadline of each request (s)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def cmd_bench(args: argparse.Namespace) -> int:
    """Runs `pdserve bench serve` and prints its summary; exit status 2 on bad flags, 1 if none completed."""
    if args.rate is not None and args.rate <= 0:
        print("error: --rate must be > 0", file=sys.stderr)
        return 2
    if args.concurrency is not None and args.concurrency < 1:
        print("error: --concurrency must be >= 1", file=sys.stderr)
        return 2
    if not args.burstiness > 0:
        print("error: --burstiness must be > 0", file=sys.stderr)
        return 2
    if args.turns < 1 or args.think_time < 0:
        print("error: --turns must be >= 1 and --think-time >= 0", file=sys.stderr)
        return 2
    if args.turns > 1 and (args.rate is None or args.dataset or args.lora_adapters or args.duration):
        print(
            "error: --turns takes --rate and random prompts (no --dataset, --lora-adapters, --duration)",
            file=sys.stderr,
        )
        return 2
    num_requests = args.num_requests
    if num_requests is None and args.duration is None:
        num_requests = 100
    try:
        LengthDist.parse(args.prompt_len), LengthDist.parse(args.output_len)
        SharedPrefix.parse(args.shared_prefix)
        if args.dataset:
            load_dataset(args.dataset)
        if args.plots:
            pyplot()
    except (ValueError, OSError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    client = client_from_flags(args)
    if client is None:
        return 2
    try:
        result = bench(
            args.server,
            rate=args.rate,
            burstiness=args.burstiness,
            turns=args.turns,
            think_time_s=args.think_time,
            concurrency=args.concurrency,
            num_requests=num_requests,
            duration_s=args.duration,
            prompt_len=args.prompt_len,
            output_len=args.output_len,
            dataset=args.dataset,
            lora_adapters=args.lora_adapters.split(",") if args.lora_adapters else (),
            shared_prefix=args.shared_prefix,
            slo_ttft_ms=args.slo_ttft_ms,
            slo_tpot_ms=args.slo_tpot_ms,
            seed=args.seed,
            ignore_eos=args.ignore_eos,
            timeout_s=args.timeout,
            json_path=args.json_path,
            plots_dir=args.plots,
            progress=not args.no_progress,
            client=client,
        )
    finally:
        client.close()
    print(format_summary(result["stats"]))
    return 0 if result["stats"]["completed"] else 1
