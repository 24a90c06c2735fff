"""Operating the daemons: Prometheus metrics that move under load, the OpenAI-compatible HTTP API driven
by the official `openai` client, and JSON logs carrying request ids from the client to the prefill side."""

from __future__ import annotations

import concurrent.futures
import json
import threading
import time

import pytest

from pdserve.engine.sampling_params import SamplingParams
from pdserve.services.client import Client
from pdserve.testing.launch import scrape

pytestmark = pytest.mark.daemon


def test_metrics_move_under_load(decode, prefill):
    client = Client(decode.address)
    address = decode.addresses["metrics"]
    seen_used, stop = [], threading.Event()

    def watch():
        while not stop.is_set():
            seen_used.append(scrape(address)['pdserve_kv_blocks_used{role="decode"}'])
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        list(
            pool.map(
                lambda i: client.generate(f"Tell me about number {i}. " * 8, max_tokens=24, ignore_eos=True),
                range(6),
            )
        )
    stop.set()
    watcher.join()
    assert max(seen_used) > 0  # the gauge rose under load
    deadline = time.monotonic() + 10
    while scrape(address)['pdserve_kv_blocks_used{role="decode"}'] != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert scrape(address)['pdserve_kv_blocks_used{role="decode"}'] == 0  # and fell back
    m = scrape(address)
    assert m['pdserve_requests_total{outcome="length",role="decode"}'] >= 6
    assert (
        m['pdserve_kv_transfer_bytes_total{role="decode"}'] > 0
        and m['pdserve_kv_transfers_total{role="decode"}'] >= 6
    )
    assert (
        m["pdserve_time_to_first_token_seconds_count"] >= 6
        and m["pdserve_inter_token_latency_seconds_count"] >= 6 * 23
    )
    assert (
        m["pdserve_time_per_output_token_seconds_count"] >= 6
        and m["pdserve_request_duration_seconds_sum"] > 0
    )
    # free, or held only by the prefix cache (reclaimable): earlier tests' blocks may fill the cache
    reclaimable = m['pdserve_kv_blocks_free{role="decode"}'] + m['pdserve_kv_blocks_cached{role="decode"}']
    assert reclaimable > 0 and 'pdserve_decode_queue_depth{role="decode"}' in m
    routed = sum(v for k, v in m.items() if k.startswith("pdserve_prefill_routes_total{"))
    assert routed >= 6 and 'pdserve_prefill_route_actual_hit_tokens_total{role="decode"}' in m
    p = scrape(prefill.addresses["metrics"])
    assert p["pdserve_prefill_duration_seconds_count"] >= 6
    assert p['pdserve_kv_frames_sent_total{role="prefill"}'] >= 6
    assert (
        0
        < p['pdserve_kv_frames_after_compute_total{role="prefill"}']
        <= p['pdserve_kv_frames_sent_total{role="prefill"}']
    )


def test_openai_client_completions_and_chat(decode, make_engine, loaded_model, colocated, openai, model_path):
    client = openai.OpenAI(base_url=f"http://{decode.addresses['http']}/v1", api_key="unused")
    models = client.models.list()
    assert [m.id for m in models.data] == [str(model_path)]  # --model as given (vLLM's default name)
    model = models.data[0].id

    question = [{"role": "user", "content": "What is the capital of France?"}]
    prompt_ids = loaded_model.tokenizer.encode_chat(question)
    answer = colocated(prompt_ids, field="text", max_tokens=32)
    answer_ids = colocated(prompt_ids, max_tokens=32)
    chat = client.chat.completions.create(model=model, messages=question, temperature=0, max_tokens=32)
    assert chat.choices[0].message.content == answer
    assert chat.usage.completion_tokens == len(answer_ids)

    completion = client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=12, temperature=0
    )
    ids = loaded_model.tokenizer.encode("Once upon a time")
    expected = make_engine().generate([ids], SamplingParams(temperature=0, max_tokens=12))[0]
    assert completion.choices[0].text == expected.text and completion.usage.prompt_tokens == len(ids)

    streamed = client.chat.completions.create(
        model=model,
        messages=question,
        temperature=0,
        max_tokens=32,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == answer
    assert chunks[-1].usage.completion_tokens == len(answer_ids)
    # the same prompt as the first chat: its whole blocks were found in the prefill server's cache
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens >= 16

    text_stream = client.completions.create(
        model=model, prompt="Once upon a time", max_tokens=12, temperature=0, stream=True
    )
    parts = list(text_stream)
    assert (
        "".join(p.choices[0].text for p in parts) == expected.text
        and parts[-1].choices[0].finish_reason == "length"
    )

    with_logprobs = client.completions.create(
        model=model, prompt="Hello", max_tokens=3, temperature=0, logprobs=2
    )
    assert len(with_logprobs.choices[0].logprobs.token_logprobs) == 3

    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model, prompt="Hello", max_tokens=3, top_p=2.0)
    assert "top_p" in str(err.value)


def test_json_logs_carry_request_ids_to_the_prefill_side(decode, prefill):
    Client(decode.address).generate("Hello there, tracing!", max_tokens=2, request_id="trace-4242")
    time.sleep(0.5)
    decode_lines = [
        json.loads(line) for line in decode.log_path.read_text().splitlines() if line.startswith("{")
    ]
    assert any(e.get("request_id") == "trace-4242" and e["message"] == "request ended" for e in decode_lines)
    assert "trace-4242" in prefill.log_path.read_text()  # the prefill server logged the same id
    assert "Hello there, tracing!" not in decode.log_path.read_text() + prefill.log_path.read_text()
