"""The disaggregated service end to end with real processes on loopback: outputs equal the colocated
engine's, token for token; contiguous and scattered decode blocks; concurrency; a pool of replicas;
heterogeneous TP in the single-process `serve` shape; clean SIGTERM exits; no blocks left behind."""

from __future__ import annotations

import concurrent.futures

import pytest

from pdserve.services.client import Client, build_request
from pdserve.services.sampling import params_from_request
from pdserve.testing.launch import HOST_TIER_ARGS, serve_daemon
from tests.helpers import assert_all_free, in_process

pytestmark = pytest.mark.daemon

LONG = " ".join(f"Item {i}: a lantern, {i % 7} maps and a compass." for i in range(48))


def prompts(tokenizer) -> list[list[int]]:
    """Prompts of 1 to 700+ tokens."""
    chat = tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    out = [
        [tokenizer.encode("Hello")[0]],
        tokenizer.encode("Once upon a time"),
        chat,
        tokenizer.encode(LONG[:1200]),
        tokenizer.encode(LONG),
    ]
    assert len(out[0]) == 1 and len(out[-1]) >= 700, [len(p) for p in out]
    return out


GREEDY = dict(max_tokens=16, temperature=0.0, ignore_eos=True)
SEEDED = [dict(max_tokens=16, temperature=0.9, top_p=0.9, seed=11 + i, ignore_eos=True) for i in range(3)]


def test_disaggregated_equals_colocated_greedy_and_seeded(decode, prefill, colocated, loaded_model):
    client = Client(decode.address)
    lead = loaded_model.tokenizer.encode("Seeded:")  # other prompts: a repeat would be served from the
    seeded_prompts = [lead + ids for ids in prompts(loaded_model.tokenizer)[1:4]]  # decode server's cache
    seeded = list(zip(seeded_prompts, SEEDED, strict=True))
    colocated.prepare([(ids, GREEDY) for ids in prompts(loaded_model.tokenizer)] + seeded)
    for ids in prompts(loaded_model.tokenizer):
        got = client.generate(ids, **GREEDY)
        assert got.token_ids == colocated(ids, **GREEDY), len(ids)
        assert got.prompt_tokens == len(ids) and got.finish_reason == "length"
    for ids, kw in seeded:
        assert client.generate(ids, **kw).token_ids == colocated(ids, **kw)
    assert client.model_info().prefill_mode == "remote"
    assert Client(prefill.address).stats().num_requests_total >= 8
    assert_all_free(decode.address, prefill.address)


def test_the_default_model_answers_through_both_roles(full_daemons, openai):
    """The one end-to-end case on the whole default model (the other daemon tests use the test model's
    first layers): a chat through a prefill-server and a decode-server, over gRPC and the OpenAI API,
    gets the model's answer, ended by its EOS."""
    prefill, decode = full_daemons
    question = [{"role": "user", "content": "What is the capital of France?"}]
    result = Client(decode.address).generate(chat=question, max_tokens=32)
    assert result.text == "The capital of France is Paris." and result.finish_reason == "stop"
    http = openai.OpenAI(base_url=f"http://{decode.addresses['http']}/v1", api_key="unused")
    (model,) = http.models.list().data
    chat = http.chat.completions.create(model=model.id, messages=question, temperature=0, max_tokens=32)
    assert chat.choices[0].message.content == "The capital of France is Paris."
    assert chat.choices[0].finish_reason == "stop" and chat.usage.completion_tokens == 8
    # the answer given as the assistant's open last message: the model's first token (the prefill
    # server's: a salt the decode server's cache has no block of) is EOS; with min_tokens it is held back
    # there and the answer goes on
    answered = [*question, {"role": "assistant", "content": chat.choices[0].message.content}]
    template = {"add_generation_prompt": False, "continue_final_message": True, "cache_salt": "ended"}
    ended = http.chat.completions.create(
        model=model.id, messages=answered, temperature=0, max_tokens=8, extra_body=template
    )
    assert ended.choices[0].finish_reason == "stop" and ended.usage.completion_tokens == 1
    held = http.chat.completions.create(
        model=model.id,
        messages=answered,
        temperature=0,
        max_tokens=8,
        extra_body={**template, "cache_salt": "held", "min_tokens": 3},
    )
    assert held.usage.completion_tokens == 8 and held.choices[0].message.content.strip()
    assert Client(prefill.address).stats().num_requests_total >= 3
    assert_all_free(decode.address, prefill.address)


