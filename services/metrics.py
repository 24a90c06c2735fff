"""Prometheus metrics of a daemon, served on their own HTTP port (`--metrics-port`).

Latency histograms are observed by the request handlers; everything else (blocks, queues, counters that
the Admin service also reports) is read when scraped from the engine's last stats snapshot
(EngineLoop.stats, engine.boundary.EngineStats) and the daemon's Counters, so there is one source for each
number (services.admin.read_load for the load) and no scrape thread walks the engine.

The series an endpoint picker scores pods by (the Gateway API Inference Extension's, llm-d's router, which
scrapes every 50 ms) are PICKER_SERIES, also served alone on PICKER_PATH: waiting and running requests, KV
use as a fraction 0-1, the cache layout as labels of an info gauge, and vLLM's LoRA-info shape (labels
max_lora, running_lora_adapters and waiting_lora_adapters, comma-separated; value: the Unix time the adapter
lists last changed). Why pdserve's own names and not vLLM's: docs/gateway.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import weakref

import jax
from aiohttp import web
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    Info,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pdserve.engine.compile_cache import COMPILE_EVENT
from pdserve.engine.core.speculation import SpeculationStats
from pdserve.services.admin import Counters, read_load
from pdserve.services.engine_loop import EngineLoop

log = logging.getLogger(__name__)
STATS_INTERVAL_S = 10.0  # --log-stats-interval's default (vLLM's)

# The series an endpoint picker scores pods by, under the keys of llm-d's core-metrics-extractor
# `engineConfigs` (deploy/components/inference-gateway/epp-config.yaml maps them; {role}: prefill or decode).
PICKER_SERIES = {
    "queuedRequestsSpec": "pdserve_{role}_queue_depth",
    "runningRequestsSpec": "pdserve_running_requests",
    "kvUsageSpec": "pdserve_kv_cache_usage_ratio",
    "loraSpec": "pdserve_lora_requests_info",
    "cacheInfoSpec": "pdserve_kv_cache_config_info",
}
CACHE_NUM_BLOCKS_LABEL = "num_blocks"  # of cacheInfoSpec (vLLM's: num_gpu_blocks), beside block_size
# The picker's series alone, for its 20 Hz polling: rendered 14x faster than /metrics, whose histograms
# dominate (docs/benchmark-history.md "Behind an inference gateway")
PICKER_PATH = "/metrics/picker"

# The metrics port's bounds: connections open at once (the picker's, Prometheus', a person's; more are
# closed on arrival), and how long one may stay open, whatever it does (a scrape takes milliseconds: a
# half-open or slow connection holds its slot no longer)
MAX_CONNECTIONS = 64
MAX_CONNECTION_S = 30.0

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2, 5, 10, 30, 60, 120)


def _gauge(name: str, doc: str, role: str, value: float) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=["role"])
    family.add_metric([role], value)
    return family


def _counter(name: str, doc: str, role: str, value: float) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=["role"])
    family.add_metric([role], value)
    return family


class _PickerCollector:
    """PICKER_SERIES, read at scrape time from the stats snapshot (services.admin.read_load)."""

    def __init__(self, role: str, loop: EngineLoop, counters: Counters):
        self.role, self.loop, self.counters = role, loop, counters
        self._adapters: tuple | None = None  # (running, waiting) at the last scrape, and since when
        self._adapters_since = 0.0

    def collect(self):
        load, role = read_load(self.loop.stats, self.counters), self.role
        yield _gauge(
            PICKER_SERIES["runningRequestsSpec"],
            "requests holding blocks: decoding, being prefilled or receiving KV",
            role,
            load.num_running,
        )
        yield _gauge(
            PICKER_SERIES["queuedRequestsSpec"].format(role=role),
            "requests waiting for blocks or a prefill slot",
            role,
            load.num_waiting,
        )
        yield _gauge(
            PICKER_SERIES["kvUsageSpec"],
            "KV cache blocks held by requests / all blocks (cached unreferenced blocks count as free)",
            role,
            load.kv_usage,
        )
        info = GaugeMetricFamily(
            PICKER_SERIES["cacheInfoSpec"],
            "KV cache layout",
            labels=["role", "block_size", CACHE_NUM_BLOCKS_LABEL, "cache_dtype"],  # vLLM's label names
        )
        info.add_metric([role, str(load.block_size), str(load.num_blocks), load.cache_dtype], 1)
        yield info
        adapters = (load.running_adapters, load.waiting_adapters)
        if adapters != self._adapters:
            self._adapters, self._adapters_since = adapters, time.time()
        lora = GaugeMetricFamily(
            PICKER_SERIES["loraSpec"],
            "adapters of the running and the waiting requests; value: when those last changed",
            labels=["role", "max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )
        labels = [role, str(load.max_loras), ",".join(adapters[0]), ",".join(adapters[1])]
        lora.add_metric(labels, self._adapters_since)
        yield lora
        yield _gauge(
            "pdserve_incoming_transfers",
            "of the running, requests whose KV is being received",
            role,
            load.num_incoming,
        )


class _StateCollector:
    """The other gauges and counters, read at scrape time from the stats snapshot and the Counters."""

    def __init__(self, role: str, loop: EngineLoop, counters: Counters):
        self.role, self.loop, self.counters = role, loop, counters

    def collect(self):
        stats, c, role = self.loop.stats, self.counters, self.role

        def gauge(name, doc, value):
            return _gauge(name, doc, role, value)

        def counter(name, doc, value):
            return _counter(name, doc, role, value)

        yield gauge("pdserve_kv_blocks_used", "KV cache blocks held by requests", stats.num_used_blocks)
        yield gauge(
            "pdserve_kv_blocks_free", "KV cache blocks free (holding nothing cached)", stats.num_free_blocks
        )
        yield gauge(
            "pdserve_kv_blocks_cached",
            "unreferenced KV blocks kept by the prefix cache",
            stats.num_cached_blocks,
        )
        yield counter(
            "pdserve_prefix_cache_queries",
            "prompt tokens looked up in the prefix cache",
            stats.prefix_cache_queries,
        )
        yield counter(
            "pdserve_prefix_cache_hits", "prompt tokens found in the prefix cache", stats.prefix_cache_hits
        )
        yield counter(
            "pdserve_prefix_cache_evictions",
            "cached KV blocks evicted for new ones",
            stats.prefix_cache_evictions,
        )
        yield counter("pdserve_preemptions", "requests preempted to free blocks", stats.num_preemptions)
        if stats.num_host_blocks:  # the host tier (--kv-offloading-size)
            yield gauge("pdserve_kv_host_blocks", "host tier slots, a KV block each", stats.num_host_blocks)
            yield gauge(
                "pdserve_kv_host_blocks_cached",
                "host tier slots holding cached blocks",
                stats.num_host_cached_blocks,
            )
            yield gauge(
                "pdserve_kv_host_blocks_staged",
                "host tier slots reserved by prefill streams' staged KV",
                stats.num_host_staged_blocks,
            )
            yield counter(
                "pdserve_prefix_cache_host_hits",
                "of the prefix cache hits, prompt tokens loaded back from the host tier",
                stats.prefix_cache_host_hits,
            )
            yield counter(
                "pdserve_kv_host_offloads", "KV blocks copied to the host tier", stats.num_host_offloads
            )
        yield gauge(
            "pdserve_lora_adapters_loaded", "LoRA adapters requests may name", stats.num_adapters_loaded
        )
        yield gauge("pdserve_lora_slots_used", "adapter slots holding an adapter", stats.num_lora_slots_used)
        yield counter(
            "pdserve_lora_slot_loads", "adapters written into a device slot", stats.num_lora_slot_loads
        )
        for name, doc, field in _COUNTERS:
            yield counter(name, doc, getattr(c, field))
        if stats.speculation is not None:
            yield from _speculation_counters(role, stats.speculation)
        if role == "decode":
            yield from _migration_series(role, c)
        for name, doc, label, values in (
            ("pdserve_prefill_routes", "prefills routed to a replica, by reason", "reason", c.routes),
            ("pdserve_requests", "finished requests by outcome", "outcome", c.outcomes),
        ):
            family = CounterMetricFamily(name, doc, labels=["role", label])
            for value, count in sorted(values.items()):
                family.add_metric([role, value], count)
            yield family


def _migration_series(role: str, c: Counters):
    """Live migration (a decode server): sequences moved out and in by outcome, the KV bytes of the moves,
    and once a drain has handed its requests off, how long that took; resumptions clients asked for."""
    moves = CounterMetricFamily(
        "pdserve_migrations",
        "sequences moved to peers on drain (direction out: moved, stayed) or taken over (in: accepted, "
        "refused, failed)",
        labels=["role", "direction", "outcome"],
    )
    for (direction, outcome), count in sorted(c.migrations.items()):
        moves.add_metric([role, direction, outcome], count)
    yield moves
    moved = CounterMetricFamily(
        "pdserve_migration_kv_bytes",
        "KV bytes of moved sequences, by direction",
        labels=["role", "direction"],
    )
    for direction, count in sorted(c.migration_kv_bytes.items()):
        moved.add_metric([role, direction], count)
    yield moved
    if c.drain_handoff_seconds is not None:
        yield _gauge(
            "pdserve_drain_handoff_seconds",
            "seconds from the drain's start until every running request had moved or stayed",
            role,
            c.drain_handoff_seconds,
        )
    yield _counter(
        "pdserve_resumptions",
        "requests resumed here from the output a client received",
        role,
        c.resumptions_total,
    )


def _log_speculation(now: SpeculationStats, before: SpeculationStats | None) -> None:
    """The stats line of speculative decoding over an interval (as vLLM logs it), when rows verified drafts:
    the mean accepted length, drafts accepted of those verified, each position's acceptance rate."""
    before = before or SpeculationStats(now.k)
    rows = now.num_drafts - before.num_drafts
    if not rows:
        return
    drafted = now.num_draft_tokens - before.num_draft_tokens
    accepted = now.num_accepted_tokens - before.num_accepted_tokens
    per_position = [
        (a - b) / rows for a, b in zip(now.accepted_per_position, before.accepted_per_position, strict=True)
    ]
    log.info(
        "speculative decoding: mean accepted length %.2f, accepted %d of %d draft tokens (%.1f%%), "
        "acceptance rate by position %s",
        1 + accepted / rows,
        accepted,
        drafted,
        100 * accepted / drafted if drafted else 0.0,
        ", ".join(f"{rate:.2f}" for rate in per_position),
    )


