"""Helpers shared by the tests: daemons a test starts and stops, servers on a thread of the test process, and
waiting for a daemon to be idle."""

from __future__ import annotations

import contextlib
import queue
import time
from collections.abc import Iterator

from pdserve.services.client import Client, build_request
from pdserve.services.sampling import params_from_request
from pdserve.testing.launch import Daemon, ServerThread, decode_server, prefill_server
from pdserve.v1 import admin_pb2


class Reference:
    """What a colocated engine generates for a prompt (text or ids) under Client keywords (`lora_adapter`
    included), mapped exactly as a decode-server maps them; cached. `get_engine()` gives the engine.

    `reference(prompt, **kw)`: the token ids (`field="text"`: the text); `reference.prepare([(prompt, kw),
    ...])` runs many in one batch (a request's tokens never depend on its batch)."""

    def __init__(self, get_engine):
        self.get_engine = get_engine
        self._done = {}

    @property
    def engine(self):
        return self.get_engine()

    @staticmethod
    def _key(prompt, kw: dict):
        return (prompt if isinstance(prompt, str) else tuple(prompt), tuple(sorted(kw.items())))

    def prepare(self, jobs) -> None:
        todo = list(
            {self._key(p, kw): (p, kw) for p, kw in jobs if self._key(p, kw) not in self._done}.items()
        )
        if not todo:
            return
        prompts = [p if isinstance(p, str) else list(p) for _, (p, _) in todo]
        params = [params_from_request(build_request("", **kw)) for _, (_, kw) in todo]
        loras = [kw.get("lora_adapter") or None for _, (_, kw) in todo]
        for (key, _), result in zip(
            todo, self.get_engine().generate(prompts, params, lora=loras), strict=True
        ):
            self._done[key] = result

    def __call__(self, prompt, field: str = "token_ids", **kw):
        self.prepare([(prompt, kw)])
        return getattr(self._done[self._key(prompt, kw)], field)


class Daemons:
    """The daemons one test starts; `stop_all` stops them (SIGTERM; SIGKILL past the drain)."""

    def __init__(self, model_path, log_dir):
        self.model_path, self.log_dir = model_path, log_dir
        self.started: list[Daemon] = []

    def add(self, daemon: Daemon) -> Daemon:
        self.started.append(daemon)
        return daemon

    def prefill(self, name: str, extra=()) -> Daemon:
        return self.add(prefill_server(self.model_path, self.log_dir, name=name, extra=extra))

    def decode(self, prefill: str, name: str, extra=()) -> Daemon:
        return self.add(decode_server(self.model_path, prefill, self.log_dir, name=name, extra=extra))

    def stop_all(self) -> dict[str, int]:
        """Exit codes of the daemons that were not killed on purpose (0 after a clean drain)."""
        codes = {}
        for daemon in reversed(self.started):
            code = daemon.terminate()
            if not daemon.killed:
                codes[daemon.name] = code
        return codes


def not_in_use(s: admin_pb2.ServerStats) -> bool:
    """No request runs or receives KV, every block is free or held only by the prefix cache (reclaimable,
    not leaked), and no host tier slot is staged for a stream."""
    return (
        s.num_free_blocks + s.num_cached_blocks == s.num_blocks
        and s.num_running == 0
        and s.num_incoming == 0
        and s.num_host_staged_blocks == 0
    )


def wait_all_free(address: str, timeout: float = 40.0) -> admin_pb2.ServerStats:
    """A daemon's stats once every block is free or cached and nothing runs (cleanup after cancels and broken
    streams may still be under way: polls), or the last stats after `timeout`."""
    client = Client(address)
    try:
        deadline = time.monotonic() + timeout
        while True:
            s = client.stats()
            idle = not_in_use(s)
            if idle or time.monotonic() > deadline:
                return s
            time.sleep(0.05)
    finally:
        client.close()


def assert_all_free(*addresses: str) -> None:
    for address in addresses:
        s = wait_all_free(address)
        assert not_in_use(s), (address, s)


@contextlib.contextmanager
def in_process(start) -> Iterator[str]:
    """A daemon's `serve()` on a thread of this process, over an engine of this process: yields its address
    and drains it on exit. `start(stop, on_ready)` returns the coroutine, e.g.
    `lambda stop, ready: serve(PrefillService.for_engine(engine), 0, stop, on_ready=ready)`."""
    ready: queue.Queue[str] = queue.Queue()
    server = ServerThread(lambda stop: start(stop, ready.put))
    try:
        yield ready.get(timeout=120)
    finally:
        server.stop()


class OTLPCollector:
    """An OTLP/gRPC trace collector on a loopback port of the test process (OpenTelemetry's own proto
    service): the spans daemons export to `endpoint`, as (service name, span) pairs."""

    def __init__(self):
        from concurrent import futures

        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as pb
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as pb_grpc

        received: queue.Queue = queue.Queue()

        class Collector(pb_grpc.TraceServiceServicer):
            def Export(self, request, context):  # noqa: N802 - the proto's name
                received.put(request)
                return pb.ExportTraceServiceResponse()

        self._received = received
        self._spans: list = []
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        pb_grpc.add_TraceServiceServicer_to_server(Collector(), self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()
        self.endpoint = f"http://127.0.0.1:{port}"

    def spans(self, trace_id: bytes, until, timeout_s: float = 30.0) -> list:
        """The (service, span) pairs of trace `trace_id` received, once `until(pairs)` holds (AssertionError
        after `timeout_s`)."""
        deadline = time.monotonic() + timeout_s
        while True:
            with contextlib.suppress(queue.Empty):
                while True:
                    request = self._received.get_nowait()
                    for resource_spans in request.resource_spans:
                        attributes = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                        for scope_spans in resource_spans.scope_spans:
                            self._spans += [(attributes.get("service.name"), s) for s in scope_spans.spans]
            found = [(service, s) for service, s in self._spans if s.trace_id == trace_id]
            if until(found):
                return found
            if time.monotonic() > deadline:
                raise AssertionError(f"trace {trace_id.hex()}: {[(svc, s.name) for svc, s in found]}")
            time.sleep(0.2)

    def stop(self) -> None:
        self._server.stop(0)
