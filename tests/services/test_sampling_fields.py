"""The one mapping of sampling parameters (services/sampling.py): every knob survives every interface.

SamplingParams -> GenerateRequest -> SamplingParams, -> PrefillRequest (all but max_tokens), -> the
`pdserve generate` flags -> the request the CLI sends, -> Client keywords -> build_request, and -> an
OpenAI body -> the HTTP front's parser: each round trip gives back the same SamplingParams, for any value
of every field. And the table covers every field of SamplingParams and of the protos.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from pdserve.cli import build_parser, generate_request
from pdserve.engine.sampling_params import Constraint, InvalidRequestError, SamplingParams
from pdserve.services.client import build_request
from pdserve.services.decode.openai.protocol import sampling_params as openai_params
from pdserve.services.sampling import FIELDS, params_from_request, params_to_request
from pdserve.v1 import generation_pb2 as pb
from pdserve.v1 import prefill_pb2

pytestmark = pytest.mark.fast

f32 = st.floats(-2, 2, width=32, allow_subnormal=False)  # proto floats are 32-bit
words = st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\x00"), min_size=1, max_size=6)
sampling_params = st.builds(
    SamplingParams,
    temperature=f32.map(abs),
    top_k=st.integers(0, 1000),
    top_p=st.floats(0.25, 1, width=32),
    min_p=st.floats(0, 1, width=32, allow_subnormal=False),  # (x / 2 of a float32 may not be one)
    repetition_penalty=st.floats(0.5, 3, width=32),
    presence_penalty=f32,
    frequency_penalty=f32,
    seed=st.one_of(st.none(), st.integers(0, 2**63 - 1)),
    max_tokens=st.integers(1, 4096),
    stop_token_ids=st.lists(st.integers(0, 49151), max_size=3).map(tuple),
    stop=st.lists(words, max_size=3).map(tuple),
    n=st.integers(1, 8),
    allowed_token_ids=st.lists(st.integers(0, 49151), max_size=3).map(tuple),
    bad_words=st.lists(words.filter(str.strip), max_size=2).map(tuple),
    reasoning_end=st.lists(st.integers(0, 49151), max_size=2).map(tuple),
    ignore_eos=st.booleans(),
    skip_special_tokens=st.booleans(),
    logprobs=st.one_of(st.none(), st.integers(0, 20)),
    prompt_logprobs=st.one_of(st.none(), st.integers(0, 20)),
    min_tokens=st.integers(0, 8),
    logit_bias=st.dictionaries(st.integers(0, 49151), st.floats(-100, 100, width=32), max_size=3).map(
        lambda d: tuple(sorted(d.items()))
    ),
)
constraints = st.one_of(
    st.none(),
    st.builds(Constraint, st.sampled_from(["json_schema", "regex", "grammar"]), words),
    st.just(Constraint("json_object")),
    st.builds(Constraint, st.just("choice"), choices=st.lists(words, min_size=1, max_size=3).map(tuple)),
)
constrained_params = st.builds(dataclasses.replace, sampling_params, constraint=constraints)


def _keywords(params: SamplingParams) -> dict:
    return {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}


def test_the_table_covers_every_field():
    names = {f.name for f in FIELDS}
    assert names | {"constraint"} == {f.name for f in dataclasses.fields(SamplingParams)}  # a message
    proto = (
        set(pb.SamplingParameters.DESCRIPTOR.fields_by_name)
        | set(pb.StopConditions.DESCRIPTOR.fields_by_name)
        | {"max_tokens"}
    )
    assert names == proto
    for field in FIELDS:
        where = pb.GenerateRequest if field.message == "request" else getattr(pb, _message(field))
        assert field.name in where.DESCRIPTOR.fields_by_name, field


def _message(field) -> str:
    return {"sampling": "SamplingParameters", "stop": "StopConditions"}[field.message]


@settings(max_examples=200, deadline=None)
@given(params=constrained_params)
def test_proto_round_trip(params):
    assert params_from_request(params_to_request(params, pb.GenerateRequest())) == params
    prefill = params_to_request(params, prefill_pb2.PrefillRequest())
    assert params_from_request(prefill) == dataclasses.replace(params, max_tokens=256)


@settings(max_examples=200, deadline=None)
@given(params=constrained_params)
def test_client_keywords_round_trip(params):
    request = build_request("hi", **_keywords(params))
    assert params_from_request(request) == params


@settings(max_examples=100, deadline=None)
@given(params=sampling_params)
@example(params=SamplingParams(stop=("--", "x"), bad_words=("--",)))  # (argparse 3.11 drops a value `--`)
def test_cli_flags_round_trip(params):
    argv = ["generate"]
    for field in FIELDS:
        value = getattr(params, field.name)
        if field.kind is bool:
            argv.append(field.cli_flag if value else "--no-" + field.cli_flag.removeprefix("--"))
        elif field.mapping:
            argv += [f"{field.cli_flag}={token}={item!r}" for token, item in value]
        elif field.repeated:
            for item in value:
                argv.append(f"{field.cli_flag}={item}")
        elif value is not None:
            argv.append(f"{field.cli_flag}={value!r}" if field.kind is float else f"{field.cli_flag}={value}")
    args = build_parser().parse_args([*argv, "--", "a prompt"])
    assert params_from_request(generate_request(args)) == params


@settings(max_examples=200, deadline=None)
@given(params=sampling_params)
def test_openai_body_round_trip(params):
    body = {"model": "m", "prompt": "hi", **_keywords(params)}
    del body["constraint"]  # OpenAI's response_format and tools (test_openai_constraints)
    body["stop"] = list(params.stop)
    body["stop_token_ids"] = list(params.stop_token_ids)
    assert openai_params(body, chat=False) == params


def test_unset_fields_take_each_apis_defaults():
    grpc_default = params_from_request(build_request("hi"))
    assert grpc_default.greedy and grpc_default.max_tokens == 256 and grpc_default.top_p == 1.0
    assert grpc_default.seed is None and grpc_default.logprobs is None
    openai_default = openai_params({"prompt": "hi"}, chat=False)
    assert openai_default == SamplingParams(max_tokens=16)  # OpenAI: temperature 1


@pytest.mark.parametrize(
    "body, field",
    [
        ({"temperature": "hot"}, "temperature"),
        ({"seed": 1.5}, "seed"),
        ({"stop": [1]}, "stop"),
        ({"stop_token_ids": "1"}, "stop_token_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"top_k": True}, "top_k"),
    ],
)
def test_openai_type_errors_name_the_field(body, field):
    with pytest.raises(InvalidRequestError) as err:
        openai_params(body, chat=False)
    assert err.value.field == field


def test_openai_shapes():
    assert openai_params({"stop": "x"}, chat=False).stop == ("x",)
    assert openai_params({"logprobs": True, "top_logprobs": 3}, chat=False).logprobs == 3  # chat
    assert openai_params({"logprobs": True}, chat=False).logprobs == 0
    assert openai_params({"logprobs": False, "top_logprobs": 3}, chat=False).logprobs is None
    assert openai_params({"max_completion_tokens": 7}, chat=False).max_tokens == 7


def test_unknown_client_keyword_is_a_type_error():
    with pytest.raises(TypeError, match="temprature"):
        build_request("hi", temprature=0.5)


def test_openai_constraints():
    """response_format, vLLM's structured_outputs and its older guided_* keys -> the constraint; shapes
    checked, naming the key; at most one of them."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    wrapped = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema, "strict": True}}
    assert openai_params({"response_format": wrapped}, chat=False).constraint == Constraint(
        "json_schema", json.dumps(schema)
    )
    assert openai_params({"response_format": {"type": "json_object"}}, chat=False).constraint == Constraint(
        "json_object"
    )
    assert openai_params({"response_format": {"type": "text"}}, chat=False).constraint is None
    assert openai_params({"guided_regex": "a+"}, chat=False).constraint == Constraint("regex", "a+")
    assert openai_params({"guided_choice": ["x", "y"]}, chat=False).constraint == Constraint(
        "choice", choices=("x", "y")
    )
    assert openai_params({"guided_json": schema}, chat=False).constraint == Constraint(
        "json_schema", json.dumps(schema)
    )
    structured = {
        "json": (schema, Constraint("json_schema", json.dumps(schema))),
        "regex": ("a+", Constraint("regex", "a+")),
        "grammar": ("start: x", Constraint("grammar", "start: x")),
        "choice": (["x", "y"], Constraint("choice", choices=("x", "y"))),
        "json_object": (True, Constraint("json_object")),
    }
    for key, (value, constraint) in structured.items():
        assert openai_params({"structured_outputs": {key: value}}, chat=False).constraint == constraint
    for body, field in [
        ({"structured_outputs": {"choice": "x"}}, "structured_outputs"),
        ({"structured_outputs": {"json": schema, "regex": "a"}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a"}, "guided_regex": "a"}, "guided_regex"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a"}}}, "response_format"),
        ({"guided_choice": "x"}, "guided_choice"),
        ({"guided_regex": "a", "guided_grammar": "start: x"}, "guided_grammar"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ]:
        with pytest.raises(InvalidRequestError) as err:
            openai_params(body, chat=False)
        assert err.value.field == field


