"""A detached sequence's state on the wire (services.decode.migration.header_of): what the peer reads back
is the sequence's own parameters with its seed and n = 1, its prompt and output, its adapter and salt, and
a KV digest of every token but the last output; a peer's GenerateResponse reads back as the output of the
sequence's index."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.engine.boundary import DetachedSequence
from pdserve.engine.core.request import FinishReason
from pdserve.engine.sampling_params import Constraint, SamplingParams
from pdserve.kvtransfer import KVLayout, LayerSpec, SpecKind
from pdserve.services import sampling, wire
from pdserve.services.decode.migration import header_of, output_of
from pdserve.v1 import generation_pb2 as gen_pb

pytestmark = pytest.mark.fast

LAYOUT = KVLayout("m@d", (LayerSpec(SpecKind.FULL),) * 2, 3, 64, "bfloat16", 16, tp_size=1)


def f32(low: float, high: float, exclude_min: bool = False):
    return st.floats(low, high, width=32, exclude_min=exclude_min)


ids = st.lists(st.integers(0, 49151), min_size=1, max_size=40)

params = st.builds(
    SamplingParams,
    temperature=f32(0, 2),
    n=st.integers(1, 4),
    top_k=st.integers(0, 100),
    top_p=f32(0, 1, exclude_min=True),
    min_p=f32(0, 1),
    repetition_penalty=f32(0, 2, exclude_min=True),
    presence_penalty=f32(-2, 2),
    frequency_penalty=f32(-2, 2),
    max_tokens=st.integers(41, 512),
    min_tokens=st.integers(0, 8),
    logit_bias=st.lists(st.tuples(st.integers(0, 100), f32(-100, 100)), max_size=3).map(
        lambda pairs: tuple(sorted(dict(pairs).items()))
    ),
    stop_token_ids=st.lists(st.integers(0, 100), max_size=3).map(tuple),
    stop=st.lists(st.text(min_size=1, max_size=5), max_size=2).map(tuple),
    ignore_eos=st.booleans(),
    logprobs=st.one_of(st.none(), st.integers(0, 5)),
    skip_special_tokens=st.booleans(),
    constraint=st.one_of(
        st.none(), st.just(Constraint("regex", "[a-z]+")), st.just(Constraint("json_object"))
    ),
)


@settings(max_examples=60, deadline=None)
@given(
    params, ids, ids, st.integers(0, 2**63 - 1), st.integers(0, 3), st.one_of(st.none(), st.text(max_size=8))
)
def test_a_detached_sequence_reads_back_as_its_resumption(params, prompt, output, seed, index, salt):
    state = DetachedSequence(
        request_id="req-1#1",
        index=index,
        prompt_ids=tuple(prompt),
        output_ids=tuple(output),
        params=params,
        seed=seed,
        lora_name="sql" if salt else None,
        lora_fingerprint="f00d" if salt else None,
        cache_salt=salt or None,
        num_kv_tokens=len(prompt) + len(output) - 1,
    )
    header = header_of(state, LAYOUT, "client-id")
    request = type(header).FromString(header.SerializeToString()).request  # (through the wire)
    assert sampling.params_from_request(request) == dataclasses.replace(params, n=1, seed=seed)
    assert list(request.token_ids.ids) == prompt and list(request.resume_token_ids) == output
    assert (request.request_id, request.lora_adapter, header.lora_fingerprint) == (
        "client-id",
        state.lora_name or "",
        state.lora_fingerprint or "",
    )
    assert request.cache_salt == (salt or "") and header.index == index
    assert header.kv_digest == wire.prompt_digest(prompt + output[:-1])
    assert KVLayout.from_json(header.layout_json) == LAYOUT


def test_a_peers_response_reads_back_as_the_output_of_the_sequence():
    response = gen_pb.GenerateResponse(
        request_id="client-id", token_ids=[5, 6], text="ab", finish_reason=gen_pb.FINISH_REASON_LENGTH
    )
    response.usage.prompt_tokens, response.usage.completion_tokens = 7, 30
    response.logprobs.add(token_id=5, logprob=-0.5)
    output = output_of(response, index=2)
    assert (output.new_token_ids, output.text, output.index) == ([5, 6], "ab", 2)
    assert output.finished and output.finish_reason is FinishReason.LENGTH
    assert (output.num_prompt_tokens, output.num_output_tokens) == (7, 30)
    assert output.logprobs[0].token_id == 5
    running = output_of(gen_pb.GenerateResponse(token_ids=[1], text="x"), index=0)
    assert not running.finished and running.finish_reason is None
