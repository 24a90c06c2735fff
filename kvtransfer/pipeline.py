"""A bounded producer thread: overlap producing the next item (receiving a frame, encoding one) with the
consumer's work on the current one (verify, put on the mesh, insert; or gRPC sending).

prefetch(source, depth) iterates `source` on a background thread and hands its items over in order. The
producer starts item k + depth + 1 only when the consumer has finished item k (asked for the next one),
so at most depth + 1 items exist at once (the consumer's and depth produced ahead): the memory bound.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")
_END = object()


def prefetch(source: Iterable[T], depth: int = 1, on_close: Callable[[], None] | None = None) -> Iterator[T]:
    """Yields source's items, produced on a thread at most `depth` items ahead of the consumer.

    An exception raised by the source is re-raised here, after the items produced before it. Closing the
    generator early (or an exception in the consumer) stops the producer: `on_close` is called to unblock
    a producer waiting inside the source (e.g. cancel a gRPC call), and the thread is joined.
    """
    if depth < 1:
        raise ValueError(f"depth must be >= 1, got {depth}")
    slots = threading.Semaphore(depth + 1)  # items alive: the consumer's + depth ahead
    items: queue.SimpleQueue = queue.SimpleQueue()
    stop = threading.Event()

    def produce():
        try:
            iterator = iter(source)
            while True:
                slots.acquire()
                if stop.is_set():
                    return
                item = next(iterator, _END)
                items.put((item, None))
                if item is _END:
                    return
                del item
        except BaseException as e:  # handed to the consumer
            items.put((_END, e))

    thread = threading.Thread(target=produce, name="kvtransfer-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            item, error = items.get()
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
        if thread.is_alive() and on_close is not None:
            on_close()
        thread.join()
