"""Every input bounded where it enters, at the lowest level that shows it (no model): each knob's range
against what it becomes on the device (engine.sampling_params.BOUNDS), the sizes a request may carry
(services.sampling.Limits), a replica's trailer (check_first_token), the OpenAI body's key types, and log
lines that stay one line whatever a client sent. The end-to-end examples against real daemons are in
tests/services/test_daemons.py; the fuzzer over whole requests run by the engine in
tests/services/test_request_validation.py."""

from __future__ import annotations

import dataclasses
import logging
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.engine.core.request import Request, TokenLogprobs
from pdserve.engine.sampling_params import BOUNDS, INT32_MAX, InvalidRequestError, SamplingParams
from pdserve.services.decode.openai.protocol import BODY_TYPES as _BODY_TYPES
from pdserve.services.decode.openai.protocol import check_types as _check_types
from pdserve.services.decode.prefillers import FirstToken, PrefillError, check_first_token
from pdserve.services.decode.tools import tool_choice
from pdserve.services.logs import TextFormatter
from pdserve.services.sampling import Limits, add_limit_flags, limits_from_flags

pytestmark = pytest.mark.fast

# what hostile clients send: the edges of every width a value passes through on its way to the device
EXTREMES = [
    2**31 - 1,
    2**31,
    2**32,
    2**63,
    2**64,
    -1,
    -(2**31),
    -(2**63),
    0,
    1,
    1e-46,
    1e-39,
    -1e-46,
    3.5e38,
    1e39,
    float("inf"),
    float("-inf"),
    float("nan"),
    True,
    "1",
    None,
    [],
]


