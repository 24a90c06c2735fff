"""Structured output across the prefill -> decode handoff (the session's daemons on the whole default model,
whose JSON ends; the test model's runs on in whitespace): the prefill server samples
the first token under the request's constraint, the decode server's matcher resumes after it, and the
outputs equal the colocated engine's and validate; a bad constraint is INVALID_ARGUMENT and the daemon
keeps serving."""

from __future__ import annotations

import concurrent.futures
import json

import grpc
import pytest

from pdserve.engine.sampling_params import Constraint
from pdserve.services.client import Client
from pdserve.testing.constraint_schemas import SCHEMAS
from tests.helpers import assert_all_free

pytestmark = pytest.mark.daemon

PROMPT = "Give me a JSON record about a city you like. "


def test_constrained_requests_disaggregated_equal_colocated(full_daemons, full_colocated):
    """Two schemas (greedy: an enum and a bounded number; seeded: nested objects), a chunked prompt under
    json_object, and a free request side by side: every prompt transferred, the tokens equal the colocated
    engine's, and each output validates (every test schema validates colocated: tests/engine)."""
    import jsonschema

    (prefill, decode), colocated = full_daemons, full_colocated
    schemas = [SCHEMAS[1], SCHEMAS[3]]
    jobs = [
        (
            f"{PROMPT}Record {i}:",
            dict(
                max_tokens=96,
                temperature=0.0 if i % 2 == 0 else 0.7,
                seed=i,
                constraint=Constraint("json_schema", json.dumps(schema)),
            ),
        )
        for i, schema in enumerate(schemas)
    ]
    jobs.append((PROMPT * 30, dict(max_tokens=48, temperature=0.0, constraint=Constraint("json_object"))))
    jobs.append((f"{PROMPT}Plainly:", dict(max_tokens=12, temperature=0.0)))
    colocated.prepare(jobs)
    client = Client(decode.address)
    before = client.stats()
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        outs = list(pool.map(lambda job: client.generate(job[0], timeout=300, **job[1]), jobs))
    assert [o.token_ids for o in outs] == [colocated(p, **kw) for p, kw in jobs]
    for out, schema in zip(outs, schemas, strict=False):
        jsonschema.validate(json.loads(out.text), schema)
    assert isinstance(json.loads(outs[2].text), dict) or outs[2].finish_reason == "length"
    after = client.stats()
    assert after.num_transfers_total - before.num_transfers_total == len(jobs)
    assert after.num_transfer_failures_total == before.num_transfer_failures_total
    client.close()
    assert_all_free(decode.address, prefill.address)


@pytest.mark.parametrize(
    "constraint",
    [
        Constraint("json_schema", '{"type": "object", "properties": {"a": {"type": 7}}}'),
        Constraint("regex", "("),
    ],
)
def test_a_bad_constraint_is_invalid_argument_and_the_daemon_keeps_serving(decode, constraint):
    client = Client(decode.address)
    with pytest.raises(grpc.RpcError) as e:
        client.generate(PROMPT, max_tokens=4, constraint=constraint)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "constraint" in e.value.details()
    assert client.generate(PROMPT, max_tokens=4).finish_reason == "length"
    client.close()


def test_openai_response_format_json_schema_and_json_object(full_daemons):
    """The official openai client: response_format json_schema (streamed and not) and json_object; the
    content validates, the stream carries the same text."""
    openai = pytest.importorskip("openai")
    import jsonschema

    _, decode = full_daemons
    client = openai.OpenAI(base_url=f"http://{decode.addresses['http']}/v1", api_key="unused")
    model = client.models.list().data[0].id
    schema = SCHEMAS[1]  # an enum and a bounded number
    messages = [{"role": "user", "content": "Pick a color and a score as JSON."}]
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "pick", "schema": schema, "strict": True},
    }
    kw = dict(model=model, messages=messages, temperature=0, max_tokens=64, response_format=response_format)
    chat = client.chat.completions.create(**kw)
    jsonschema.validate(json.loads(chat.choices[0].message.content), schema)
    assert chat.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(**kw, stream=True))
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == chat.choices[0].message.content
    )
    anything = client.chat.completions.create(
        model=model, messages=messages, temperature=0, max_tokens=64, response_format={"type": "json_object"}
    )
    assert isinstance(json.loads(anything.choices[0].message.content), dict)
    with pytest.raises(openai.BadRequestError, match="response_format"):
        client.chat.completions.create(model=model, messages=messages, response_format={"type": "xml"})
    broken = {"type": "json_schema", "json_schema": {"name": "b", "schema": {"type": "nope"}}}
    with pytest.raises(openai.BadRequestError, match="response_format: invalid json_schema"):
        client.chat.completions.create(model=model, messages=messages, response_format=broken)


