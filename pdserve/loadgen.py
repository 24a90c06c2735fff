"""`pdserve bench`: a load generator against the Generation API of a decode-server.

Open loop (Poisson arrivals at `--rate`) or closed loop (`--concurrency` streams), prompt and output
lengths from distributions (`fixed:N`, `uniform:A:B`) or a JSONL dataset. Measures, client-side, per
request: TTFT (send -> first token), TPOT ((last token - first token) / (tokens - 1)), ITL (every gap
between consecutive tokens) and end-to-end latency (send -> last message); reports mean/p50/p90/p99 of
each, request and token throughput, and goodput (requests/s that meet both the TTFT and TPOT SLOs).

The statistics are a pure function of the per-request records (`compute_stats`); `run_load` produces the
records; `bench` is the Python entry point that does both (and the plots, with matplotlib installed).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import itertools
import json
import math
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np

from pdserve.services.client import add_client_flags, client_from_flags

PERCENTILES = (50, 90, 99)
# Prompt token ids are drawn from this range: ordinary vocabulary ids of the Llama-family models, clear of
# special tokens at the bottom (ids 0-99) and inside every supported model's vocabulary.
PROMPT_ID_RANGE = (100, 30000)


# --------------------------------------------------------------------------------------------------------
# Workload


@dataclasses.dataclass(frozen=True)
class LengthDist:
    """`fixed:N` or `uniform:A:B` (inclusive)."""

    low: int
    high: int

    @classmethod
    def parse(cls, spec: str) -> LengthDist:
        parts = spec.split(":")
        try:
            if parts[0] == "fixed" and len(parts) == 2:
                low = high = int(parts[1])
            elif parts[0] == "uniform" and len(parts) == 3:
                low, high = int(parts[1]), int(parts[2])
            else:
                raise ValueError
        except ValueError:
            raise ValueError(f"bad length distribution {spec!r}: want fixed:N or uniform:A:B") from None
        if low < 1 or high < low:
            raise ValueError(f"bad length distribution {spec!r}: want 1 <= A <= B")
        return cls(low, high)

    def sample(self, rng: np.random.Generator) -> int:
        return int(rng.integers(self.low, self.high + 1))


@dataclasses.dataclass
class RequestSpec:
    index: int
    prompt: str | list[int]  # token ids (exact lengths) or text
    max_tokens: int
    lora_adapter: str = ""  # "": the base model


def load_dataset(path: str | Path) -> list[dict]:
    """JSONL, one object a line: `prompt` (text) or `prompt_ids` (token ids), optional `max_tokens`."""
    entries = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        entry = json.loads(line)
        if not isinstance(entry, dict) or ("prompt" not in entry and "prompt_ids" not in entry):
            raise ValueError(f"{path}:{number}: want an object with `prompt` or `prompt_ids`")
        entries.append(entry)
    if not entries:
        raise ValueError(f"{path}: no entries")
    return entries


def make_workload(
    prompt_len: LengthDist | None,
    output_len: LengthDist,
    seed: int = 0,
    dataset: Sequence[dict] | None = None,
    lora_adapters: Sequence[str] = (),
) -> Iterator[RequestSpec]:
    """An endless, reproducible stream of requests: random token-id prompts of `prompt_len` tokens, or the
    dataset's entries in a seeded order (cycled); `max_tokens` from the entry, else from `output_len`; the
    LoRA adapter from the entry's `lora_adapter`, else `lora_adapters` in turn ("": the base model)."""
    rng = np.random.default_rng(seed)
    order: list[int] = []
    for index in itertools.count():
        if dataset:
            if not order:
                order = rng.permutation(len(dataset)).tolist()
            entry = dataset[order.pop()]
            prompt = entry["prompt_ids"] if "prompt_ids" in entry else entry["prompt"]
            max_tokens = int(entry.get("max_tokens") or output_len.sample(rng))
        else:
            length = prompt_len.sample(rng)
            prompt = rng.integers(*PROMPT_ID_RANGE, length).tolist()
            max_tokens = output_len.sample(rng)
        adapter = lora_adapters[index % len(lora_adapters)] if lora_adapters else ""
        if dataset:
            adapter = entry.get("lora_adapter", adapter)
        yield RequestSpec(index, prompt, max_tokens, adapter)