def test_chat_and_text_deltas_stream(decode, colocated, loaded_model):
    client = Client(decode.address)
    chat = [{"role": "user", "content": "What is the capital of France?"}]
    result = client.generate(chat=chat, max_tokens=32)
    ids = loaded_model.tokenizer.encode_chat(chat)
    assert result.token_ids == colocated(ids, max_tokens=32)
    assert result.text == colocated(ids, field="text", max_tokens=32)
    responses = list(client.stream(build_request("Once upon a time", max_tokens=8, ignore_eos=True)))
    assert len(responses) == 8 and all(len(r.token_ids) == 1 for r in responses)
    assert responses[-1].usage.completion_tokens == 8


def test_a_conversation_reuses_its_prefix_and_transfers_only_what_decode_lacks(
    decode, prefill, colocated, loaded_model
):
    """Turn 2 carries turn 1 (prompt and answer): the prefill server computes only what it has not cached
    (turn 1's prompt; the answer was decoded elsewhere) and sends only the blocks the decode server lacks;
    the response reports the prefill server's cached tokens; a repeat of turn 2 is served from the decode
    server's cache without a Prefill call. The tokens are the colocated engine's every time."""
    tokenize = loaded_model.tokenizer.encode
    turn1 = tokenize("A conversation about prefix caching. " * 12 + "First question?")
    client, decode_admin, prefill_admin = (
        Client(decode.address),
        Client(decode.address),
        Client(prefill.address),
    )
    sent = lambda: decode_admin.stats().kv_transfer_bytes_total  # noqa: E731
    before = sent()
    first = client.generate(turn1, **GREEDY)
    turn1_bytes = sent() - before
    turn2 = turn1 + first.token_ids + tokenize(" Second question? Tell me more about it, please.")
    before, hits = sent(), prefill_admin.stats().prefix_cache_hits_total
    second = client.generate(turn2, **GREEDY)
    assert second.token_ids == colocated(turn2, **GREEDY)
    assert second.cached_prompt_tokens == len(turn1) // 16 * 16  # the prefill server's hit: turn 1's blocks
    assert prefill_admin.stats().prefix_cache_hits_total - hits == second.cached_prompt_tokens
    # the decode server holds turn 1's 5 prompt and answer blocks: 2 of turn 2's 7 blocks are sent, not 7
    assert 0 < sent() - before < turn1_bytes / 2
    requests = prefill_admin.stats().num_requests_total
    again = client.generate(turn2, **GREEDY)
    assert again.token_ids == second.token_ids and prefill_admin.stats().num_requests_total == requests
    assert again.cached_prompt_tokens >= len(turn2) - 16  # found here: at most a block computed
    assert decode_admin.stats().num_cached_blocks > 0
    assert_all_free(decode.address, prefill.address)


def test_32_concurrent_streams(decode, prefill, colocated, loaded_model):
    client = Client(decode.address)
    texts = [f"Story {i}: the fox and the {['owl', 'bear', 'crow', 'hare'][i % 4]} went" for i in range(32)]
    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        results = list(pool.map(lambda t: client.generate(t, **GREEDY), texts))
    assert all(len(r.token_ids) == 16 for r in results)
    for text, result in list(zip(texts, results, strict=True))[:3]:
        ids = loaded_model.tokenizer.encode(text)
        assert result.token_ids == colocated(ids, **GREEDY)
    assert_all_free(decode.address, prefill.address)


def test_two_prefill_replicas_are_both_used(prefill, loaded_model, small_config):
    """A decode server with two replicas (the shared prefill-server and one on a thread here) uses both.
    (Its engine and the second replica's have the default shapes: nothing new to compile.)"""
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.services.decode.core import GenerationCore
    from pdserve.services.decode.server import serve as serve_decode
    from pdserve.services.prefill.server import PrefillService
    from pdserve.services.prefill.server import serve as serve_prefill

    second_service = PrefillService.for_engine(LLMEngine(loaded_model, small_config))
    with in_process(lambda stop, ready: serve_prefill(second_service, 0, stop, on_ready=ready)) as second:
        core = GenerationCore.for_engine(
            LLMEngine(loaded_model, small_config), prefill_targets=[prefill.address, second]
        )
        with in_process(lambda stop, ready: serve_decode(core, 0, stop, on_ready=ready)) as decode:
            before = Client(prefill.address).stats().num_requests_total
            client = Client(decode)
            with concurrent.futures.ThreadPoolExecutor(8) as pool:
                results = list(pool.map(lambda i: client.generate(f"Number {i} is", max_tokens=4), range(16)))
            assert all(r.completion_tokens >= 1 for r in results)
            assert Client(prefill.address).stats().num_requests_total > before
            assert Client(second).stats().num_requests_total > 0
            assert_all_free(decode, prefill.address, second)


