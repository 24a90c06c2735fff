"""`pdserve bench`: statistics as a pure function of records, the load loop against a fake client, and one
end-to-end run against a real decode-server."""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from pdserve.bench.clients import run_chats, run_load
from pdserve.bench.stats import RequestRecord, compute_stats, distribution, meets_slo, throughput_timeline
from pdserve.bench.workload import (
    LengthDist,
    SharedPrefix,
    arrival_times,
    load_dataset,
    make_chats,
    make_workload,
)
from pdserve.v1 import generation_pb2 as pb

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def record(index=0, start=0.0, times=(0.1, 0.2, 0.3), e2e=None, prompt=10, error=""):
    times = list(times)
    if e2e is None and not error:
        e2e = times[-1] + 0.01 if times else 0.05
    return RequestRecord(index, start, prompt, len(times), times, e2e, "length", error)


# --------------------------------------------------------------------------------------------------------
# Pure statistics


@pytest.mark.fast
def test_record_metrics():
    r = record(times=[0.5, 0.6, 0.8, 1.1])
    assert r.ttft_s == 0.5
    assert r.tpot_s == pytest.approx(0.2)  # (1.1 - 0.5) / 3
    assert r.itl_s == pytest.approx([0.1, 0.2, 0.3])
    assert r.output_tokens == 4 and r.ok


@pytest.mark.fast
def test_one_token_output_has_no_tpot_and_meets_tpot_slo():
    r = record(times=[0.3])
    assert r.tpot_s is None and r.itl_s == []
    assert meets_slo(r, 0.5, 0.001)
    assert not meets_slo(r, 0.1, None)  # TTFT still counts
    stats = compute_stats([r], duration_s=1.0, slo_ttft_ms=500, slo_tpot_ms=1)
    assert stats["tpot_ms"]["count"] == 0 and stats["tpot_ms"]["p50"] is None
    assert stats["goodput"] == 1.0


@pytest.mark.fast
def test_distribution_percentiles():
    d = distribution(list(range(1, 101)), scale=2.0)
    assert d["count"] == 100
    assert d["mean"] == pytest.approx(101.0)
    assert d["p50"] == pytest.approx(np.percentile(np.arange(1, 101) * 2.0, 50))
    assert d["p90"] == pytest.approx(180.2)
    assert d["p99"] == pytest.approx(198.02)
    assert d["min"] == 2.0 and d["max"] == 200.0
    assert distribution([])["mean"] is None


@pytest.mark.fast
def test_compute_stats_throughput_goodput_and_failures():
    records = [
        record(0, 0.0, [0.1, 0.2, 0.3]),  # TTFT 100 ms, TPOT 100 ms: good
        record(1, 0.5, [0.4, 0.45, 0.5]),  # TTFT 400 ms: misses the TTFT SLO
        record(2, 1.0, [0.05, 0.35, 0.65]),  # TPOT 300 ms: misses the TPOT SLO
        record(3, 1.5, [], error="UNAVAILABLE: down"),  # failed: never good, not in latencies
    ]
    stats = compute_stats(records, duration_s=2.0, slo_ttft_ms=200, slo_tpot_ms=150)
    assert stats["requests"] == 4 and stats["completed"] == 3 and stats["failed"] == 1
    assert stats["errors"] == ["UNAVAILABLE: down"]
    assert stats["request_throughput"] == pytest.approx(1.5)
    assert stats["output_tokens"] == 9 and stats["output_token_throughput"] == pytest.approx(4.5)
    assert stats["total_token_throughput"] == pytest.approx((9 + 30) / 2)
    assert stats["good_requests"] == 1 and stats["goodput"] == pytest.approx(0.5)
    assert stats["slo_attainment"] == pytest.approx(0.25)
    assert stats["ttft_ms"]["count"] == 3
    assert stats["ttft_ms"]["mean"] == pytest.approx((100 + 400 + 50) / 3)
    assert stats["tpot_ms"]["max"] == pytest.approx(300)
    assert stats["itl_ms"]["count"] == 6
    # one SLO only: the other is not applied
    assert compute_stats(records, 2.0, slo_ttft_ms=200)["good_requests"] == 2
    assert compute_stats(records, 2.0, slo_tpot_ms=150)["good_requests"] == 2
    assert "goodput" not in compute_stats(records, 2.0)