# --------------------------------------------------------------------------------------------------------
# Records and statistics (pure)


@dataclasses.dataclass
class RequestRecord:
    """One request as the client saw it. Times in seconds; `start_s` since the run began, token times
    since the request was sent (tokens of one response message share its arrival time)."""

    index: int
    start_s: float
    prompt_tokens: int
    max_tokens: int
    token_times_s: list[float] = dataclasses.field(default_factory=list)
    e2e_s: float | None = None  # send -> the last message (None: failed)
    finish_reason: str = ""
    error: str = ""  # empty: succeeded

    @property
    def ok(self) -> bool:
        return not self.error and self.e2e_s is not None

    @property
    def output_tokens(self) -> int:
        return len(self.token_times_s)

    @property
    def ttft_s(self) -> float | None:
        return self.token_times_s[0] if self.token_times_s else None

    @property
    def tpot_s(self) -> float | None:
        """(last - first) / (n - 1); None for fewer than two tokens (no decode step to time)."""
        n = len(self.token_times_s)
        return (self.token_times_s[-1] - self.token_times_s[0]) / (n - 1) if n > 1 else None

    @property
    def itl_s(self) -> list[float]:
        t = self.token_times_s
        return [b - a for a, b in zip(t, t[1:], strict=False)]

    def summary(self) -> dict:
        return {
            "index": self.index,
            "start_s": self.start_s,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "ttft_s": self.ttft_s,
            "tpot_s": self.tpot_s,
            "e2e_s": self.e2e_s,
            "finish_reason": self.finish_reason,
            "error": self.error,
        }


def distribution(values: Sequence[float], scale: float = 1.0) -> dict:
    """mean/p50/p90/p99 (and min/max, count) of `values` times `scale`; None entries when empty."""
    keys = ["mean", *(f"p{p}" for p in PERCENTILES), "min", "max"]
    if len(values) == 0:
        return {"count": 0, **dict.fromkeys(keys)}
    a = np.asarray(values, dtype=np.float64) * scale
    out = {"count": int(a.size), "mean": float(a.mean())}
    out.update({f"p{p}": float(np.percentile(a, p)) for p in PERCENTILES})
    out.update({"min": float(a.min()), "max": float(a.max())})
    return out


def meets_slo(record: RequestRecord, slo_ttft_s: float | None, slo_tpot_s: float | None) -> bool:
    """Succeeded, and within both SLOs (an absent SLO always holds; so does TPOT for 1-token outputs)."""
    if not record.ok or record.ttft_s is None:
        return False
    if slo_ttft_s is not None and record.ttft_s > slo_ttft_s:
        return False
    tpot = record.tpot_s
    return slo_tpot_s is None or tpot is None or tpot <= slo_tpot_s