def test_scattered_decode_blocks(prefill, loaded_model, small_config, colocated):
    """The decode engine's free blocks are made non-contiguous first; the KV lands in scattered blocks."""
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.services.decode.core import GenerationCore
    from pdserve.services.decode.server import serve

    engine = LLMEngine(loaded_model, small_config)
    pool = engine.scheduler.kv.pool
    held = pool.allocate(pool.num_available)
    pool.release(held[1::2])  # only every other block is free
    core = GenerationCore.for_engine(engine, prefill_targets=[prefill.address])
    with in_process(lambda stop, ready: serve(core, 0, stop, on_ready=ready)) as address:
        client = Client(address)
        colocated.prepare([(ids, GREEDY) for ids in prompts(loaded_model.tokenizer)[1:]])
        for ids in prompts(loaded_model.tokenizer)[1:]:
            assert client.generate(ids, **GREEDY).token_ids == colocated(ids, **GREEDY), len(ids)
    assert pool.num_available == len(held[1::2])  # everything the requests took came back (or is cached)


def test_a_conversation_over_heterogeneous_tp_moves_only_its_new_blocks(
    prefill, loaded_model, small_config, make_engine, colocated
):
    """Prefill TP 1 (the shared prefill-server) -> a decode engine of TP 2 over gRPC, heads converted:
    turn 2 of a conversation (two prefill chunks; the held head covers part of the first) moves only the
    blocks after those the decode side holds, streamed per chunk; greedy and seeded tokens are the
    colocated engine's."""
    import jax

    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.kvtransfer import plan_frames
    from pdserve.services.decode.core import GenerationCore
    from pdserve.services.decode.server import serve

    core = GenerationCore.for_engine(
        LLMEngine(loaded_model, small_config, jax.devices()[2:4]), prefill_targets=[prefill.address]
    )
    tokenize = loaded_model.tokenizer.encode
    sender_layout = make_engine().kv_layout  # the prefill server's: TP 1, the same sizes

    def planned_layer_blocks(num_tokens: int) -> int:
        return sum(p.num_layers * p.bucket for p in plan_frames(sender_layout, num_tokens))

    with in_process(lambda stop, ready: serve(core, 0, stop, on_ready=ready)) as address:
        client = Client(address)
        for i, kw in enumerate((GREEDY, SEEDED[0])):
            turn1 = tokenize(LONG[i * 600 : (i + 1) * 600])
            before = client.stats().kv_transfer_bytes_total
            first = client.generate(turn1, **kw)
            assert first.token_ids == colocated(turn1, **kw)
            full = client.stats().kv_transfer_bytes_total - before
            turn2 = turn1 + first.token_ids + tokenize(" And then? " + LONG[1200 - i * 100 : 2000 - i * 100])
            assert len(turn2) > 256 > len(turn1)
            before = client.stats().kv_transfer_bytes_total
            assert client.generate(turn2, **kw).token_ids == colocated(turn2, **kw)
            # bytes received follow the frame plan: its chunks' blocks, the last of each padded to its
            # bucket (as many blocks as a frame holds: 4 layers' frames hold turn 1 whole)
            per_layer_block = full / planned_layer_blocks(len(turn1))
            held = len(turn1) // 16 * 16  # at least turn 1's full blocks
            moved = client.stats().kv_transfer_bytes_total - before
            assert 0 < moved <= per_layer_block * planned_layer_blocks(len(turn2) - held)
        assert client.stats().num_transfer_failures_total == 0
        assert_all_free(address, prefill.address)


def test_heterogeneous_tp_in_serve_shape(model_path, log_dir, daemons, colocated, loaded_model):
    """Prefill TP 1 on device 0 -> decode TP 4 on devices 4-7, one process, KV moved by device_put (staged
    in the host tier's memory on the way: host arrays put on the decode mesh). (TP 1 -> TP 2:
    tests/services/test_lora.py::test_serve_shape_with_adapters.)"""
    daemon = daemons.add(serve_daemon(model_path, log_dir, "4,5,6,7", name="serve-tp4", extra=HOST_TIER_ARGS))
    client = Client(daemon.address)
    info = client.model_info()
    assert info.tensor_parallel == 4 and info.prefill_mode == "local-engine"
    for ids in prompts(loaded_model.tokenizer)[1:4]:
        assert client.generate(ids, **GREEDY).token_ids == colocated(ids, **GREEDY), len(ids)
    assert_all_free(daemon.address)


