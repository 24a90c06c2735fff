"""prefill-server: the internal Prefill service (docs/architecture.md tells the whole lifecycle).

Request lifecycle, as this server sees it:
 1. Handshake: a decode server sends its KV layout; an incompatible one (other model, dtype, block size,
    ...) gets FAILED_PRECONDITION naming what differs. Each Prefill request repeats the fingerprint.
 2. Prefill: the prompt joins the engine's queue (bounded: RESOURCE_EXHAUSTED when full) as a request of
    one token; the engine batches and chunks it with other prompts, and computes only what its prefix
    cache lacks. The KV sent starts after the leading blocks the decode side holds (held_block_hashes,
    checked against the prompt's own block hashes: INVALID_ARGUMENT otherwise); the header's first_block
    says where.
 3. The stream sends a header (layout, prompt length, first block, adapter), then the KV frames as the
    prompt computes: after each prefill chunk of the request, the engine's PrefillConnector gathers the
    frames of the plan whose tokens are all computed (kvtransfer.gather_request: copies), and off the
    engine thread they become frames (crc32c, <= 4 MiB; kvtransfer.encode_request, a frame ahead of
    gRPC), sent while the next chunk computes. A cached prefix is sent from the first step.
 4. The first token is sampled with the request's own parameters and resolved seed, so it is the token a
    colocated engine would pick; it ends the request, whose last frames follow it out (its blocks go
    back to the prefix cache at once), and the trailer carries it with the prefix-cache hit. A LoRA
    request runs with its adapter, which must be loaded here with the decode side's fingerprint
    (NOT_FOUND / FAILED_PRECONDITION otherwise); the header names it.
 5. The decode side registers the request only on the trailer, which confirms every frame.
 6. A cancelled stream (the decode side gave up or vanished: keepalive pings notice a dead peer) aborts
    the request if it is still queued, which frees its blocks; a frame write that stalls past the lease
    ends the stream too.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
from collections.abc import Callable

import grpc

from pdserve import kvtransfer
from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.sampling_params import InvalidRequestError
from pdserve.services import sampling, wire
from pdserve.services.admin import SERVICE_NAME as ADMIN_SERVICE
from pdserve.services.admin import AdminService, Counters
from pdserve.services.engine_loop import (
    FAILED_GRACE_S,
    STEP_TIMEOUT_S,
    EngineLoop,
    EngineStopped,
    until_stopped,
)
from pdserve.services.grpc_server import RunningServer, service_handler
from pdserve.services.kv_events_zmq import (
    KVEventPublisher,
    KVEventsConfig,
    parse_reader_key,
    start_publishing,
)
from pdserve.services.metrics import Metrics
from pdserve.services.prefill_stream import PrefillFailed, PrefillStream, install_connector
from pdserve.services.prepare import Overloaded, Preparer
from pdserve.services.sampling import Limits
from pdserve.services.security import ServerSecurity
from pdserve.services.tracing import TRACEPARENT, Tracing
from pdserve.v1 import admin_pb2_grpc
from pdserve.v1 import prefill_pb2 as pb
from pdserve.v1 import prefill_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

SERVICE = pb.DESCRIPTOR.services_by_name["Prefill"]
SERVICE_NAME = SERVICE.full_name


class PrefillService(pb_grpc.PrefillServicer):
    def __init__(
        self,
        loop: EngineLoop,
        counters: Counters,
        max_queue: int = 64,
        lease_s: float = 30.0,
        limits: Limits | None = None,
    ):
        self.loop = loop
        self.counters = counters
        self.engine: LLMEngine = loop.engine
        install_connector(self.engine)
        self.layout = self.engine.kv_layout
        self.layout_json = self.layout.to_json()
        self.fingerprint = self.layout.fingerprint()
        self.max_queue = max_queue
        self.lease_s = lease_s
        self.limits = limits or Limits()
        self.preparer = Preparer(max_waiting=max_queue, name="prefill-prepare")
        self._keys = itertools.count()  # the engine's own request keys, unique whatever peers send
        self.num_active = 0
        self.metrics = Metrics("prefill", loop, counters)
        self.draining = False
        self.kv_events: KVEventPublisher | None = None
        self.kv_events_settled = asyncio.Event()  # set once serve() knows whether it publishes
        self.tracing: Tracing | None = None  # with --otlp-traces-endpoint (services.tracing)

    @classmethod
    def for_engine(cls, engine: LLMEngine, **kwargs) -> PrefillService:
        """The service over `engine`, run on its own thread (started by `serve`)."""
        return cls(EngineLoop(engine, name="prefill-engine"), Counters(), **kwargs)

    async def Handshake(self, request: pb.HandshakeRequest, context) -> pb.HandshakeResponse:
        try:
            peer = kvtransfer.KVLayout.from_json(request.layout_json)
            self.layout.check_compatible(peer)
        except kvtransfer.LayoutMismatchError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except (ValueError, KeyError, TypeError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"layout_json: {e}")
        try:
            reader_key = parse_reader_key(request.kv_events_key) if request.kv_events_key else None
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"kv_events_key: {e}")
        reply = pb.HandshakeResponse(
            layout_json=self.layout_json, fingerprint=self.fingerprint, features=[wire.CONSTRAINTS_FEATURE]
        )
        await self.kv_events_settled.wait()
        if self.kv_events is not None:
            reply.kv_events_port = self.kv_events.port
            reply.kv_events_replay_port = self.kv_events.replay_port
            reply.kv_events_topic = self.kv_events.topic.decode()
            reply.kv_events_key = self.kv_events.public_key.decode()
            if reader_key is not None and self.kv_events.public_key:
                self.kv_events.allow(reader_key)  # this call passed the port's mTLS and tokens
        return reply

    async def Prefill(self, request: pb.PrefillRequest, context):
        if isinstance(request, wire.Unparsable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: {request.error}")
        if request.layout_fingerprint != self.fingerprint:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"layout fingerprint {request.layout_fingerprint!r} differs from this server's "
                f"{self.fingerprint!r}: call Handshake for the differences",
            )
        if self.draining:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "prefill server is shutting down")
        if self.num_active >= self.max_queue:
            context.set_trailing_metadata((("retry-after-ms", "100"),))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"prefill queue full ({self.max_queue})")
        self.num_active += 1
        self.counters.num_requests_total += 1
        self.counters.num_waiting += 1  # in flight: the prefill queue depth
        outcome, span = "cancelled", None
        if self.tracing is not None:  # the child of the decode server's span for the request
            traceparent = dict(context.invocation_metadata() or ()).get(TRACEPARENT)
            span = self.tracing.start("prefill", traceparent, {"pdserve.request_id": request.request_id})
        try:
            async for message in self._prefill(request, context):
                await asyncio.wait_for(context.write(message), self.lease_s)
            outcome = "ok"
        except TimeoutError as e:
            outcome = "lease_expired"
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED, str(e) or f"frame not taken within {self.lease_s:g} s"
            )
        except PrefillFailed as e:
            outcome = "error"
            await context.abort(grpc.StatusCode.INTERNAL, str(e))
        except EngineStopped as e:
            outcome = "unavailable"
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"the prefill engine stopped: {e}")
        finally:
            self.num_active -= 1
            self.counters.num_waiting -= 1
            self.counters.count_outcome(outcome)
            if span is not None:
                self.tracing.end(
                    span, {"pdserve.outcome": outcome, "pdserve.prompt_tokens": len(request.prompt_ids)}
                )

    def _make_request(self, request: pb.PrefillRequest, params):
        """The engine request of a Prefill call (a thread of the Preparer: a constraint compiles here)."""
        return self.engine.make_request(
            list(request.prompt_ids),
            params,
            request_id=f"prefill-{next(self._keys)}",
            lora=request.lora_adapter or None,
            lora_fingerprint=request.lora_fingerprint or None,
            seed=request.seed,
            cache_salt=request.cache_salt or None,
        )

    async def _prefill(self, request: pb.PrefillRequest, context):
        start = time.perf_counter()
        try:  # the decode side's id: in the header, the frames and the log line (never an engine key)
            rid = self.limits.check_request_id(request.request_id) or f"prefill-{id(request)}"
            params = dataclasses.replace(sampling.params_from_request(request), max_tokens=1)  # first token
            sampling.check_knobs(params, self.limits)
        except InvalidRequestError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if params.constraint is not None and params.constraint.fingerprint != request.constraint_fingerprint:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"constraint_fingerprint {request.constraint_fingerprint!r} differs from this server's "
                f"reading of the constraint ({params.constraint.fingerprint!r})",
            )
        try:
            engine_request = await self.preparer.run(lambda: self._make_request(request, params))
        except InvalidRequestError as e:  # NOT_FOUND / FAILED_PRECONDITION: the adapter is not here as asked
            await context.abort(grpc.StatusCode[e.status], str(e))
        except Overloaded as e:
            context.set_trailing_metadata((("retry-after-ms", str(e.retry_after_ms)),))
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        first_block = len(request.held_block_hashes)
        if first_block:
            problem = held_blocks_problem(
                engine_request, list(request.held_block_hashes), self.layout.block_size
            )
            if problem:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"held_block_hashes: {problem}")
        header = pb.PrefillHeader(
            request_id=rid,
            prompt_len=len(engine_request.prompt_ids),
            first_block=first_block,
            layout_json=self.layout_json,
            lora_adapter=request.lora_adapter,
            lora_fingerprint=engine_request.lora.fingerprint if engine_request.lora else "",
            prompt_digest=wire.prompt_digest(engine_request.prompt_ids),
        )
        order = wire.PrefillStreamOrder()  # header -> frames -> trailer, as the receiver checks it
        yield order.write(pb.PrefillMessage(header=header))
        stream = PrefillStream(self.loop, engine_request, first_block=first_block)
        try:
            await stream.start()
            # each chunk is framed on the producer thread as soon as the engine has computed its tokens
            frames = kvtransfer.encode_request(
                rid, self.layout, stream.num_tokens, stream.chunks(), lead=wire.kv_frame_lead
            )
            async with contextlib.aclosing(kvtransfer.aprefetch(frames)) as messages:
                async for message in messages:
                    yield order.write(message)  # back here once gRPC took it
                    computed = stream.computed_at
                    if computed is not None and time.monotonic() - computed > self.lease_s:
                        # the KV waits outside the block pool for this receiver: it may not for long
                        raise TimeoutError(
                            f"the KV was not taken within {self.lease_s:g} s of its computation"
                        )
            output, *forks = await stream.first_tokens()
        finally:
            stream.close()
        self.metrics.prefill.observe(time.perf_counter() - start)
        self.metrics.observe_output(output)  # the prompt's tokens, the first token, the queue time
        self.counters.kv_frames_sent_total += order.num_frames
        self.counters.kv_frames_after_compute_total += stream.num_chunks_after_compute  # a frame a chunk
        log.info(
            "prefilled",
            extra={
                "request_id": rid,
                "engine_id": engine_request.request_id,
                "prompt_tokens": stream.num_tokens,
                "frames": order.num_frames,
            },
        )
        trailer = pb.PrefillTrailer(
            num_frames=order.num_frames,
            num_bytes=order.num_bytes,
            prefill_seconds=time.perf_counter() - start,
            first_token=output.new_token_ids[0],
            num_cached_tokens=output.num_cached_tokens,
        )
        if output.logprobs:
            trailer.first_logprobs.CopyFrom(wire.logprobs_to_proto(output.logprobs[0]))
        for fork in forks:  # (n > 1: the other sequences' first tokens)
            start = trailer.forks.add(token=fork.new_token_ids[0])
            if fork.logprobs:
                start.logprobs.CopyFrom(wire.logprobs_to_proto(fork.logprobs[0]))
        if output.prompt_logprobs is not None:  # (the first position has none; off the event loop: by size)
            entries = output.prompt_logprobs[1:]
            await asyncio.to_thread(trailer.prompt_logprobs.extend, map(wire.logprobs_to_proto, entries))
        if output.draft_aux is not None:
            trailer.draft_aux = wire.draft_aux_to_bytes(output.draft_aux)
        yield order.write(pb.PrefillMessage(trailer=trailer))


def held_blocks_problem(request, held: list[int], block_size: int) -> str | None:
    """Why the decode side's held blocks cannot stand for the prompt's head (None: they can): they must be
    the prompt's own leading block hashes (same tokens, same adapter) and leave a token to compute."""
    if len(held) * block_size >= len(request.prompt_ids):
        return f"{len(held)} blocks of {block_size} tokens cover all {len(request.prompt_ids)} prompt tokens"
    if request.prefix_hashes(block_size)[: len(held)] != held:
        return "not the hashes of the prompt's leading blocks (with its adapter)"
    return None


