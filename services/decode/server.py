"""decode-server: the client-facing Generation service.

Request lifecycle:
 1. Generate arrives: text, token ids or a chat; validated and tokenized (INVALID_ARGUMENT names the
    field).
 2. Prompts shorter than `local_prefill_below` tokens (or all, with `--prefill local`) are prefilled by
    this server's own engine: the colocated path.
 3. Otherwise admission: blocks for the prompt's KV are reserved on this engine (waiting in a bounded
    queue while none are free; RESOURCE_EXHAUSTED when that queue is full).
 4. The prefill replica with the least outstanding work prefills it and streams the first token, then the
    KV frames; each frame is verified and put on this mesh as it arrives, and inserted into the reserved
    blocks by the engine thread while the next frame is received.
 5. When the trailer confirms that every frame arrived, the request is registered with its first token and
    joins continuous batching; its tokens stream back as text deltas.
 6. A failed prefill (unreachable, died mid-stream, bad frame) frees the reserved blocks; the request is
    retried on another replica, then prefilled locally (`fallback_local`), else UNAVAILABLE. A request is
    never decoded from a partial cache.
 7. A client cancel or deadline aborts the request here (freeing its blocks) and cancels the prefill
    stream, which frees them on the prefill side.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable

import grpc

from engine.engine import LLMEngine
from engine.output import RequestOutput
from engine.request import Request
from engine.sampling_params import InvalidRequestError
from kvtransfer import KVChunk, chunk_sharding
from pdserve.v1 import admin_pb2_grpc
from pdserve.v1 import generation_pb2 as pb
from pdserve.v1 import generation_pb2_grpc as pb_grpc
from services import wire
from services.admin import SERVICE_NAME as ADMIN_SERVICE
from services.admin import AdminService, Counters
from services.decode.prefill_pool import FirstToken, LocalPrefiller, Prefiller, PrefillError, PrefillPool
from services.engine_loop import EngineLoop
from services.grpc_server import RunningServer
from services.kv import engine_layout
from services.metrics import Metrics
from services.security import PLAINTEXT, ChannelSecurity, ServerSecurity

log = logging.getLogger(__name__)

SERVICE_NAME = "pdserve.v1.Generation"


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    local_prefill_below: int = 0  # prompts shorter than this are prefilled here (0: none; all with no pool)
    max_queue: int = 256  # requests waiting for blocks before RESOURCE_EXHAUSTED
    max_attempts: int = 3  # prefill replicas tried per request
    fallback_local: bool = True  # prefill here when every replica failed


class ServiceError(Exception):
    """A request the service cannot take now: a gRPC status (HTTP front: 429 / 503) and a message."""

    def __init__(self, code: grpc.StatusCode, message: str, retry_after_ms: int | None = None):
        super().__init__(message)
        self.code, self.message, self.retry_after_ms = code, message, retry_after_ms


class GenerationService(pb_grpc.GenerationServicer):
    def __init__(
        self,
        loop: EngineLoop,
        pool: PrefillPool | None,
        config: DecodeConfig,
        prefill_mode: str,
        counters: Counters,
        metrics: Metrics | None = None,
    ):
        self.loop = loop
        self.counters = counters
        self.metrics = metrics
        self.engine: LLMEngine = loop.engine
        self.pool = pool
        self.config = config
        self.prefill_mode = prefill_mode
        self.layout = engine_layout(self.engine)
        self.sharding = chunk_sharding(self.engine.mesh, self.layout)
        self.draining = False
        self.blocks_freed = asyncio.Event()

    async def GetModelInfo(self, request, context) -> pb.ModelInfo:
        cfg = self.engine.model.config
        return pb.ModelInfo(
            model=cfg.name,
            vocab_size=cfg.vocab_size,
            max_model_len=self.engine.config.max_model_len,
            prefill_mode=self.prefill_mode,
            num_layers=cfg.num_layers,
            tensor_parallel=self.engine.config.tp,
            lora_adapters=sorted(self.engine.loras.adapters),
        )

    async def Generate(self, request: pb.GenerateRequest, context):
        if isinstance(request, wire.Unparsable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: {request.error}")
        try:
            prompt = wire.prompt_from_proto(request, self.engine.tokenizer)
            params = wire.sampling_from_proto(request.sampling, request.max_tokens, request.stop)
            engine_request = self.make_request(prompt, params, request.request_id, request.lora_adapter)
            async for output in self.stream(engine_request, context.time_remaining()):
                yield self._response(output, engine_request.request_id)
        except InvalidRequestError as e:  # INVALID_ARGUMENT; NOT_FOUND for an adapter not loaded here
            await context.abort(grpc.StatusCode[e.status], str(e))
        except ServiceError as e:
            if e.retry_after_ms is not None:
                context.set_trailing_metadata((("retry-after-ms", str(e.retry_after_ms)),))
            await context.abort(e.code, e.message)

    # ---- the core shared by the gRPC and the HTTP front ends -----------------------------------------
    def make_request(self, prompt, params, request_id: str = "", lora: str = "") -> Request:
        """Validates and tokenizes (InvalidRequestError names the field); refuses while draining."""
        if self.draining:
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, "decode server is shutting down")
        try:
            return self.engine.make_request(
                prompt, params, request_id=request_id or uuid.uuid4().hex, lora=lora or None
            )
        except InvalidRequestError:
            self.counters.count_outcome("invalid")
            raise

    async def stream(self, engine_request: Request, time_remaining: float | None = None):
        """Runs one request: prefill (remote or here), decode; yields its RequestOutputs.

        Raises ServiceError (RESOURCE_EXHAUSTED, UNAVAILABLE); cancelling the consumer frees everything.
        """
        rid = engine_request.request_id
        self.counters.num_requests_total += 1
        start, token_times, outcome = time.monotonic(), [], "abort"
        outputs = self.loop.open_stream(rid)
        pending = []  # the first token of a remote prefill: ahead of anything the engine queued since
        try:
            if self._prefill_locally(engine_request):
                await self.loop.call(lambda e: e.add_prepared_request(engine_request))
            else:
                first = await self._remote_prefill(engine_request, time_remaining)
                if first is None:  # every replica failed: prefill here
                    self.counters.num_local_fallbacks_total += 1
                    await self.loop.call(lambda e: e.add_prepared_request(engine_request))
                else:
                    pending.append(first)
            while True:
                output = pending.pop() if pending else await outputs.get()
                token_times += [time.monotonic()] * len(output.new_token_ids)
                yield output
                if output.finished:
                    outcome = output.finish_reason.value
                    return
        except ServiceError as e:
            outcome = e.code.name.lower()
            raise
        finally:  # finished, cancelled, deadline, failed: free whatever the request still holds
            self.loop.close_stream(rid)
            self.loop.submit(lambda e: e.discard(engine_request))
            self.blocks_freed.set()
            self.counters.count_outcome(outcome)
            log.info(
                "request ended",
                extra={
                    "request_id": rid,
                    "outcome": outcome,
                    "prompt_tokens": len(engine_request.prompt_ids),
                    "output_tokens": len(token_times),
                },
            )
            if self.metrics is not None and outcome in ("stop", "length"):
                self.metrics.observe_request(token_times, start)

    def _prefill_locally(self, request: Request) -> bool:
        return self.pool is None or len(request.prompt_ids) < self.config.local_prefill_below

    async def _remote_prefill(self, request: Request, time_remaining: float | None) -> RequestOutput | None:
        """Reserves blocks, streams the KV in from a replica and registers the request.

        Returns the first token's output, or None when no replica could prefill it and the request should
        be prefilled locally.
        """
        await self._admit(request)
        tried: set[str] = set()
        for _ in range(self.config.max_attempts):
            replica = self.pool.pick(exclude=tried)
            if replica is None:
                break
            tried.add(replica.name)
            try:
                first = await self._transfer(replica, request, time_remaining)
            except PrefillError as e:
                if e.replica_down:
                    replica.mark_failed()
                self.counters.num_transfer_failures_total += 1
                log.warning(
                    "prefill failed: %s", e, extra={"request_id": request.request_id, "replica": replica.name}
                )
                continue
            return await self.loop.call(_registrar(request, first))
        self.loop.submit(lambda e: e.abandon_transfer(request))
        self.blocks_freed.set()
        if self.config.fallback_local:
            return None
        raise ServiceError(
            grpc.StatusCode.UNAVAILABLE, f"no prefill replica could serve the request (tried {sorted(tried)})"
        )

    async def _transfer(self, replica: Prefiller, request: Request, timeout: float | None) -> FirstToken:
        """One attempt; on failure the request's blocks stay reserved (to be refilled by the next try).

        Closing the prefill stream (aclosing) cancels it at once when this request is cancelled.
        """
        replica.outstanding += 1
        try:
            first, started, nbytes = None, 0.0, 0
            num_prompt_blocks = -(-len(request.prompt_ids) // self.engine.config.block_size)
            blocks = request.blocks.block_ids[:num_prompt_blocks]
            async with contextlib.aclosing(
                replica.prefill(request, self.layout, self.sharding, timeout)
            ) as items:
                async for item in items:
                    if isinstance(item, FirstToken):
                        first, started = item, time.perf_counter()
                    else:
                        nbytes += item.data.nbytes
                        self.loop.submit(_inserter(item, blocks))
            if first is None:
                raise PrefillError(f"{replica.name}: no first token")
            self.counters.num_transfers_total += 1
            self.counters.kv_transfer_seconds_total += time.perf_counter() - started
            self.counters.kv_transfer_bytes_total += nbytes
            return first
        finally:
            replica.outstanding -= 1

    async def _admit(self, request: Request) -> None:
        """Waits for blocks (check + do on the engine thread); RESOURCE_EXHAUSTED past the queue bound."""
        if await self.loop.call(lambda e: e.reserve_for_transfer(request)):
            return
        if self.counters.num_waiting >= self.config.max_queue:
            raise ServiceError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"admission queue full ({self.config.max_queue})",
                retry_after_ms=500,
            )
        self.counters.num_waiting += 1
        try:
            while not await self.loop.call(lambda e: e.reserve_for_transfer(request)):
                self.blocks_freed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.blocks_freed.wait(), 0.05)
        finally:
            self.counters.num_waiting -= 1

    @staticmethod
    def _response(output: RequestOutput, rid: str) -> pb.GenerateResponse:
        response = pb.GenerateResponse(
            request_id=rid,
            token_ids=output.new_token_ids,
            text=output.text,
            finish_reason=wire.FINISH_REASONS[output.finish_reason],
            logprobs=[wire.logprobs_to_proto(lp) for lp in output.logprobs],
        )
        if output.finished:
            response.usage.prompt_tokens = output.num_prompt_tokens
            response.usage.completion_tokens = output.num_output_tokens
        return response


def add_to_server(server: grpc.aio.Server, service: GenerationService) -> None:
    """Registers Generation with a lenient request parser (bad UTF-8 etc. -> INVALID_ARGUMENT)."""
    handler = grpc.method_handlers_generic_handler(
        SERVICE_NAME,
        {
            "Generate": grpc.unary_stream_rpc_method_handler(
                service.Generate,
                request_deserializer=wire.lenient(pb.GenerateRequest.FromString),
                response_serializer=pb.GenerateResponse.SerializeToString,
            ),
            "GetModelInfo": grpc.unary_unary_rpc_method_handler(
                service.GetModelInfo,
                request_deserializer=wire.lenient(pb.GetModelInfoRequest.FromString),
                response_serializer=pb.ModelInfo.SerializeToString,
            ),
        },
    )
    server.add_generic_rpc_handlers((handler,))


async def _refresh_pool(pool: PrefillPool, stop: asyncio.Event, every_s: float = 30.0) -> None:
    """Re-resolves dns:/// targets, so prefill replicas that a headless service adds or drops are seen."""
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)
        try:
            await pool.refresh()
        except OSError as e:
            log.warning("prefill pool refresh failed: %s", e)


