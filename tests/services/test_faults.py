"""Fault injection with real processes: a prefill replica killed with SIGKILL under load, 20% of requests
cancelled at random moments, a prefill server that sends corrupted / truncated / duplicated frames, drops
trailers or dies mid-stream, a prefill server that restarts, a decode server that vanishes, overload and
SIGTERM drains. Every request that was not cancelled either finishes with the colocated engine's tokens or
gets a clear error, no daemon crashes, and every KV block is free again on every side."""

from __future__ import annotations

import concurrent.futures
import json
import os
import random
import threading
import time

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.sampling_params import SamplingParams
from pdserve.v1 import admin_pb2, admin_pb2_grpc
from services.client import Client, build_request
from services.launch import ENGINE_ARGS, Daemon, decode_server, prefill_server

REPORT = os.environ.get("PDSERVE_RELIABILITY_REPORT")  # where to write the figures (RELIABILITY.md)
WORDS = ["river", "lantern", "owl", "copper", "meadow", "signal", "harbor", "quartz", "ember", "violet"]


def make_prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(60, 200))) for _ in range(n)]


def stats(address: str) -> admin_pb2.ServerStats:
    with grpc.insecure_channel(address) as channel:
        return admin_pb2_grpc.AdminStub(channel).GetStats(admin_pb2.GetStatsRequest(), timeout=10)


def wait_all_free(address: str, timeout: float = 40.0) -> admin_pb2.ServerStats:
    """Blocks are freed by cleanup that may still be running (stream breaks, keepalive): poll."""
    deadline = time.monotonic() + timeout
    while True:
        s = stats(address)
        if (
            s.num_free_blocks == s.num_blocks and s.num_running == 0 and s.num_incoming == 0
        ) or time.monotonic() > deadline:
            return s


@pytest.fixture(scope="module")
def reference(make_engine, loaded_model):
    engine = make_engine()
    cache = {}

    def tokens(text: str, max_tokens: int) -> list[int]:
        key = (text, max_tokens)
        if key not in cache:
            ids = loaded_model.tokenizer.encode(text)
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            cache[key] = engine.generate([ids], params)[0].token_ids
        return cache[key]

    return tokens


@pytest.fixture(scope="module")
def faulty(gguf_path, log_dir):
    argv = ["--model", str(gguf_path), "--port", "0", "--no-warmup", *ENGINE_ARGS]
    daemon = Daemon(argv, "faulty-prefill", log_dir, entry="tests.services.faulty_prefill:main")
    yield daemon
    assert daemon.terminate() == 0


def run_load(client: Client, prompts: list[str], reference, cancel_fraction: float, seed: int, on_start=None):
    """Runs prompts concurrently; cancels a fraction at random moments. Returns counters."""
    rng = random.Random(seed)
    plan = [
        (p, rng.random() < cancel_fraction, rng.choice([0.0, 0.05, 0.3, 1.0]), rng.randint(0, 6))
        for p in prompts
    ]
    counts = {"requests": len(prompts), "cancelled": 0, "finished_equal": 0, "wrong": 0, "errors": []}
    lock = threading.Lock()

    def one(item):
        prompt, cancel, delay, after = item
        call = client.stub.Generate(build_request(prompt, max_tokens=12, ignore_eos=True), timeout=300)
        if cancel:
            timer = threading.Timer(delay, call.cancel)
            timer.start()
        tokens = []
        try:
            for response in call:
                tokens += response.token_ids
                if cancel and len(tokens) >= after:
                    call.cancel()
        except grpc.RpcError as e:
            with lock:
                if e.code() == grpc.StatusCode.CANCELLED and cancel:
                    counts["cancelled"] += 1
                else:
                    counts["errors"].append(f"{e.code().name}: {e.details()}")
            return
        with lock:
            if cancel and len(tokens) < 12:
                counts["cancelled"] += 1
            elif tokens == reference(prompt, 12):
                counts["finished_equal"] += 1
            else:
                counts["wrong"] += 1

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        futures = [pool.submit(one, item) for item in plan]
        if on_start:
            on_start()
        for f in futures:
            f.result()
    return counts


