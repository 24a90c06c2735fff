"""The prefill connector with the real model: a prompt longer than one chunk hands its KV over chunk by
chunk as it computes, each piece only once its tokens are computed, and the pieces are the cache's final
KV of those blocks."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve import kvtransfer
from pdserve.engine.boundary import AddRequest, SendKV
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
