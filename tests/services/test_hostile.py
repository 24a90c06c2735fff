"""Hostile input against the real daemons (the shared prefill-server and decode-server), one end-to-end
example per API: each bad request gets INVALID_ARGUMENT / HTTP 400 naming the field, never a 500; duplicate
request ids never meet; a client that goes away frees its blocks on both sides; and afterwards the daemon
serves a normal request with the colocated engine's tokens. (The breadth is at the validation level:
tests/services/test_limits.py and tests/services/test_request_validation.py.)"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import time

import grpc
import pytest

from pdserve.services.client import Client, build_request
from pdserve.testing.launch import scrape
from tests.helpers import assert_all_free

pytestmark = pytest.mark.daemon

GREEDY = dict(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(top_k=2**31), "top_k"),  # killed the engine thread (int32 overflow in the sampler)
        (dict(top_k=2**32 - 1), "top_k"),
        (dict(repetition_penalty=1e-45), "repetition_penalty"),  # 0 in float32: NaN in the answer
        (dict(temperature=1e-45), "temperature"),
        (dict(seed=2**64 - 1), "seed"),
        (dict(logprobs=2**32 - 1), "logprobs"),
        (dict(stop=["ab"] * 65), "stop"),
        (dict(stop=["x" * 513]), "stop"),
        (dict(request_id="forged\nINFO line"), "request_id"),
        (dict(request_id="x" * 257), "request_id"),
        # fan-out (the shared decode server: max_num_seqs 32, so --max-n defaults to 16)
        (dict(n=17), "n"),
        (dict(n=16, max_tokens=10_000), "n"),  # n x max_tokens past --max-n-tokens
        (dict(allowed_token_ids=[5] * 49_153), "allowed_token_ids"),  # more than the vocabulary
        (dict(allowed_token_ids=[3] * 2_000_000, n=8), "allowed_token_ids"),  # the 2 MB request
    ],
)
def test_hostile_generate_requests_are_invalid_argument(decode, kwargs, field):
    with pytest.raises(grpc.RpcError) as err:
        list(Client(decode.address).stream(build_request("hi", **kwargs), timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert err.value.details().startswith(field), err.value.details()


def test_a_chat_past_the_size_limit_is_refused_before_rendering(decode):
    chat = [{"role": "user", "content": "x" * 20_000}]  # over 16 characters a token of max_model_len
    with pytest.raises(grpc.RpcError) as err:
        list(Client(decode.address).stream(build_request(chat=chat), timeout=60))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "chat" in err.value.details()


def test_duplicate_request_ids_never_meet(decode, prefill, colocated):
    prompts = [f"Story {i}: the fox and the owl went" for i in range(4)]
    colocated.prepare([(p, GREEDY) for p in prompts])
    client = Client(decode.address)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda p: client.generate(p, request_id="same-id", **GREEDY), prompts))
    assert [r.token_ids for r in results] == [colocated(p, **GREEDY) for p in prompts]
    assert_all_free(decode.address, prefill.address)


def _post(address: str, path: str, body, headers=None) -> tuple[int, dict, dict]:
    connection = http.client.HTTPConnection(address, timeout=120)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    connection.request("POST", path, data, {"Content-Type": "application/json", **(headers or {})})
    response = connection.getresponse()
    payload = response.read()
    connection.close()
    return response.status, dict(response.getheaders()), json.loads(payload or b"{}")


CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", {"prompt": "Hi", "top_k": 2**31}, "top_k"),
        ("/v1/completions", {"prompt": "Hi", "repetition_penalty": 1e-46}, "repetition_penalty"),
        ("/v1/completions", {"prompt": "Hi", "stop": ["a"] * 65}, "stop"),
        (
            "/v1/completions",
            {"prompt": "Hi", "stream": True, "stream_options": ["include_usage"]},
            "stream_options",
        ),
        ("/v1/completions", {"prompt": "Hi", "n": True}, "n"),
        ("/v1/completions", {"prompt": "Hi", "n": 17}, "n"),
        ("/v1/completions", {"prompt": "Hi", "allowed_token_ids": [1] * 300_000}, "allowed_token_ids"),
        ("/v1/completions", {"prompt": "Hi", "max_tokens": "16"}, "max_tokens"),
        (
            "/v1/chat/completions",
            {**CHAT, "messages": [{"role": "user", "content": "x" * 20_000}]},
            "messages",
        ),
        (
            "/v1/chat/completions",
            {
                **CHAT,
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": "f"},
            },
            "tool_choice",
        ),
        ("/v1/chat/completions/render", {"messages": [{"role": "tool", "content": 3}]}, "messages"),
    ],
)
def test_hostile_http_bodies_are_400_naming_the_field(decode, path, body, param):
    status, _, answer = _post(decode.addresses["http"], path, body)
    assert status == 400 and answer["error"]["param"] == param, answer


def test_deeply_nested_json_and_a_bad_request_id_header_are_400(decode):
    address = decode.addresses["http"]
    status, _, answer = _post(
        address, "/v1/completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    )
    assert status == 400 and "nested" in answer["error"]["message"]
    status, _, answer = _post(address, "/v1/completions", {"prompt": "Hi"}, {"X-Request-Id": "x" * 300})
    assert status == 400 and answer["error"]["param"] == "X-Request-Id"
    status, _, answer = _post(address, "/v1/completions", {"prompt": "Hi"}, {"X-Request-Timeout": "-1"})
    assert status == 400 and answer["error"]["param"] == "X-Request-Timeout"


def test_a_request_past_its_http_deadline_is_504_and_freed(decode, prefill):
    address = decode.addresses["http"]
    body = {"prompt": "Count:", "max_tokens": 900, "ignore_eos": True, "temperature": 0}
    status, _, answer = _post(address, "/v1/completions", body, {"X-Request-Timeout": "0.5"})
    assert status == 504 and "deadline" in answer["error"]["message"]
    assert_all_free(decode.address, prefill.address)


def test_http_clients_that_go_away_free_their_blocks_on_both_sides(decode, prefill):
    """Streamed and not: the connection closes while the request generates; the handler is cancelled,
    the request aborted (outcome "abort"), and its blocks are free on both daemons."""
    address = decode.addresses["http"]
    metrics = decode.addresses["metrics"]
    aborted = 'pdserve_requests_total{outcome="abort",role="decode"}'
    before = scrape(metrics).get(aborted, 0)
    body = {"prompt": "Count to a thousand:", "max_tokens": 900, "ignore_eos": True, "temperature": 0}
    for stream in (True, False):
        connection = http.client.HTTPConnection(address, timeout=120)
        payload = json.dumps({**body, "stream": stream}).encode()
        connection.request("POST", "/v1/completions", payload, {"Content-Type": "application/json"})
        if stream:
            response = connection.getresponse()
            assert response.status == 200
            response.fp.readline()  # the first chunk: it is generating
        else:
            deadline = time.monotonic() + 60
            while Client(decode.address).stats().num_running == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
        connection.sock.close()
        connection.close()
    deadline = time.monotonic() + 60
    while scrape(metrics).get(aborted, 0) < before + 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert scrape(metrics).get(aborted, 0) >= before + 2
    assert_all_free(decode.address, prefill.address)


def test_a_request_of_n_at_the_limit_leaves_slots_for_a_later_one(decode, prefill):
    """n at --max-n's default (half the sequence slots) with long outputs: a request that arrives after it
    is admitted and streams its tokens while the n sequences still decode, and ends first."""
    client = Client(decode.address)
    wide = client.stream(
        build_request("Once upon a time", n=16, max_tokens=64, temperature=1.0, seed=1, ignore_eos=True)
    )
    first = next(wide)  # the n sequences are decoding
    assert first.token_ids
    victim = client.generate("The sky is", **GREEDY)
    running = client.stats().num_running  # the n sequences, still decoding after the victim ended
    assert victim.finish_reason == "length" and len(victim.token_ids) == GREEDY["max_tokens"]
    assert running >= 1
    assert sum(1 for _ in wide) > 0
    assert_all_free(decode.address, prefill.address)


def test_health_answers_while_the_largest_answer_is_built(decode, prefill):
    """The largest answer the limits allow for a 900-token prompt (its logprobs, 20 a position, echoed
    with n = 12 choices: 226,800 of the 262,144 entries) is rendered and serialized off the event loop:
    /health keeps answering (within a readiness probe's 3 s) while it is built and sent."""
    import threading

    prompt = list(range(1000, 1900))
    body = {"prompt": prompt, "max_tokens": 1, "n": 12, "prompt_logprobs": 20, "echo": True, "logprobs": 1}
    done, answer = threading.Event(), {}

    def large():
        answer["status"], _, answer["body"] = _post(decode.addresses["http"], "/v1/completions", body)
        done.set()

    thread = threading.Thread(target=large)
    thread.start()
    latencies = []
    while not done.is_set():
        connection = http.client.HTTPConnection(decode.addresses["http"], timeout=30)
        start = time.perf_counter()
        connection.request("GET", "/health")
        assert connection.getresponse().status == 200
        latencies.append(time.perf_counter() - start)
        connection.close()
        time.sleep(0.05)
    thread.join()
    assert answer["status"] == 200 and len(answer["body"]["choices"]) == 12
    choices = answer["body"]["choices"]
    assert all(len(c["prompt_logprobs"]) == len(prompt) for c in choices)
    assert choices[0]["prompt_logprobs"] == choices[11]["prompt_logprobs"]
    assert latencies and max(latencies) < 3.0, latencies
    assert_all_free(decode.address, prefill.address)


def test_after_all_that_the_daemon_serves_as_the_colocated_engine(decode, colocated):
    prompt = "Paris is the capital of France. Berlin is the capital of"
    assert Client(decode.address).generate(prompt, **GREEDY).token_ids == colocated(prompt, **GREEDY)
