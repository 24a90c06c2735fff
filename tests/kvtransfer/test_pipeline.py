"""The bounded prefetch thread behind the prefill server's frame sending: order, overlap, the bound on
items alive, errors, and early close."""

import asyncio
import threading

import pytest

from pdserve.kvtransfer.pipeline import aprefetch

pytestmark = pytest.mark.fast

WAIT = 30  # seconds: only a deadlock would take that long


async def collect(source, depth=1):
    return [item async for item in aprefetch(source, depth)]


def test_items_arrive_in_order_and_errors_after_the_items_before_them():
    assert asyncio.run(collect(range(100), depth=2)) == list(range(100))

    def failing():
        yield 1
        yield 2
        raise KeyError("boom")

    got = []

    async def consume():
        async for item in aprefetch(failing()):
            got.append(item)

    with pytest.raises(KeyError, match="boom"):
        asyncio.run(consume())
    assert got == [1, 2]
    with pytest.raises(ValueError, match="depth"):
        asyncio.run(collect([], depth=0))


@pytest.mark.parametrize("depth", [1, 2])
def test_the_producer_overlaps_the_consumer_but_stays_at_most_depth_items_ahead(depth):
    produced = []
    ahead = threading.Event()

    def source():
        for i in range(10):
            produced.append(i)
            if i == depth:
                ahead.set()
            yield i

    async def consume():
        i = 0
        async for item in aprefetch(source(), depth):
            assert item == i
            if i == 0:  # while the consumer holds item 0, the producer makes items 1..depth
                assert await asyncio.to_thread(ahead.wait, WAIT)
            assert len(produced) <= i + 1 + depth  # never more than depth items ahead of the consumer
            i += 1

    asyncio.run(consume())
    assert produced == list(range(10))


def test_closing_early_stops_the_producer():
    produced = []

    def source():
        for i in range(1000):
            produced.append(i)
            yield i

    async def first_only():
        items = aprefetch(source())
        assert await anext(items) == 0
        await items.aclose()
        await asyncio.sleep(0.2)

    asyncio.run(first_only())
    assert len(produced) <= 3  # the item held, one ahead, and the one it was making when told to stop