def _device_safe(name: str, value) -> bool:
    """What the sampler can take for `name` without overflow, NaN or a zero divisor (the property BOUNDS
    must give): an int32 top_k, finite float32 knobs whose lower ends stay normal."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return value is None and name == "seed"
    if name in ("top_k", "max_tokens"):
        return isinstance(value, int) and 0 <= value <= INT32_MAX and (name == "top_k" or value >= 1)
    if name == "seed":
        return isinstance(value, int) and 0 <= value < 2**63
    if name == "temperature":
        return value == 0 or 1e-6 <= value <= 1e3
    if name in ("top_p", "repetition_penalty"):
        return value >= 1e-6 and value <= (1 if name == "top_p" else 100)
    low, high = (0, 1) if name == "min_p" else (-2, 2)  # min_p; presence and frequency penalties
    return low <= value <= high


@pytest.mark.parametrize("name", sorted(BOUNDS))
@pytest.mark.parametrize("value", EXTREMES, ids=repr)
def test_every_knob_is_refused_naming_it_or_safe_for_the_device(name, value):
    params = dataclasses.replace(SamplingParams(), **{name: value})
    try:
        params.validate(vocab_size=49152, max_logprobs=20)
    except InvalidRequestError as e:
        assert e.field == name and str(BOUNDS[name].high) in str(e), e
        return
    assert _device_safe(name, value), (name, value)


def test_the_issue_s_killers_are_refused():
    """top_k >= 2**31 killed the engine thread (int32 overflow); repetition_penalty 1e-46 is 0 in float32
    (NaN in the answer)."""
    for field, value in (("top_k", 2**31), ("repetition_penalty", 1e-46), ("temperature", 1e-46)):
        with pytest.raises(InvalidRequestError) as e:
            dataclasses.replace(SamplingParams(), **{field: value}).validate(49152, 20)
        assert e.value.field == field
    with pytest.raises(InvalidRequestError, match="logprobs"):
        SamplingParams(logprobs=2**32).validate(49152, 20)
    with pytest.raises(InvalidRequestError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=(49152,)).validate(49152, 20)


def test_limits_name_the_field_and_the_limit():
    limits = Limits()
    limits.check(SamplingParams(stop=("x",) * limits.max_stop_strings))
    for params, field, limit in (
        (SamplingParams(stop=("x",) * (limits.max_stop_strings + 1)), "stop", limits.max_stop_strings),
        (
            SamplingParams(stop=("y" * (limits.max_stop_string_chars + 1),)),
            "stop",
            limits.max_stop_string_chars,
        ),
        (SamplingParams(stop_token_ids=(1,) * 300), "stop_token_ids", limits.max_stop_token_ids),
    ):
        with pytest.raises(InvalidRequestError) as e:
            limits.check(params)
        assert e.value.field == field and f"the limit is {limit}" in str(e.value)
    with pytest.raises(InvalidRequestError, match="messages: 3 characters in all: the limit is 2"):
        limits.check_chat(["a", "bc"], max_chars=2)


def test_fan_out_limits_name_the_field_and_the_limit():
    """n against --max-n (default: half of max_num_seqs) and n x max_tokens against --max-n-tokens;
    allowed_token_ids at most the vocabulary; each refusal names the field and the limit."""
    limits = Limits()
    limits.check_fanout(SamplingParams(n=16), max_num_seqs=32)
    with pytest.raises(InvalidRequestError, match="^n: 17 sequences: the limit is 16$"):
        limits.check_fanout(SamplingParams(n=17), max_num_seqs=32)
    Limits(max_n=32).check_fanout(SamplingParams(n=32), max_num_seqs=32)
    Limits().check_fanout(SamplingParams(n=1), max_num_seqs=1)
    limits.check(SamplingParams(n=8, max_tokens=limits.max_n_tokens // 8))
    with pytest.raises(
        InvalidRequestError, match=f"^n: 131080 tokens in all .*the limit is {limits.max_n_tokens}"
    ):
        limits.check(SamplingParams(n=8, max_tokens=16_385))
    limits.check(SamplingParams(n=1, max_tokens=10**6))  # (one sequence: bounded by the model length)
    SamplingParams(allowed_token_ids=tuple(range(49152))).validate(49152, 20)
    with pytest.raises(
        InvalidRequestError, match="^allowed_token_ids: 49153 token ids: the vocabulary's size is 49152$"
    ):
        SamplingParams(allowed_token_ids=(7,) * 49153).validate(49152, 20)


def test_token_id_lists_are_refused_before_they_are_read():
    """A list past MAX_TOKEN_IDS is refused from its length alone, from a proto (gRPC) or JSON (HTTP),
    before a Python object is made of each id; ids within it are range-checked as one array."""
    from pdserve.engine.sampling_params import MAX_TOKEN_IDS
    from pdserve.services.sampling import params_from_request, params_from_values
    from pdserve.v1 import generation_pb2 as pb

    request = pb.GenerateRequest()
    request.sampling.allowed_token_ids.extend([5] * (MAX_TOKEN_IDS + 1))
    with pytest.raises(
        InvalidRequestError, match=f"^allowed_token_ids: {MAX_TOKEN_IDS + 1} values: the limit"
    ):
        params_from_request(request)
    with pytest.raises(InvalidRequestError, match="^allowed_token_ids: .* values: the limit"):
        params_from_values({"allowed_token_ids": [5] * (MAX_TOKEN_IDS + 1)})
    ids = [3] * 40_000 + [49152]
    with pytest.raises(
        InvalidRequestError, match=r"^allowed_token_ids: must be an int in \[0, 49151\] \(token id 49152\)"
    ):
        SamplingParams(allowed_token_ids=tuple(ids)).validate(49152, 20)
    with pytest.raises(InvalidRequestError, match="^stop_token_ids: .*token id -1"):
        SamplingParams(stop_token_ids=(1, -1)).validate(49152, 20)


@settings(derandomize=True, max_examples=200, deadline=None)
@given(st.text(max_size=300))
def test_request_ids_are_printable_ascii_labels_of_bounded_length(request_id):
    limits = Limits(max_request_id_chars=256)
    ok = len(request_id) <= 256 and all("!" <= c <= "~" for c in request_id)
    try:
        assert limits.check_request_id(request_id) == request_id and ok
    except InvalidRequestError as e:
        assert e.field == "request_id" and not ok


def test_every_limit_has_a_flag():
    import argparse

    parser = argparse.ArgumentParser()
    add_limit_flags(parser)
    assert limits_from_flags(parser.parse_args([])) == Limits()
    assert limits_from_flags(parser.parse_args(["--max-stop-strings", "4"])).max_stop_strings == 4


def _request(logprobs=None) -> Request:
    return Request("r", list(range(40)), SamplingParams(logprobs=logprobs), seed=0)


@pytest.mark.parametrize(
    "first, logprobs",
    [
        (FirstToken(-1, None), None),
        (FirstToken(49152, None), None),
        (FirstToken(5, None, num_cached_tokens=41), None),
        (FirstToken(5, None, num_cached_tokens=-1), None),
        (FirstToken(5, None), 2),  # asked for logprobs, got none
        (FirstToken(5, TokenLogprobs(5, -0.1, [])), None),  # not asked for
        (FirstToken(5, TokenLogprobs(6, -0.1, [])), 0),  # another token's
        (FirstToken(5, TokenLogprobs(5, -0.1, [(1, -1.0)] * 3)), 2),  # more than asked
        (FirstToken(5, TokenLogprobs(5, float("nan"), [])), 0),
        (FirstToken(5, TokenLogprobs(5, -0.1, [(60000, -1.0)])), 1),
        (FirstToken(5, TokenLogprobs(5, 3.0, [])), 0),
    ],
)
def test_a_replica_s_trailer_out_of_range_is_a_failed_prefill(first, logprobs):
    with pytest.raises(PrefillError, match="trailer") as e:
        check_first_token(first, _request(logprobs), 49152, "replica")
    assert e.value.replica_down


def _prompt_entries(tokens=range(1, 40), rank=1, top=1, logprob=-0.5) -> list[TokenLogprobs]:
    return [TokenLogprobs(t, logprob, [(t, logprob)] * top, rank) for t in tokens]


@pytest.mark.parametrize(
    "entries",
    [
        None,  # asked for, none sent
        _prompt_entries(range(1, 39)),  # one short
        _prompt_entries(range(2, 41)),  # another prompt's
        _prompt_entries(rank=0),
        _prompt_entries(top=3),  # more than asked
        _prompt_entries(logprob=0.5),
    ],
)
def test_a_replica_s_prompt_logprobs_out_of_range_are_a_failed_prefill(entries):
    request = Request("r", list(range(40)), SamplingParams(prompt_logprobs=1), seed=0)
    with pytest.raises(PrefillError, match="prompt_logprobs"):
        check_first_token(FirstToken(5, None, 0, entries), request, 49152, "replica")
    check_first_token(FirstToken(5, None, 0, _prompt_entries()), request, 49152, "replica")


def test_a_replica_s_trailer_in_range_passes():
    check_first_token(FirstToken(5, None, 40), _request(), 49152, "r")
    check_first_token(FirstToken(5, TokenLogprobs(5, -0.5, [(5, -0.5), (9, -2.0)])), _request(2), 49152, "r")


@pytest.mark.parametrize("key", sorted(_BODY_TYPES))
@pytest.mark.parametrize("value", [{"a": 1}, [1], "s", 3, 2.5, True])
def test_openai_body_keys_of_the_wrong_type_are_refused_naming_them(key, value):
    kinds = _BODY_TYPES[key]
    ok = isinstance(value, kinds) and (not isinstance(value, bool) or bool in kinds)
    try:
        _check_types({key: value})
        assert ok
    except InvalidRequestError as e:
        assert e.field == key and not ok


@pytest.mark.parametrize("choice", [{"type": "function", "function": "f"}, {"type": "function"}, ["f"], 3])
def test_a_malformed_tool_choice_is_refused_naming_it(choice):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    with pytest.raises(InvalidRequestError) as e:
        tool_choice({"tools": tools, "tool_choice": choice})
    assert e.value.field == "tool_choice"


def test_too_many_tools_are_refused():
    tools = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]
    with pytest.raises(InvalidRequestError, match="129 tools: the limit is 128"):
        tool_choice({"tools": tools})


def test_a_log_line_stays_one_line_whatever_a_client_sent():
    record = logging.makeLogRecord(
        {"msg": "prefill failed: %s", "args": ("bad\nINFO forged",), "request_id": "a\r\nb", "levelno": 20}
    )
    line = TextFormatter().format(record)
    assert "\n" not in line and "\r" not in line
    assert "bad\\nINFO forged" in line and "request_id=a\\r\\nb" in line
