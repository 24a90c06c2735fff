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

from engine.sampling_params import InvalidRequestError
from services import wire
from services.client import build_request
from services.sampling import params_from_request

pytestmark = pytest.mark.model

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


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    text=st.one_of(st.none(), st.text(max_size=200)),
    ids=st.lists(st.integers(-5, 60_000), max_size=40),
    chat=st.one_of(st.none(), st.lists(st.text(max_size=20), max_size=2)),
    temperature=st.floats(allow_nan=True, allow_infinity=True, width=32),
    top_p=st.one_of(st.none(), st.floats(-1, 2, width=32)),
    top_k=st.integers(0, 100_000),
    min_p=st.floats(-1, 2, width=32),
    repetition_penalty=st.one_of(st.none(), st.floats(-1, 3, width=32)),
    presence_penalty=st.floats(-3, 3, width=32),
    max_tokens=st.integers(0, 5000),
    logprobs=st.one_of(st.none(), st.integers(0, 100)),
    stop=st.lists(st.text(max_size=5), max_size=3),
    stop_token_ids=st.lists(st.integers(-2, 50_000), max_size=2),
)
def test_fuzzed_requests_are_refused_naming_a_field_or_answered(make_engine, text, ids, chat, **fields):
    engine = make_engine()
    if chat is not None:
        request = build_request(chat=[{"role": "user", "content": c} for c in chat], **fields)
    else:
        request = build_request(text if text is not None else ids, **fields)
    try:
        prompt = wire.prompt_from_proto(request, engine.tokenizer)
        params = params_from_request(request)
        engine_request = engine.make_request(prompt, params)
    except InvalidRequestError as e:
        assert e.field in FIELDS_NAMED, e
        return
    # accepted: it runs to an answer (two tokens are enough to show it; the length is not the point)
    short = dataclasses.replace(params, max_tokens=min(params.max_tokens, 2))
    (result,) = engine.generate([engine_request.prompt_ids], short)
    assert result.finish_reason is not None and 1 <= len(result.token_ids) <= 2
