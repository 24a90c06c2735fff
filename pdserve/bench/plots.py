"""Plots of load runs (matplotlib, optional: the `plots` extra): latency CDFs and throughput over time,
one line per labelled run; and the planner's goodput-vs-rate curves, one per configuration, and a
simulated run's queues and KV use, one line per replica."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from pdserve.bench.stats import RequestRecord, throughput_timeline


def pyplot():
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
    plt = pyplot()
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
    return save(plt, fig, path, title)


def save(plt, fig, path: str | Path, title: str) -> Path:
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
    plt = pyplot()
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
    return save(plt, fig, path, title)


def plot_goodput_curves(
    curves: dict[str, tuple[int, Sequence[tuple[float, float]]]],
    attainment: float,
    path: str | Path,
    title: str = "",
) -> Path:
    """Per labelled configuration (its chips, its (rate, SLO attainment) points): the attainment and the
    goodput (requests/s within the SLO, rate x attainment), both against the offered rate per chip, with
    the attainment target dashed."""
    plt = pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6), dpi=80, sharex=True)
    for label, (chips, points) in curves.items():
        rate, met = (np.array(v, dtype=np.float64) for v in zip(*points, strict=True))
        top.plot(rate / chips, met, marker=".", label=label)
        bottom.plot(rate / chips, rate * met / chips, marker=".", label=label)
    top.axhline(attainment, color="grey", linestyle="--", linewidth=1)
    top.set_ylabel("SLO attainment")
    top.set_ylim(0, 1.02)
    bottom.set_ylabel("goodput per chip (requests/s)")
    bottom.set_xlabel("offered rate per chip (requests/s)")
    for ax in (top, bottom):
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
    top.legend(fontsize=7)
    return save(plt, fig, path, title)


def plot_queue_series(series: dict[str, dict[str, Sequence]], path: str | Path, title: str = "") -> Path:
    """Per replica (planner.simulator.queue_series): sequences running and waiting, and the share of the KV
    cache in use, over time."""
    plt = pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5), dpi=80, sharex=True)
    for replica, s in series.items():
        (line,) = top.step(s["t_s"], s["running"], where="post", label=f"{replica} running")
        top.step(
            s["t_s"],
            s["waiting"],
            where="post",
            linestyle="--",
            color=line.get_color(),
            label=f"{replica} waiting",
        )
        bottom.step(s["t_s"], s["kv_use"], where="post", label=replica)
    top.set_ylabel("sequences")
    bottom.set_ylabel("KV cache in use")
    bottom.set_ylim(0, 1.02)
    bottom.set_xlabel("time since start (s)")
    for ax in (top, bottom):
        ax.grid(alpha=0.3)
    top.legend(fontsize=7)
    return save(plt, fig, path, title)