def _speculation_counters(role: str, spec: SpeculationStats):
    """vLLM's spec-decode counters under pdserve's names (engine.core.speculation.SpeculationStats)."""
    yield _counter(
        "pdserve_spec_decode_num_drafts", "decode rows that verified drafts", role, spec.num_drafts
    )
    yield _counter(
        "pdserve_spec_decode_num_draft_tokens", "draft tokens verified", role, spec.num_draft_tokens
    )
    yield _counter(
        "pdserve_spec_decode_num_accepted_tokens", "draft tokens accepted", role, spec.num_accepted_tokens
    )
    family = CounterMetricFamily(
        "pdserve_spec_decode_num_accepted_tokens_per_pos",
        "rows whose draft at this position (from 0) was accepted, with every draft before it",
        labels=["role", "position"],
    )
    for position, value in enumerate(spec.accepted_per_position):
        family.add_metric([role, str(position)], value)
    yield family


# Counters of services.admin.Counters: (metric name, help, Counters field)
_COUNTERS = (
    ("pdserve_prompt_tokens", "prompt tokens of requests that got their first token", "prompt_tokens_total"),
    ("pdserve_generation_tokens", "tokens generated", "generation_tokens_total"),
    ("pdserve_kv_transfer_bytes", "KV bytes received from prefill servers", "kv_transfer_bytes_total"),
    ("pdserve_kv_transfer_seconds", "seconds spent receiving KV", "kv_transfer_seconds_total"),
    ("pdserve_kv_transfers", "KV transfers completed", "num_transfers_total"),
    (
        "pdserve_kv_transfer_failures",
        "prefill attempts that failed and were retried",
        "num_transfer_failures_total",
    ),
    (
        "pdserve_prefill_local_fallbacks",
        "requests prefilled locally after every replica failed",
        "num_local_fallbacks_total",
    ),
    ("pdserve_kv_frames_sent", "KV frames sent to decode servers", "kv_frames_sent_total"),
    (
        "pdserve_kv_frames_after_compute",
        "KV frames gathered when a prompt's last chunk was computed (the rest streamed during compute)",
        "kv_frames_after_compute_total",
    ),
    (
        "pdserve_prefill_route_expected_hit_tokens",
        "prompt tokens the chosen prefill replicas held, per their KV events",
        "route_expected_hit_tokens_total",
    ),
    (
        "pdserve_prefill_route_actual_hit_tokens",
        "prompt tokens the chosen prefill replicas found in their prefix caches",
        "route_actual_hit_tokens_total",
    ),
)


