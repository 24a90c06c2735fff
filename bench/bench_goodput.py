"""Goodput under SLOs across request rates: colocated vs disaggregated on the same two cores.

    .venv/bin/python bench/bench_goodput.py [--rates 0.25,0.5,0.75,1.0] [--seconds 36] [--json OUT] [--smoke]

Colocated: one decode-server prefilling locally, pinned to cores 0,1 (taskset). Disaggregated: a
prefill-server on core 0 and a decode-server on core 1. Each runs `pdserve bench`'s Python entry point
(pdserve.bench.serve.bench) at each rate with Poisson arrivals, random token-id prompts of uniform:64:1024
tokens and uniform:16:64 output tokens (ignore_eos), the same seed (so the same requests and arrival
times) for both. Goodput: requests/s with TTFT <= --slo-ttft-ms and TPOT <= --slo-tpot-ms.
Writes bench/plots/goodput_vs_rate.png, and latency CDFs and throughput over time at one rate.
--smoke: the test model, one rate, 4 short requests, no warm-up pass, the plots in a temporary folder.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import tempfile
import time
from pathlib import Path

import numpy as np

from pdserve.bench.common import emit, write_json
from pdserve.bench.plots import plot_latency_cdfs, plot_throughput, pyplot
from pdserve.bench.serve import bench
from pdserve.services.client import Client
from pdserve.testing.launch import decode_server, prefill_server
from pdserve.testing.models import bench_model

ENGINE_ARGS = ["--max-model-len", "2048", "--num-blocks", "640", "--max-num-seqs", "16"]
PLOTS = Path(__file__).parent / "plots"


def warm(address: str) -> float:
    """Compiles the shapes the measurement will hit (--no-warmup daemons): prompts of several lengths
    one at a time, then 8 and 16 at once (decode batch buckets)."""
    t = time.perf_counter()
    client = Client(address)
    rng = np.random.default_rng(99)

    def one(length: int, tokens: int) -> None:
        client.generate(rng.integers(100, 30000, length).tolist(), max_tokens=tokens, ignore_eos=True)

    for length in (64, 200, 512, 700, 1024):
        one(length, 4)
    for n in (4, 8, 16):
        with concurrent.futures.ThreadPoolExecutor(n) as pool:
            list(pool.map(lambda i: one(64 + 37 * i, 24), range(n)))
    client.close()
    return time.perf_counter() - t


def sweep(name: str, address: str, args) -> list[dict]:
    results = []
    for rate in args.rates:
        n = max(4, round(rate * args.seconds))
        result = bench(
            address,
            rate=rate,
            num_requests=n,
            prompt_len=args.prompt_len,
            output_len=args.output_len,
            slo_ttft_ms=args.slo_ttft_ms,
            slo_tpot_ms=args.slo_tpot_ms,
            seed=args.seed,
            progress=False,
            keep_records=True,
        )
        s = result["stats"]
        row = {
            "setup": name,
            "rate": rate,
            "requests": s["requests"],
            "failed": s["failed"],
            "goodput": s["goodput"],
            "slo_attainment": s["slo_attainment"],
            "request_throughput": s["request_throughput"],
            "output_token_throughput": s["output_token_throughput"],
            "ttft_p50_ms": s["ttft_ms"]["p50"],
            "ttft_p90_ms": s["ttft_ms"]["p90"],
            "tpot_p50_ms": s["tpot_ms"]["p50"],
            "tpot_p90_ms": s["tpot_ms"]["p90"],
            "itl_p99_ms": s["itl_ms"]["p99"],
            "duration_s": s["duration_s"],
        }
        emit(row)
        results.append({**row, "stats": s, "records": result["records"]})
    return results


def plot_goodput(results: dict[str, list[dict]], path: Path, args) -> None:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.5), dpi=80)
    for name, rows in results.items():
        rates = [r["rate"] for r in rows]
        left.plot(rates, [r["goodput"] for r in rows], marker="o", label=name)
        right.plot(rates, [100 * r["slo_attainment"] for r in rows], marker="o", label=name)
    left.plot(args.rates, args.rates, ls=":", color="grey", label="offered rate")
    left.set_xlabel("request rate (req/s, Poisson)")
    left.set_ylabel("goodput (req/s)")
    right.set_xlabel("request rate (req/s, Poisson)")
    right.set_ylabel("requests within both SLOs (%)")
    right.set_ylim(0, 105)
    for ax in (left, right):
        ax.grid(alpha=0.3)
    left.legend(fontsize=8)
    fig.suptitle(f"SLO: TTFT <= {args.slo_ttft_ms:g} ms, TPOT <= {args.slo_tpot_ms:g} ms", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--rates", type=lambda s: [float(x) for x in s.split(",")], default=[0.25, 0.5, 0.75, 1.0]
    )
    parser.add_argument("--seconds", type=float, default=36.0, help="requests per rate: rate x this")
    parser.add_argument("--prompt-len", default="uniform:64:1024")
    parser.add_argument("--output-len", default="uniform:16:64")
    parser.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=150.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot-rate", type=float, default=None, help="rate of the CDF plots (default: 2nd)")
    parser.add_argument("--plots", type=Path, default=PLOTS)
    parser.add_argument("--json", default=None)
    parser.add_argument("--smoke", action="store_true", help="the test model, 4 short requests at one rate")
    args = parser.parse_args(argv)
    if args.smoke:
        args.rates, args.seconds, args.prompt_len, args.output_len = [2.0], 2.0, "uniform:16:64", "fixed:4"
        if args.plots == PLOTS:
            args.plots = Path(tempfile.mkdtemp(prefix="bench-goodput-plots-"))
    gguf = bench_model(args.smoke)
    logs = Path(tempfile.mkdtemp(prefix="bench-goodput-"))
    results: dict[str, list[dict]] = {}
    started = time.perf_counter()

    daemon = decode_server(gguf, "local", logs, name="coloc", engine_args=ENGINE_ARGS, cpus="0,1")
    try:
        if not args.smoke:
            print(f"colocated: warm {warm(daemon.address):.1f} s", flush=True)
        results["colocated (cores 0,1)"] = sweep("colocated", daemon.address, args)
    finally:
        daemon.terminate()
    pf = prefill_server(gguf, logs, name="prefill", engine_args=ENGINE_ARGS, cpus="0")
    try:
        dc = decode_server(gguf, pf.address, logs, name="decode", engine_args=ENGINE_ARGS, cpus="1")
        try:
            if not args.smoke:
                print(f"disaggregated: warm {warm(dc.address):.1f} s", flush=True)
            results["disaggregated (prefill 0, decode 1)"] = sweep("disaggregated", dc.address, args)
        finally:
            dc.terminate()
    finally:
        pf.terminate()
    print(f"total {time.perf_counter() - started:.0f} s; logs in {logs}", flush=True)

    summary = {
        "config": {k: v if not isinstance(v, Path) else str(v) for k, v in vars(args).items()},
        "engine_args": ENGINE_ARGS,
        "results": {
            name: [{k: v for k, v in r.items() if k != "records"} for r in rows]
            for name, rows in results.items()
        },
    }
    write_json(summary, args.json)
    print(
        f"{'setup':<15}{'rate':>6}{'goodput':>9}{'in SLO':>8}{'TTFT p50':>10}{'TTFT p90':>10}"
        f"{'TPOT p50':>10}{'TPOT p90':>10}{'tok/s':>8}"
    )
    for rows in results.values():
        for r in rows:
            print(
                f"{r['setup']:<15}{r['rate']:>6g}{r['goodput']:>9.2f}{100 * r['slo_attainment']:>7.0f}%"
                f"{r['ttft_p50_ms']:>10.0f}{r['ttft_p90_ms']:>10.0f}{r['tpot_p50_ms']:>10.0f}"
                f"{r['tpot_p90_ms']:>10.0f}{r['output_token_throughput']:>8.1f}"
            )

    args.plots.mkdir(parents=True, exist_ok=True)
    plot_goodput(results, args.plots / "goodput_vs_rate.png", args)
    plot_rate = args.plot_rate if args.plot_rate is not None else args.rates[min(1, len(args.rates) - 1)]
    at_rate = {
        name: next(r["records"] for r in rows if r["rate"] == plot_rate) for name, rows in results.items()
    }
    tag = f"{plot_rate:g}".replace(".", "p")
    title = f"{plot_rate:g} req/s, prompts {args.prompt_len}, outputs {args.output_len}"
    plot_latency_cdfs(at_rate, args.plots / f"goodput_latency_cdf_rate{tag}.png", title)
    plot_throughput(at_rate, args.plots / f"goodput_throughput_rate{tag}.png", 2.0, title)


if __name__ == "__main__":
    main()
