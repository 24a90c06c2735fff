"""Daemon surface: health and reflection, model info, layout handshake, conditional disaggregation, bad
input answered with INVALID_ARGUMENT (and the daemon keeps serving)."""

from __future__ import annotations

import dataclasses
import json

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pdserve.services.client import Client, build_request
from pdserve.testing.launch import decode_server
from pdserve.v1 import prefill_pb2


@pytest.fixture(scope="module")
def conditional(model_path, prefill, log_dir):
    daemon = decode_server(
        model_path, prefill.address, log_dir, name="conditional", extra=["--local-prefill-below", "16"]
    )
    yield daemon
    assert daemon.terminate() == 0


def requests_served(address: str) -> int:
    return Client(address).stats().num_requests_total


@pytest.mark.daemon
def test_health_and_reflection(prefill, conditional):
    for address, service in (
        (prefill.address, "pdserve.v1.Prefill"),
        (conditional.address, "pdserve.v1.Generation"),
    ):
        with grpc.insecure_channel(address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            for name in ("", service):
                status = health.Check(health_pb2.HealthCheckRequest(service=name)).status
                assert status == health_pb2.HealthCheckResponse.SERVING
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            reply = next(
                stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
            )
            names = {s.name for s in reply.list_services_response.service}
            assert {service, "pdserve.v1.Admin", "grpc.health.v1.Health"} <= names


@pytest.mark.daemon
def test_model_info(conditional, loaded_model):
    info = Client(conditional.address).model_info()
    assert info.vocab_size == 49152 and info.max_model_len == 1024
    assert info.num_layers == loaded_model.config.num_layers == 4  # the test model
    assert info.prefill_mode == "conditional:16"


@pytest.mark.daemon
def test_short_prompts_are_prefilled_locally(prefill, conditional, loaded_model):
    client = Client(conditional.address)
    before = requests_served(prefill.address)
    short = client.generate("Hi there", max_tokens=4, ignore_eos=True)
    assert requests_served(prefill.address) == before and len(short.token_ids) == 4
    long_prompt = "The quick brown fox jumps over the lazy dog. " * 4
    assert len(loaded_model.tokenizer.encode(long_prompt)) >= 16
    client.generate(long_prompt, max_tokens=4)
    assert requests_served(prefill.address) == before + 1


@pytest.mark.daemon
def test_layout_mismatch_is_failed_precondition_naming_the_field(prefill, make_engine):

    layout = make_engine().kv_layout
    other = dataclasses.replace(layout, dtype="bfloat16", block_size=32)
    with grpc.insecure_channel(prefill.address) as channel:
        handshake = channel.unary_unary(
            "/pdserve.v1.Prefill/Handshake",
            request_serializer=prefill_pb2.HandshakeRequest.SerializeToString,
            response_deserializer=prefill_pb2.HandshakeResponse.FromString,
        )
        reply = handshake(prefill_pb2.HandshakeRequest(layout_json=layout.to_json()))
        assert json.loads(reply.layout_json)["model"] == layout.model
        with pytest.raises(grpc.RpcError) as err:
            handshake(prefill_pb2.HandshakeRequest(layout_json=other.to_json()))
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "dtype" in err.value.details() and "block_size" in err.value.details()
        with pytest.raises(grpc.RpcError) as err:
            handshake(prefill_pb2.HandshakeRequest(layout_json=layout.to_json(), kv_events_key="not a key"))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "kv_events_key" in err.value.details()


@pytest.mark.daemon
def test_a_prefill_servers_kv_events_are_read_only_with_a_key_given_in_the_handshake(prefill, make_engine):
    """The events carry prompts' token ids: from loopback, a reader without a key (or with one the server
    was not given) gets no answer from the replay socket; one whose key came in a Handshake gets the
    server's history."""
    import asyncio

    from pdserve.services.decode.prefix_index import replay
    from pdserve.services.kv_events_zmq import CurveKeys, ReaderCredentials

    keys, stranger = CurveKeys.generate(), CurveKeys.generate()
    with grpc.insecure_channel(prefill.address) as channel:
        handshake = channel.unary_unary(
            "/pdserve.v1.Prefill/Handshake",
            request_serializer=prefill_pb2.HandshakeRequest.SerializeToString,
            response_deserializer=prefill_pb2.HandshakeResponse.FromString,
        )
        layout = make_engine().kv_layout.to_json()
        reply = handshake(
            prefill_pb2.HandshakeRequest(layout_json=layout, kv_events_key=keys.public.decode())
        )
    publisher_key = reply.kv_events_key.encode()
    assert len(publisher_key) == 40
    endpoint = f"tcp://127.0.0.1:{reply.kv_events_replay_port}"
    assert endpoint == f"tcp://{prefill.addresses['kv-events-replay']}"
    for credentials in (None, ReaderCredentials(stranger, publisher_key)):
        with pytest.raises(TimeoutError):
            asyncio.run(replay(endpoint, 0, 1.0, credentials))
    batches = asyncio.run(replay(endpoint, 0, 10.0, ReaderCredentials(keys, publisher_key)))
    assert batches[0][0] == 0  # from the first batch (AllBlocksCleared) on


@pytest.mark.daemon
@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(prompt=""), "prompt"),
        (dict(prompt=[1, 2, 10**6]), "prompt_token_ids"),
        (dict(prompt="hi", temperature=-1.0), "temperature"),
        (dict(prompt="hi", temperature=float("nan")), "temperature"),
        (dict(prompt="hi", top_p=1.5), "top_p"),
        (dict(prompt="hi", max_tokens=5000), "max_tokens"),
        (dict(prompt=None), "prompt"),
        (dict(prompt="x" * 20_000), "prompt"),
    ],
)
def test_bad_input_is_invalid_argument(conditional, kwargs, field):
    client = Client(conditional.address)
    prompt = kwargs.pop("prompt")
    with pytest.raises(grpc.RpcError) as err:
        list(client.stream(build_request(prompt, **kwargs)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in err.value.details()
    assert client.generate("Still serving", max_tokens=2).completion_tokens == 2


@pytest.mark.fast
def test_dns_targets_resolve_to_every_address():
    from pdserve.services.decode.routing import PrefillPool

    assert PrefillPool.resolve("10.0.0.1:50051") == ["10.0.0.1:50051"]
    resolved = PrefillPool.resolve("dns:///localhost:50051")
    assert "127.0.0.1:50051" in resolved and all(r.endswith(":50051") for r in resolved)


@pytest.mark.daemon
def test_invalid_utf8_is_invalid_argument(conditional):
    """A string field that is not UTF-8 (hand-encoded: field 2 `text`) is refused, naming the problem."""
    with grpc.insecure_channel(conditional.address) as channel:
        generate = channel.unary_stream("/pdserve.v1.Generation/Generate", request_serializer=None)
        raw = b"\x12\x03\xff\xfe\xfd"  # GenerateRequest.text = b"\xff\xfe\xfd"
        with pytest.raises(grpc.RpcError) as err:
            list(generate(raw, timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "UTF-8" in err.value.details()
    assert Client(conditional.address).generate("ok", max_tokens=1).completion_tokens == 1