def _inserter(chunk: KVChunk, blocks: list[int]):
    return lambda engine: engine.insert_kv(chunk, blocks)


def _registrar(request: Request, first: FirstToken):
    return lambda engine: engine.register_prefilled(request, first.token, first.logprobs)


async def serve(
    engine: LLMEngine,
    port: int,
    stop: asyncio.Event,
    prefill_targets: list[str] | None = None,
    local_prefiller: Prefiller | None = None,
    config: DecodeConfig = DecodeConfig(),
    host: str = "127.0.0.1",
    grace_s: float = 30.0,
    on_ready: Callable[[str], None] | None = None,
    security: ServerSecurity | None = None,
    prefill_security: ChannelSecurity = PLAINTEXT,
    metrics_port: int | None = None,
    http_port: int | None = None,
    lora_root: str | None = None,
) -> None:
    """Serves Generate until `stop` is set; then refuses new requests and lets running ones finish.

    `security`: TLS / mutual TLS and bearer tokens of the public port; `prefill_security`: how the
    prefill servers are reached (their CA, this server's client certificate). Default: plaintext, open."""
    loop = EngineLoop(engine, name="decode-engine")
    loop.start()
    layout = engine_layout(engine)
    pool = None
    if local_prefiller is not None:
        pool = PrefillPool([], layout)
        pool.replicas["local"] = local_prefiller
        mode = "local-engine"
    elif prefill_targets:
        pool = PrefillPool(prefill_targets, layout, prefill_security)
        await pool.refresh()
        for replica in pool.replicas.values():
            try:
                await replica.handshake()
            except PrefillError as e:  # a replica that is down now may come back; a mismatch will not
                log.warning("%s", e)
        mode = "remote" if not config.local_prefill_below else f"conditional:{config.local_prefill_below}"
    else:
        mode = "local"
    counters = Counters()
    metrics = Metrics("decode", loop, counters)
    service = GenerationService(loop, pool, config, mode, counters, metrics)
    if metrics_port is not None:
        print(f"metrics on {host}:{metrics.serve(metrics_port, host)}", flush=True)
    http = None
    if http_port is not None:
        from services.decode.openai_api import OpenAIFrontend

        http = OpenAIFrontend(service, security)
        print(f"http on {host}:{await http.start(host, http_port)}", flush=True)
    # `pdserve serve`: adapters loaded at run time go into the local prefill engine too
    mirrors = [local_prefiller.loop] if isinstance(local_prefiller, LocalPrefiller) else []
    admin = AdminService("decode", loop, counters, lora_root=lora_root, mirrors=mirrors)

    def register(server: grpc.aio.Server) -> None:
        add_to_server(server, service)
        admin_pb2_grpc.add_AdminServicer_to_server(admin, server)

    running = await RunningServer.start([SERVICE_NAME, ADMIN_SERVICE], register, host, port, security)
    bound = running.port
    print(f"decode-server ready on {host}:{bound} (prefill: {mode})", flush=True)
    if on_ready is not None:
        on_ready(f"{host}:{bound}")
    refresher = asyncio.create_task(_refresh_pool(pool, stop)) if prefill_targets else None
    await stop.wait()
    if refresher is not None:
        refresher.cancel()
    service.draining = True
    await running.stop(grace_s)
    if http is not None:
        await http.stop()
    if pool is not None:
        await pool.close()
    loop.stop()
