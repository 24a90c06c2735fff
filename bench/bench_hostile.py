"""Issue 29's benchmark: the TPOT of normal streams while hostile traffic arrives, against the same streams
alone, on real daemons (a prefill-server, and a decode-server with the HTTP API on it); and what
validating a request costs against its TTFT.

    .venv/bin/python bench/bench_hostile.py [--rounds 3] [--tokens 48] [--json OUT] [--smoke]

Rounds alternate alone / hostile, so that the shared machine's drift hits both alike. Each round runs 8
greedy streams of `--tokens` tokens (128-token prompts, no shared prefix) over gRPC; their inter-token gaps
give TPOT p50 and p99. Both phases also run two companion requests in the same batch (so the batch has the
same shape): plain in the alone phase, hostile in the other. The hostile traffic, from threads of this
process while the 8 streams run, each at a fixed rate (`--rate-scale` multiplies them; the daemons and
this client share the machine's cores, so an unbounded flood measures the client's own CPU as well):
  * max-size stop lists: the two companions carry the limit of stop strings (64 of 512 characters);
  * max-size chat bodies: OpenAI chat requests at the character limit (16 x max_model_len characters),
    2/s (rendered and tokenized off the event loop, then refused: past the model length);
  * slow Prefill readers: two Prefill streams of 768-token prompts opened straight on the prefill server,
    each reading a message every 5 s (the KV they leave waiting is cut loose after the lease);
  * a flood of invalid requests: top_k = 2**31, 50/s over gRPC and 50/s over HTTP.
The prefill server and this client share core 0, the decode server has core 1 to itself (one role per
device, as deployed). Validation: services.sampling.Limits.check + SamplingParams.validate + the request
id, per request, against the median TTFT of a 128-token prompt measured in the same run.

Issue 48's fan-out cases (`--fanout`): daemons with default sizes (max_num_seqs 32, so --max-n 16; the KV
cache sized by the default rule), a victim that streams 48 greedy tokens of a 128-token prompt again and
again (TTFT and inter-token gaps: p50 and p99) alone and beside each attacker in turn, rounds alternating:
  * n_max: one request at --max-n's default (n = 16), max_tokens 256, ignore_eos, started again when it ends;
  * allowed_ids: 2,000,000 allowed_token_ids (all below 128) with n = 8, one a second (refused by name now);
  * prompt_logprobs: the largest /v1/completions answer the limits allow for a 4,000-token prompt
    (prompt_logprobs 20 with n = 3: 252,000 entries; n = 32 is refused), back to back; /health is probed
    every 0.2 s meanwhile and its worst latency reported;
  * sixteen_streams: the control of n_max, 16 requests of n = 1 (same lengths) from 16 clients: what 16
    more sequences in each step cost the victim whoever sent them;
  * long_prompt: the control of prompt_logprobs, the same 4,000-token prompt without logprobs or n, back
    to back, each a new prompt (what any long prompt costs the victim: the prefill server's token budget,
    the KV inserted).

--smoke: the test model, one round of 4-token streams (with --fanout too: then the tests' engine sizes).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import http.client
import json
import os
import statistics
import tempfile
import threading
import time
import timeit
from pathlib import Path

import numpy as np

from pdserve.bench.common import ratio, report
from pdserve.bench.prompts import random_prompt
from pdserve.testing.models import bench_model

STREAMS = 8
PROMPT_TOKENS = 128


def _streams(client, tokens: int, salt: int) -> list[float]:
    """8 concurrent greedy streams; every inter-token gap (seconds) of all of them."""
    from pdserve.services.client import build_request

    def one(i: int) -> list[float]:
        request = build_request(
            random_prompt(PROMPT_TOKENS, salt * 100 + i), max_tokens=tokens, ignore_eos=True
        )
        times = [time.perf_counter() for _ in client.stream(request, timeout=600)]
        return list(np.diff(times[1:]))  # after the first token: the decode steps

    with concurrent.futures.ThreadPoolExecutor(STREAMS) as pool:
        return [gap for gaps in pool.map(one, range(STREAMS)) for gap in gaps]


class Hostile:
    """The hostile traffic's threads (started, then stopped after the streams)."""

    KINDS = ("stop_lists", "chat_bodies", "slow_readers", "invalid")

    def __init__(
        self, decode, prefill, limits, max_chars: int, layout, hostile: bool = True, scale=1.0, only=KINDS
    ):
        self.decode, self.prefill, self.limits = decode, prefill, limits
        self.max_chars, self.layout, self.scale = max_chars, layout, scale
        self.stop = threading.Event()
        self.counts: dict[str, int] = {"stop_lists": 0, "chat_bodies": 0, "slow_readers": 0, "invalid": 0}
        kinds = {
            "chat_bodies": (self._chat_bodies,),
            "slow_readers": (self._slow_reader, self._slow_reader),
            "invalid": (self._invalid_grpc, self._invalid_http),
        }
        others = tuple(fn for kind, fns in kinds.items() if kind in only for fn in fns)
        companions = (self._companion, self._companion)
        self.hostile = hostile and "stop_lists" in only  # the companions carry the stop lists
        self.threads = [
            threading.Thread(target=fn, daemon=True) for fn in companions + (others if hostile else ())
        ]

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(60)

    def _loop(self, name: str, fn, per_s: float | None = None) -> None:
        """fn() again and again until stopped, at most `per_s` times a second (scaled)."""
        period = 1.0 / (per_s * self.scale) if per_s else 0.0
        while not self.stop.is_set():
            started = time.perf_counter()
            with contextlib.suppress(Exception):  # refusals are what they are for
                fn()
            self.counts[name] += 1
            if period:
                self.stop.wait(max(0.0, period - (time.perf_counter() - started)))

    def _companion(self) -> None:
        """A request decoding beside the 8 streams: with the limit of stop strings when hostile."""
        from pdserve.services.client import Client

        client = Client(self.decode.address)
        limit, chars = self.limits.max_stop_strings, self.limits.max_stop_string_chars
        stops = [f"{i:03d}" + "z" * (chars - 3) for i in range(limit)] if self.hostile else None
        text = random_prompt(PROMPT_TOKENS, 777)
        self._loop("stop_lists", lambda: client.generate(text, max_tokens=16, ignore_eos=True, stop=stops))

    def _chat_bodies(self) -> None:
        words = ("lorem ipsum dolor sit amet " * (self.max_chars // 27))[
            : self.max_chars - 400
        ]  # rendered: <= max
        body = {"messages": [{"role": "user", "content": words}], "max_tokens": 1}
        address = self.decode.addresses["http"]
        self._loop("chat_bodies", lambda: _post(address, "/v1/chat/completions", body), per_s=2)

    def _slow_reader(self) -> None:
        import grpc

        from pdserve.services import wire
        from pdserve.v1 import prefill_pb2 as pb

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
                request_id="slow-reader", prompt_ids=random_prompt(768, self.counts["slow_readers"] + 1000)
            )
            request.layout_fingerprint = fingerprint
            stream = call(request, timeout=120)
            for _ in stream:
                if self.stop.wait(5.0):
                    stream.cancel()
                    return

        self._loop("slow_readers", read_slowly)

    def _invalid_grpc(self) -> None:
        from pdserve.services.client import Client

        client = Client(self.decode.address)
        self._loop("invalid", lambda: client.generate("hi", top_k=2**31, max_tokens=4), per_s=50)

    def _invalid_http(self) -> None:
        body = {"prompt": "hi", "top_k": 2**31}
        self._loop("invalid", lambda: _post(self.decode.addresses["http"], "/v1/completions", body), per_s=50)


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
    from pdserve.engine.sampling_params import SamplingParams

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


