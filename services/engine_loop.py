"""Runs an LLMEngine on its own thread so device work never blocks the asyncio event loop, and
supervises it.

The engine is reached only through its boundary (engine.boundary): typed commands in, run on the engine
thread between steps in submission order (`await loop.call(command)` for a result, `loop.submit(command)`
fire and forget), and each step's EngineOutputs out: every per-request output (a transfer's blocks ready,
KV ready to send, tokens) goes to that request's asyncio queue (`open_stream`), in order, and the stats
snapshot to `loop.stats`, which Admin and /metrics read.

Supervision: a step that raises fails the requests it scheduled (each gets an output with
FinishReason.ERROR; the engine pins what it can to one request itself, see LLMEngine.step) and serving
goes on. When the engine itself is broken (a second step in a row fails, a step runs past the watchdog's
limit, the thread is gone), the loop is failed: `failure` says why, every waiting `call` raises
EngineStopped and every open stream receives an EngineFailure at once, later calls raise at once, and
`supervise()` returns the reason to the daemon, which reports NOT_SERVING and exits non-zero.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from pdserve.engine.boundary import Command, EngineOutputs, EngineStats, KVReady, TransferReady, Utility
from pdserve.engine.core.output import RequestOutput
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.step_log import StepLogWriter, engine_description

log = logging.getLogger(__name__)

MAX_FAILED_STEPS = 2  # steps failing in a row: the engine is broken
STEP_TIMEOUT_S = 600.0  # a step running longer is hung (compiling a new shape takes seconds, not minutes)
FAILED_GRACE_S = 2.0  # after a failure: health says NOT_SERVING and calls get UNAVAILABLE, then exit


class EngineStopped(RuntimeError):
    """The engine can no longer serve (EngineLoop.failure says why)."""


@dataclasses.dataclass(frozen=True)
class EngineFailure:
    """What an open stream receives instead of further outputs when the engine stopped."""

    message: str


StreamItem = RequestOutput | TransferReady | KVReady | EngineFailure  # what a request's queue receives


class EngineLoop:
    def __init__(self, engine: LLMEngine, name: str = "engine"):
        self.engine = engine
        self.name = name
        self._commands: queue.Queue[Callable[[], None] | None] = queue.Queue()  # commands, wrapped
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._stopped = threading.Event()
        self._kv_events: Callable[[list], None] | None = None  # publish_kv_events' sink
        self.failure: str | None = None  # why the engine cannot serve (None: it can)
        self._lock = threading.Lock()  # failure, _pending
        self._pending: set[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = set()
        self._failed_steps = 0  # in a row
        self._on_failure: list[Callable[[], None]] = []  # supervise()'s wake-ups (any thread)
        self.step_started: float | None = None  # monotonic time the running step began (None: none runs)
        self.stats: EngineStats = engine.stats()  # after the last step (replaced whole, read by any thread)
        self.engine_info: dict[str, str] = engine.summary()  # what the engine runs on (fixed at start)
        self._step_log: StepLogWriter | None = None  # log_steps' writer
        self._unwaited: list[list[tuple[int, int]]] = []  # steps since the last that sampled: their rows
        self._unwaited_s = 0.0  # and their seconds

    def publish_kv_events(self, sink: Callable[[list], None]) -> None:
        """The engine's KV cache events go to `sink` from the next step on (called on the engine thread
        with each step's; it must not block)."""
        self._kv_events = sink
        self.submit(Utility("record_kv_events"))

    def log_steps(self, path: str) -> None:
        """From now on each step's rows and wall time go to the step log at `path` (engine.step_log); the
        writer is closed when the loop stops."""
        self._step_log = StepLogWriter(path, engine_description(self.engine))

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Ends the thread after the commands already queued."""
        self._commands.put(None)
        self._thread.join(timeout)
        if self._step_log is not None and not self._thread.is_alive():
            self._step_log.close()

    # ---- called from asyncio -----------------------------------------------------------------------
    async def call(self, command: Command) -> Any:
        """Runs the command on the engine thread; returns its result or raises its exception (EngineStopped
        when the engine cannot serve, at once)."""
        if self.failure is not None:
            raise EngineStopped(self.failure)
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def run():
            try:
                result = self.engine.apply(command)
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                loop.call_soon_threadsafe(_set_exception, future, e)
            else:
                loop.call_soon_threadsafe(_set_result, future, result)

        self._commands.put(run)
        return await self._wait(future)

    async def _wait(self, future: asyncio.Future) -> Any:
        """Awaits a future the engine thread resolves; raises EngineStopped when the engine stops first."""
        entry = (asyncio.get_running_loop(), future)
        with self._lock:
            if self.failure is not None:
                raise EngineStopped(self.failure)
            self._pending.add(entry)
        try:
            return await future
        finally:
            with self._lock:
                self._pending.discard(entry)

    def submit(self, command: Command) -> None:
        """Runs the command on the engine thread, fire and forget (errors are logged)."""

        def run():
            try:
                self.engine.apply(command)
            except Exception:
                log.exception("%s: command %s failed", self.name, type(command).__name__)

        self._commands.put(run)

    def open_stream(self, request_id: str) -> asyncio.Queue:
        """A queue that receives the request's outputs in order (StreamItem: TransferReady, KVReady,
        RequestOutput; an EngineFailure last when the engine stopped); open it before the request is
        added."""
        outputs: asyncio.Queue[StreamItem] = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), outputs)
        if self.failure is not None:
            outputs.put_nowait(EngineFailure(self.failure))
        return outputs

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    # ---- supervision -------------------------------------------------------------------------------
    def fail(self, reason: str) -> None:
        """The engine cannot serve (any thread; idempotent): every waiting call and open stream is told at
        once, later calls are refused."""
        with self._lock:
            if self.failure is not None:
                return
            self.failure = reason
            pending, self._pending = self._pending, set()
            streams = list(self._streams.values())
        log.error("%s: engine failed, serving stops: %s", self.name, reason)
        error = EngineStopped(reason)
        tell = [*self._on_failure]  # first: health turns NOT_SERVING before any caller hears of it
        tell += [
            lambda loop=loop, f=f: loop.call_soon_threadsafe(_set_exception, f, error) for loop, f in pending
        ]
        tell += [
            lambda loop=loop, q=q: loop.call_soon_threadsafe(q.put_nowait, EngineFailure(reason))
            for loop, q in streams
        ]
        for notify in tell:
            with contextlib.suppress(RuntimeError):  # its event loop is closed already
                notify()

    def check(self, step_timeout_s: float = STEP_TIMEOUT_S) -> str | None:
        """Why the engine cannot serve (None: it can), looking also for a hung step and a thread that is
        gone; fails the loop when it finds one."""
        if self.failure is None:
            started = self.step_started
            if started is not None and time.monotonic() - started > step_timeout_s:
                self.fail(f"a step has run for more than {step_timeout_s:.0f} s")
            elif (
                self._thread.ident is not None and not self._thread.is_alive() and not self._stopped.is_set()
            ):
                self.fail("the engine thread is gone")
        return self.failure

    async def supervise(self, step_timeout_s: float = STEP_TIMEOUT_S, every_s: float = 0.5) -> str:
        """Returns the reason once the engine cannot serve: at once when fail() is called, and within
        `every_s` of check()'s watchdog finding a hung step or a thread that is gone."""
        aloop, failed = asyncio.get_running_loop(), asyncio.Event()
        self._on_failure.append(lambda: aloop.call_soon_threadsafe(failed.set))
        while self.check(step_timeout_s) is None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(failed.wait(), every_s)
        return self.failure

    # ---- the engine thread -------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as e:  # noqa: BLE001 - the thread ends: the loop is failed, never silent
            log.exception("%s: engine thread failed", self.name)
            self.fail(f"engine thread failed: {type(e).__name__}: {e}")

    def _serve(self) -> None:
        engine = self.engine
        while True:
            block = not engine.has_unfinished or engine.stalled  # nothing a step could do: wait for a command
            try:
                command = self._commands.get(block=block, timeout=None)
            except queue.Empty:
                command = False
            ran = command is not False
            while command is not False:
                if command is None:
                    self._stopped.set()
                    return
                command()
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    command = False
            if (
                ran
            ):  # what the commands produced (a first token from elsewhere) goes out before a step's compute
                self.publish(engine.take_outputs())
            if engine.has_unfinished:
                self.publish(self._step())

    def _step(self) -> EngineOutputs:
        """One engine step; a failed one fails the requests it scheduled (its outputs say so), and a
        second failure in a row is raised (the thread ends, the loop fails)."""
        self.step_started = time.monotonic()
        began = time.perf_counter()
        try:
            scheduled = self.engine.schedule_step()
            admitted = self.engine.take_outputs()
            if admitted.for_requests():  # transfers to start: out before the step computes
                self.publish(admitted)
            outputs = self.engine.run_step(scheduled)
        except Exception as e:
            self._failed_steps += 1
            log.exception("%s: engine step failed (%d in a row)", self.name, self._failed_steps)
            if self._failed_steps >= MAX_FAILED_STEPS:
                raise
            return self.engine.fail_step(f"{type(e).__name__}: {e}")
        finally:
            self.step_started = None
        self._failed_steps = 0
        if self._step_log is not None and scheduled is not None:
            self._log_step(scheduled, time.perf_counter() - began)
        return outputs

    def _log_step(self, scheduled, seconds: float) -> None:
        """A step that sampled goes to the step log with the chunk-only steps before it (engine.step_log:
        those are not waited for, their time is in its own)."""
        rows = [(len(row.tokens), row.num_past) for row in scheduled.rows]
        if not any(row.samples for row in scheduled.rows):
            self._unwaited.append(rows)
            self._unwaited_s += seconds
            return
        self._step_log.write(rows, self._unwaited_s + seconds, self._unwaited)
        self._unwaited, self._unwaited_s = [], 0.0

    def publish(self, outputs: EngineOutputs) -> None:
        """Hands a step's outputs to their streams, its stats to `stats`, its KV events to their sink
        (engine thread)."""
        self.stats = outputs.stats
        for item in outputs.for_requests():
            target = self._streams.get(item.request_id)
            if target is not None:
                loop, outputs_queue = target
                loop.call_soon_threadsafe(outputs_queue.put_nowait, item)
        if outputs.kv_events and self._kv_events is not None:
            self._kv_events(outputs.kv_events)


def _set_result(future: asyncio.Future, result: Any) -> None:
    if not future.done():
        future.set_result(result)


def _set_exception(future: asyncio.Future, error: BaseException) -> None:
    if not future.done():
        future.set_exception(error)


async def until_stopped(
    stop: asyncio.Event, loops: list[EngineLoop], step_timeout_s: float = STEP_TIMEOUT_S
) -> str | None:
    """A daemon's life: waits for `stop` (SIGTERM) or for one of its engines to fail (EngineLoop.supervise);
    returns the failure's reason, None when stopped."""
    stopping = asyncio.ensure_future(stop.wait())
    watches = [asyncio.ensure_future(loop.supervise(step_timeout_s)) for loop in loops]
    done, _ = await asyncio.wait([stopping, *watches], return_when=asyncio.FIRST_COMPLETED)
    for task in [stopping, *watches]:
        task.cancel()
    failed = [task.result() for task in watches if task in done]
    return failed[0] if failed else None