def test_openai_tools_required_named_and_auto(full_daemons):
    """tools with tool_choice required and named (streamed and not): a tool call whose arguments validate
    against its parameters, finish_reason tool_calls; auto: text or valid calls."""
    openai = pytest.importorskip("openai")
    import jsonschema

    from tests.services.test_tools import TIME, WEATHER

    _, decode = full_daemons
    client = openai.OpenAI(base_url=f"http://{decode.addresses['http']}/v1", api_key="unused")
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    params = WEATHER["function"]["parameters"]
    named = {"type": "function", "function": {"name": "get_weather"}}
    for choice in ("required", named):
        kw = dict(
            model=model,
            messages=messages,
            tools=[WEATHER, TIME],
            tool_choice=choice,
            temperature=0,
            max_tokens=64,
        )
        out = client.chat.completions.create(**kw).choices[0]
        assert out.finish_reason == "tool_calls" and out.message.content is None
        [call] = out.message.tool_calls
        assert call.type == "function" and call.function.name in ("get_weather", "get_time")
        if call.function.name == "get_weather":
            jsonschema.validate(json.loads(call.function.arguments), params)
        chunks = [c for c in client.chat.completions.create(**kw, stream=True) if c.choices]
        pieces = [t for c in chunks for t in (c.choices[0].delta.tool_calls or [])]  # named: as generated
        assert {t.index for t in pieces} == {0} and pieces[0].function.name == call.function.name
        assert "".join(t.function.arguments or "" for t in pieces) == call.function.arguments
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
    auto = client.chat.completions.create(
        model=model, messages=messages, tools=[WEATHER], temperature=0, max_tokens=32
    ).choices[0]
    for call in auto.message.tool_calls or []:
        jsonschema.validate(json.loads(call.function.arguments), params)
    assert auto.message.tool_calls or isinstance(auto.message.content, str)
    # auto reading a call in the model's format (Hermes here), which a regex makes this small model write
    call_json = r'\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,9}"\}\}'
    hermes = rf"Checking\.\n<tool_call>\n{call_json}\n</tool_call>"
    kw = dict(model=model, messages=messages, tools=[WEATHER], temperature=0, max_tokens=64)
    out = client.chat.completions.create(**kw, extra_body={"guided_regex": hermes}).choices[0]
    assert out.finish_reason == "tool_calls" and out.message.content == "Checking."
    [call] = out.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), params)
    chunks = [
        c for c in client.chat.completions.create(**kw, stream=True, extra_body={"guided_regex": hermes})
    ]
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas).strip() == "Checking."
    [piece] = [t for d in deltas for t in (d.tool_calls or [])]  # the call in one delta once it closed
    assert (piece.function.name, piece.function.arguments) == ("get_weather", call.function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def _schemas():
    """Random JSON schemas of the constructs the tests use, and some that are not schemas at all."""
    from hypothesis import strategies as st

    scalar = st.one_of(
        st.just({"type": "string"}),
        st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(1, 12)),
        st.builds(
            lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
            st.integers(-50, 50),
            st.integers(0, 100),
        ),
        st.just({"type": "number"}),
        st.just({"type": "boolean"}),
        st.builds(
            lambda vs: {"enum": vs},
            st.lists(st.sampled_from(["a", "b", "c", 1, 2, None]), min_size=1, max_size=3, unique=True),
        ),
    )
    names = st.sampled_from(["id", "name", "tags", "score", "ok"])

    def extend(inner):
        return st.one_of(
            st.builds(
                lambda items, n: {"type": "array", "items": items, "maxItems": n}, inner, st.integers(1, 3)
            ),
            st.builds(
                lambda props: {
                    "type": "object",
                    "properties": props,
                    "required": sorted(props),
                    "additionalProperties": False,
                },
                st.dictionaries(names, inner, min_size=1, max_size=3),
            ),
            st.builds(lambda a, b: {"anyOf": [a, b]}, inner, inner),
        )

    valid = st.recursive(scalar, extend, max_leaves=6)
    broken = st.sampled_from(
        [{"type": "nope"}, {"type": "integer", "minimum": "x"}, {"anyOf": "x"}, {"$ref": "#/nowhere"}]
    )
    return st.one_of(valid, valid, valid, broken)


def test_random_schemas_give_valid_outputs_or_invalid_argument(decode):
    """Hypothesis: each random schema's output validates (when it finished) or the request is
    INVALID_ARGUMENT naming the constraint, and so do random grammars; the daemon keeps serving
    throughout."""
    import jsonschema
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    client = Client(decode.address)

    @settings(max_examples=12, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(schema=_schemas())
    def check(schema):
        try:
            out = client.generate(
                PROMPT,
                max_tokens=48,
                temperature=0.0,
                constraint=Constraint("json_schema", json.dumps(schema)),
            )
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "constraint" in e.details(), e.details()
            return
        if out.finish_reason == "stop":
            jsonschema.validate(json.loads(out.text), schema)
        else:
            assert out.finish_reason in ("length", "constraint_dead_end"), out.finish_reason

    @settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(grammar=st.one_of(st.text(max_size=40), st.just("start: x"), st.just('start: "a" start')))
    def check_grammar(grammar):  # mostly not Lark at all: refused; otherwise served
        try:
            out = client.generate(
                PROMPT, max_tokens=8, temperature=0.0, constraint=Constraint("grammar", grammar)
            )
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT and "constraint" in e.details(), e.details()
            return
        assert out.finish_reason in ("stop", "length", "constraint_dead_end")

    check()
    check_grammar()
    assert client.generate(PROMPT, max_tokens=4).finish_reason == "length"
    client.close()