FANOUT = ("n_max", "allowed_ids", "prompt_logprobs", "long_prompt", "sixteen_streams")


class Attacker:
    """One of the fan-out cases (FANOUT), sending from threads until closed; `health_s`: the /health
    latencies seen meanwhile (the prompt_logprobs case)."""

    def __init__(self, kind: str, decode):
        self.kind, self.decode = kind, decode
        self.stop, self.threads = threading.Event(), []
        self.outcomes: dict[str, int] = {}
        self.health_s: list[float] = []
        self.sent = 0  # long prompts sent

    def __enter__(self) -> Attacker:
        target = {
            "n_max": self._wide,
            "allowed_ids": self._ids,
            "prompt_logprobs": self._logprobs,
            "long_prompt": self._long,
            "sixteen_streams": self._sixteen,
        }[self.kind]
        self.threads = [threading.Thread(target=self._guard, args=(target,), daemon=True)]
        if self.kind in ("prompt_logprobs", "long_prompt"):
            self.threads.append(threading.Thread(target=self._health, daemon=True))
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=600)

    def _guard(self, target) -> None:
        while not self.stop.is_set():
            try:
                outcome = target()
            except Exception as e:  # noqa: BLE001 - counted: a refusal is an outcome
                outcome = e.code().name if hasattr(e, "code") else type(e).__name__
            self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    def _wide(self) -> str:
        from pdserve.services.client import Client, build_request

        request = build_request("Once upon a time", n=16, max_tokens=256, temperature=1.0, ignore_eos=True)
        Client(self.decode.address).generate_sequences(request, timeout=900)
        return "n16_done"

    def _ids(self) -> str:
        from pdserve.services.client import Client, build_request

        start = time.perf_counter()
        try:
            ids = [i % 128 for i in range(2_000_000)]
            Client(self.decode.address).generate_sequences(build_request("hi", allowed_token_ids=ids, n=8))
        finally:
            self.stop.wait(max(0.0, 1.0 - (time.perf_counter() - start)))
        return "served"

    def _logprobs(self) -> str:
        body = {"prompt": random_prompt(4000, 7), "max_tokens": 1, "n": 3, "prompt_logprobs": 20}
        return f"http_{_post(self.decode.addresses['http'], '/v1/completions', body)}"

    def _sixteen(self) -> str:
        from pdserve.services.client import Client

        client = Client(self.decode.address)
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            list(
                pool.map(
                    lambda i: client.generate(
                        f"Story {i}:", max_tokens=256, temperature=1.0, ignore_eos=True
                    ),
                    range(16),
                )
            )
        return "16_done"

    def _long(self) -> str:
        self.sent += 1  # a new prompt each time, as prompt logprobs read no prefix cache
        body = {"prompt": random_prompt(4000, 1000 + self.sent), "max_tokens": 1}
        return f"http_{_post(self.decode.addresses['http'], '/v1/completions', body)}"

    def _health(self) -> None:
        while not self.stop.is_set():
            connection = http.client.HTTPConnection(self.decode.addresses["http"], timeout=120)
            start = time.perf_counter()
            connection.request("GET", "/health")
            connection.getresponse().read()
            self.health_s.append(time.perf_counter() - start)
            connection.close()
            self.stop.wait(0.2)