def test_cache_salts_keep_tenants_apart_on_both_roles(prefill, decode, loaded_model, colocated, openai):
    """GenerateRequest.cache_salt (and the OpenAI body's cache_salt): a prompt one tenant cached, in the
    decode server's cache and the prefill server's, is not found for another tenant; the same tenant
    hits. The tokens are the colocated engine's."""
    prompt = loaded_model.tokenizer.encode("Tenant isolation: the same words from two tenants. " * 6)
    client = Client(decode.address)
    first = client.generate(prompt, cache_salt="tenant-a", **GREEDY)
    other = client.generate(prompt, cache_salt="tenant-b", **GREEDY)
    assert first.cached_prompt_tokens == other.cached_prompt_tokens == 0
    again = client.generate(prompt, cache_salt="tenant-a", **GREEDY)
    assert again.cached_prompt_tokens >= len(prompt) - 16
    assert first.token_ids == other.token_ids == again.token_ids == colocated(prompt, **GREEDY)
    http = openai.OpenAI(base_url=f"http://{decode.addresses['http']}/v1", api_key="unused")
    (model,) = http.models.list().data
    text = loaded_model.tokenizer.decode(prompt)
    for salt, cached in (("tenant-c", False), ("tenant-c", True)):
        usage = http.completions.create(
            model=model.id, prompt=text, max_tokens=2, temperature=0, extra_body={"cache_salt": salt}
        ).usage
        assert (usage.prompt_tokens_details.cached_tokens > 0) == cached, salt
    assert_all_free(decode.address, prefill.address)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "int8"])
def test_a_quantized_kv_cache_disaggregated_equals_colocated_and_refuses_other_replicas(
    prefill, loaded_model, small_config, kv_cache_dtype
):
    """--kv-cache-dtype fp8_e4m3 or int8 on both roles (in-process servers; int8: prefill TP 1, decode TP
    2): the KV crosses as stored (fp8 frames; int8 values with their scales, heads converted) and decoding
    reads what a colocated engine of that dtype wrote, so the tokens are the colocated engine's, greedy
    and seeded, a long prompt in several chunks too, and a second turn of a conversation that moves only
    the blocks the decode side does not hold. A decode server whose replica (the shared one) keeps a
    float32 cache refuses it at the handshake and prefills locally: the same tokens again.

    What it compares: each prompt is prefilled in the same chunks on both paths, so every position's K/V
    was quantized from the same computation. A position one path recomputes in a prefill chunk and the
    other wrote by decode steps can round differently (docs/architecture.md, "KV cache"); the second
    turn here gives equal tokens, a near-tie there could differ."""
    import dataclasses

    import jax

    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.services.decode.core import GenerationCore
    from pdserve.services.decode.server import serve as serve_decode
    from pdserve.services.prefill.server import PrefillService
    from pdserve.services.prefill.server import serve as serve_prefill

    quantized = dataclasses.replace(small_config, kv_cache_dtype=kv_cache_dtype)
    reference = LLMEngine(loaded_model, quantized)
    assert reference.kv_layout.dtype == {"fp8_e4m3": "float8_e4m3fn", "int8": "int8"}[kv_cache_dtype]
    jobs = [(ids, kw) for ids in prompts(loaded_model.tokenizer)[1:] for kw in (GREEDY, SEEDED[0])]
    params = [params_from_request(build_request(ids, **kw)) for ids, kw in jobs]
    expected = [c.token_ids for c in reference.generate([ids for ids, _ in jobs], params)]
    turn1 = jobs[-2][0]  # the longest prompt, greedy
    turn2 = turn1 + expected[-2] + loaded_model.tokenizer.encode(" And then? " + LONG[:300])
    (expected_turn2,) = reference.generate([turn2], params[-2])
    service = PrefillService.for_engine(LLMEngine(loaded_model, quantized))
    decode_tp = 2 if kv_cache_dtype == "int8" else 1  # heterogeneous TP: one dtype is enough
    with in_process(lambda stop, ready: serve_prefill(service, 0, stop, on_ready=ready)) as replica:
        for target, transferred in ((replica, True), (prefill.address, False)):
            engine = LLMEngine(
                loaded_model, dataclasses.replace(quantized, tp=decode_tp), jax.devices()[2 : 2 + decode_tp]
            )
            core = GenerationCore.for_engine(engine, prefill_targets=[target])
            with in_process(
                lambda stop, ready, core=core: serve_decode(core, 0, stop, on_ready=ready)
            ) as decode:
                client = Client(decode)
                assert [client.generate(ids, **kw).token_ids for ids, kw in jobs] == expected
                second = client.generate(turn2, **GREEDY)
                assert second.token_ids == expected_turn2.token_ids
                assert second.cached_prompt_tokens >= len(turn1) // 16 * 16  # the rest moved (or computed)
                assert (client.stats().num_transfers_total > 0) == transferred, target
                assert_all_free(decode)