def test_kill_cancel_corrupt_restart(gguf_path, log_dir, prefill, faulty, reference):
    doomed = prefill_server(gguf_path, log_dir, name="prefill-doomed")
    doomed_port = doomed.address.rsplit(":", 1)[1]
    decode = decode_server(
        gguf_path,
        f"{prefill.address},{doomed.address},{faulty.address}",
        log_dir,
        name="decode-faults",
        extra=["--max-num-seqs", "16"],
    )
    client = Client(decode.address)
    prompts = make_prompts(40, seed=1)
    for p in prompts:  # reference tokens first (in this process), so the load runs without pauses
        reference(p, 12)

    def kill_soon():
        time.sleep(1.5)
        doomed.kill()  # SIGKILL under load

    first = run_load(
        client, prompts, reference, 0.2, seed=2, on_start=lambda: threading.Thread(target=kill_soon).start()
    )
    # the killed replica comes back on the same port; the decode server reconnects to it
    restarted = prefill_server(gguf_path, log_dir, name="prefill-restarted", extra=["--port", doomed_port])
    time.sleep(4)  # past the failed replica's back-off and the channel's reconnect back-off
    second = run_load(client, make_prompts(16, seed=3), reference, 0.2, seed=4)
    try:
        assert stats(restarted.address).num_requests_total > 0  # the pool uses the restarted replica
        decode_stats = wait_all_free(decode.address)
        for address in (decode.address, prefill.address, faulty.address, restarted.address):
            s = wait_all_free(address)
            assert s.num_free_blocks == s.num_blocks and s.num_running == 0, (address, s)
        for counts in (first, second):
            assert counts["wrong"] == 0 and not counts["errors"], counts
            assert counts["finished_equal"] + counts["cancelled"] == counts["requests"]
        assert decode_stats.num_transfer_failures_total >= 5  # the faulty replica's streams and the kill
        assert decode.proc.poll() is None and prefill.proc.poll() is None and faulty.proc.poll() is None
        if REPORT:
            with open(REPORT, "a") as f:
                f.write(
                    json.dumps(
                        {
                            "test": "kill_cancel_corrupt_restart",
                            "requests": first["requests"] + second["requests"],
                            "cancelled": first["cancelled"] + second["cancelled"],
                            "finished_equal_to_colocated": first["finished_equal"] + second["finished_equal"],
                            "wrong_outputs": first["wrong"] + second["wrong"],
                            "errors": first["errors"] + second["errors"],
                            "transfer_failures_retried": decode_stats.num_transfer_failures_total,
                            "prefill_killed": 1,
                            "prefill_restarted": 1,
                            "leaked_blocks": 0,
                            "crashes": 0,
                        }
                    )
                    + "\n"
                )
    finally:
        assert decode.terminate() == 0
        assert restarted.terminate() == 0


def test_unavailable_when_nothing_can_prefill(gguf_path, log_dir, faulty):
    """Only a faulty replica and no local fallback: a clear UNAVAILABLE, nothing decoded, nothing leaked."""
    decode = decode_server(
        gguf_path, faulty.address, log_dir, name="decode-nofallback", extra=["--no-fallback-local"]
    )
    try:
        client = Client(decode.address)
        outcomes = []
        for prompt in make_prompts(6, seed=5):  # the faulty server cycles through its 6 modes
            try:
                outcomes.append(len(client.generate(prompt, max_tokens=4, ignore_eos=True).token_ids))
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.UNAVAILABLE and "prefill" in e.details()
                outcomes.append("unavailable")
        assert outcomes.count("unavailable") == 5 and outcomes.count(4) == 1, outcomes
        s = wait_all_free(decode.address)
        assert s.num_free_blocks == s.num_blocks
    finally:
        assert decode.terminate() == 0


def test_decode_side_vanishing_frees_prefill_blocks(gguf_path, log_dir, prefill):
    decode = decode_server(gguf_path, prefill.address, log_dir, name="decode-vanishing")
    client = Client(decode.address)
    calls = [
        client.stub.Generate(build_request(p, max_tokens=200, ignore_eos=True))
        for p in make_prompts(4, seed=6)
    ]
    next(iter(calls[0]))  # at least one request is decoding
    decode.kill()
    for call in calls:
        call.cancel()
    s = wait_all_free(prefill.address)
    assert s.num_free_blocks == s.num_blocks and s.num_running == 0


