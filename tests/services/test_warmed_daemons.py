"""Daemons started as they are deployed, every shape compiled before they say ready (no --no-warmup): a
prefill server and a decode server serve prompts of every length the small engine takes, with prefix
hits, n > 1, logprobs and penalties, and neither compiles anything while serving (their
pdserve_xla_compilations_total stays flat): each step, sampler and KV transfer shape was compiled at
start (engine.compilation's warmup, LLMEngine.warmup_transfers)."""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest

from pdserve.services.client import Client, build_request
from pdserve.testing.launch import decode_server, prefill_server, scrape

pytestmark = [pytest.mark.daemon, pytest.mark.standalone]  # starts every daemon it uses

METRICS = ["--metrics-port", "0"]


def compilations(daemon) -> float:
    metrics = scrape(daemon.addresses["metrics"])
    return sum(v for k, v in metrics.items() if k.startswith("pdserve_xla_compilations_total"))


def test_warmed_daemons_compile_nothing_while_serving(model_path, log_dir):
    prefill = prefill_server(model_path, log_dir, name="warm-prefill", extra=METRICS, warmup=True)
    try:
        decode = decode_server(
            model_path, prefill.address, log_dir, name="warm-decode", extra=METRICS, warmup=True
        )
        try:
            rng = np.random.default_rng(11)
            shared = rng.integers(100, 30000, 300).tolist()  # a prefix the later prompts hit
            prompts = [rng.integers(100, 30000, n).tolist() for n in (3, 17, 40, 100, 250, 600, 990)]
            prompts += [shared, shared + rng.integers(100, 30000, 200).tolist()]
            knobs = [
                dict(temperature=0.0, max_tokens=8, ignore_eos=True),
                dict(temperature=0.8, seed=1, max_tokens=6, n=2, logprobs=2, repetition_penalty=1.2),
            ]
            before = [compilations(d) for d in (prefill, decode)]
            client = Client(decode.address)
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                calls = [
                    pool.submit(client.generate_sequences, build_request(p, **knobs[i % 2]), 300)
                    for i, p in enumerate(prompts)
                ]
                done = [c for call in calls for c in call.result()]
            assert len(done) == len(prompts) + len(prompts) // 2
            assert all(c.token_ids for c in done)
            assert [compilations(d) for d in (prefill, decode)] == before
        finally:
            assert decode.terminate() == 0
    finally:
        assert prefill.terminate() == 0
