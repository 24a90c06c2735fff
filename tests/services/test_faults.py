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

from pdserve.services.client import Client, build_request
from pdserve.testing.launch import ENGINE_ARGS, EPHEMERAL_KV_EVENTS, HOST_TIER_ARGS, Daemon, prefill_server
from tests.helpers import wait_all_free

pytestmark = pytest.mark.daemon

REPORT = os.environ.get("PDSERVE_RELIABILITY_REPORT")  # where to write the figures (RELIABILITY.md)
WORDS = ["river", "lantern", "owl", "copper", "meadow", "signal", "harbor", "quartz", "ember", "violet"]


def make_prompts(n: int, seed: int) -> list[str]:
    """Prompts of 60-120 words."""
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(60, 120))) for _ in range(n)]


@pytest.fixture(scope="module")
def reference(colocated):
    """`reference(prompt, n)`: the colocated engine's first n greedy tokens (EOS ignored);
    `reference.prepare(prompts, n)` computes many in one batch."""

    def tokens(prompt, n: int) -> list[int]:
        return colocated(prompt, max_tokens=n, ignore_eos=True)

    tokens.prepare = lambda prompts, n: colocated.prepare(
        [(p, dict(max_tokens=n, ignore_eos=True)) for p in prompts]
    )
    return tokens


@pytest.fixture(scope="module")
def faulty(model_path, log_dir):
    argv = ["--model", str(model_path), "--port", "0", "--no-warmup", *EPHEMERAL_KV_EVENTS, *ENGINE_ARGS]
    argv += HOST_TIER_ARGS
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