def compute_stats(
    records: Sequence[RequestRecord],
    duration_s: float | None = None,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
) -> dict:
    """The benchmark's figures from its per-request records (latencies in ms).

    `duration_s`: the run's wall time for the throughputs; None: from the first send to the last finish.
    Failed requests count in `failed` and against goodput, never in the latency distributions.
    """
    ok = [r for r in records if r.ok]
    if duration_s is None:
        ends = [r.start_s + r.e2e_s for r in ok]
        duration_s = (max(ends) - min(r.start_s for r in records)) if ends else 0.0
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: None)
    output_tokens = sum(r.output_tokens for r in ok)
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    stats = {
        "requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:10],
        "duration_s": duration_s,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "request_throughput": per_s(len(ok)),
        "output_token_throughput": per_s(output_tokens),
        "total_token_throughput": per_s(output_tokens + prompt_tokens),
        "ttft_ms": distribution([r.ttft_s for r in ok if r.ttft_s is not None], 1e3),
        "tpot_ms": distribution([r.tpot_s for r in ok if r.tpot_s is not None], 1e3),
        "itl_ms": distribution([g for r in ok for g in r.itl_s], 1e3),
        "e2e_ms": distribution([r.e2e_s for r in ok], 1e3),
        "output_len": distribution([r.output_tokens for r in ok]),
        "prompt_len": distribution([r.prompt_tokens for r in ok]),
    }
    if slo_ttft_ms is not None or slo_tpot_ms is not None:
        good = sum(
            meets_slo(
                r,
                None if slo_ttft_ms is None else slo_ttft_ms / 1e3,
                None if slo_tpot_ms is None else slo_tpot_ms / 1e3,
            )
            for r in records
        )
        stats["slo"] = {"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms}
        stats["good_requests"] = good
        stats["goodput"] = per_s(good)
        stats["slo_attainment"] = good / len(records) if records else None
    return stats


def throughput_timeline(records: Sequence[RequestRecord], bin_s: float = 1.0) -> dict:
    """Output tokens/s and finished requests/s in bins of `bin_s` since the run began."""
    ok = [r for r in records if r.ok]
    token_at = [r.start_s + t for r in ok for t in r.token_times_s]
    done_at = [r.start_s + r.e2e_s for r in ok]
    end = max([*token_at, *done_at], default=0.0)
    edges = np.arange(0.0, end + bin_s, bin_s)
    if edges.size < 2:
        edges = np.array([0.0, bin_s])
    tokens, _ = np.histogram(token_at, edges)
    done, _ = np.histogram(done_at, edges)
    return {
        "t_s": edges[:-1].tolist(),
        "output_tokens_per_s": (tokens / bin_s).tolist(),
        "requests_per_s": (done / bin_s).tolist(),
    }


# --------------------------------------------------------------------------------------------------------
# Running the load


def _one_request(client, spec: RequestSpec, t0: float, ignore_eos: bool, timeout: float | None):
    import grpc

    from pdserve.services.client import build_request
    from pdserve.services.wire import FINISH_NAMES

    request = build_request(
        spec.prompt, max_tokens=spec.max_tokens, ignore_eos=ignore_eos, lora_adapter=spec.lora_adapter
    )
    start = time.perf_counter()
    record = RequestRecord(
        index=spec.index,
        start_s=start - t0,
        prompt_tokens=len(spec.prompt) if isinstance(spec.prompt, list) else 0,
        max_tokens=spec.max_tokens,
    )
    try:
        for response in client.stream(request, timeout=timeout):
            now = time.perf_counter() - start
            record.token_times_s += [now] * len(response.token_ids)
            if response.finish_reason:
                record.finish_reason = FINISH_NAMES[response.finish_reason]
                record.prompt_tokens = response.usage.prompt_tokens or record.prompt_tokens
        record.e2e_s = time.perf_counter() - start
    except grpc.RpcError as e:
        record.error = f"{e.code().name}: {e.details()}"
    except Exception as e:  # noqa: BLE001 - a load generator reports, it does not stop
        record.error = f"{type(e).__name__}: {e}"
    return record


def run_load(
    client,
    workload: Iterator[RequestSpec],
    num_requests: int | None = None,
    rate: float | None = None,
    concurrency: int | None = None,
    duration_s: float | None = None,
    seed: int = 0,
    ignore_eos: bool = True,
    timeout_s: float | None = None,
    on_done: Callable[[RequestRecord], None] | None = None,
    max_threads: int = 512,
) -> tuple[list[RequestRecord], float]:
    """Sends requests from `workload` until `num_requests` are sent or `duration_s` has passed.

    `rate`: Poisson arrivals at this many requests/s (open loop; inf: all at once), capped at `max_threads`
    in flight; `concurrency`: that many requests in flight at all times (closed loop). Returns the records
    (in send order) and the wall time from the first send to the last finish.
    """
    if (rate is None) == (concurrency is None):
        raise ValueError("give exactly one of rate and concurrency")
    if num_requests is None and duration_s is None:
        raise ValueError("give num_requests, duration_s or both")
    specs = workload if num_requests is None else itertools.islice(workload, num_requests)
    lock = threading.Lock()
    records: list[RequestRecord] = []
    t0 = time.perf_counter()
    deadline = None if duration_s is None else t0 + duration_s

    def run(spec: RequestSpec) -> None:
        record = _one_request(client, spec, t0, ignore_eos, timeout_s)
        with lock:
            records.append(record)
        if on_done:
            on_done(record)

    if concurrency is not None:

        def worker() -> None:
            while deadline is None or time.perf_counter() < deadline:
                with lock:
                    spec = next(specs, None)
                if spec is None:
                    return
                run(spec)

        threads = [threading.Thread(target=worker, daemon=True) for _ in range(concurrency)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    else:
        rng = np.random.default_rng(seed + 1_000_003)
        workers = max_threads if num_requests is None else max(1, min(num_requests, max_threads))
        with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="bench") as pool:
            next_at = t0
            for spec in specs:
                if deadline is not None and next_at >= deadline:
                    break
                delay = next_at - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
                pool.submit(run, spec)
                if math.isfinite(rate):
                    next_at += rng.exponential(1.0 / rate)
    wall = time.perf_counter() - t0
    records.sort(key=lambda r: r.start_s)
    return records, wall


# --------------------------------------------------------------------------------------------------------
# Plots (matplotlib, optional: the `plots` extra)


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError(
            "plots need matplotlib: pip install 'pdserve[plots]' (or pip install matplotlib)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_latency_cdfs(runs: dict[str, Sequence[RequestRecord]], path: str | Path, title: str = "") -> Path:
    """One figure, four panels (TTFT, TPOT, ITL, end-to-end): an empirical CDF per labelled run."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(8, 6), dpi=80)
    metrics = [
        ("TTFT", lambda rs: [r.ttft_s for r in rs if r.ok and r.ttft_s is not None]),
        ("TPOT", lambda rs: [r.tpot_s for r in rs if r.ok and r.tpot_s is not None]),
        ("ITL", lambda rs: [g for r in rs if r.ok for g in r.itl_s]),
        ("end-to-end", lambda rs: [r.e2e_s for r in rs if r.ok]),
    ]
    for ax, (name, values) in zip(axes.flat, metrics, strict=True):
        for label, records in runs.items():
            v = np.sort(np.asarray(values(records), dtype=np.float64) * 1e3)
            if v.size:
                ax.step(v, np.arange(1, v.size + 1) / v.size, where="post", label=label)
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests" if name != "ITL" else "fraction of gaps")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    return _save(plt, fig, path, title)


def _save(plt, fig, path: str | Path, title: str) -> Path:
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


def plot_throughput(
    runs: dict[str, Sequence[RequestRecord]], path: str | Path, bin_s: float = 1.0, title: str = ""
) -> Path:
    """Output tokens/s and finished requests/s over time, per labelled run."""
    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5), dpi=80, sharex=True)
    for label, records in runs.items():
        timeline = throughput_timeline(records, bin_s)
        top.plot(timeline["t_s"], timeline["output_tokens_per_s"], label=label)
        bottom.plot(timeline["t_s"], timeline["requests_per_s"], label=label)
    top.set_ylabel("output tokens/s")
    bottom.set_ylabel("requests/s finished")
    bottom.set_xlabel(f"time since start (s), {bin_s:g} s bins")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    top.legend(fontsize=8)
    return _save(plt, fig, path, title)


# --------------------------------------------------------------------------------------------------------
# Entry points


def bench(
    server: str,
    *,
    rate: float | None = None,
    concurrency: int | None = None,
    num_requests: int | None = 100,
    duration_s: float | None = None,
    prompt_len: str = "fixed:128",
    output_len: str = "fixed:64",
    dataset: str | Path | None = None,
    lora_adapters: Sequence[str] = (),
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
) -> dict:
    """Runs one benchmark against `server` (a decode-server's ADDR) and returns its result dict
    (`config`, `stats`, `timeline`, `requests`; with `keep_records`, also `records`: the RequestRecords).
    `client`: a services.client.Client to use instead of a new plaintext one (TLS, tokens)."""
    from tqdm import tqdm

    from pdserve.services.client import Client

    if rate is None and concurrency is None:
        rate = math.inf
    workload = make_workload(
        LengthDist.parse(prompt_len),
        LengthDist.parse(output_len),
        seed,
        load_dataset(dataset) if dataset else None,
        lora_adapters,
    )
    own_client = client is None
    client = client or Client(server)
    bar = tqdm(total=num_requests, desc="bench", unit="req", disable=not progress, file=sys.stderr)
    failures = 0

    def on_done(record: RequestRecord) -> None:
        nonlocal failures
        failures += not record.ok
        bar.update(1)
        if failures:
            bar.set_postfix(failed=failures, refresh=False)

    try:
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
            "concurrency": concurrency,
            "num_requests": num_requests,
            "duration_s": duration_s,
            "prompt_len": None if dataset else prompt_len,
            "output_len": output_len,
            "dataset": str(dataset) if dataset else None,
            "lora_adapters": list(lora_adapters),
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
        Path(json_path).write_text(json.dumps(result, indent=2))
    if keep_records:
        result["records"] = records
    return result


def format_summary(stats: dict) -> str:
    """A human-readable table of the main figures."""

    def num(x, fmt="{:.2f}"):
        return "-" if x is None else fmt.format(x)

    lines = [
        f"requests: {stats['completed']} completed, {stats['failed']} failed in {stats['duration_s']:.2f} s",
        f"request throughput: {num(stats['request_throughput'])} req/s",
        f"output token throughput: {num(stats['output_token_throughput'], '{:.1f}')} tok/s "
        f"(total incl. prompt: {num(stats['total_token_throughput'], '{:.1f}')} tok/s)",
    ]
    if "goodput" in stats:
        slo = stats["slo"]
        lines.append(
            f"goodput (TTFT <= {num(slo['ttft_ms'], '{:g}')} ms, TPOT <= {num(slo['tpot_ms'], '{:g}')} ms): "
            f"{num(stats['goodput'])} req/s, {stats['good_requests']}/{stats['requests']} requests "
            f"({num(stats['slo_attainment'] and stats['slo_attainment'] * 100, '{:.0f}')}%)"
        )
    lines.append(f"{'ms':<12}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E")):
        d = stats[key]
        cells = "".join(f"{num(d[k], '{:.1f}'):>10}" for k in ("mean", "p50", "p90", "p99"))
        lines.append(f"{name:<12}{cells}")
    for error in stats["errors"]:
        lines.append(f"error: {error}")
    return "\n".join(lines)


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    add_client_flags(parser, "ADDR of a decode-server (host:port)", required=True)
    load = parser.add_mutually_exclusive_group()
    load.add_argument("--rate", type=float, help="Poisson arrivals, requests/s (default: all at once)")
    load.add_argument("--concurrency", type=int, help="this many requests in flight (closed loop)")
    parser.add_argument("--num-requests", type=int, default=None, help="default 100 (without --duration)")
    parser.add_argument("--duration", type=float, default=None, help="stop sending after S seconds")
    parser.add_argument("--prompt-len", default="fixed:128", help="fixed:N or uniform:A:B (token ids)")
    parser.add_argument("--output-len", default="fixed:64", help="fixed:N or uniform:A:B (max_tokens)")
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
    if args.rate is not None and args.rate <= 0:
        print("error: --rate must be > 0", file=sys.stderr)
        return 2
    if args.concurrency is not None and args.concurrency < 1:
        print("error: --concurrency must be >= 1", file=sys.stderr)
        return 2
    num_requests = args.num_requests
    if num_requests is None and args.duration is None:
        num_requests = 100
    try:
        LengthDist.parse(args.prompt_len), LengthDist.parse(args.output_len)
        if args.dataset:
            load_dataset(args.dataset)
        if args.plots:
            _pyplot()
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
            concurrency=args.concurrency,
            num_requests=num_requests,
            duration_s=args.duration,
            prompt_len=args.prompt_len,
            output_len=args.output_len,
            dataset=args.dataset,
            lora_adapters=args.lora_adapters.split(",") if args.lora_adapters else (),
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