def test_overload_is_resource_exhausted_with_a_retry_hint(gguf_path, log_dir, prefill):
    decode = decode_server(
        gguf_path,
        prefill.address,
        log_dir,
        name="decode-overload",
        extra=["--max-queue", "1", "--num-blocks", "40", "--max-num-seqs", "2"],
    )
    try:
        client = Client(decode.address)
        prompts = make_prompts(10, seed=7)

        def one(prompt):
            try:
                client.generate(prompt, max_tokens=24, ignore_eos=True)
                return "ok"
            except grpc.RpcError as e:
                hint = dict(e.trailing_metadata() or ()).get("retry-after-ms")
                return (e.code(), hint)

        with concurrent.futures.ThreadPoolExecutor(10) as pool:
            outcomes = list(pool.map(one, prompts))
        refused = [o for o in outcomes if o != "ok"]
        assert "ok" in outcomes and refused, outcomes
        assert all(code == grpc.StatusCode.RESOURCE_EXHAUSTED and hint for code, hint in refused)
        s = wait_all_free(decode.address)
        assert s.num_free_blocks == s.num_blocks
    finally:
        assert decode.terminate() == 0


def test_sigterm_drains_in_flight_requests(gguf_path, log_dir, prefill):
    decode = decode_server(gguf_path, prefill.address, log_dir, name="decode-drain")
    client = Client(decode.address)
    call = client.stub.Generate(build_request("Once upon a time", max_tokens=48, ignore_eos=True))
    stream = iter(call)
    tokens = list(next(stream).token_ids)
    decode.proc.send_signal(15)
    tokens += [t for r in stream for t in r.token_ids]
    assert len(tokens) == 48  # finished within the grace period
    assert decode.terminate() == 0


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(offset=st.integers(0, 10_000), xor=st.integers(1, 255), cut=st.sampled_from([0, 0, 1, 7, 100]))
def test_fuzzed_kv_frames_are_never_decoded(fuzz_decode, reference, offset, xor, cut):
    """A damaged first frame (any byte, any truncation) is detected: the request is prefilled again
    elsewhere (here: locally) and its tokens equal the colocated engine's."""
    client, prompt = fuzz_decode
    result = client.generate(prompt, max_tokens=4, ignore_eos=True, request_id=f"fuzz:{offset}:{xor}:{cut}")
    assert result.token_ids == reference(prompt, 4)


@pytest.fixture(scope="module")
def fuzz_decode(gguf_path, log_dir, faulty):
    decode = decode_server(gguf_path, faulty.address, log_dir, name="decode-fuzz")
    yield Client(decode.address), make_prompts(1, seed=8)[0]
    s = wait_all_free(decode.address)
    assert s.num_free_blocks == s.num_blocks
    assert decode.terminate() == 0


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    text=st.one_of(st.none(), st.text(max_size=200)),
    ids=st.lists(st.integers(-5, 60_000), max_size=40),
    temperature=st.floats(allow_nan=True, allow_infinity=True, width=32),
    top_p=st.one_of(st.none(), st.floats(-1, 2, width=32)),
    top_k=st.integers(0, 100_000),
    max_tokens=st.integers(0, 5000),
    logprobs=st.one_of(st.none(), st.integers(0, 100)),
    stop=st.lists(st.text(max_size=5), max_size=3),
)
def test_fuzzed_generate_requests_get_an_answer(
    fuzz_decode, text, ids, temperature, top_p, top_k, max_tokens, logprobs, stop
):
    client, _ = fuzz_decode
    request = build_request(
        text if text is not None else ids,
        max_tokens=min(max_tokens, 8) if max_tokens else 0,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        logprobs=logprobs,
        stop=stop,
    )
    if max_tokens > 8:
        request.max_tokens = max_tokens
    try:
        for _ in client.stream(request, timeout=120):
            pass
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details())
    assert client.generate("still up", max_tokens=1).completion_tokens == 1
