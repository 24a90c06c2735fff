"""The decode server's core, shared by its gRPC front (server.py) and its OpenAI HTTP front
(openai/): admission, prefill here or on a replica (transfer.KVTransfers: retries and fallback), and the
stream of a request's outputs. Neither front end imports the other; both call down into this module.

A request's life here: make_request (validate, tokenize) -> stream: AddRequest (queued in the engine's
scheduler, bounded) -> TransferReady (blocks allocated) -> prefill on a replica (InsertKV for each KV
chunk as it arrives; RemoteKVDone with the first token starts it) or on this engine -> continuous
batching -> outputs until finished; whatever ends the stream frees what the request holds (Abort, any
state). Only engine.boundary's commands go down and only its outputs come up (services.engine_loop).
The whole lifecycle, both roles: docs/architecture.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import Awaitable, Callable

import grpc

from pdserve.engine.boundary import Abort, AddRequest, QueueFull, ReceiveKV
from pdserve.engine.core.kv_connector import DecodeConnector
from pdserve.engine.core.request import FinishReason, Request
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import InvalidRequestError
from pdserve.kvtransfer import KVLayout
from pdserve.services.admin import Counters
from pdserve.services.decode.config import PREFILL_HINT_HEADER, DecodeConfig, Routing
from pdserve.services.decode.errors import ServiceError, checked
from pdserve.services.decode.local_prefiller import LocalPrefiller
from pdserve.services.decode.prefillers import Prefiller, PrefillError
from pdserve.services.decode.routing import PrefillPool
from pdserve.services.decode.timeline import Timeline
from pdserve.services.decode.transfer import KVTransfers
from pdserve.services.engine_loop import EngineLoop, EngineStopped
from pdserve.services.metrics import Metrics
from pdserve.services.prepare import Overloaded, Preparer
from pdserve.services.sampling import check_knobs
from pdserve.services.security import PLAINTEXT, ChannelSecurity
from pdserve.services.tracing import Tracing

log = logging.getLogger(__name__)


@dataclasses.dataclass
class ActiveStream:
    """A request this server streams now (GenerationCore.active): its engine request, the queue its
    outputs come in on (the engine's, or a peer's relayed: services.decode.migration), its client's id, and
    what to run when the stream ends."""

    request: Request
    outputs: asyncio.Queue
    label: str
    on_close: list[Callable[[], object]] = dataclasses.field(default_factory=list)


class GenerationCore:
    """One decode engine (on its own thread), its prefill replicas and its counters.

    `pool`: remote replicas (or the local prefill engine of `pdserve serve`); None: every prompt is
    prefilled by this engine (colocated). `start()` runs the engine thread and greets the replicas;
    `close()` stops both.
    """

    def __init__(
        self,
        loop: EngineLoop,
        pool: PrefillPool | None = None,
        config: DecodeConfig = DecodeConfig(),
        counters: Counters | None = None,
    ):
        self.loop = loop
        self.engine: LLMEngine = loop.engine
        self.pool = pool
        self.config = config
        self.counters = counters or Counters()
        self.metrics = Metrics("decode", loop, self.counters)
        self.transfers = None if pool is None else KVTransfers(loop, pool, config, self.counters)
        if pool is not None:
            pool.on_layout = self.meet_layout
        self.draining = False
        self.preparer = Preparer(max_waiting=config.max_preparing, name="decode-prepare")
        self.server_id = uuid.uuid4().hex  # (a draining server never moves a request to itself)
        self.active: dict[str, ActiveStream] = {}  # by engine key
        self.migrator = None  # services.decode.migration.Migrator with --migrate-to
        self.tracing: Tracing | None = None  # with --otlp-traces-endpoint (services.tracing)

    @classmethod
    def for_engine(
        cls,
        engine: LLMEngine,
        prefill_targets: list[str] | None = None,
        local_prefiller: Prefiller | None = None,
        config: DecodeConfig = DecodeConfig(),
        prefill_security: ChannelSecurity = PLAINTEXT,
        routing: Routing | None = None,
    ) -> GenerationCore:
        """`prefill_targets`: ADDR or dns:///NAME:PORT of prefill servers (chosen per `routing`);
        `local_prefiller`: an engine of this process instead (`pdserve serve`); neither: colocated."""
        layout = engine.kv_layout
        engine.set_kv_connector(DecodeConnector(engine.config.block_size, config.local_prefill_below))
        pool = None
        if local_prefiller is not None:
            pool = PrefillPool.of(local_prefiller, layout)
        elif prefill_targets:
            pool = PrefillPool(prefill_targets, layout, prefill_security, routing or Routing())
        return cls(EngineLoop(engine, name="decode-engine"), pool, config)

    async def meet_layout(self, src: KVLayout) -> None:
        """A peer's KV will arrive in its own frame plan (a prefill replica greeted, a draining decode
        server's hello): the inserts of its chunk shapes are compiled on a thread, off the event loop and
        the engine thread, before its first frame (LLMEngine.compile_inserts_from; once per layout)."""
        compiled = await asyncio.to_thread(self.engine.compile_inserts_from, src)
        if compiled:
            log.info("compiled the inserts of %d chunk shapes for peers at TP %d", compiled, src.tp_size)

    @property
    def prefill_mode(self) -> str:
        """ "local" (colocated), "local-engine" (`pdserve serve`), "remote" or "conditional:<N>"."""
        if self.pool is None:
            return "local"
        if not self.pool.targets:
            return "local-engine"
        below = self.config.local_prefill_below
        return f"conditional:{below}" if below else "remote"

    @property
    def mirror_loops(self) -> list[EngineLoop]:
        """Engines of this process that serve the same adapters (the local prefill engine)."""
        if self.pool is None:
            return []
        return [r.loop for r in self.pool.replicas.values() if isinstance(r, LocalPrefiller)]

    async def start(self) -> None:
        self.loop.start()
        if self.pool is None or not self.pool.targets:
            return
        await self.pool.refresh()
        for replica in self.pool.replicas.values():
            try:
                await replica.handshake()
            except PrefillError as e:  # a replica that is down now may come back; a mismatch will not
                log.warning("%s", e)

    async def refresh_pool(self, stop: asyncio.Event, every_s: float = 30.0) -> None:
        """Re-resolves dns:/// targets until `stop`, so replicas a headless service adds or drops are seen."""
        while self.pool is not None and self.pool.targets and not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), every_s)
            try:
                await self.pool.refresh()
            except OSError as e:
                log.warning("prefill pool refresh failed: %s", e)

    async def close(self) -> None:
        if self.pool is not None:
            await self.pool.close()
        if self.migrator is not None:
            await self.migrator.close()
        self.loop.stop()
        self.preparer.close()
        if self.tracing is not None:
            self.tracing.shutdown()

    def make_request(
        self,
        prompt,
        params,
        label: str = "",
        lora: str = "",
        cache_salt: str = "",
        resume_token_ids=(),
        lora_fingerprint: str | None = None,
    ) -> Request:
        """Checks the limits, validates and tokenizes (InvalidRequestError names the field); refuses while
        draining. Blocking CPU work by the size of the request: call it through `prepare`. `cache_salt`:
        the tenant's (engine.core.request.Request.cache_salt; empty: none). `resume_token_ids`: the output
        its client already received from a server that went away (a resumption, Request.num_resumed);
        `lora_fingerprint`: the adapter's weights as a peer holds them (they must be this server's).

        The engine's key is this server's own, unique whatever clients send: the client's `label` (its
        request id, checked by the caller) and a random suffix, so that two requests of one id never meet.
        """
        if self.draining:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "decode server is shutting down")
        limits = self.config.limits
        limits.check(params)
        limits.check_fanout(params, self.engine.config.max_num_seqs)
        suffix = uuid.uuid4().hex[:12]  # the key stays within the limit a prefill server checks it against
        key = f"{label[: limits.max_request_id_chars - 13]}-{suffix}" if label else uuid.uuid4().hex
        return self.engine.make_request(
            prompt,
            params,
            request_id=key,
            lora=lora or None,
            lora_fingerprint=lora_fingerprint,
            cache_salt=cache_salt or None,
            resume_token_ids=resume_token_ids,
        )

    def check_params(self, params):
        """The checks of make_request that cost next to nothing (the limits, each knob's range), for a
        front to refuse a bad request on the event loop, before it waits for a preparation thread; returns
        `params`."""
        try:
            cfg = self.engine.config
            vocab = self.engine.model.config.vocab_size
            check_knobs(params, self.config.limits, vocab, cfg.max_logprobs, cfg.max_num_seqs)
        except InvalidRequestError:
            self.counters.count_outcome("invalid")
            raise
        return params

    async def prepare(self, build):
        """Runs `build()` (parse, render, tokenize, compile: typically a make_request call) off the event
        loop (services.prepare); RESOURCE_EXHAUSTED when too many requests are being prepared."""
        try:
            return await self.preparer.run(build)
        except InvalidRequestError:
            self.counters.count_outcome("invalid")
            raise
        except Overloaded as e:
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e), e.retry_after_ms) from None

    def prefill_hint(self, value: str | None) -> str | None:
        """The prefill replica a request's PREFILL_HINT_HEADER names, as HOST:PORT; None when there is none
        or hints are not accepted here. A value that is not HOST:PORT is an InvalidRequestError."""
        if not value or not self.config.accept_prefill_hint:
            return None
        host, _, port = value.strip().rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536 or any(c.isspace() for c in host):
            raise InvalidRequestError(PREFILL_HINT_HEADER, f"{value!r} is not HOST:PORT")
        return f"{host}:{int(port)}"

    async def stream(
        self,
        engine_request: Request,
        time_remaining: float | None = None,
        prefill_hint: str | None = None,
        label: str = "",
        receive: Callable[[asyncio.Queue], Awaitable[None]] | None = None,
        traceparent: str | None = None,
    ):
        """Runs one request: prefill (remote or here), decode; yields its RequestOutputs (of its n
        sequences, interleaved: RequestOutput.index; it ends when all have finished). `prefill_hint`:
        the replica an endpoint picker chose (`prefill_hint()`), preferred when it is one of the pool's;
        `label`: the client's id of it, for the log line (default: the engine's key). `receive(outputs)`:
        how its KV arrives instead (a sequence moved here: services.decode.migration), once it is queued
        to receive KV. While it runs it is in `active` (a drain moves it to a peer from there).
        `traceparent`: the caller's span (W3C trace context), the parent of its trace (services.tracing).

        Raises ServiceError (RESOURCE_EXHAUSTED, UNAVAILABLE; INTERNAL when the engine failed on this
        request; UNAVAILABLE when the engine stopped); cancelling the consumer frees everything.
        """
        rid = engine_request.request_id
        self.counters.num_requests_total += 1
        start, token_times, outcome = time.monotonic(), [], "abort"
        timeline = Timeline(start)
        span = None
        if self.tracing is not None:
            span = self.tracing.start("generate", traceparent, {"pdserve.request_id": label or rid}, start)
            timeline.traceparent = self.tracing.traceparent(span)
        unfinished = set(range(engine_request.params.n))
        outputs = self.loop.open_stream(rid)
        active = self.active[rid] = ActiveStream(engine_request, outputs, label or rid)
        routed: dict = {}  # where it was prefilled, for the log line
        try:
            if receive is not None:
                await self._enqueue(engine_request, receive_kv=True)
                await receive(outputs)
            # colocated; or a resumption, whose output so far is computed here with its prompt (a prefill
            # server samples a first token, not the next of an output it has not seen)
            elif self.pool is None or engine_request.num_resumed:
                self.counters.resumptions_total += bool(engine_request.num_resumed)
                await self._enqueue(engine_request)
            else:
                await self._enqueue(engine_request, receive_kv=True)
                await self.transfers.receive(
                    engine_request, outputs, time_remaining, routed, prefill_hint, timeline
                )
            while True:
                output = checked(await outputs.get())
                if output.finish_reason is FinishReason.ERROR:
                    raise ServiceError(
                        grpc.StatusCode.INTERNAL, f"the engine failed on this request: {output.error}"
                    )
                token_times += [time.monotonic()] * len(output.new_token_ids)
                if self.metrics is not None:
                    self.metrics.observe_output(output)
                yield output
                if output.finished:
                    unfinished.discard(output.index)
                    if not unfinished:
                        outcome = output.finish_reason.value
                        return
        except EngineStopped as e:
            outcome = "unavailable"
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, f"the decode engine stopped: {e}") from None
        except ServiceError as e:
            outcome = e.code.name.lower()
            raise
        finally:  # finished, cancelled, deadline, failed: free whatever the request still holds
            self.active.pop(rid, None)
            for close in active.on_close:  # (relays from a peer: cancelled, the peer drops its copy)
                close()
            self.loop.close_stream(rid)
            self.loop.submit(Abort(rid))
            self.counters.count_outcome(outcome)
            if "admitted" not in timeline.marks and engine_request.scheduled_time is not None:
                timeline.mark("admitted", engine_request.scheduled_time)  # (the scheduler's monotonic clock)
            if token_times:
                timeline.mark("first_output", token_times[0])
            params, phases = engine_request.params, timeline.phases()
            log.info(
                "request ended",
                extra={
                    "request_id": label or rid,
                    "engine_id": rid,
                    "outcome": outcome,
                    # when it arrived (unix seconds) and what it asked for: a replay's workload
                    "arrival": round(time.time() - (time.monotonic() - start), 3),
                    "prompt_tokens": len(engine_request.prompt_ids),
                    "cached_prompt_tokens": engine_request.num_cached_tokens,
                    "max_tokens": params.max_tokens,
                    "n": params.n,
                    "output_tokens": len(token_times),
                    "resumed_tokens": engine_request.num_resumed,
                    "ttft_s": round(token_times[0] - start, 3) if token_times else None,
                    **phases,
                    **routed,
                },
            )
            if self.metrics is not None and outcome in ("stop", "length"):
                self.metrics.observe_request(token_times, start, phases)
            if span is not None:
                attributes = {
                    "pdserve.outcome": outcome,
                    "pdserve.prompt_tokens": len(engine_request.prompt_ids),
                    "pdserve.cached_prompt_tokens": engine_request.num_cached_tokens,
                    "pdserve.output_tokens": len(token_times),
                    "pdserve.prefill_replica": routed.get("replica"),
                }
                self.tracing.end(span, attributes, timeline.intervals())

    async def _enqueue(self, request: Request, receive_kv: bool = False) -> None:
        """Queues the request in the engine's scheduler (RESOURCE_EXHAUSTED past the queue bound). With
        `receive_kv`, its prompt KV may come from a replica: a TransferReady on its stream says how much
        once its blocks are allocated (see DecodeConnector)."""
        max_queue = self.config.max_queue
        try:
            await self.loop.call(AddRequest(request, ReceiveKV() if receive_kv else None, max_queue))
        except QueueFull as e:
            raise ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e), retry_after_ms=500) from None