def add_to_server(server: grpc.aio.Server, service: PrefillService) -> None:
    """Registers Prefill: a lenient request parser (bad UTF-8 etc. -> INVALID_ARGUMENT), KV frames sent
    as encoded (wire.serialize_prefill_message)."""
    codecs = {"Prefill": (wire.lenient(pb.PrefillRequest.FromString), wire.serialize_prefill_message)}
    server.add_generic_rpc_handlers((service_handler(SERVICE, service, codecs),))


async def serve(
    service: PrefillService,
    port: int,
    stop: asyncio.Event,
    host: str = "127.0.0.1",
    grace_s: float = 30.0,
    on_ready: Callable[[str], None] | None = None,
    metrics_port: int | None = None,
    security: ServerSecurity | None = None,
    lora_root: str | None = None,
    kv_events: KVEventsConfig | None = None,
    step_timeout_s: float = STEP_TIMEOUT_S,
    served_model_names: tuple[str, ...] = (),
    stats_interval_s: float = 0.0,
):
    """Serves `service` (and Admin, and optionally /metrics) until `stop` is set, then drains: refuses
    new prefills, finishes running ones. When its engine fails (services.engine_loop), health turns
    NOT_SERVING, waiting calls get UNAVAILABLE and this raises EngineStopped (the daemon exits non-zero).

    `security`: TLS / mutual TLS of the port and the client names allowed (default: plaintext, open).
    `kv_events`: publish the KV cache events (None: do not); Handshake tells decode servers where. Their
    topic names the first of `served_model_names` (default: the model's name). `stats_interval_s`: the
    stats line's period (services.metrics.Metrics.log_stats; 0: none)."""
    loop, counters = service.loop, service.counters
    loop.start()
    if metrics_port is not None:
        print(f"metrics on {host}:{await service.metrics.start(metrics_port, host)}", flush=True)
    admin = AdminService("prefill", loop, counters, lora_root=lora_root, drain=stop)

    def register(server: grpc.aio.Server) -> None:
        add_to_server(server, service)
        admin_pb2_grpc.add_AdminServicer_to_server(admin, server)

    running = await RunningServer.start([SERVICE_NAME, ADMIN_SERVICE], register, host, port, security)
    bound = running.port
    if kv_events is not None:
        model = served_model_names[0] if served_model_names else None
        service.kv_events = start_publishing(loop, kv_events, host, bound, model)
    service.kv_events_settled.set()
    log.info("prefill-server listening on %s:%d", host, bound)
    print(f"prefill-server ready on {host}:{bound}", flush=True)
    if on_ready is not None:
        on_ready(f"{host}:{bound}")
    stats = (
        asyncio.create_task(service.metrics.log_stats(stop, stats_interval_s)) if stats_interval_s else None
    )
    failure = await until_stopped(stop, [loop], step_timeout_s)
    if stats is not None:
        stats.cancel()
    service.draining = True
    await (running.stop(0, linger_s=FAILED_GRACE_S) if failure else running.stop(grace_s))
    await service.metrics.stop()
    if failure is None:
        loop.stop()
    service.preparer.close()
    if service.kv_events is not None:
        service.kv_events.close()
    if service.tracing is not None:
        service.tracing.shutdown()
    if failure is not None:
        raise EngineStopped(failure)
