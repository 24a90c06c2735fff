"""Fuzzed Generate requests at the lowest level that shows the property: the decode server's path from a
GenerateRequest to an engine request (wire.prompt_from_proto, sampling.params_from_request,
LLMEngine.make_request) either refuses with an InvalidRequestError naming a field, or accepts a request
that the engine then runs to an answer. (tests/services/test_daemons.py sends bad requests to a real
decode-server: INVALID_ARGUMENT, and it keeps serving.)"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.engine.sampling_params import InvalidRequestError
from pdserve.services import wire
from pdserve.services.client import build_request
from pdserve.services.sampling import Limits, params_from_request

pytestmark = pytest.mark.model

LIMITS = Limits()

FIELDS_NAMED = {
    "prompt",
    "prompt_token_ids",
    "chat",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "max_tokens",
    "logprobs",
    "stop",
    "stop_token_ids",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
}


# integers at every width a value passes through (int32, uint32, int64, uint64 on the wire), floats at
# float32's underflow and overflow: a proto field takes what its width holds, so the extremes are its edges
U32 = st.one_of(st.integers(0, 100_000), st.sampled_from([2**31 - 1, 2**31, 2**32 - 1]))
F32 = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, width=32),
    st.sampled_from([1e-45, -1e-45, 1e-38, 3.4e38, -3.4e38, 0.0, -0.0]),
)
TEXT = st.one_of(st.text(max_size=8), st.sampled_from(["x" * 600, "\n", "\x00"]))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    text=st.one_of(st.none(), st.text(max_size=200)),
    ids=st.lists(st.integers(-5, 60_000), max_size=40),
    chat=st.one_of(st.none(), st.lists(st.text(max_size=20), max_size=2)),
    temperature=F32,
    top_p=st.one_of(st.none(), F32),
    top_k=U32,
    min_p=F32,
    repetition_penalty=st.one_of(st.none(), F32),
    presence_penalty=F32,
    max_tokens=st.one_of(st.integers(0, 5000), st.sampled_from([2**31, 2**32 - 1])),
    logprobs=st.one_of(st.none(), U32),
    seed=st.one_of(st.none(), st.sampled_from([0, 2**63 - 1, 2**63, 2**64 - 1])),
    stop=st.lists(TEXT, max_size=70),
    stop_token_ids=st.lists(st.integers(-(2**31), 2**31 - 1), max_size=3),
)
def test_fuzzed_requests_are_refused_naming_a_field_or_answered(make_engine, text, ids, chat, **fields):
    engine = make_engine()
    if chat is not None:
        request = build_request(chat=[{"role": "user", "content": c} for c in chat], **fields)
    else:
        request = build_request(text if text is not None else ids, **fields)
    try:
        prompt = wire.prompt_from_proto(request, engine.tokenizer, LIMITS, engine.config.max_prompt_chars)
        params = params_from_request(request)
        LIMITS.check(params)
        engine_request = engine.make_request(prompt, params)
    except InvalidRequestError as e:
        assert e.field in FIELDS_NAMED, e
        return
    # accepted: it runs to an answer (two tokens are enough to show it; the length is not the point)
    short = dataclasses.replace(params, max_tokens=min(params.max_tokens, 2))
    (result,) = engine.generate([engine_request.prompt_ids], short)
    assert result.finish_reason is not None and 1 <= len(result.token_ids) <= 2


@pytest.fixture(scope="module")
def frontend(make_engine):
    """The decode server's OpenAI front over the default engine, not started: its parsing and validation
    (GenerationCore's make_request included) are what the fuzzer below drives."""
    from pdserve.services.decode.core import GenerationCore
    from pdserve.services.decode.openai.server import OpenAIFrontend
    from pdserve.services.engine_loop import EngineLoop

    return OpenAIFrontend(GenerationCore(EngineLoop(make_engine())))


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.sampled_from([0, 1, -1, 2**31, 2**32, 2**63, 2**64, -(2**63), 1e-46, 3.5e38, 1e308, -0.0])
    | st.integers()
    | st.floats()
    | st.text(max_size=6),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=6), children, max_size=3)
    ),
    max_leaves=6,
)


def _openai_keys():
    from pdserve.services.decode.openai.protocol import BODY_TYPES, GUIDED, UNSUPPORTED
    from pdserve.services.sampling import FIELD_NAMES

    return sorted(FIELD_NAMES | BODY_TYPES.keys() | GUIDED.keys() | UNSUPPORTED.keys())


@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    chat=st.booleans(),
    text=st.text(max_size=40),
    extra=st.dictionaries(st.sampled_from(_openai_keys()), JSON, max_size=5),
)
def test_fuzzed_openai_bodies_are_refused_naming_a_key_or_answered(frontend, make_engine, chat, text, extra):
    """Every key an OpenAI body may carry, with values of any JSON type and at every width's edge: a 400
    naming one of the body's keys (or the chat's / prompt's), or an engine request that runs."""
    from pdserve.services.decode.openai.protocol import check_fields, check_types

    base = {"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text}
    body = {**base, **extra}
    try:
        check_types(body)
        check_fields(body)
        engine_request, _ = frontend.engine_request(body, chat)
    except InvalidRequestError as e:
        assert e.field in set(body) | {"messages", "prompt", "prompt_token_ids"}, (e, body)
        return
    short = dataclasses.replace(engine_request.params, max_tokens=1)
    (result,) = make_engine().generate([engine_request.prompt_ids], short)
    assert result.finish_reason is not None
