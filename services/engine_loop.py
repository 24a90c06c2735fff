"""Runs an LLMEngine on its own thread so device work never blocks the asyncio event loop.

Everything that touches the engine (adding, aborting, inserting KV, stepping) runs on the engine thread,
between steps, in submission order. Async callers `await loop.call(fn)` to run `fn(engine)` there, and
receive each request's outputs on an asyncio queue.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from engine.engine import LLMEngine
from engine.output import RequestOutput

log = logging.getLogger(__name__)


class EngineLoop:
    def __init__(self, engine: LLMEngine, name: str = "engine"):
        self.engine = engine
        self.name = name
        self._commands: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._stopped = threading.Event()
        self._kv_events: Callable[[list], None] | None = None

    def publish_kv_events(self, sink: Callable[[list], None]) -> None:
        """The engine's KV cache events go to `sink` from the next command on (called on the engine
        thread after the commands and steps that made them; it must not block)."""

        def install() -> None:
            self.engine.record_kv_events()
            self._kv_events = sink

        self._commands.put(install)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Ends the thread after the commands already queued."""
        self._commands.put(None)
        self._thread.join(timeout)

    # ---- called from asyncio -----------------------------------------------------------------------
    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Runs fn(engine) on the engine thread; returns its result or raises its exception."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def run():
            try:
                result = fn(self.engine)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                loop.call_soon_threadsafe(_set_exception, future, e)
            else:
                loop.call_soon_threadsafe(set_result, future, result)

        self._commands.put(run)
        return await future

    def submit(self, fn: Callable[[LLMEngine], Any]) -> None:
        """Runs fn(engine) on the engine thread, fire and forget (errors are logged)."""

        def run():
            try:
                fn(self.engine)
            except Exception:
                log.exception("%s: command failed", self.name)

        self._commands.put(run)

    def open_stream(self, request_id: str) -> asyncio.Queue:
        """A queue that receives the request's RequestOutputs; open it before the request is added."""
        outputs: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), outputs)
        return outputs

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    # ---- the engine thread -------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while True:
            block = not engine.has_unfinished or engine.stalled  # nothing a step could do: wait for a command
            try:
                command = self._commands.get(block=block, timeout=None)
            except queue.Empty:
                command = False
            while command is not False:
                if command is None:
                    self._stopped.set()
                    return
                command()
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    command = False
            if engine.has_unfinished:
                try:
                    outputs = engine.step()
                except Exception:
                    log.exception("%s: engine step failed", self.name)
                    raise
                self.publish(outputs)
            if self._kv_events is not None:
                events = engine.take_kv_events()
                if events:
                    self._kv_events(events)

    def publish(self, outputs: list[RequestOutput]) -> None:
        """Hands outputs to their streams (engine thread)."""
        for output in outputs:
            target = self._streams.get(output.request_id)
            if target is not None:
                loop, outputs_queue = target
                loop.call_soon_threadsafe(outputs_queue.put_nowait, output)


def set_result(future: asyncio.Future, result: Any) -> None:
    """Resolves `future` unless it is already done (cancelled by its waiter): call it with the event loop's
    call_soon_threadsafe from another thread."""
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)
