"""The colocated engine end to end on the default model: batching, TP, stops, aborts, preemption."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from pdserve import kvtransfer
from pdserve.engine.boundary import (
    AddRequest,
    Detach,
    ExportKV,
    InsertKV,
    Reattach,
    ReceiveKV,
    RemoteKVDone,
)
from pdserve.engine.core.kv_connector import DecodeConnector, KVConnector
from pdserve.engine.core.request import FinishReason
from pdserve.engine.sampling_params import InvalidRequestError, SamplingParams

pytestmark = pytest.mark.model

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
PROMPTS = [
    "The three primary colours are",
    "def quicksort(xs):",
    "Paris is the capital of France. Berlin is the capital of Germany. Madrid is the capital of",
    "1, 2, 3, 4,",
    "A" * 3,
]


def alone(engine, prompts, params):
    return [engine.generate([p], params)[0].token_ids for p in prompts]


def test_mixed_length_greedy_batch_equals_each_request_alone(make_engine):
    engine = make_engine()
    batched = [r.token_ids for r in engine.generate(PROMPTS, GREEDY)]
    assert batched == alone(engine, PROMPTS, GREEDY)
    assert engine.scheduler.kv.pool.num_used == 0


def test_seeded_sampling_is_independent_of_the_batch(make_engine):
    engine = make_engine()
    params = [
        SamplingParams(temperature=0.9, top_p=0.95, top_k=40, seed=100 + i, max_tokens=16) for i in range(4)
    ]
    batched = [r.token_ids for r in engine.generate(PROMPTS[:4], params)]
    singles = [engine.generate([p], sp)[0].token_ids for p, sp in zip(PROMPTS[:4], params, strict=True)]
    assert batched == singles
    again = [r.token_ids for r in engine.generate(PROMPTS[:4], params)]
    assert again == batched
    other_seed = engine.generate([PROMPTS[0]], SamplingParams(temperature=0.9, seed=7, max_tokens=16))[0]
    assert other_seed.token_ids != batched[0]


@pytest.mark.parametrize("tp", [2, 4])
def test_tensor_parallel_gives_the_same_tokens(make_engine, tp):
    reference = [r.token_ids for r in make_engine().generate(PROMPTS, GREEDY)]
    engine = make_engine(devices=jax.devices()[:tp], tp=tp)
    assert engine.runner.cache.sharding.spec[3] == "model"
    assert [r.token_ids for r in engine.generate(PROMPTS, GREEDY)] == reference


def test_a_request_resumed_on_an_engine_of_another_tp_continues_with_the_same_tokens(make_engine):
    """Exact resumption (tests/engine/test_resume.py) from a TP 1 engine's output to a TP 2 engine's."""
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=5, max_tokens=16, ignore_eos=True)
    full = make_engine().generate([PROMPTS[2]], params)[0].token_ids
    engine = make_engine(devices=jax.devices()[:2], tp=2)  # (the module's, from the test above)
    request = engine.make_request(PROMPTS[2], params, resume_token_ids=full[:9])
    engine.add_prepared_request(request)
    while engine.has_unfinished:
        engine.step()
    assert request.output_ids == full


def test_a_detached_request_moves_with_its_kv_to_an_engine_of_another_tp(make_engine):
    """A drain's migration at the engine level: a request decoding on a TP 1 engine is detached at output
    position 9, its KV exported, framed, reassembled for a TP 2 engine's layout and inserted there, and it
    decodes on from its last output to the uninterrupted run's tokens; a detached request reattached
    instead goes on where it was."""
    params = SamplingParams(temperature=0.8, seed=12, max_tokens=20, ignore_eos=True)
    prompt = "Rome is the capital of Italy. " + PROMPTS[2]  # (cached on neither engine)
    source = make_engine()
    full = source.generate([prompt], params)[0].token_ids

    def decode_to(k):
        request = source.make_request(prompt, params)
        source.add_prepared_request(request)
        while len(request.output_ids) < k:
            source.step()
        return request

    stay = decode_to(5)  # detached, then reattached: a failed move leaves it decoding here
    assert len(source.apply(Detach(stay.request_id))) == 1 and source.step().tokens == []
    source.apply(Reattach((stay.request_id,)))
    while source.has_unfinished:
        source.step()
    assert stay.output_ids == full

    moving = decode_to(9)
    (state,) = source.apply(Detach(moving.request_id, export_kv=True))
    assert state.output_ids == tuple(full[:9]) and state.num_kv_tokens == len(state.prompt_ids) + 8
    exported = source.apply(ExportKV(state.request_id))  # what the detach gathered, asked for afterwards
    assert [(c.layer_start, c.token_start, c.num_tokens) for c in state.kv] == [
        (c.layer_start, c.token_start, c.num_tokens) for c in exported
    ]
    assert all(np.array_equal(a.data, b.data) for a, b in zip(state.kv, exported, strict=True))
    dest = make_engine(devices=jax.devices()[:2], tp=2)  # (the module's, from the tests above)
    dest.set_kv_connector(DecodeConnector(dest.config.block_size))
    try:
        request = dest.make_request(
            list(state.prompt_ids), params, seed=state.seed, resume_token_ids=full[:9]
        )
        dest.apply(AddRequest(request, ReceiveKV()))
        (ready,) = dest.step().transfers
        assert ready.first_block == 0  # (the prompt is cached on neither engine)
        chunks = list(state.kv)
        assert source.abort(state.request_id) and source.scheduler.kv.pool.num_used == 0
        assert ready.num_external_tokens == state.num_kv_tokens - ready.first_block * dest.config.block_size
        frames = kvtransfer.encode_request("moving", source.kv_layout, ready.num_external_tokens, chunks)
        sharding = kvtransfer.chunk_sharding(dest.mesh, dest.kv_layout)
        assembler = kvtransfer.FrameAssembler(
            "moving", ready.num_external_tokens, source.kv_layout, dest.kv_layout, sharding
        )
        for data in frames:
            chunk = assembler.add(kvtransfer.deserialize_frame(data))
            assert dest.apply(InsertKV(request.request_id, chunk, ready.first_block))
        assembler.finish()
        dest.apply(RemoteKVDone(request.request_id, None))
        while dest.has_unfinished:
            dest.step()
        assert request.output_ids == full
    finally:
        dest.abort(request.request_id)
        dest.set_kv_connector(KVConnector())


def test_a_lone_request_padded_to_two_rows_gives_the_same_tokens(make_engine):
    """bfloat16 on a CPU compiles no one-row step (EngineConfig.min_step_tokens): the padding row changes
    nothing (float32 here, for exact equality)."""
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    reference = alone(make_engine(), PROMPTS[:2], params)
    padded = make_engine(min_step_tokens=2)
    assert padded.config.token_buckets[0] == 2
    assert alone(padded, PROMPTS[:2], params) == reference


def test_stops_and_finish_reasons(full_engine):
    """On the whole default model: its answer ends with EOS."""
    engine = full_engine
    chat = engine.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    eos = engine.generate([chat], SamplingParams(temperature=0, max_tokens=64))[0]
    assert eos.finish_reason == "stop" and eos.text == "The capital of France is Paris."
    assert eos.token_ids[-1] in engine.tokenizer.eos_token_ids
    by_string = engine.generate([chat], SamplingParams(temperature=0, max_tokens=64, stop=("France is",)))[0]
    assert by_string.finish_reason == "stop" and by_string.text == "The capital of "
    by_token = engine.generate([chat], SamplingParams(temperature=0, max_tokens=64, stop_token_ids=(7042,)))[
        0
    ]
    assert by_token.finish_reason == "stop" and by_token.token_ids[-1] == 7042
    by_length = engine.generate([chat], SamplingParams(temperature=0, max_tokens=3))[0]
    assert by_length.finish_reason == "length" and len(by_length.token_ids) == 3
    assert engine.scheduler.kv.pool.num_used == 0


def test_logprobs_are_reported_per_token(make_engine):
    engine = make_engine()
    result = engine.generate(["Hello"], SamplingParams(temperature=0, max_tokens=4, logprobs=3))[0]
    assert len(result.logprobs) == 4
    for token, lp in zip(result.token_ids, result.logprobs, strict=True):
        assert lp.token_id == token and lp.logprob <= 0 and len(lp.top) == 3
        assert lp.top[0][0] == token  # greedy picks the most likely token
        assert lp.top[0][1] == pytest.approx(lp.logprob, abs=1e-5)


def test_abort_frees_blocks_and_leaves_others_untouched(make_engine):
    engine = make_engine()
    expected = engine.generate([PROMPTS[0]], GREEDY)[0].token_ids
    keep = engine.add_request(PROMPTS[0], GREEDY)
    drop = engine.add_request(PROMPTS[1] * 20, GREEDY)
    tokens = []
    for _ in range(3):
        tokens += [t for o in engine.step().tokens if o.request_id == keep for t in o.new_token_ids]
    assert engine.abort(drop) and not engine.abort(drop)
    while engine.has_unfinished:
        tokens += [t for o in engine.step().tokens if o.request_id == keep for t in o.new_token_ids]
    assert tokens == expected and engine.scheduler.kv.pool.num_used == 0


@pytest.mark.parametrize(
    "prompts",
    [
        PROMPTS,
        # a victim preempted earlier in the same decode step must not preempt an already scheduled
        # request when the loop reaches it (regression: it did, and a row with no blocks was run)
        [
            "The capital of France is",
            "Write a poem about the sea.",
            "Hello, my name is",
            "1, 2, 3, 4,",
            "AAA",
        ],
    ],
)
def test_preemption_under_block_pressure_keeps_outputs(make_engine, prompts):
    """With too few blocks for all requests, the newest are preempted and recomputed: same tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    roomy = [r.token_ids for r in make_engine().generate(prompts, params)]
    tight = make_engine(num_blocks=12)  # 5 requests of ~3-4 blocks each do not fit together
    assert [r.token_ids for r in tight.generate(prompts, params)] == roomy
    assert tight.scheduler.kv.pool.num_used == 0