def test_cli_constraint_flags(tmp_path):
    grammar = tmp_path / "g.lark"
    grammar.write_text('start: "yes" | "no"')
    cases = [
        (["--json-schema", '{"type": "object"}'], Constraint("json_schema", '{"type": "object"}')),
        (["--json-object"], Constraint("json_object")),
        (["--regex", "[a-z]+"], Constraint("regex", "[a-z]+")),
        (["--grammar", f"@{grammar}"], Constraint("grammar", 'start: "yes" | "no"')),
        (["--choice", "yes", "--choice", "no"], Constraint("choice", choices=("yes", "no"))),
        ([], None),
    ]
    for flags, constraint in cases:
        args = build_parser().parse_args(["generate", *flags, "--", "a prompt"])
        assert params_from_request(generate_request(args)).constraint == constraint
    with pytest.raises(SystemExit):  # at most one
        build_parser().parse_args(["generate", "--regex", "a", "--json-object", "--", "p"])


def test_openai_fields_at_their_defaults_or_null_pass():
    """n and best_of null or 1 (what clients send when they mean the default) are served; n null is 1;
    best_of past 1 is refused (vLLM removed it)."""
    from pdserve.services.decode.openai.protocol import check_fields, knobs

    check_fields({"n": None, "best_of": None})
    check_fields({"n": 1, "best_of": 1})
    assert knobs({"n": None}, chat=False).n == 1 and knobs({"n": 3}, chat=True).n == 3
    with pytest.raises(InvalidRequestError) as err:
        check_fields({"best_of": 2})
    assert err.value.field == "best_of"


def test_generation_config_gives_the_http_apis_defaults(tmp_path):
    """generation_config.json's sampling keys (vLLM's --generation-config auto) are the defaults of an
    OpenAI body that does not set them; a body's own value (null is unset) wins; a bad file is refused."""
    from pdserve.engine.loading.checkpoints import CheckpointError
    from pdserve.engine.loading.sources import generation_defaults
    from pdserve.services.decode.openai.protocol import knobs

    assert generation_defaults(tmp_path) == {}
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 77, "do_sample": True})
    )
    defaults = generation_defaults(tmp_path)
    assert defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 77}
    params = knobs({"prompt": "x", "top_p": None}, False, defaults)
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (0.6, 0.95, 20, 77)
    params = knobs({"prompt": "x", "temperature": 0, "max_tokens": 5}, True, defaults)
    assert (params.temperature, params.top_k, params.max_tokens) == (0, 20, 5)
    assert knobs({"prompt": "x"}, False).temperature == 1.0  # OpenAI's without a generation config
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": "hot"}))
    with pytest.raises(CheckpointError, match="temperature"):
        generation_defaults(tmp_path)
