"""Exact resumption after a crash, with real processes: a decode server SIGKILLed mid-stream, and the
Python client resumes each broken stream on another decode server (GenerateRequest.resume_token_ids);
the whole output equals an uninterrupted colocated run's, greedy and sampled (the seed the first
server drew, reported on the first message)."""

from __future__ import annotations

import concurrent.futures
import threading

import grpc
import pytest

from pdserve.services.client import Client, build_request
from pdserve.testing.launch import scrape
from tests.helpers import assert_all_free

pytestmark = pytest.mark.daemon

PROMPTS = ["Once upon a time, in a quiet village by the sea,", "The recipe for a good loaf of bread is"]


def test_streams_broken_by_a_killed_decode_server_resume_exactly_on_another(
    prefill, decode, daemons, colocated
):
    doomed = daemons.decode(prefill.address, "decode-doomed")
    resumptions = 'pdserve_resumptions_total{role="decode"}'
    before = scrape(decode.addresses["metrics"])[resumptions]
    client = Client(f"{doomed.address},{decode.address}")
    jobs = [dict(max_tokens=40, ignore_eos=True), dict(max_tokens=40, ignore_eos=True, temperature=0.9)]
    started = threading.Barrier(len(jobs) + 1)

    def one(prompt, kw):
        seen = []

        def on_response(response):  # both streams have tokens before the server dies
            seen.extend(response.token_ids)
            if len(seen) >= 4 and not getattr(on_response, "told", False):
                on_response.told = True
                started.wait(timeout=120)

        return client.generate_request(build_request(prompt, **kw), timeout=300, on_response=on_response)

    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(one, p, kw) for p, kw in zip(PROMPTS, jobs, strict=True)]
        started.wait(timeout=120)
        doomed.kill()
        results = [f.result() for f in futures]
    greedy, sampled = results
    assert all(r.num_resumes == 1 and r.finish_reason == "length" for r in results)
    assert greedy.token_ids == colocated(PROMPTS[0], **jobs[0])
    assert sampled.seed is not None  # drawn by the doomed server, reported, used by the other
    assert sampled.token_ids == colocated(PROMPTS[1], seed=sampled.seed, **jobs[1])
    assert sampled.completion_tokens == 40  # usage counts the whole output
    assert scrape(decode.addresses["metrics"])[resumptions] == before + 2
    assert_all_free(decode.address, prefill.address)


def test_a_resumption_that_cannot_be_is_invalid_argument_naming_the_field(decode):
    request = build_request(PROMPTS[0], max_tokens=8, n=2)
    request.resume_token_ids[:] = [1, 2]
    with pytest.raises(grpc.RpcError) as refused:
        list(Client(decode.address).stream(request, timeout=60))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "resume_token_ids" in refused.value.details()


def test_a_proxy_resumes_a_streamed_http_completion_with_the_ids_and_seed_it_relayed(decode, openai):
    """The HTTP extension, through the openai SDK as a proxy would call it: with `return_token_ids` each
    chunk carries its token ids, X-Pdserve-Seed says the seed drawn, and the body resent with that seed and
    `resume_token_ids` (the first 10 tokens relayed) streams the rest of the very output, text included."""
    http = openai.OpenAI(base_url=f"http://{decode.addresses['http']}/v1", api_key="unused", max_retries=0)
    model = http.models.list().data[0].id
    body = dict(model=model, prompt=PROMPTS[1], max_tokens=24, temperature=0.9, stream=True)

    def streamed(**extra):
        raw = http.completions.with_raw_response.create(
            **body, extra_body={"ignore_eos": True, "return_token_ids": True, **extra}
        )
        chunks = [
            (c.choices[0].model_extra["token_ids"], c.choices[0].text) for c in raw.parse() if c.choices
        ]
        return int(raw.headers["x-pdserve-seed"]), chunks

    seed, chunks = streamed()
    ids = [t for chunk_ids, _ in chunks for t in chunk_ids]
    assert len(ids) == 24
    relayed, shown = [], ""  # what the proxy relayed before the stream "broke": 10 tokens and their text
    for chunk_ids, text in chunks:
        if len(relayed) + len(chunk_ids) > 10:
            break
        relayed, shown = relayed + chunk_ids, shown + text
    assert len(relayed) == 10
    again_seed, rest = streamed(seed=seed, resume_token_ids=relayed)
    assert again_seed == seed
    assert relayed + [t for chunk_ids, _ in rest for t in chunk_ids] == ids
    assert shown + "".join(text for _, text in rest) == "".join(text for _, text in chunks)
