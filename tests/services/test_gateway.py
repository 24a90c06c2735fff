"""A decode server as an endpoint of an InferencePool (llm-d's router): the series the picker scrapes
under load, the render endpoints its precise prefix scorer calls, the KV events of blocks that arrived by
transfer, and the x-prefiller-host-port hint (which replica a hint picks: test_kv_events). One decode server
on a thread here (8 sequence slots, LoRA off, hints accepted) on the shared prefill-server."""

from __future__ import annotations

import concurrent.futures
import json
import time
import types
import urllib.error
import urllib.request

import grpc
import pytest
import zmq

from pdserve.services.client import Client
from pdserve.services.metrics import CACHE_NUM_BLOCKS_LABEL, PICKER_PATH, PICKER_SERIES
from pdserve.testing.launch import free_port, scrape
from tests.helpers import assert_all_free, in_process
from tests.llmd_index import RouterIndex

pytestmark = pytest.mark.daemon

GREEDY = dict(max_tokens=6, temperature=0.0, ignore_eos=True)
SYSTEM = "You are a patient tutor. Explain each step of a calculation before you give its result."


@pytest.fixture(scope="module")
def gateway(prefill, loaded_model, small_config):
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.services.decode.core import DecodeConfig, GenerationCore
    from pdserve.services.decode.server import serve as serve_decode
    from pdserve.services.kv_events_zmq import KVEventsConfig

    http, metrics, events = free_port(), free_port(), free_port()
    core = GenerationCore.for_engine(
        LLMEngine(loaded_model, small_config),
        prefill_targets=[prefill.address],
        config=DecodeConfig(accept_prefill_hint=True),
    )
    options = dict(http_port=http, metrics_port=metrics, kv_events=KVEventsConfig(events, 0, plain=True))
    with in_process(lambda stop, ready: serve_decode(core, 0, stop, on_ready=ready, **options)) as decode:
        yield types.SimpleNamespace(
            address=decode,
            http=f"127.0.0.1:{http}",
            metrics=f"127.0.0.1:{metrics}",
            events=events,
            core=core,
            model=core.engine.model.config.name,
        )
        assert_all_free(decode, prefill.address)