# The Metrics whose compilation counters jax.monitoring's events go to (weakly held: a process's listeners
# are never removed, and a Metrics holds its engine)
_COUNTING: weakref.WeakSet = weakref.WeakSet()
_listener_lock = threading.Lock()
_listener_registered = False


def _count_compilations(metrics: Metrics) -> None:
    global _listener_registered
    with _listener_lock:
        if not _listener_registered:
            jax.monitoring.register_event_duration_secs_listener(_on_jax_event)
            _listener_registered = True
        _COUNTING.add(metrics)


def _on_jax_event(event: str, duration: float, **_) -> None:
    if event == COMPILE_EVENT:
        for metrics in list(_COUNTING):
            metrics.compilations.inc()
            metrics.compile_seconds.inc(duration)


class Metrics:
    """The registry of one daemon; `observe_*` are called from request handlers."""

    def __init__(self, role: str, loop: EngineLoop, counters: Counters):
        self.loop, self.counters = loop, counters
        picker = _PickerCollector(role, loop, counters)
        self.picker_registry = CollectorRegistry()  # PICKER_PATH: what a picker polls at 20 Hz, no more
        self.picker_registry.register(picker)
        self.registry = CollectorRegistry()  # /metrics: everything
        self.registry.register(picker)
        self.registry.register(_StateCollector(role, loop, counters))
        info = Info(
            "pdserve_engine", "what the engine runs on (its start-up line)", ["role"], registry=self.registry
        )
        info.labels(role).info(loop.engine_info)
        hist = lambda name, doc: Histogram(name, doc, buckets=_LATENCY_BUCKETS, registry=self.registry)  # noqa: E731
        self.ttft = hist("pdserve_time_to_first_token_seconds", "request arrival to its first token")
        self.tpot = hist("pdserve_time_per_output_token_seconds", "mean gap between a request's tokens")
        self.itl = hist("pdserve_inter_token_latency_seconds", "every gap between consecutive tokens")
        self.e2e = hist("pdserve_request_duration_seconds", "request arrival to its last token")
        self.prefill = hist("pdserve_prefill_duration_seconds", "prefill server: arrival to KV gathered")
        self.queue = hist("pdserve_request_queue_time_seconds", "request arrival to its admission (blocks)")
        self.ttft_phases = Histogram(
            "pdserve_ttft_phase_seconds",
            "where time to first token goes, by phase (services/decode/timeline.py: queue, prefill, kv, "
            "insert, first_output)",
            ["phase"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.compilations = Counter(
            "pdserve_xla_compilations",
            "XLA programs compiled (or loaded from the persistent compilation cache) since the metrics port "
            "opened: after warmup, a shape met for the first time while serving, and a stall",
            registry=self.registry,
        )
        self.compile_seconds = Counter(
            "pdserve_xla_compile_seconds",
            "seconds spent in those compilations",
            registry=self.registry,
        )
        _count_compilations(self)
        self.refused_connections = Counter(
            "pdserve_metrics_connections_refused",
            "connections to the metrics port closed on arrival: as many as it serves at once were open",
            registry=self.registry,
        )
        self._runner: web.ServerRunner | None = None

    async def log_stats(self, stop: asyncio.Event, interval_s: float = STATS_INTERVAL_S) -> None:
        """Until `stop`: every `interval_s` in which the engine was not idle, one line as vLLM logs it:
        prompt and generation throughput over the interval, running and waiting requests, KV cache use,
        the prefix cache's hit rate over the interval."""
        c = self.counters

        def totals():  # (now, prompt tokens, generated tokens, cache queries, cache hits)
            stats = self.loop.stats
            return (
                time.monotonic(),
                c.prompt_tokens_total,
                c.generation_tokens_total,
                stats.prefix_cache_queries,
                stats.prefix_cache_hits,
            )

        last, last_spec = totals(), self.loop.stats.speculation
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)
            now, stats = totals(), self.loop.stats
            if stats.speculation is not None:
                _log_speculation(stats.speculation, last_spec)
                last_spec = stats.speculation
            seconds, prompt, generated, queries, hits = (a - b for a, b in zip(now, last, strict=True))
            last = now
            if not (prompt or generated or stats.num_running or stats.num_waiting):
                continue  # idle
            log.info(
                "engine stats: prompt throughput %.1f tokens/s, generation throughput %.1f tokens/s, "
                "running %d, waiting %d, KV cache use %.1f%%, prefix cache hit rate %.1f%%",
                prompt / seconds,
                generated / seconds,
                stats.num_running,
                stats.num_waiting,
                100 * stats.kv_usage,
                100 * hits / queries if queries else 0.0,
            )

    def observe_output(self, output) -> None:
        """Counts a request's output (an engine.core.output.RequestOutput) as it streams: its tokens,
        and with its first one the prompt's tokens and the queue time."""
        self.counters.generation_tokens_total += len(output.new_token_ids)
        if output.queue_s is not None:
            self.counters.prompt_tokens_total += output.num_prompt_tokens
            self.queue.observe(output.queue_s)

    def observe_request(
        self, token_times: list[float], start: float, ttft_phases: dict | None = None
    ) -> None:
        """`token_times`: monotonic arrival time of each token of a finished request; `ttft_phases`: its
        TTFT's phases in seconds (services.decode.timeline.Timeline.phases: `queue_s`, ...)."""
        if not token_times:
            return
        for phase, seconds in (ttft_phases or {}).items():
            self.ttft_phases.labels(phase.removesuffix("_s")).observe(seconds)
        self.ttft.observe(token_times[0] - start)
        self.e2e.observe(token_times[-1] - start)
        for a, b in zip(token_times, token_times[1:], strict=False):
            self.itl.observe(b - a)
        if len(token_times) > 1:
            self.tpot.observe((token_times[-1] - token_times[0]) / (len(token_times) - 1))

    async def start(
        self,
        port: int,
        host: str = "127.0.0.1",
        max_connections: int = MAX_CONNECTIONS,
        max_connection_s: float = MAX_CONNECTION_S,
    ) -> int:
        """Starts the HTTP endpoint on the running event loop (no thread per connection): PICKER_PATH
        serves the picker's series, any other path all of them (/metrics). Returns the bound port."""

        server = _BoundedServer(
            lambda request: self.scrape(request.path),
            max_connections,
            max_connection_s,
            self.refused_connections.inc,
            keepalive_timeout=max_connection_s,
            access_log=None,
        )
        self._runner = web.ServerRunner(server)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        return site._server.sockets[0].getsockname()[1]

    async def scrape(self, path: str) -> web.Response:
        """The exposition of PICKER_PATH's series, or (any other path) all of them."""
        registry = self.picker_registry if path == PICKER_PATH else self.registry
        body = await asyncio.to_thread(generate_latest, registry)  # (collectors read snapshots)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()


class _BoundedServer(web.Server):
    """aiohttp's low-level HTTP server with a bound on the connections open at once (one past it is
    closed on arrival and counted) and on each connection's life (closed `max_connection_s` after it
    opened)."""

    def __init__(self, handler, max_connections: int, max_connection_s: float, on_refused, **kwargs):
        super().__init__(handler, **kwargs)
        self.max_connections, self.max_connection_s, self.on_refused = (
            max_connections,
            max_connection_s,
            on_refused,
        )

    def connection_made(self, handler, transport: asyncio.Transport) -> None:
        if len(self.connections) >= self.max_connections:
            self.on_refused()
            transport.close()
            return
        super().connection_made(handler, transport)
        asyncio.get_running_loop().call_later(self.max_connection_s, transport.close)
