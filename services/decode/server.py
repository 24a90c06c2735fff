"""decode-server: the client-facing Generation service (docs/architecture.md tells the whole lifecycle).

Request lifecycle, as this server sees it:
 1. Generate arrives: text, token ids or a chat; validated and tokenized (INVALID_ARGUMENT names the
    field).
 2. Admission: the engine's scheduler queues the request (bounded; RESOURCE_EXHAUSTED when full) until
    it can allocate blocks for the whole prompt; blocks its prefix cache holds are used as they are.
 3. Prompts with fewer uncached tokens than `local_prefill_below` (or all, with `--prefill local`) are
    computed by this server's own engine: the colocated path.
 4. Otherwise the pool picks a prefill replica (cache-aware score, then least outstanding work) and opens
    a Prefill stream: a header declaring the frames, the KV frames of the blocks this server lacks (each
    verified and put on this mesh as it arrives, written into the allocated blocks by the engine thread
    while the next frame is received), then a trailer with the first token.
 5. After the trailer and the last insert, the request starts with that first token and joins continuous
    batching; its tokens stream back as text deltas.
 6. A failed prefill (unreachable, busy, died mid-stream, bad frame, no trailer) keeps the allocated
    blocks: the request is retried on another replica into the same blocks, then computed here
    (`fallback_local`), else UNAVAILABLE. A request is never started from a partial cache.
 7. Whatever ends the stream (finish, client cancel, deadline, failure) frees the request's blocks here;
    cancelling the Prefill stream frees them on the prefill side.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc

from pdserve.engine.sampling_params import InvalidRequestError
from pdserve.services import sampling, wire
from pdserve.services.admin import SERVICE_NAME as ADMIN_SERVICE
from pdserve.services.admin import AdminService
from pdserve.services.decode.core import PREFILL_HINT_HEADER, GenerationCore
from pdserve.services.decode.errors import ServiceError
from pdserve.services.decode.migration import SERVICE_NAME as MIGRATION_SERVICE
from pdserve.services.decode.migration import MigrationService
from pdserve.services.decode.openai.server import OpenAIFrontend
from pdserve.services.engine_loop import FAILED_GRACE_S, STEP_TIMEOUT_S, EngineStopped, until_stopped
from pdserve.services.grpc_server import RunningServer, service_handler
from pdserve.services.kv_events_zmq import KVEventsConfig, start_publishing
from pdserve.services.security import ServerSecurity
from pdserve.services.tracing import TRACEPARENT
from pdserve.v1 import admin_pb2_grpc, migration_pb2_grpc
from pdserve.v1 import generation_pb2 as pb
from pdserve.v1 import generation_pb2_grpc as pb_grpc

SERVICE = pb.DESCRIPTOR.services_by_name["Generation"]
SERVICE_NAME = SERVICE.full_name


class GenerationService(pb_grpc.GenerationServicer):
    """The gRPC front of a GenerationCore."""

    def __init__(self, core: GenerationCore):
        self.core = core
        self.engine = core.engine

    async def GetModelInfo(self, request, context) -> pb.ModelInfo:
        cfg = self.engine.model.config
        return pb.ModelInfo(
            model=cfg.name,
            vocab_size=cfg.vocab_size,
            max_model_len=self.engine.config.max_model_len,
            prefill_mode=self.core.prefill_mode,
            num_layers=cfg.num_layers,
            tensor_parallel=self.engine.config.tp,
            lora_adapters=list(self.engine.adapter_names()),
        )

    def _make_request(self, request: pb.GenerateRequest, params, label: str):
        """The engine request of a GenerateRequest: on a preparation thread (a chat renders here)."""
        config = self.core.config
        prompt = wire.prompt_from_proto(
            request, self.engine.tokenizer, config.limits, self.engine.config.max_prompt_chars
        )
        return self.core.make_request(
            prompt, params, label, request.lora_adapter, request.cache_salt, request.resume_token_ids
        )

    async def Generate(self, request: pb.GenerateRequest, context):
        if isinstance(request, wire.Unparsable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"request: {request.error}")
        try:
            label = self.core.config.limits.check_request_id(request.request_id)
            metadata = dict(context.invocation_metadata() or ())
            hint = self.core.prefill_hint(metadata.get(PREFILL_HINT_HEADER))
            params = self.core.check_params(sampling.params_from_request(request))  # cheap: here, first
            engine_request = await self.core.prepare(lambda: self._make_request(request, params, label))
            label = label or engine_request.request_id
            prompt_ids = engine_request.prompt_ids if request.return_prompt_ids else ()
            first = True
            outputs = self.core.stream(
                engine_request, context.time_remaining(), hint, label, traceparent=metadata.get(TRACEPARENT)
            )
            async for output in outputs:
                if output.prompt_logprobs is None:
                    response = wire.output_to_response(output, label, prompt_ids)
                else:  # (a message by the prompt's size: made off the event loop)
                    response = await asyncio.to_thread(wire.output_to_response, output, label, prompt_ids)
                if first:  # on the first message only
                    response.seed, prompt_ids, first = engine_request.seed, (), False
                yield response
        except InvalidRequestError as e:  # INVALID_ARGUMENT; NOT_FOUND for an adapter not loaded here
            await context.abort(grpc.StatusCode[e.status], str(e))
        except ServiceError as e:
            if e.retry_after_ms is not None:
                context.set_trailing_metadata((("retry-after-ms", str(e.retry_after_ms)),))
            await context.abort(e.code, e.message)


def add_to_server(server: grpc.aio.Server, service: GenerationService) -> None:
    """Registers Generation with a lenient request parser (bad UTF-8 etc. -> INVALID_ARGUMENT)."""
    codecs = {
        "Generate": (wire.lenient(pb.GenerateRequest.FromString), pb.GenerateResponse.SerializeToString),
        "GetModelInfo": (wire.lenient(pb.GetModelInfoRequest.FromString), pb.ModelInfo.SerializeToString),
    }
    server.add_generic_rpc_handlers((service_handler(SERVICE, service, codecs),))


async def serve(
    core: GenerationCore,
    port: int,
    stop: asyncio.Event,
    host: str = "127.0.0.1",
    grace_s: float = 30.0,
    on_ready: Callable[[str], None] | None = None,
    security: ServerSecurity | None = None,
    metrics_port: int | None = None,
    http_port: int | None = None,
    lora_root: str | None = None,
    kv_events: KVEventsConfig | None = None,
    http_plaintext: bool = False,
    tool_call_parser: str = "auto",
    reasoning_parser: str | None = None,
    sampling_defaults: dict | None = None,
    http_timeout_s: float = 600.0,
    step_timeout_s: float = STEP_TIMEOUT_S,
    served_model_names: tuple[str, ...] = (),
    stats_interval_s: float = 0.0,
) -> None:
    """Serves Generate (and Admin, and optionally /metrics and the OpenAI HTTP API) over `core` until
    `stop` is set; then refuses new requests and lets running ones finish.

    `security`: TLS / mutual TLS and bearer tokens of the public port (default: plaintext, open), and of
    the HTTP port unless `http_plaintext` (behind an inference gateway, whose proxy and endpoint picker
    reach pods over plain HTTP: the bearer tokens still apply). `kv_events`: publish this engine's KV
    cache events (None: do not); their topic names the HTTP port when there is one (the port an
    InferencePool targets), else the gRPC port. `tool_call_parser`: the HTTP API's format of the model's own
    tool calls (services.decode.tool_formats; "auto": the one its chat template writes), `reasoning_parser`
    how it splits out a thinking model's reasoning (services.decode.openai.reasoning), `sampling_defaults`
    its default sampling parameters (the model's generation config); `http_timeout_s`:
    an HTTP request's deadline. `served_model_names`: what clients call the model (the HTTP API's `model`,
    the KV events' topic; default: the model's name); `stats_interval_s`: the stats line's period
    (services.metrics.Metrics.log_stats; 0: none). When an engine fails (services.engine_loop: a step
    failing twice running, one running past `step_timeout_s`), health turns NOT_SERVING, waiting calls get
    UNAVAILABLE and this raises EngineStopped (the daemon exits non-zero)."""
    await core.start()
    if metrics_port is not None:
        print(f"metrics on {host}:{await core.metrics.start(metrics_port, host)}", flush=True)
    http, http_bound = None, None
    if http_port is not None:
        http_security = security
        if http_plaintext and security is not None:
            http_security = ServerSecurity(tokens=security.tokens)
        http = OpenAIFrontend(
            core,
            http_security,
            tool_call_parser,
            http_timeout_s,
            served_model_names,
            reasoning_parser,
            sampling_defaults,
        )
        http_bound = await http.start(host, http_port)
        print(f"http on {host}:{http_bound}", flush=True)
    # `pdserve serve`: adapters loaded at run time go into the local prefill engine too
    admin = AdminService(
        "decode", core.loop, core.counters, lora_root=lora_root, mirrors=core.mirror_loops, drain=stop
    )

    def register(server: grpc.aio.Server) -> None:
        add_to_server(server, GenerationService(core))
        admin_pb2_grpc.add_AdminServicer_to_server(admin, server)
        migration_pb2_grpc.add_MigrationServicer_to_server(MigrationService(core), server)

    names = [SERVICE_NAME, ADMIN_SERVICE, MIGRATION_SERVICE]
    running = await RunningServer.start(names, register, host, port, security)
    bound = running.port
    publisher = None
    if kv_events is not None:
        model = served_model_names[0] if served_model_names else None
        publisher = start_publishing(core.loop, kv_events, host, http_bound or bound, model)
    print(f"decode-server ready on {host}:{bound} (prefill: {core.prefill_mode})", flush=True)
    if on_ready is not None:
        on_ready(f"{host}:{bound}")
    refresher = asyncio.create_task(core.refresh_pool(stop))
    stats = asyncio.create_task(core.metrics.log_stats(stop, stats_interval_s)) if stats_interval_s else None
    failure = await until_stopped(stop, [core.loop, *core.mirror_loops], step_timeout_s)
    refresher.cancel()
    if stats is not None:
        stats.cancel()
    core.draining = True
    if failure is None and core.migrator is not None:  # running requests move to peers, then drain
        await running.not_serving()
        await core.migrator.migrate_all(timeout_s=grace_s / 2)
    await (running.stop(0, linger_s=FAILED_GRACE_S) if failure else running.stop(grace_s))
    if http is not None:
        await http.stop()
    await core.metrics.stop()
    if failure is None:
        await core.close()
    if publisher is not None:
        publisher.close()
    if failure is not None:
        raise EngineStopped(failure)
