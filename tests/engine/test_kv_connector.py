"""The prefill connector with the real model: a prompt longer than one chunk hands its KV over chunk by
chunk as it computes, each piece only once its tokens are computed, and the pieces are the cache's final
KV of those blocks."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve import kvtransfer
from pdserve.engine.boundary import AddRequest, SendKV
from pdserve.engine.core.host_pool import HostBlockPool
from pdserve.engine.core.kv_connector import PrefillConnector
from pdserve.engine.core.request import Status
from pdserve.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.model


def test_a_long_prompt_is_handed_over_per_chunk_from_the_first_block_asked(make_engine, small_config):
    engine = make_engine()
    layout, bs = engine.kv_layout, small_config.block_size
    prompt = np.random.default_rng(7).integers(100, 30000, 600).tolist()  # 3 chunks of <= 256 tokens
    # frames of a few blocks each (the test model's 4 layers would fit the prompt in one 4 MiB frame)
    frame_bytes = 1 << 19
    first_block = 3  # the receiver holds the first 3 blocks
    calls = []
    connector, original = PrefillConnector(layout), engine.kv_connector
    engine.set_kv_connector(connector)
    try:
        request = engine.make_request(prompt, SamplingParams(temperature=0, max_tokens=1), "streamed")
        engine.apply(AddRequest(request, SendKV(max_frame_bytes=frame_bytes, first_block=first_block)))
        while engine.has_unfinished:
            for ready in engine.step().kv:  # each step's: the KV its chunk completed
                calls.append((request.num_computed, request.status, ready.chunks, ready.last))
    finally:
        engine.set_kv_connector(original)
    assert [(computed, last) for computed, _, _, last in calls] == [(256, False), (512, False), (600, True)]
    # the last pieces went out as the request finished, and its blocks went back at once
    assert calls[0][1] is Status.RUNNING and calls[-1][1] is Status.FINISHED
    for computed, _, chunks, _ in calls:  # nothing handed over before its tokens were computed
        assert all(first_block * bs + c.token_start + c.num_tokens <= computed for c in chunks)
    chunks = [c for *_, cs, _ in calls for c in cs]
    plan = kvtransfer.plan_frames(layout, 600 - first_block * bs, frame_bytes)
    assert [(c.layer_start, c.token_start, c.num_tokens) for c in chunks] == [
        (p.layer_start, p.token_start, p.num_tokens) for p in plan
    ]
    # the blocks are cached now: what was handed over early is their final KV
    blocks = engine.scheduler.kv.lookup(prompt + [0])[first_block:]
    for c, p in zip(chunks, plan, strict=True):
        if p.block_start + p.num_blocks > len(blocks):
            continue  # the partial last block is not cached
        expected = kvtransfer.gather(
            engine.runner.cache,
            blocks[p.block_start : p.block_start + p.num_blocks],
            p.num_tokens,
            layer_start=p.layer_start,
            num_layers=p.num_layers,
            token_start=p.token_start,
            bucket=p.bucket,
        )
        np.testing.assert_array_equal(np.asarray(c.valid()), np.asarray(expected.valid()))


def test_staged_kv_waits_in_host_memory_and_bounds_admission(make_engine):
    """Prefill staging (a host tier's slots): the chunks come out as host arrays and the request's device
    blocks go back as it finishes, however long its reader takes; a second prompt whose KV does not fit
    the slots left waits (back-pressure) until the first stream is forgotten (its reader closed); a
    prompt larger than the whole tier is sent unstaged, from device copies."""
    engine = make_engine()
    staging = HostBlockPool(30)
    connector, original = PrefillConnector(engine.kv_layout, staging), engine.kv_connector
    engine.set_kv_connector(connector)
    rng = np.random.default_rng(3)
    greedy = SamplingParams(temperature=0, max_tokens=1)
    requests = [
        engine.make_request(rng.integers(100, 30000, n).tolist(), greedy, rid)
        for rid, n in (("first", 300), ("second", 300), ("huge", 600))  # 19, 19 and 38 blocks
    ]
    chunks: dict[str, list] = {r.request_id: [] for r in requests}
    try:
        for request in requests:
            engine.apply(AddRequest(request, SendKV()))
        while requests[0].status is not Status.FINISHED:
            for ready in engine.step().kv:
                chunks[ready.request_id] += ready.chunks
        assert requests[1].status is Status.WAITING and staging.num_staged == 19
        assert engine.scheduler.kv.pool.num_used == 0  # nobody has read a byte: no device block is held
        assert chunks["first"] and all(isinstance(c.data, np.ndarray) for c in chunks["first"])
        engine.abort("first")  # its stream closed
        assert staging.num_staged == 0
        while engine.has_unfinished:
            for ready in engine.step().kv:
                chunks[ready.request_id] += ready.chunks
        assert all(isinstance(c.data, np.ndarray) for c in chunks["second"])
        assert chunks["huge"] and not any(isinstance(c.data, np.ndarray) for c in chunks["huge"])
        engine.abort("second"), engine.abort("huge")
        assert staging.num_staged == 0 and engine.scheduler.kv.pool.num_used == 0
        staging.check()
    finally:
        engine.set_kv_connector(original)