def test_speculative_decoding_on_the_decode_server_only_equals_colocated(prefill, loaded_model, colocated):
    """A decode server with n-gram speculation behind the session's prefill server without it (the
    mismatch that broke SGLang's P/D, sglang#17212): greedy and seeded outputs equal the colocated engine's
    without speculation, drafts were accepted, and Admin stats count them."""
    import dataclasses

    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.services.decode.core import GenerationCore
    from pdserve.services.decode.server import serve
    from pdserve.testing.launch import TEST_ENGINE

    ngram = (  # every draft verified ("cost" would weigh them by this machine's speed)
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3, '
        '"draft_policy": "all"}'
    )
    engine = LLMEngine(loaded_model, dataclasses.replace(TEST_ENGINE, speculative_config=ngram))
    core = GenerationCore.for_engine(engine, prefill_targets=[prefill.address])
    quote = loaded_model.tokenizer.encode("Say it twice: a lantern, four maps and a compass. " * 3)
    cases = [
        (ids, kw) for ids in (quote, *prompts(loaded_model.tokenizer)[2:4]) for kw in (GREEDY, SEEDED[0])
    ]
    colocated.prepare(cases)
    with in_process(lambda stop, ready: serve(core, 0, stop, on_ready=ready)) as address:
        client = Client(address)
        for ids, kw in cases:
            assert client.generate(ids, **kw).token_ids == colocated(ids, **kw), (len(ids), kw)
        stats = client.stats()
        assert stats.spec_decode_num_accepted_tokens_total > 0
        assert stats.spec_decode_num_draft_tokens_total >= stats.spec_decode_num_accepted_tokens_total
        assert len(stats.spec_decode_accepted_per_position_total) == 3
        assert stats.num_transfers_total >= 3  # each prompt's KV came from the prefill server (once)
        assert_all_free(address, prefill.address)


def test_eagle3_drafts_after_the_handoff_equal_a_colocated_engines(
    prefill, loaded_model, small_config, tmp_path
):
    """EAGLE-3 on both roles (a random head in the published format): the prefill server runs the head over
    the prompt and sends its KV (a layer of the KV layout) and its input at the last position (the
    trailer); the decode server's drafts, after every sequence of tokens both drafted after (its first
    step's included), equal a colocated engine's, and so do its tokens. A decode server with the head and
    a replica without one (the session's) do not exchange KV: the handshake refuses the replica, naming
    the draft layer, and the request is computed locally."""
    import dataclasses

    from pdserve.engine.draft_runner import DraftRunner
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.services.decode.core import GenerationCore
    from pdserve.services.decode.server import serve as serve_decode
    from pdserve.services.prefill.server import PrefillService
    from pdserve.services.prefill.server import serve as serve_prefill
    from pdserve.testing.eagle3 import eagle3_config

    config = dataclasses.replace(
        small_config, speculative_config=eagle3_config(tmp_path / "head", loaded_model)
    )
    drafted: dict[int, dict[tuple[int, ...], list[int]]] = {}  # engine's drafter -> tokens -> drafts
    run = DraftRunner._run

    def record(self, spans, num_tokens, aux):
        proposed = run(self, spans, num_tokens, aux)
        for span in (s for s in spans if s.propose):
            drafted.setdefault(id(self), {})[tuple(span.request.all_ids)] = proposed[span.request.request_id]
        return proposed

    DraftRunner._run = record
    try:
        reference = LLMEngine(loaded_model, config)
        jobs = [(ids, kw) for ids in prompts(loaded_model.tokenizer)[1:4] for kw in (GREEDY, SEEDED[0])]
        expected = [
            reference.generate([ids], params_from_request(build_request(ids, **kw)))[0].token_ids
            for ids, kw in jobs
        ]
        service = PrefillService.for_engine(LLMEngine(loaded_model, config))
        with in_process(lambda stop, ready: serve_prefill(service, 0, stop, on_ready=ready)) as replica:
            for target, transferred in ((replica, True), (prefill.address, False)):
                engine = LLMEngine(loaded_model, config)
                core = GenerationCore.for_engine(engine, prefill_targets=[target])
                with in_process(
                    lambda stop, ready, core=core: serve_decode(core, 0, stop, on_ready=ready)
                ) as d:
                    client = Client(d)
                    assert [client.generate(ids, **kw).token_ids for ids, kw in jobs] == expected
                    stats = client.stats()
                    assert (stats.num_transfers_total >= 2) == transferred, target  # (short or cached: local)
                    assert stats.spec_decode_num_accepted_tokens_total > 0
                    assert_all_free(d)
                here, there = drafted.pop(id(engine.drafter)), drafted[id(reference.drafter)]
                common = here.keys() & there.keys()
                assert len(common) >= 30, len(common)
                assert {k: here[k] for k in common} == {k: there[k] for k in common}
                first = {tuple(ids + [e[0]]) for (ids, _), e in zip(jobs, expected, strict=True)}
                assert first <= common  # the first drafts after each prompt, on either path
            assert_all_free(replica)
    finally:
        DraftRunner._run = run


