"""The bounded prefetch thread behind the gRPC send and receive pipelines: order, overlap, the bound on
items alive, errors, and early close."""

import threading

import pytest

from kvtransfer.pipeline import prefetch

pytestmark = pytest.mark.fast

WAIT = 30  # seconds: only a deadlock would take that long


def test_items_arrive_in_order_and_errors_after_the_items_before_them():
    assert list(prefetch(range(100), depth=2)) == list(range(100))

    def failing():
        yield 1
        yield 2
        raise KeyError("boom")

    got = []
    with pytest.raises(KeyError, match="boom"):
        for item in prefetch(failing()):
            got.append(item)
    assert got == [1, 2]
    with pytest.raises(ValueError, match="depth"):
        next(prefetch([], depth=0))


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

    for i, item in enumerate(prefetch(source(), depth)):
        assert item == i
        if i == 0:  # while the consumer holds item 0, the producer makes items 1..depth
            assert ahead.wait(WAIT)
        assert len(produced) <= i + 1 + depth  # never more than depth items ahead of the consumer
    assert produced == list(range(10))


def test_closing_early_unblocks_the_producer_and_joins_its_thread():
    release = threading.Event()
    closed = []

    def source():
        yield 0
        release.wait(WAIT)  # like a gRPC call waiting for the next message
        yield 1

    def on_close():
        closed.append(True)
        release.set()  # like call.cancel()

    items = prefetch(source(), on_close=on_close)
    assert next(items) == 0
    before = {t for t in threading.enumerate() if t.name == "kvtransfer-prefetch"}
    items.close()
    assert closed == [True]
    assert not any(t.is_alive() for t in before)