def test_kill_cancel_corrupt_restart_vanish(prefill, faulty, reference, daemons):
    """A decode server with three replicas (healthy, doomed, faulty) under concurrent load with cancels:
    the doomed replica is SIGKILLed once it is serving, restarted on its port and used again; at the end the
    decode server itself is SIGKILLed mid-stream and every prefill replica frees what it held."""
    doomed = daemons.prefill("prefill-doomed", extra=HOST_TIER_ARGS)
    doomed_port = doomed.address.rsplit(":", 1)[1]
    replicas = f"{prefill.address},{doomed.address},{faulty.address}"
    decode = daemons.decode(replicas, "decode-faults", extra=["--max-num-seqs", "16", *HOST_TIER_ARGS])
    client = Client(decode.address)
    prompts, more = (
        make_prompts(24, seed=1),
        make_prompts(12, seed=3),
    )  # rounds of the faulty server's 6 modes
    reference.prepare(prompts + more, 12)  # first (in this process), so the load runs without pauses

    def kill_under_load():
        doomed_client = Client(doomed.address)
        while doomed_client.stats().num_requests_total < 1:  # it is serving: kill it (SIGKILL)
            time.sleep(0.02)
        doomed.kill()

    first = run_load(
        client,
        prompts,
        reference,
        0.2,
        seed=2,
        on_start=lambda: threading.Thread(target=kill_under_load).start(),
    )
    # the killed replica comes back on the same port; the decode server reconnects to it
    restarted = daemons.prefill("prefill-restarted", extra=["--port", doomed_port, *HOST_TIER_ARGS])
    time.sleep(4)  # past the failed replica's back-off and the channel's reconnect back-off
    second = run_load(client, more, reference, 0.2, seed=4)
    assert Client(restarted.address).stats().num_requests_total > 0  # the pool uses the restarted replica
    decode_stats = wait_all_free(decode.address)
    for address in (decode.address, prefill.address, faulty.address, restarted.address):
        s = wait_all_free(address)
        assert s.num_free_blocks + s.num_cached_blocks == s.num_blocks and s.num_running == 0, (address, s)
    for counts in (first, second):
        assert counts["wrong"] == 0 and not counts["errors"], counts
        assert counts["finished_equal"] + counts["cancelled"] == counts["requests"]
    assert decode_stats.num_transfer_failures_total >= 5  # the faulty replica's streams and the kill
    assert decode.proc.poll() is None and prefill.proc.poll() is None and faulty.proc.poll() is None
    # the decode server vanishes with requests in flight: the prefill side frees everything
    calls = [
        client.stub.Generate(build_request(p, max_tokens=200, ignore_eos=True))
        for p in make_prompts(4, seed=6)
    ]
    next(iter(calls[0]))  # at least one request is decoding
    decode.kill()
    for call in calls:
        call.cancel()
    for address in (prefill.address, faulty.address, restarted.address):
        s = wait_all_free(address)
        assert s.num_free_blocks + s.num_cached_blocks == s.num_blocks and s.num_running == 0, (address, s)
    if REPORT:
        with open(REPORT, "a") as f:
            record = {
                "test": "kill_cancel_corrupt_restart_vanish",
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
            f.write(json.dumps(record) + "\n")


def test_unavailable_when_nothing_can_prefill(faulty, daemons):
    """Only a faulty replica and no local fallback: a clear UNAVAILABLE, nothing decoded, nothing leaked."""
    decode = daemons.decode(faulty.address, "decode-nofallback", extra=["--no-fallback-local"])
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
    assert s.num_free_blocks + s.num_cached_blocks == s.num_blocks


def test_overload_is_resource_exhausted_then_sigterm_drains(prefill, daemons):
    """A decode server with 40 blocks and a queue of one: refusals are RESOURCE_EXHAUSTED with a retry hint,
    nothing leaks; then SIGTERM during a stream: the stream completes and the server exits 0."""
    extra = ["--max-queue", "1", "--num-blocks", "40", "--max-num-seqs", "2"]
    decode = daemons.decode(prefill.address, "decode-overload", extra=extra)
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
    assert s.num_free_blocks + s.num_cached_blocks == s.num_blocks
    call = client.stub.Generate(build_request("Once upon a time", max_tokens=48, ignore_eos=True))
    stream = iter(call)
    tokens = list(next(stream).token_ids)
    decode.proc.send_signal(15)
    tokens += [t for r in stream for t in r.token_ids]
    assert len(tokens) == 48  # finished within the grace period
    assert decode.terminate() == 0


def test_damaged_kv_frames_are_never_decoded(faulty, daemons, reference, loaded_model):
    """A damaged first frame (a header byte; a payload byte and a cut), a replica that dies after a frame of
    a long prompt (the frame already inserted, the trailer never sent), and a damaged frame of a delta
    transfer (the decode server holds the conversation's head), and a trailer whose first token is outside
    the vocabulary are detected end to end: the request is
    prefilled again elsewhere (here: locally, in the same blocks) and its tokens equal the colocated
    engine's; nothing leaks. (Any damage to any frame: the assembler fuzz in
    tests/kvtransfer/test_codec.py.)"""
    decode = daemons.decode(faulty.address, "decode-fuzz")
    client = Client(decode.address)
    damages = [(9, 0xFF, 0), (4000, 0x01, 7)]
    for prompt, (offset, xor, cut) in zip(make_prompts(2, seed=8), damages, strict=True):  # other prompts:
        damage = f"fuzz:{offset}:{xor}:{cut}"  # a repeat would be served from the decode server's cache
        assert client.generate(prompt, max_tokens=4, ignore_eos=True, request_id=damage).token_ids == (
            reference(prompt, 4)
        )
    long_prompt = " ".join(make_prompts(6, seed=21))
    assert len(loaded_model.tokenizer.encode(long_prompt)) > 2 * 256  # three prefill chunks
    # the replica dies after its first frame is streamed (and inserted). The test model's 4 layers put
    # about 40 blocks in a 4 MiB frame, so that frame is the whole prompt's: the stream dies before its
    # trailer, not between two prompt chunks as with the whole model's 5-block frames
    died = client.generate(long_prompt, max_tokens=4, ignore_eos=True, request_id="die:1:long")
    assert died.token_ids == reference(long_prompt, 4)
    head = make_prompts(1, seed=22)[0]
    client.generate(head, max_tokens=4, ignore_eos=True)  # whatever the replica does, decode caches it
    turn = head + " " + make_prompts(1, seed=23)[0]
    damaged = client.generate(turn, max_tokens=4, ignore_eos=True, request_id="fuzz:4000:1:0")
    assert damaged.token_ids == reference(turn, 4) and damaged.cached_prompt_tokens > 0
    # a trailer whose first token is out of range (the detokenizer or the sampler would fail on it)
    for bad, prompt in zip((-1, 49152), make_prompts(2, seed=24), strict=True):
        result = client.generate(prompt, max_tokens=4, ignore_eos=True, request_id=f"badtoken:{bad}")
        assert result.token_ids == reference(prompt, 4)
    # KV computed for another prompt of the same length (the header says which: PrefillHeader.prompt_digest)
    other = make_prompts(1, seed=25)[0]
    result = client.generate(other, max_tokens=4, ignore_eos=True, request_id="otherprompt")
    assert result.token_ids == reference(other, 4)
    # none of that KV entered the decode server's prefix cache: asked again, the prompts hit it (whole
    # blocks of the KV computed again in their place) and still give the colocated engine's tokens
    for prompt in (make_prompts(2, seed=8)[0], other):
        again = client.generate(prompt, max_tokens=4, ignore_eos=True)
        assert again.token_ids == reference(prompt, 4) and again.cached_prompt_tokens > 0
    assert client.stats().num_transfer_failures_total >= 7
    s = wait_all_free(decode.address)
    assert s.num_free_blocks + s.num_cached_blocks == s.num_blocks


def test_a_replica_with_other_weights_under_the_same_name_is_never_used(
    daemons, model_path, tmp_path, reference
):
    """A rolling update: a prefill server on other weights in a folder of the same name (so the same model
    name) is refused at its handshake (the KV layout names the weights' digest); the decode server prefills
    itself and its tokens are the colocated engine's."""
    import shutil

    from safetensors.numpy import load_file, save_file

    other = tmp_path / "update" / model_path.name
    shutil.copytree(model_path, other)
    for shard in other.glob("*.safetensors"):
        tensors = load_file(str(shard))
        tensors = {k: v * 1.01 if ".mlp." in k else v for k, v in tensors.items()}
        save_file(tensors, str(shard))
    replica = daemons.add(prefill_server(other, daemons.log_dir, name="prefill-updated"))
    decode = daemons.decode(replica.address, "decode-before-update")
    prompt = make_prompts(1, seed=26)[0]
    assert Client(decode.address).generate(prompt, max_tokens=4, ignore_eos=True).token_ids == reference(
        prompt, 4
    )
    assert Client(replica.address).stats().num_requests_total == 0