def test_host_tiers_on_both_roles_keep_a_conversation_from_being_recomputed(
    loaded_model, small_config, colocated
):
    """--kv-offloading-size on both roles (in process, real gRPC): after prompts longer than the device
    caches push turn 1 of a conversation out of both (into their host tiers), turn 2 finds turn 1 in the
    decode server's host tier (loaded back and counted as held: only the new blocks move) and in the
    prefill server's (its hit reported); the prefill server staged its streams in host memory. The tokens
    are the colocated engine's, and nothing is left held in either tier."""
    import dataclasses

    import numpy as np

    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.kvtransfer import plan_frames
    from pdserve.services.decode.core import GenerationCore
    from pdserve.services.decode.server import serve as serve_decode
    from pdserve.services.prefill.server import PrefillService
    from pdserve.services.prefill.server import serve as serve_prefill

    config = dataclasses.replace(small_config, kv_offloading_size=0.05)
    tokenize = loaded_model.tokenizer.encode
    rng = np.random.default_rng(9)
    flood = [rng.integers(100, 30000, 1000).tolist() for _ in range(4)]  # 252 blocks > the devices' 192
    service = PrefillService.for_engine(LLMEngine(loaded_model, config))
    with in_process(lambda stop, ready: serve_prefill(service, 0, stop, on_ready=ready)) as replica:
        core = GenerationCore.for_engine(LLMEngine(loaded_model, config), prefill_targets=[replica])
        with in_process(lambda stop, ready: serve_decode(core, 0, stop, on_ready=ready)) as address:
            client, prefill_admin = Client(address), Client(replica)
            turn1 = tokenize(LONG[:600])
            before = client.stats().kv_transfer_bytes_total
            first = client.generate(turn1, **GREEDY)
            turn1_bytes = client.stats().kv_transfer_bytes_total - before
            assert first.token_ids == colocated(turn1, **GREEDY)
            for prompt in flood:
                client.generate(prompt, max_tokens=1)
            turn2 = turn1 + first.token_ids + tokenize(" And then? " + LONG[600:900])
            before = client.stats().kv_transfer_bytes_total
            second = client.generate(turn2, **SEEDED[0])
            assert second.token_ids == colocated(turn2, **SEEDED[0])
            assert second.cached_prompt_tokens >= len(turn1) // 16 * 16
            # bytes follow the frame plan (each frame's blocks padded to its bucket): only the blocks after
            # the 14 of turn 1 and its answer, which the decode server loaded back from its host tier
            layout = core.loop.engine.kv_layout
            planned = lambda n: sum(p.num_layers * p.bucket for p in plan_frames(layout, n))  # noqa: E731
            per_layer_block = turn1_bytes / planned(len(turn1))
            moved = client.stats().kv_transfer_bytes_total - before
            assert 0 < moved == per_layer_block * planned(len(turn2) - 14 * 16)
            decode_stats, prefill_stats = client.stats(), prefill_admin.stats()
            assert decode_stats.prefix_cache_host_hits_total >= len(turn1) // 16 * 16
            assert prefill_stats.prefix_cache_host_hits_total >= len(turn1) // 16 * 16
            assert prefill_stats.num_host_offloads_total > 0 and decode_stats.num_host_offloads_total > 0
            assert prefill_stats.num_host_staged_blocks == 0  # every stream closed gave its slots back
            assert_all_free(address, replica)
