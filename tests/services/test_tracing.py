"""OpenTelemetry traces (services/tracing.py) from the session's daemons, exported to a collector in the test
process: a request the caller sends under its own span is one trace: the decode server's `generate` under
the caller's span, one child span per phase of its time to first token (`ttft.queue`, ...), and the prefill
server's `prefill` under the generate span (its traceparent carried in the Prefill call's metadata); over
HTTP the same from the `traceparent` header."""

from __future__ import annotations

import json
import os
import urllib.request

import pytest

from pdserve.services.client import Client, build_request

pytestmark = pytest.mark.daemon

PHASES = tuple(f"ttft.{p}" for p in ("queue", "prefill", "kv", "insert", "first_output"))


def traceparent() -> tuple[str, bytes, bytes]:
    trace_id, span_id = os.urandom(16), os.urandom(8)
    return f"00-{trace_id.hex()}-{span_id.hex()}-01", trace_id, span_id


def complete(spans) -> bool:
    names = [s.name for _, s in spans]
    return "generate" in names and "prefill" in names and all(p in names for p in PHASES)


def test_a_grpc_request_is_one_trace_from_the_callers_span_to_the_prefill_server(decode, otlp_collector):
    header, trace_id, caller = traceparent()
    client = Client(decode.address)
    request = build_request(list(range(300, 380)), max_tokens=4, ignore_eos=True, request_id="traced-1")
    responses = list(client.stub.Generate(request, timeout=60, metadata=(("traceparent", header),)))
    assert sum(len(r.token_ids) for r in responses) == 4
    spans = otlp_collector.spans(trace_id, complete)
    by_name = {}
    for service, span in spans:
        by_name.setdefault(span.name, []).append((service, span))
    [(service, generate)] = by_name["generate"]
    assert service == "pdserve-decode" and generate.parent_span_id == caller
    attributes = {a.key: a.value for a in generate.attributes}
    assert attributes["pdserve.request_id"].string_value == "traced-1"
    assert attributes["pdserve.outcome"].string_value == "length"
    assert attributes["pdserve.prompt_tokens"].int_value == 80
    assert attributes["pdserve.output_tokens"].int_value == 4
    phases = [span for name in PHASES for service, span in by_name[name] if service == "pdserve-decode"]
    assert [s.name for s in phases] == list(PHASES)
    assert all(s.parent_span_id == generate.span_id for s in phases)
    assert all(
        a.end_time_unix_nano == b.start_time_unix_nano for a, b in zip(phases, phases[1:], strict=False)
    )
    assert generate.start_time_unix_nano <= phases[0].start_time_unix_nano
    assert phases[-1].end_time_unix_nano <= generate.end_time_unix_nano
    [prefill] = [span for service, span in by_name["prefill"] if service == "pdserve-prefill"]
    assert prefill.parent_span_id == generate.span_id
    assert {a.key: a.value for a in prefill.attributes}["pdserve.outcome"].string_value == "ok"


def test_an_http_request_joins_the_trace_of_its_traceparent_header(decode, otlp_collector):
    header, trace_id, caller = traceparent()
    with urllib.request.urlopen(f"http://{decode.addresses['http']}/v1/models", timeout=30) as response:
        model = json.loads(response.read())["data"][0]["id"]
    body = json.dumps({"model": model, "prompt": [5, 6, 7, 8] * 20, "max_tokens": 2}).encode()
    call = urllib.request.Request(
        f"http://{decode.addresses['http']}/v1/completions",
        body,
        {"Content-Type": "application/json", "traceparent": header},
    )
    with urllib.request.urlopen(call, timeout=60) as response:
        assert json.loads(response.read())["usage"]["completion_tokens"] == 2
    spans = otlp_collector.spans(trace_id, complete)
    [generate] = [s for _, s in spans if s.name == "generate"]
    assert generate.parent_span_id == caller
