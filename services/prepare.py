"""Request preparation off the event loop: the CPU work that grows with what a client sends (rendering a
chat template, tokenizing, compiling a constraint) runs on a few threads of its own, never on the loop
that serves gRPC, HTTP and health probes, and only so many requests may wait for it."""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


class Overloaded(Exception):
    """More requests are being prepared than `max_waiting`: the caller answers RESOURCE_EXHAUSTED / 429
    with `retry_after_ms`."""

    def __init__(self, message: str, retry_after_ms: int = 200):
        super().__init__(message)
        self.retry_after_ms = retry_after_ms


class Preparer:
    """`await run(fn)` runs fn() on one of `threads` threads and returns its result (or raises its
    exception); at most `max_waiting` calls are in flight, the next one raises Overloaded at once."""

    def __init__(self, threads: int = 2, max_waiting: int = 64, name: str = "prepare"):
        self.max_waiting = max_waiting
        self.num_waiting = 0
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix=name)

    async def run(self, fn: Callable[[], T]) -> T:
        if self.num_waiting >= self.max_waiting:
            raise Overloaded(f"{self.num_waiting} requests being prepared (the limit is {self.max_waiting})")
        self.num_waiting += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn)
        finally:
            self.num_waiting -= 1

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