@pytest.mark.fast
def test_compute_stats_default_duration_and_empty():
    records = [record(0, 1.0, [0.1], e2e=0.5), record(1, 2.0, [0.1], e2e=1.0)]
    assert compute_stats(records)["duration_s"] == pytest.approx(2.0)  # first send 1.0 -> last end 3.0
    empty = compute_stats([], duration_s=0.0, slo_ttft_ms=1)
    assert empty["completed"] == 0 and empty["request_throughput"] is None and empty["goodput"] is None


@pytest.mark.fast
def test_throughput_timeline():
    records = [record(0, 0.0, [0.5, 1.5, 1.7], e2e=1.8), record(1, 1.0, [0.2, 2.5], e2e=2.6)]
    tl = throughput_timeline(records, bin_s=1.0)
    assert tl["t_s"] == [0.0, 1.0, 2.0, 3.0]
    assert tl["output_tokens_per_s"] == [1.0, 3.0, 0.0, 1.0]
    assert tl["requests_per_s"] == [0.0, 1.0, 0.0, 1.0]
    assert sum(tl["output_tokens_per_s"]) == 5


# --------------------------------------------------------------------------------------------------------
# Workload


@pytest.mark.fast
def test_length_dist():
    assert LengthDist.parse("fixed:128") == LengthDist(128, 128)
    d = LengthDist.parse("uniform:64:512")
    values = [d.sample(np.random.default_rng(i)) for i in range(200)]
    assert min(values) >= 64 and max(values) <= 512 and len(set(values)) > 50
    for bad in ("fixed", "fixed:x", "uniform:5", "uniform:9:3", "normal:1:2", "fixed:0"):
        with pytest.raises(ValueError):
            LengthDist.parse(bad)


@pytest.mark.fast
def test_workload_random_ids_exact_and_reproducible():
    a = list(zip(range(20), make_workload(LengthDist(8, 32), LengthDist(4, 4), seed=3), strict=False))
    b = list(zip(range(20), make_workload(LengthDist(8, 32), LengthDist(4, 4), seed=3), strict=False))
    assert [s.prompt for _, s in a] == [s.prompt for _, s in b]
    for i, spec in a:
        assert spec.index == i and 8 <= len(spec.prompt) <= 32 and spec.max_tokens == 4
        assert all(isinstance(t, int) and t >= 100 for t in spec.prompt)


@pytest.mark.fast
def test_dataset(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "Hello", "max_tokens": 7}\n\n{"prompt_ids": [5, 6, 7]}\n')
    entries = load_dataset(path)
    assert len(entries) == 2
    specs = [s for _, s in zip(range(4), make_workload(None, LengthDist(3, 3), 0, entries), strict=False)]
    assert sorted(str(s.prompt) for s in specs[:2]) == ["Hello", "[5, 6, 7]"]  # each once per pass
    for s in specs:
        assert s.max_tokens == (7 if s.prompt == "Hello" else 3)
    (tmp_path / "bad.jsonl").write_text('{"text": "x"}\n')
    with pytest.raises(ValueError, match="prompt"):
        load_dataset(tmp_path / "bad.jsonl")


# --------------------------------------------------------------------------------------------------------
# The load loop against a fake client (no server)


