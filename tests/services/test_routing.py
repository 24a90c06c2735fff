"""Prefix-aware routing over real prefill servers and their KV events: requests go to the replica that holds
their prefix, the index follows a replica that restarts with an empty cache, and a cut events stream only
degrades routing. Outputs equal the colocated engine's throughout."""

from __future__ import annotations

import contextlib
import time

import pytest

from pdserve.services.client import Client
from pdserve.testing.launch import free_port
from tests.helpers import assert_all_free, in_process

pytestmark = pytest.mark.daemon

GREEDY = dict(max_tokens=4, temperature=0.0, ignore_eos=True)
# longer than two blocks: the decode server holds the system prompts too, and would compute a remainder of
# up to a block itself
TAIL = " Please answer in a few careful words, as you would to a friend who asked you over dinner tonight."
SYSTEM = [  # two system prompts of 5+ blocks, ending without a space
    ("You are a careful assistant for a bakery. Answer questions about bread, flour and ovens. " * 6).strip(),
    ("You are a ship's navigator. Explain tides, stars, charts and compasses to new sailors. " * 6).strip(),
]


def _wait(predicate, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_prefix_routing_follows_what_each_replica_caches(prefill, loaded_model, small_config, colocated):
    """Two replicas: the shared prefill-server and one on a thread here, which restarts (same ports, empty
    cache) and then loses its events stream."""
    from pdserve.engine.core.kv_cache_manager import hash_blocks
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.services.decode.config import Routing
    from pdserve.services.decode.core import GenerationCore
    from pdserve.services.decode.server import serve as serve_decode
    from pdserve.services.kv_events_zmq import KVEventsConfig
    from pdserve.services.prefill.server import PrefillService
    from pdserve.services.prefill.server import serve as serve_prefill

    tokenize = loaded_model.tokenizer.encode
    events = KVEventsConfig(free_port(), free_port())  # fixed ports: a restart publishes where it did
    port = free_port()

    def start_second():
        service = PrefillService.for_engine(LLMEngine(loaded_model, small_config))
        server = in_process(
            lambda stop, ready: serve_prefill(service, port, stop, on_ready=ready, kv_events=events)
        )
        return service, server, server.__enter__()

    with contextlib.ExitStack() as stack:
        service, server, second = start_second()
        stack.callback(lambda: server.__exit__(None, None, None))
        core = GenerationCore.for_engine(
            LLMEngine(loaded_model, small_config),
            prefill_targets=[prefill.address, second],
            routing=Routing(events_resync_s=0.3),
        )
        decode = stack.enter_context(
            in_process(lambda stop, ready: serve_decode(core, 0, stop, on_ready=ready))
        )
        client, replicas, counters = Client(decode), core.pool.replicas, core.counters
        bs = small_config.block_size
        blocks = [len(tokenize(system)) // bs - 1 for system in SYSTEM]  # the last may tokenize otherwise
        assert min(blocks) >= 4

        def ask(system: int, question: str) -> str:
            """Sends one request (checking its tokens); returns the replica that prefilled it."""
            ids = tokenize(SYSTEM[system] + question)
            served = {r: Client(r).stats().num_requests_total for r in replicas}
            assert client.generate(ids, **GREEDY).token_ids == colocated(ids, **GREEDY)
            (chosen,) = [r for r in replicas if Client(r).stats().num_requests_total > served[r]]
            return chosen

        def known(replica: str, system: int) -> int:
            cache = replicas[replica].cache
            prefix = hash_blocks(tokenize(SYSTEM[system]), bs)
            return 0 if cache is None else cache.matched_blocks(prefix)

        # nobody holds either system prompt: they go to different replicas, in turns
        owner = [ask(0, " How hot should the oven be?"), ask(1, " What is a neap tide?")]
        assert owner[0] != owner[1]
        for s in (0, 1):
            _wait(lambda s=s: known(owner[s], s) >= blocks[s], f"the events of prefix {s}")
        expected, actual = counters.route_expected_hit_tokens_total, counters.route_actual_hit_tokens_total
        for i in range(3):  # each follow-up goes to the replica holding its system prompt
            assert ask(0, f" {i}: rye or wheat?{TAIL}") == owner[0]
            assert ask(1, f" {i}: which star?{TAIL}") == owner[1]
        assert counters.routes["prefix"] == 6
        gained = counters.route_expected_hit_tokens_total - expected
        assert gained >= 3 * (blocks[0] + blocks[1]) * bs
        assert counters.route_actual_hit_tokens_total - actual == gained  # the index was exact
        assert_all_free(decode, prefill.address, second)

        # the thread's replica restarts in place with an empty cache: the index forgets its prefix
        moved = owner.index(second)
        server.__exit__(None, None, None)
        service, server, second = start_second()
        _wait(lambda: replicas[second].cache.num_resyncs >= 1, "the restart seen in the events")
        assert known(second, moved) == 0
        expected = counters.route_expected_hit_tokens_total
        ask(moved, f" After the restart?{TAIL}")  # goes by load: nobody is expected to hold it
        assert counters.route_expected_hit_tokens_total == expected

        # its events stream is cut: routing works from what it knew, outputs stay right
        service.kv_events.close()
        for i in range(2):
            ask(moved, f" Without events {i}?{TAIL}")
            assert ask(1 - moved, f" Without events {i}?{TAIL}") == owner[1 - moved]
        assert_all_free(decode, prefill.address, second)