def post(address: str, path: str, body: dict, headers: dict | None = None) -> tuple[int, object]:
    request = urllib.request.Request(
        f"http://{address}{path}",
        json.dumps(body).encode(),
        {"Content-Type": "application/json", **(headers or {})},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_render_gives_the_prompt_ids_generate_uses(gateway):
    client = Client(gateway.address)
    text = "The three primary colours are"
    chats = [
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 12 times 7?"}],
        [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": "What is 12 times 7?"},
            {"role": "assistant", "content": "12 times 7 is 84."},
            {"role": "user", "content": "And 84 divided by 4?"},
        ],
    ]
    status, rendered = post(gateway.http, "/v1/completions/render", {"model": gateway.model, "prompt": text})
    assert status == 200 and [r["model"] for r in rendered] == [gateway.model]
    assert rendered[0]["token_ids"] == client.generate(text, max_tokens=1, return_prompt_ids=True).prompt_ids
    for chat in chats:
        status, rendered = post(gateway.http, "/v1/chat/completions/render", {"messages": chat})
        assert status == 200
        assert (
            rendered["token_ids"]
            == client.generate(chat=chat, max_tokens=1, return_prompt_ids=True).prompt_ids
        )
        _, completion = post(gateway.http, "/v1/chat/completions", {"messages": chat, "max_tokens": 1})
        assert completion["usage"]["prompt_tokens"] == len(rendered["token_ids"])
    assert post(gateway.http, "/v1/chat/completions/render", {"messages": "hi"})[0] == 400
    health = urllib.request.urlopen(f"http://{gateway.http}/health", timeout=10)
    assert health.status == 200


def test_blocks_received_by_transfer_are_published_for_the_router(gateway):
    """The router subscribes to the decode pod and keys its blocks itself: a transferred prompt's blocks
    appear, chained from the first, under the pod the InferencePool targets (its HTTP port)."""
    context = zmq.Context()
    socket = context.socket(zmq.SUB)
    socket.setsockopt(zmq.SUBSCRIBE, b"kv@")
    socket.connect(f"tcp://127.0.0.1:{gateway.events}")
    index, pod = RouterIndex(16), gateway.http
    try:
        ids = (
            Client(gateway.address)
            .generate(
                "Rain falls, rivers run to the sea, the sun lifts the water back into clouds. " * 3,
                return_prompt_ids=True,
                **GREEDY,
            )
            .prompt_ids
        )
        blocks = len(ids) // 16
        assert blocks >= 2 and gateway.core.counters.num_transfers_total >= 1
        deadline = time.monotonic() + 30
        while index.matched_blocks(pod, ids, gateway.model) < blocks:
            assert time.monotonic() < deadline, "the transferred blocks were not published"
            if socket.poll(100):
                frames = socket.recv_multipart()
                assert frames[0] == f"kv@{pod}@{gateway.model}".encode()
                index.add_frames(frames)
        assert index.num_dropped == 0
    finally:
        context.destroy(linger=0)


def test_the_prefiller_hint_is_used_when_it_names_a_replica(gateway, prefill, colocated):
    client, counters = Client(gateway.address), gateway.core.counters

    def complete(prompt: str, hint: str):
        body = {"model": gateway.model, "prompt": prompt, **GREEDY}
        return post(gateway.http, "/v1/completions", body, {"x-prefiller-host-port": hint})

    # distinct from their first block: none is mostly cached here (which would be prefilled here)
    prompts = [f"Quiz question {i}. {SYSTEM} How many minutes are there in {i + 2} hours?" for i in range(4)]
    hinted = counters.routes.get("hint", 0)
    # the replica, named as llm-d names a pod (its IP and the pool's target port), then by its address
    for prompt, hint in zip(prompts[:2], ["127.0.0.1:8000", prefill.address], strict=True):
        status, body = complete(prompt, hint)
        assert status == 200 and body["choices"][0]["text"] == colocated(prompt, field="text", **GREEDY)
    assert counters.routes["hint"] == hinted + 2
    # a pod that is not one of our replicas: ignored, routed as usual
    status, body = complete(prompts[2], "10.255.255.1:8000")
    assert status == 200 and body["choices"][0]["text"] == colocated(prompts[2], field="text", **GREEDY)
    assert counters.routes["hint"] == hinted + 2
    # not HOST:PORT: refused, nothing else disturbed
    status, body = complete(prompts[3], "not a host port")
    assert status == 400 and body["error"]["param"] == "x-prefiller-host-port"
    client.metadata = (("x-prefiller-host-port", "nowhere"),)
    with pytest.raises(grpc.RpcError) as err:
        client.generate(prompts[3], **GREEDY)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    client.metadata = (("x-prefiller-host-port", prefill.address),)
    assert client.generate(prompts[3], **GREEDY).token_ids == colocated(prompts[3], **GREEDY)
    assert counters.routes["hint"] == hinted + 3


def test_the_pickers_series_follow_the_load_as_admin_reports_it(gateway):
    """11 long requests on 8 sequence slots: 8 running, 3 waiting, as long as none finishes. Whenever
    Admin reports the same load before and after a scrape, the scrape reports it too."""
    client, address = Client(gateway.address), gateway.metrics
    names = {k: v.format(role="decode") + '{role="decode"}' for k, v in PICKER_SERIES.items()}
    series = {
        "running": names["runningRequestsSpec"],
        "waiting": names["queuedRequestsSpec"],
        "usage": names["kvUsageSpec"],
    }

    def load(s):
        used = s.num_blocks - s.num_free_blocks - s.num_cached_blocks
        return {"running": s.num_running, "waiting": s.num_waiting, "usage": used / s.num_blocks}

    seen = []
    with concurrent.futures.ThreadPoolExecutor(11) as pool:
        futures = [
            pool.submit(client.generate, f"Count slowly from {i} upwards:", max_tokens=24, ignore_eos=True)
            for i in range(11)
        ]
        while not all(f.done() for f in futures):
            before, metrics, after = load(client.stats()), scrape(address, PICKER_PATH), load(client.stats())
            if before == after:
                assert {k: metrics[name] for k, name in series.items()} == before
                seen.append(before)
        [f.result() for f in futures]
    assert any(s["running"] == 8 and s["waiting"] == 3 for s in seen), seen
    assert all(0 <= s["usage"] <= 1 for s in seen) and max(s["usage"] for s in seen) > 0
    assert_all_free(gateway.address)
    metrics = scrape(address, PICKER_PATH)
    assert [metrics[name] for name in series.values()] == [0, 0, 0]
    everything = scrape(address)  # /metrics holds them too, and the rest
    assert metrics.items() <= everything.items() and len(everything) > 3 * len(metrics)
    info = PICKER_SERIES["cacheInfoSpec"]
    labels = f'block_size="16",cache_dtype="float32",{CACHE_NUM_BLOCKS_LABEL}="192",role="decode"'
    assert metrics[f"{info}{{{labels}}}"] == 1  # the capacity in tokens: blocks x block_size
    (lora,) = [k for k in metrics if k.startswith(PICKER_SERIES["loraSpec"] + "{")]
    assert 'max_lora="0"' in lora and 'running_lora_adapters=""' in lora
    # what the engine runs on (its start-up line) is on /metrics and in Admin stats alike
    (engine,) = [k for k in everything if k.startswith("pdserve_engine_info{")]
    stats = client.stats().engine
    assert stats["platform"] == "cpu" and stats["kv_blocks"] == "192" and stats["sized_by"] == "num_blocks"
    assert all(f'{key}="{value}"' in engine for key, value in stats.items())
