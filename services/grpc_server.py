"""What both daemons share around grpc.aio: uvloop, health and reflection, message limits, ports (plaintext or
TLS), SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import ServiceDescriptor
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pdserve.services.security import ServerSecurity

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 8 << 20  # KV frames are <= 4 MiB; anything larger is refused by gRPC itself


# Peers that vanish (a killed decode server mid-transfer, a host gone) are noticed by keepalive pings within
# 15 s, which breaks their streams: servers' handlers clean up, channels' calls fail.
KEEPALIVE_OPTIONS = [("grpc.keepalive_time_ms", 10_000), ("grpc.keepalive_timeout_ms", 5_000)]


# ---- services as the generated descriptors define them (names, paths, streaming kinds, message types) ----
Codec = tuple[Callable[[bytes], object], Callable[[object], bytes]]  # (request parser, response serializer)


def method_path(service: ServiceDescriptor, method: str) -> str:
    """A method's gRPC path, "/package.Service/Method", for a client's channel."""
    return f"/{service.full_name}/{service.methods_by_name[method].name}"


def service_handler(
    service: ServiceDescriptor, servicer: object, codecs: dict[str, Codec] | None = None
) -> grpc.GenericRpcHandler:
    """The handler of every method of `service` (a generated module's DESCRIPTOR.services_by_name[...]):
    the servicer's method of that name, of the descriptor's streaming kind, with the messages' own parsing
    and serialization, or a method's `codecs` (a lenient parser, pre-encoded frames)."""
    handlers = {}
    for method in service.methods:
        kind = f"{'stream' if method.client_streaming else 'unary'}_"
        kind += "stream" if method.server_streaming else "unary"
        request_class = message_factory.GetMessageClass(method.input_type)
        response_class = message_factory.GetMessageClass(method.output_type)
        parse, serialize = (codecs or {}).get(
            method.name, (request_class.FromString, response_class.SerializeToString)
        )
        handlers[method.name] = getattr(grpc, f"{kind}_rpc_method_handler")(
            getattr(servicer, method.name), request_deserializer=parse, response_serializer=serialize
        )
    return grpc.method_handlers_generic_handler(service.full_name, handlers)


def server_options(max_message_bytes: int = MAX_MESSAGE_BYTES, max_send_bytes: int | None = None) -> list:
    """A server's options: messages received of at most `max_message_bytes`, sent of at most
    `max_send_bytes` (default: the same)."""
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_send_bytes or max_message_bytes),
        ("grpc.so_reuseport", 0),
        *KEEPALIVE_OPTIONS,
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
        ("grpc.keepalive_permit_without_calls", 1),
    ]


def channel_options(max_message_bytes: int = MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
    ]


def make_server(
    service_names: list[str], security: ServerSecurity | None = None
) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    """A grpc.aio server with grpc.health.v1 (all services SERVING once started) and reflection; with
    `security`, its token and peer checks on every service but health."""
    interceptors = security.interceptors() if security is not None else []
    server = grpc.aio.server(options=server_options(), interceptors=interceptors)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server
    )
    return server, health_servicer


def add_port(server: grpc.aio.Server, host: str, port: int, security: ServerSecurity | None = None) -> int:
    """Binds `host:port` with TLS when `security` has a certificate, else plaintext; returns the port."""
    credentials = security.credentials() if security is not None else None
    if credentials is None:
        return server.add_insecure_port(f"{host}:{port}")
    return server.add_secure_port(f"{host}:{port}", credentials)


async def set_serving(health_servicer, service_names: list[str], serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ["", *service_names]:
        await health_servicer.set(name, status)


def run_until_signal(main: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Runs `main(stop_event)` on uvloop; SIGTERM/SIGINT set the event (main drains, then returns).
    Once main has returned the process is exiting: later signals are ignored, so a SIGTERM sent while it
    tears down (after an Admin.Drain, or a second one from an orchestrator) does not turn a clean exit
    into a kill."""
    import uvloop

    async def runner():
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        try:
            await main(stop)
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)  # (restores the default action: ignore at once)
                signal.signal(sig, signal.SIG_IGN)

    uvloop.run(runner())


class RunningServer:
    """A started daemon port: gRPC services + Admin + health + reflection, SERVING until `stop()`."""

    def __init__(self, server: grpc.aio.Server, health_servicer, service_names: list[str], port: int):
        self.server, self.health, self.service_names, self.port = server, health_servicer, service_names, port

    @classmethod
    async def start(
        cls,
        service_names: list[str],
        register: Callable[[grpc.aio.Server], None],
        host: str,
        port: int,
        security: ServerSecurity | None = None,
    ) -> RunningServer:
        """`register(server)` adds the services; then the port is bound, started and marked SERVING."""
        server, health_servicer = make_server(service_names, security)
        register(server)
        bound = add_port(server, host, port, security)
        await server.start()
        await set_serving(health_servicer, service_names, True)
        return cls(server, health_servicer, service_names, bound)

    async def not_serving(self) -> None:
        """NOT_SERVING for probes, calls still served (a drain's first step: migrations before stop)."""
        await set_serving(self.health, self.service_names, False)

    async def stop(self, grace_s: float, linger_s: float = 0.0) -> None:
        """Drain: NOT_SERVING for probes (and `linger_s` seconds in which calls are still answered, as
        they are by a failed engine: UNAVAILABLE), then running calls get `grace_s` to finish."""
        await set_serving(self.health, self.service_names, False)
        if linger_s:
            await asyncio.sleep(linger_s)
        await self.server.stop(grace_s)