@pytest.mark.parametrize(
    "prompt, params, field",
    [
        ("", SamplingParams(), "prompt"),
        ([5, 49152], SamplingParams(), "prompt_token_ids"),
        ("hi", SamplingParams(max_tokens=5000), "max_tokens"),
        ("hi", SamplingParams(temperature=float("nan")), "temperature"),
        ("hi", SamplingParams(temperature=-1), "temperature"),
        ("hi", SamplingParams(top_p=0.0), "top_p"),
        ("hi", SamplingParams(top_p=1.5), "top_p"),
        ("hi", SamplingParams(logprobs=100), "logprobs"),
    ],
)
def test_bad_requests_name_the_field(make_engine, prompt, params, field):
    engine = make_engine()
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request(prompt, params)
    assert err.value.field == field
    assert not engine.has_unfinished


def test_abort_reason_is_recorded(make_engine):
    engine = make_engine()
    rid = engine.add_request("hello", GREEDY)
    request = engine.scheduler.requests[rid]
    engine.abort(rid)
    assert request.finish_reason is FinishReason.ABORT


def test_a_request_that_cannot_be_admitted_stalls_the_engine_until_blocks_return(make_engine):
    """No step can run while the only request waits for blocks: the engine says so (its thread then sleeps
    until a command arrives instead of spinning) and runs it once the blocks are back."""
    engine = make_engine()
    pool = engine.scheduler.kv.pool
    held = pool.allocate(pool.num_available)  # another holder has every block
    rid = engine.add_request("Hello there", SamplingParams(temperature=0, max_tokens=2))
    assert engine.step().tokens == [] and engine.stalled and engine.has_unfinished
    pool.release(held)
    outputs = []
    while engine.has_unfinished:
        outputs += engine.step().tokens
    assert not engine.stalled and [o.request_id for o in outputs] == [rid, rid]