class FakeClient:
    """Streams max_tokens tokens, one per message, `gap` s apart; counts requests in flight."""

    def __init__(self, ttft=0.02, gap=0.005, fail_every=0):
        self.ttft, self.gap, self.fail_every = ttft, gap, fail_every
        self.lock = threading.Lock()
        self.in_flight = self.max_in_flight = self.calls = 0

    def stream(self, request, timeout=None):
        with self.lock:
            self.calls += 1
            call = self.calls
            self.in_flight += 1
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.fail_every and call % self.fail_every == 0:
                raise RuntimeError("boom")
            time.sleep(self.ttft)
            for i in range(request.max_tokens):
                if i:
                    time.sleep(self.gap)
                last = i == request.max_tokens - 1
                yield pb.GenerateResponse(
                    token_ids=[100 + i],
                    finish_reason=pb.FINISH_REASON_LENGTH if last else 0,
                    usage=pb.Usage(prompt_tokens=len(request.token_ids.ids), completion_tokens=i + 1)
                    if last
                    else None,
                )
        finally:
            with self.lock:
                self.in_flight -= 1


class RecordingClient(FakeClient):
    """FakeClient that keeps each prompt it was sent (its token ids)."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.prompts: list[list[int]] = []

    def stream(self, request, timeout=None):
        with self.lock:
            self.prompts.append(list(request.token_ids.ids))
        yield from super().stream(request, timeout)


@pytest.mark.fast
def test_run_load_concurrency():
    client = FakeClient()
    workload = make_workload(LengthDist(16, 16), LengthDist(5, 5), seed=0)
    records, wall = run_load(client, workload, num_requests=12, concurrency=3)
    assert len(records) == 12 and client.max_in_flight == 3
    assert all(r.ok and r.output_tokens == 5 and r.prompt_tokens == 16 for r in records)
    assert all(r.finish_reason == "length" for r in records)
    assert all(r.ttft_s >= 0.02 and r.e2e_s >= r.token_times_s[-1] for r in records)
    assert wall >= 4 * 0.04  # 4 rounds of ~0.04 s


@pytest.mark.fast
def test_run_load_poisson_rate_and_failures():
    client = FakeClient(ttft=0.01, gap=0.001, fail_every=5)
    workload = make_workload(LengthDist(4, 4), LengthDist(2, 2), seed=1)
    records, wall = run_load(client, workload, num_requests=40, rate=200.0, seed=1)
    assert len(records) == 40
    assert sum(not r.ok for r in records) == 8 and all("boom" in r.error for r in records if not r.ok)
    starts = [r.start_s for r in records]
    assert starts == sorted(starts)
    assert 0.05 < starts[-1] < 1.0  # 39 exponential gaps of mean 5 ms
    stats = compute_stats(records, wall, slo_ttft_ms=1000, slo_tpot_ms=1000)
    assert stats["good_requests"] == 32 and stats["failed"] == 8


@pytest.mark.fast
def test_bursty_arrivals_keep_the_rate_and_clump():
    """Gamma gaps of shape b (as vLLM's --burstiness): the same mean rate; a coefficient of variation of
    1 / sqrt(b); b = 1 is the Poisson stream as before (the same times for the same seed)."""
    poisson = list(itertools.islice(arrival_times(4.0, seed=3), 4000))
    assert poisson == list(itertools.islice(arrival_times(4.0, seed=3, burstiness=1.0), 4000))
    for burstiness in (0.25, 1.0, 4.0):
        gaps = np.diff(list(itertools.islice(arrival_times(4.0, seed=3, burstiness=burstiness), 4000)))
        assert gaps.mean() == pytest.approx(0.25, rel=0.1)
        assert gaps.std() / gaps.mean() == pytest.approx(burstiness**-0.5, rel=0.1)
    with pytest.raises(ValueError, match="burstiness"):
        next(arrival_times(1.0, burstiness=0.0))


@pytest.mark.fast
def test_a_conversations_turns_carry_the_conversation_so_far():
    """run_chats: each turn's prompt is every prompt and answer before it and its own new tokens, sent after
    the answer before it; turn 1 of each conversation is make_workload's request of the same index."""
    client = RecordingClient(ttft=0.0, gap=0.0)
    chats = make_chats(LengthDist(4, 4), LengthDist(2, 2), turns=3, think_s=0.01, seed=5)
    records, _ = run_chats(client, chats, num_chats=2, rate=1000.0, seed=5)
    assert sorted(r.index for r in records) == list(range(6)) and all(r.ok for r in records)
    firsts = list(itertools.islice(make_workload(LengthDist(4, 4), LengthDist(2, 2), seed=5), 2))
    by_chat = {}
    for prompt in client.prompts:
        by_chat.setdefault(tuple(prompt[:4]), []).append(prompt)
    assert sorted(by_chat) == sorted(tuple(f.prompt) for f in firsts)
    for turns in by_chat.values():
        assert [len(p) for p in turns] == [4, 4 + 2 + 4, 4 + 2 + 4 + 2 + 4]
        for before, after in itertools.pairwise(turns):
            assert after[: len(before) + 2] == [*before, 100, 101]  # (the answer: FakeClient's ids)
    with pytest.raises(ValueError, match="turn"):
        next(make_chats(LengthDist(4, 4), LengthDist(2, 2), turns=0))


@pytest.mark.fast
def test_run_load_duration_without_count():
    client = FakeClient(ttft=0.0, gap=0.0)
    workload = make_workload(LengthDist(4, 4), LengthDist(1, 1))
    records, wall = run_load(client, workload, rate=math.inf, duration_s=0.0)
    assert records == []
    records, wall = run_load(client, workload, concurrency=2, duration_s=0.2)
    assert len(records) > 2 and wall < 2.0


@pytest.mark.fast
def test_run_load_needs_one_mode():
    workload = make_workload(LengthDist(4, 4), LengthDist(1, 1))
    with pytest.raises(ValueError):
        run_load(FakeClient(), workload, num_requests=1)
    with pytest.raises(ValueError):
        run_load(FakeClient(), workload, num_requests=1, rate=1.0, concurrency=1)


@pytest.mark.fast
def test_cli_bad_arguments():
    from pdserve.cli import main

    assert main(["bench", "--server", "127.0.0.1:1", "--prompt-len", "normal:3"]) == 2
    assert main(["bench", "--server", "127.0.0.1:1", "--rate", "0"]) == 2
    assert main(["bench", "--server", "127.0.0.1:1", "--rate", "1", "--burstiness", "0"]) == 2
    with pytest.raises(SystemExit):
        main(["bench", "--server", "x", "--rate", "1", "--concurrency", "2"])


@pytest.mark.fast
def test_cli_scenarios_and_the_plain_form():
    """`pdserve bench serve ...` is plain `pdserve bench ...`; throughput and latency check their sizes
    before building an engine; --server stays required for both serving forms."""
    from pdserve.bench import offline, serve
    from pdserve.cli import build_parser, main

    parser = build_parser()
    plain = parser.parse_args(["bench", "--server", "h:1", "--concurrency", "3"])
    scenario = parser.parse_args(["bench", "serve", "--server", "h:1", "--concurrency", "3"])
    assert scenario.func is serve.cmd_bench and scenario.concurrency == plain.concurrency == 3
    assert parser.parse_args(["bench", "latency", "--batch-size", "2"]).func is offline.cmd_latency
    assert main(["bench", "serve", "--server", "127.0.0.1:1", "--rate", "0"]) == 2
    assert main(["bench", "throughput", "--num-prompts", "0"]) == 2
    assert main(["bench", "latency", "--num-iters", "0"]) == 2
    for argv in (["bench"], ["bench", "serve"], ["bench", "--rate", "1"]):
        with pytest.raises(SystemExit):
            main(argv)


@pytest.mark.model
def test_offline_throughput_and_latency(make_engine):
    """`pdserve bench throughput|latency`'s measurements on the session's engine: every request generates
    exactly its output length, and the engine is left without requests."""
    from pdserve.bench import offline

    engine = make_engine()
    stats = offline.throughput(engine, num_prompts=3, input_len=8, output_len=4)
    assert stats["requests"] == 3 and stats["output_tokens"] == 12 and stats["output_token_throughput"] > 0
    result = offline.latency(engine, batch_size=2, input_len=8, output_len=3, iters_warmup=1, iters=2)
    assert result["latency_s"]["count"] == 2 and len(result["latencies_s"]) == 2
    assert not engine.has_unfinished


# --------------------------------------------------------------------------------------------------------
# End to end: `pdserve bench` against a real decode-server


@pytest.mark.daemon
def test_bench_against_decode_server(decode, tmp_path):
    out = tmp_path / "bench.json"
    plots = tmp_path / "plots"
    argv = [
        *("bench", "--server", decode.address, "--concurrency", "2", "--num-requests", "5"),
        *("--prompt-len", "uniform:8:40", "--output-len", "fixed:6", "--seed", "1"),
        *("--slo-ttft-ms", "60000", "--slo-tpot-ms", "60000", "--json", str(out)),
        *(("--plots", str(plots)) if HAS_MATPLOTLIB else ()),
    ]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", *argv], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr
    assert "goodput" in proc.stdout and "TTFT" in proc.stdout
    result = json.loads(out.read_text())
    stats = result["stats"]
    assert stats["requests"] == 5 and stats["completed"] == 5 and stats["failed"] == 0
    assert stats["output_tokens"] == 30  # ignore_eos: exactly max_tokens each
    assert 5 * 8 <= stats["prompt_tokens"] <= 5 * 40
    assert all(8 <= r["prompt_tokens"] <= 40 and r["output_tokens"] == 6 for r in result["requests"])
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        d = stats[key]
        assert 0 < d["p50"] <= d["p90"] <= d["p99"] <= d["max"], key
        assert d["min"] <= d["mean"] <= d["max"]
    assert stats["ttft_ms"]["max"] < stats["e2e_ms"]["max"]
    assert stats["request_throughput"] > 0 and stats["output_token_throughput"] > 0
    assert stats["good_requests"] == 5 and stats["goodput"] == pytest.approx(stats["request_throughput"])
    assert result["config"]["concurrency"] == 2
    if HAS_MATPLOTLIB:
        for name in ("latency_cdf.png", "throughput.png"):
            data = (plots / name).read_bytes()
            assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
    else:
        pytest.skip("matplotlib not installed: PNGs not checked (the JSON was)")


@pytest.mark.fast
def test_workload_gives_lora_adapters_in_turn(tmp_path):
    specs = make_workload(LengthDist(4, 4), LengthDist(2, 2), lora_adapters=["", "sql", "chat"])
    assert [s.lora_adapter for _, s in zip(range(5), specs, strict=False)] == ["", "sql", "chat", "", "sql"]
    entries = [{"prompt": "a", "lora_adapter": "x"}, {"prompt": "b"}]
    specs = [
        s for _, s in zip(range(2), make_workload(None, LengthDist(1, 1), 0, entries, ["y"]), strict=False)
    ]
    assert sorted((s.prompt, s.lora_adapter) for s in specs) == [("a", "x"), ("b", "y")]


@pytest.mark.fast
def test_shared_prefixes_lead_the_prompts_in_turn():
    """`256:2`: prompts alternate between two prefixes of 16 ids, each followed by its own random tokens of
    the prompt length; the rest of the stream is what it would be without them; bad specs are refused."""
    shared = SharedPrefix.parse("16:2")
    specs = [
        s
        for _, s in zip(
            range(4), make_workload(LengthDist(8, 8), LengthDist(2, 2), 5, shared_prefix=shared), strict=False
        )
    ]
    plain = [s for _, s in zip(range(4), make_workload(LengthDist(8, 8), LengthDist(2, 2), 5), strict=False)]
    assert all(len(s.prompt) == 24 for s in specs)
    assert specs[0].prompt[:16] == specs[2].prompt[:16] != specs[1].prompt[:16] == specs[3].prompt[:16]
    assert [s.prompt[16:] for s in specs] == [s.prompt for s in plain]
    assert SharedPrefix.parse("") is None
    for bad in ("16", "0:2", "a:b"):
        with pytest.raises(ValueError, match="shared prefix"):
            SharedPrefix.parse(bad)
