"""A supervised engine, in a real decode-server process (tests/faulty_engine.py's engine, built to fail on
purpose): a failure pinned to one request is INTERNAL for it while the others get their tokens; when the
engine itself breaks, the daemon reports NOT_SERVING (gRPC health and HTTP /health), fails every waiting
call at once with UNAVAILABLE and exits 4, for Kubernetes to restart it."""

from __future__ import annotations

import concurrent.futures
import time
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.daemons import EXIT_ENGINE_FAILED
from pdserve.services.client import Client, build_request
from pdserve.testing.launch import ENGINE_ARGS, EPHEMERAL_KV_EVENTS, Daemon
from tests.faulty_engine import BROKEN, PINNED

pytestmark = [pytest.mark.daemon, pytest.mark.standalone]  # starts every daemon it uses

GREEDY = dict(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = ["The three primary colours are", "def quicksort(xs):"]


def _http_health(address: str) -> int:
    try:
        return urllib.request.urlopen(f"http://{address}/health", timeout=5).status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return -1


def test_a_pinned_failure_fails_one_request_and_a_broken_engine_ends_the_daemon(
    model_path, log_dir, colocated
):
    argv = ["--model", str(model_path), "--port", "0", "--no-warmup", "--prefill", "local"]
    argv += ["--http-port", "0", *EPHEMERAL_KV_EVENTS, *ENGINE_ARGS]
    daemon = Daemon(argv, "faulty-decode", log_dir, entry="tests.faulty_engine:main")
    try:
        client = Client(daemon.address)
        colocated.prepare([(p, GREEDY) for p in PROMPTS])
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            normal = [pool.submit(client.generate, p, **GREEDY) for p in PROMPTS]
            pinned = pool.submit(client.generate, "Hello", stop=[PINNED], **GREEDY)
            with pytest.raises(grpc.RpcError) as e:
                pinned.result()
            assert e.value.code() == grpc.StatusCode.INTERNAL and "injected" in e.value.details()
            assert [f.result().token_ids for f in normal] == [colocated(p, **GREEDY) for p in PROMPTS]

        # the engine breaks while a stream is running: that stream fails at once, not at its deadline
        health = health_pb2_grpc.HealthStub(grpc.insecure_channel(daemon.address))
        running = client.stream(build_request("Count:", max_tokens=900, ignore_eos=True), timeout=300)
        next(running)
        with pytest.raises(grpc.RpcError) as e:
            client.generate("x", stop=[BROKEN], timeout=300)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(grpc.RpcError) as e:
            for _ in running:
                pass
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "engine" in e.value.details()

        seen, http_seen = set(), set()
        while daemon.proc.poll() is None:
            try:
                seen.add(health.Check(health_pb2.HealthCheckRequest(), timeout=2).status)
            except grpc.RpcError:
                seen.add("gone")
            http_seen.add(_http_health(daemon.addresses["http"]))
            time.sleep(0.02)
        assert health_pb2.HealthCheckResponse.NOT_SERVING in seen
        assert (
            health_pb2.HealthCheckResponse.SERVING not in seen and 503 in http_seen and 200 not in http_seen
        )
        assert daemon.proc.wait(30) == EXIT_ENGINE_FAILED
        log = daemon.log_path.read_text()
        assert "engine failed" in log and "injected: the device is gone" in log
    finally:
        if daemon.proc.poll() is None:
            daemon.kill()
        daemon.log.close()
