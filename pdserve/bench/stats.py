"""The figures of a load run as a pure function of its per-request records: TTFT (send -> first token),
TPOT ((last token - first token) / (tokens - 1)), ITL (every gap between consecutive tokens) and
end-to-end latency, their mean/p50/p90/p99, request and token throughput, goodput against TTFT and TPOT
SLOs, throughput over time, and a human-readable summary."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

PERCENTILES = (50, 90, 99)


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
