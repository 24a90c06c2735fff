"""OpenTelemetry traces of a request's way through the daemons: `--otlp-traces-endpoint URL` (vLLM's flag
name) exports them over OTLP/gRPC; the `tracing` extra (opentelemetry-sdk and its OTLP exporter) provides
them. Off by default and free when off: nothing of OpenTelemetry is imported, and a request pays one
`is None` check.

A decode server makes one span per request, `generate` (service pdserve-decode), the child of the caller's
W3C `traceparent` (gRPC metadata, or the HTTP header) when it sends one, with a child span per phase of its
time to first token (`ttft.queue`, ...: services.decode.timeline's phases) and its outcome and token counts
as attributes. Its Prefill call carries the generate span's `traceparent` in the gRPC metadata, and the
prefill server (pdserve-prefill) makes `prefill` under it: one trace from the client's span to the prefill
server's work.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

TRACEPARENT = "traceparent"  # the W3C trace context header (gRPC metadata keys are lower case too)
EXPORT_DELAY_MS = 1000  # spans are batched and sent at most this long after they end
EXPORT_TIMEOUT_S = 5  # one export call to the collector


class Tracing:
    """The daemon's tracer: spans go to the OTLP collector at `endpoint` (http://HOST:PORT: plaintext;
    https:// or HOST:PORT: TLS) under the resource `service.name` = `service`."""

    def __init__(self, endpoint: str, service: str):
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError as e:
            raise SystemExit(
                f"--otlp-traces-endpoint needs the tracing extra (pip install 'pdserve[tracing]'): {e}"
            ) from None
        self.provider = TracerProvider(resource=Resource.create({"service.name": service}))
        # (a collector that is away costs a daemon at most EXPORT_TIMEOUT_S at exit, in shutdown)
        exporter = OTLPSpanExporter(
            endpoint=endpoint, insecure=endpoint.startswith("http://"), timeout=EXPORT_TIMEOUT_S
        )
        self.provider.add_span_processor(BatchSpanProcessor(exporter, schedule_delay_millis=EXPORT_DELAY_MS))
        self.tracer = self.provider.get_tracer("pdserve")
        self.propagator = TraceContextTextMapPropagator()
        # time.monotonic -> the wall clock spans are stamped in, read once: every span of a request on one
        # scale (each reading would differ from the next by the microseconds between its two clock reads)
        self._offset_ns = time.time_ns() - time.monotonic_ns()

    def _ns(self, monotonic_s: float) -> int:
        return int(monotonic_s * 1e9) + self._offset_ns

    def start(
        self, name: str, traceparent: str | None, attributes: Mapping[str, object], start: float | None = None
    ):
        """A span begun at `start` (time.monotonic; None: now), the child of `traceparent` (None or
        malformed: a new trace)."""
        parent = self.propagator.extract({TRACEPARENT: traceparent}) if traceparent else None
        at = self._ns(time.monotonic() if start is None else start)
        return self.tracer.start_span(name, context=parent, attributes=dict(attributes), start_time=at)

    def traceparent(self, span) -> str:
        """`span`'s context as a traceparent value, for the next hop's metadata."""
        from opentelemetry import trace

        carrier: dict[str, str] = {}
        self.propagator.inject(carrier, context=trace.set_span_in_context(span))
        return carrier[TRACEPARENT]

    def end(
        self, span, attributes: Mapping[str, object], phases: Mapping[str, tuple[float, float]] = {}
    ) -> None:
        """Ends `span` with `attributes` added, after a child span per phase: name -> (start, end) in
        time.monotonic seconds."""
        from opentelemetry import trace

        context = trace.set_span_in_context(span)
        for name, (start, end) in phases.items():
            child = self.tracer.start_span(f"ttft.{name}", context=context, start_time=self._ns(start))
            child.end(end_time=self._ns(end))
        span.set_attributes({k: v for k, v in attributes.items() if v is not None})
        span.end(end_time=self._ns(time.monotonic()))

    def shutdown(self) -> None:
        """Sends what is batched (a daemon's last requests' spans), then stops."""
        self.provider.shutdown()
