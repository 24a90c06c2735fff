"""A bounded producer thread for asyncio consumers: overlap producing the next item (copying a frame to
host, checksumming and serializing it) with the consumer's work on the current one (gRPC sending it).

aprefetch(source, depth) iterates `source` on a background thread and hands its items over in order. The
producer starts item k + depth + 1 only when the consumer has finished item k (asked for the next one),
so at most depth + 1 items exist at once (the consumer's and depth produced ahead): the memory bound.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterable
from typing import TypeVar

T = TypeVar("T")
_END = object()


async def aprefetch(source: Iterable[T], depth: int = 1) -> AsyncIterator[T]:
    """Yields source's items, produced on a thread at most `depth` items ahead of the consumer.

    An exception raised by the source is re-raised here, after the items produced before it. Closing the
    iterator early (or cancelling the consumer) stops the producer after the item it is producing.
    """
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    loop = asyncio.get_running_loop()
    items: asyncio.Queue = asyncio.Queue()
    slots = threading.Semaphore(depth + 1)  # items alive: the consumer's + depth ahead
    stop = threading.Event()

    def hand_over(item, error=None) -> None:
        try:
            loop.call_soon_threadsafe(items.put_nowait, (item, error))
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            stop.set()

    def produce():
        try:
            iterator = iter(source)
            while True:
                slots.acquire()
                if stop.is_set():
                    return
                item = next(iterator, _END)
                hand_over(item)
                if item is _END:
                    return
                del item
        except BaseException as e:  # handed to the consumer
            hand_over(_END, e)

    threading.Thread(target=produce, name="kvtransfer-prefetch", daemon=True).start()
    try:
        while True:
            item, error = await items.get()
            if item is _END:
                if error is not None:
                    raise error
                return
            yield item
            del item  # done with it: the producer may start another
            slots.release()
    finally:
        stop.set()
        slots.release()  # wake a producer waiting for a slot
