"""Issue 29's benchmark: the TPOT of normal streams while hostile traffic arrives, against the same streams
alone, on real daemons (a prefill-server, and a decode-server with the HTTP API on it); and what
validating a request costs against its TTFT.

    .venv/bin/python bench/bench_hostile.py [--rounds 3] [--tokens 48] [--json OUT]

Rounds alternate alone / hostile, so that the shared machine's drift hits both alike. Each round runs 8
greedy streams of `--tokens` tokens (128-token prompts, no shared prefix) over gRPC; their inter-token gaps
give TPOT p50 and p99. The hostile traffic, from threads of this process while the 8 streams run:
  * max-size stop lists: valid requests carrying the limit of stop strings (64 of 512 characters), two at
    a time, decoding in the same batch as the 8 streams;
  * max-size chat bodies: OpenAI chat requests just under the character limit (16 x max_model_len), one
    token each, two at a time (rendered and tokenized off the event loop);
  * slow Prefill readers: Prefill streams of 768-token prompts opened straight on the prefill server, each
    reading a message every 5 s (the KV they leave waiting is cut loose after the lease);
  * a flood of invalid requests: top_k = 2**31 over gRPC and over HTTP, as fast as two threads send them.
Validation: services.sampling.Limits.check + SamplingParams.validate + the request id, per request, against
the median TTFT of a 128-token prompt measured in the same run.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import http.client
import json
import statistics
import sys
import tempfile
import threading
import time
import timeit
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_disagg import prompt  # noqa: E402  bench/ is on the path
from bench_engine import report  # noqa: E402

STREAMS = 8
PROMPT_TOKENS = 128


def _streams(client, tokens: int, salt: int) -> list[float]:
    """8 concurrent greedy streams; every inter-token gap (seconds) of all of them."""
    from services.client import build_request

    def one(i: int) -> list[float]:
        request = build_request(prompt(PROMPT_TOKENS, salt * 100 + i), max_tokens=tokens, ignore_eos=True)
        times = [time.perf_counter() for _ in client.stream(request, timeout=600)]
        return list(np.diff(times[1:]))  # after the first token: the decode steps

    with concurrent.futures.ThreadPoolExecutor(STREAMS) as pool:
        return [gap for gaps in pool.map(one, range(STREAMS)) for gap in gaps]


class Hostile:
    """The hostile traffic's threads (started, then stopped after the streams)."""

    def __init__(self, decode, prefill, limits, max_chars: int, layout):
        self.decode, self.prefill, self.limits = decode, prefill, limits
        self.max_chars, self.layout = max_chars, layout
        self.stop = threading.Event()
        self.counts: dict[str, int] = {"stop_lists": 0, "chat_bodies": 0, "slow_readers": 0, "invalid": 0}
        self.threads = [
            threading.Thread(target=fn, daemon=True)
            for fn in (
                self._stop_lists,
                self._stop_lists,
                self._chat_bodies,
                self._chat_bodies,
                self._slow_reader,
                self._slow_reader,
                self._invalid_grpc,
                self._invalid_http,
            )
        ]

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(60)

    def _loop(self, name: str, fn) -> None:
        while not self.stop.is_set():
            with contextlib.suppress(Exception):  # refusals are what they are for
                fn()
            self.counts[name] += 1

    def _stop_lists(self) -> None:
        from services.client import Client

        client = Client(self.decode.address)
        stops = [f"{i:03d}" + "z" * (self.limits.max_stop_string_chars - 3) for i in range(64)]
        text = prompt(PROMPT_TOKENS, 777)
        self._loop("stop_lists", lambda: client.generate(text, max_tokens=16, ignore_eos=True, stop=stops))

    def _chat_bodies(self) -> None:
        words = ("lorem ipsum dolor sit amet " * (self.max_chars // 27))[: self.max_chars - 64]
        body = {"messages": [{"role": "user", "content": words}], "max_tokens": 1}
        self._loop("chat_bodies", lambda: _post(self.decode.addresses["http"], "/v1/chat/completions", body))

    def _slow_reader(self) -> None:
        import grpc

        from pdserve.v1 import prefill_pb2 as pb
        from services import wire

        channel = grpc.insecure_channel(self.prefill.address)
        handshake = channel.unary_unary(
            "/pdserve.v1.Prefill/Handshake",
            request_serializer=pb.HandshakeRequest.SerializeToString,
            response_deserializer=pb.HandshakeResponse.FromString,
        )
        call = channel.unary_stream(
            "/pdserve.v1.Prefill/Prefill",
            request_serializer=pb.PrefillRequest.SerializeToString,
            response_deserializer=wire.deserialize_prefill_message,
        )
        fingerprint = handshake(
            pb.HandshakeRequest(layout_json=self.layout.to_json()), timeout=30
        ).fingerprint

        def read_slowly():
            request = pb.PrefillRequest(
                request_id="slow-reader", prompt_ids=prompt(768, self.counts["slow_readers"] + 1000)
            )
            request.layout_fingerprint = fingerprint
            stream = call(request, timeout=120)
            for _ in stream:
                if self.stop.wait(5.0):
                    stream.cancel()
                    return

        self._loop("slow_readers", read_slowly)

    def _invalid_grpc(self) -> None:
        from services.client import Client

        client = Client(self.decode.address)
        self._loop("invalid", lambda: client.generate("hi", top_k=2**31, max_tokens=4))

    def _invalid_http(self) -> None:
        body = {"prompt": "hi", "top_k": 2**31}
        self._loop("invalid", lambda: _post(self.decode.addresses["http"], "/v1/completions", body))


def _post(address: str, path: str, body: dict) -> int:
    connection = http.client.HTTPConnection(address, timeout=120)
    connection.request("POST", path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    status = connection.getresponse().status
    connection.close()
    return status


def _percentiles(gaps: list[float]) -> dict:
    ms = np.asarray(gaps) * 1e3
    return {"p50_ms": float(np.percentile(ms, 50)), "p99_ms": float(np.percentile(ms, 99)), "n": len(ms)}


def validation_cost(limits, ttft_s: float) -> dict:
    """Seconds per request of the checks at the door, against `ttft_s` (a 128-token prompt's TTFT)."""
    from engine.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=1, stop=("\n\n", "Question:"))

    def check():
        limits.check_request_id("client-request-1234")
        limits.check(params)
        params.validate(49152, 20)

    n = 20_000
    per_request = min(timeit.repeat(check, number=n, repeat=5)) / n
    return {
        "validation_us": per_request * 1e6,
        "ttft_ms": ttft_s * 1e3,
        "fraction_of_ttft": per_request / ttft_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()

    from engine.config import EngineConfig
    from engine.models import DEFAULT_MODEL, fetch, load_model
    from services.client import Client
    from services.kv import model_layout
    from services.launch import ENGINE_ARGS, decode_server, prefill_server
    from services.sampling import Limits

    gguf = fetch(DEFAULT_MODEL, progress=False)
    logs = Path(tempfile.mkdtemp())
    config = dataclasses.replace(EngineConfig(max_model_len=1024, num_blocks=192), dtype="float32")
    layout = model_layout(load_model(gguf).config, config)
    pf = prefill_server(gguf, logs, engine_args=ENGINE_ARGS)
    dc = decode_server(gguf, pf.address, logs, engine_args=ENGINE_ARGS, extra=["--http-port", "0"])
    limits = Limits()
    try:
        client = Client(dc.address)
        _streams(client, 4, salt=0)  # compile the shapes of both phases once
        with Hostile(dc, pf, limits, config.max_prompt_chars, layout):
            _streams(client, 4, salt=1)
        alone, hostile, counts = [], [], {}
        for r in range(args.rounds):
            alone += _streams(client, args.tokens, salt=10 + 2 * r)
            with Hostile(dc, pf, limits, config.max_prompt_chars, layout) as h:
                hostile += _streams(client, args.tokens, salt=11 + 2 * r)
            counts = {k: counts.get(k, 0) + v for k, v in h.counts.items()}
        ttft = statistics.median(
            client.generate(prompt(PROMPT_TOKENS, 500 + i), max_tokens=1).ttft_s for i in range(5)
        )
        a, b = _percentiles(alone), _percentiles(hostile)
        results = {
            "alone": a,
            "hostile": b,
            "ratio_p50": b["p50_ms"] / a["p50_ms"],
            "ratio_p99": b["p99_ms"] / a["p99_ms"],
            "hostile_requests": counts,
            "still_serving": client.generate("ok", max_tokens=1).completion_tokens == 1,
            "validation": validation_cost(limits, ttft),
        }
        report(results, args.json)
    finally:
        dc.terminate()
        pf.terminate()


if __name__ == "__main__":
    main()