def _victim(client, rounds: int, tokens: int, salt: int) -> tuple[list[float], list[float]]:
    """A greedy stream of `tokens` tokens, `rounds` times one after another: (TTFTs, inter-token gaps)."""
    from pdserve.services.client import build_request

    ttfts, gaps = [], []
    for r in range(rounds):
        start = time.perf_counter()
        request = build_request(
            random_prompt(PROMPT_TOKENS, salt * 100 + r), max_tokens=tokens, ignore_eos=True
        )
        times = [time.perf_counter() for _ in client.stream(request, timeout=900)]
        ttfts.append(times[0] - start)
        gaps += list(np.diff(times))
    return ttfts, gaps


def fanout(args) -> dict:
    """The fan-out cases (module docstring), on daemons of default sizes."""
    from pdserve.services.client import Client
    from pdserve.testing.launch import ENGINE_ARGS, decode_server, prefill_server

    gguf = bench_model(args.smoke)
    logs = Path(tempfile.mkdtemp())
    os.sched_setaffinity(0, {0})
    sizes = ENGINE_ARGS if args.smoke else []
    pf = prefill_server(gguf, logs, engine_args=sizes, cpus="0")
    dc = decode_server(gguf, pf.address, logs, engine_args=sizes, extra=["--http-port", "0"], cpus="1")
    try:
        client = Client(dc.address)
        _victim(client, 1, 4, 0)  # compile the victim's shapes once
        alone = ([], [])
        cases = {kind: ([], [], {}, []) for kind in args.fanout}
        for r in range(args.rounds):
            for i, kind in enumerate(args.fanout):
                ttfts, gaps = _victim(client, 3, args.tokens, 10 + r * 10 + 2 * i)
                alone[0].extend(ttfts), alone[1].extend(gaps)
                with Attacker(kind, dc) as attacker:
                    time.sleep(3.0)  # under way
                    ttfts, gaps = _victim(client, 3, args.tokens, 11 + r * 10 + 2 * i)
                case = cases[kind]
                case[0].extend(ttfts), case[1].extend(gaps), case[3].extend(attacker.health_s)
                for k, v in attacker.outcomes.items():
                    case[2][k] = case[2].get(k, 0) + v
        a_ttft, a_gap = _percentiles(alone[0]), _percentiles(alone[1])
        results = {"alone": {"ttft": a_ttft, "itl": a_gap}}
        for kind, (ttfts, gaps, outcomes, health) in cases.items():
            t, g = _percentiles(ttfts), _percentiles(gaps)
            results[kind] = {
                "ttft": t,
                "itl": g,
                "ttft_p50_ratio": ratio(t["p50_ms"], a_ttft["p50_ms"]),
                "itl_p50_ratio": ratio(g["p50_ms"], a_gap["p50_ms"]),
                "itl_p99_ratio": ratio(g["p99_ms"], a_gap["p99_ms"]),
                "attacker_outcomes": outcomes,
                **({"health_max_s": max(health), "health_probes": len(health)} if health else {}),
            }
        results["engine"] = dict(client.stats().engine)
        return results
    finally:
        dc.terminate()
        pf.terminate()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rate-scale", type=float, default=1.0, help="multiplies the hostile rates")
    parser.add_argument("--only", nargs="+", choices=Hostile.KINDS, default=Hostile.KINDS, help="these kinds")
    parser.add_argument("--json", default=None)
    parser.add_argument("--fanout", nargs="*", choices=FANOUT, help="issue 48's fan-out cases instead")
    parser.add_argument("--smoke", action="store_true", help="the test model, one round of 4 tokens")
    args = parser.parse_args(argv)
    if args.smoke:
        args.rounds, args.tokens = 1, 4
    if args.fanout is not None:
        args.fanout = args.fanout or list(FANOUT)
        report(fanout(args), args.json)
        return

    from pdserve.engine.config import EngineConfig
    from pdserve.engine.loading.sources import load_model
    from pdserve.engine.model.kv_cache import kv_layout
    from pdserve.services.client import Client
    from pdserve.services.sampling import Limits
    from pdserve.testing.launch import ENGINE_ARGS, decode_server, prefill_server

    gguf = bench_model(args.smoke)
    logs = Path(tempfile.mkdtemp())
    config = dataclasses.replace(EngineConfig(max_model_len=1024, num_blocks=192), dtype="float32")
    layout = kv_layout(load_model(gguf).config, config)
    # as deployed, the roles do not share their devices: the prefill server and this client on core 0, the
    # decode server alone on core 1, so what the decode streams feel is the decode server's own handling
    # of the hostile traffic (on a CPU host the cores are the device)
    os.sched_setaffinity(0, {0})
    pf = prefill_server(gguf, logs, engine_args=ENGINE_ARGS, cpus="0")
    dc = decode_server(gguf, pf.address, logs, engine_args=ENGINE_ARGS, extra=["--http-port", "0"], cpus="1")
    limits = Limits()
    try:
        client = Client(dc.address)

        def phase(hostile: bool, salt: int, tokens: int) -> tuple[list[float], dict]:
            kinds = dict(hostile=hostile, scale=args.rate_scale, only=args.only)
            with Hostile(dc, pf, limits, config.max_prompt_chars, layout, **kinds) as h:
                return _streams(client, tokens, salt), h.counts

        phase(False, 0, 4)  # compile the shapes of both phases once
        phase(True, 1, 4)
        alone, hostile, counts = [], [], {}
        for r in range(args.rounds):
            alone += phase(False, 10 + 2 * r, args.tokens)[0]
            gaps, seen = phase(True, 11 + 2 * r, args.tokens)
            hostile += gaps
            counts = {k: counts.get(k, 0) + v for k, v in seen.items()}
        ttft = statistics.median(
            client.generate(random_prompt(PROMPT_TOKENS, 500 + i), max_tokens=1).ttft_s for i in range(5)
        )
        a, b = _percentiles(alone), _percentiles(hostile)
        results = {
            "alone": a,
            "hostile": b,
            "ratio_p50": ratio(b["p50_ms"], a["p50_ms"]),
            "ratio_p99": ratio(b["p99_ms"], a["p99_ms"]),
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
