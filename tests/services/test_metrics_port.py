"""The metrics port under connections that never scrape: bounded, each closed in time, no thread each
(services.metrics: aiohttp's server on the daemon's event loop)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from pdserve.services.admin import Counters
from pdserve.services.engine_loop import EngineLoop
from pdserve.services.metrics import Metrics

pytestmark = pytest.mark.model

GET = b"GET /metrics HTTP/1.1\r\nHost: pdserve\r\nConnection: close\r\n\r\n"


async def _closed_by_server(reader: asyncio.StreamReader) -> bool:
    return await asyncio.wait_for(reader.read(), timeout=30) == b""


async def _connections_are_bounded_and_expire(metrics: Metrics) -> None:
    port = await metrics.start(0, max_connections=4, max_connection_s=1.0)
    try:
        threads = threading.active_count()
        idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(4)]  # they never send
        await asyncio.sleep(0.2)
        assert threading.active_count() == threads  # no thread per connection
        reader, _ = await asyncio.open_connection("127.0.0.1", port)
        assert await _closed_by_server(reader)  # a fifth: closed on arrival
        for reader, _ in idle:  # each closed once its time is up, though it never sent a byte
            assert await _closed_by_server(reader)
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(GET)
        response = await asyncio.wait_for(reader.read(), timeout=30)
        assert response.startswith(b"HTTP/1.1 200") and b"pdserve_running_requests" in response
        assert b"pdserve_metrics_connections_refused_total 1.0" in response
    finally:
        await metrics.stop()


def test_connections_are_bounded_and_expire(make_engine):
    metrics = Metrics("decode", EngineLoop(make_engine()), Counters())
    asyncio.run(_connections_are_bounded_and_expire(metrics))


def test_a_stats_line_while_busy_none_while_idle(make_engine, caplog):
    """Metrics.log_stats: a line with the interval's throughput, the requests and the cache's state after
    an interval with tokens, nothing after an idle one (vLLM's log line, under pdserve's names)."""
    counters = Counters()
    metrics = Metrics("decode", EngineLoop(make_engine()), counters)

    async def main():
        stop = asyncio.Event()
        task = asyncio.create_task(metrics.log_stats(stop, 0.2))
        await asyncio.sleep(0.3)  # one idle interval
        counters.prompt_tokens_total += 200
        counters.generation_tokens_total += 40
        await asyncio.sleep(0.2)
        stop.set()
        await task

    with caplog.at_level("INFO", logger="pdserve.services.metrics"):
        asyncio.run(main())
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine stats:")]
    assert len(lines) == 1, lines
    assert "prompt throughput" in lines[0] and "running 0, waiting 0" in lines[0]
