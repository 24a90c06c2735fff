"""OpenAI tools (services/decode/tools.py) without a model: tool_choice's shapes, the constraint of a
required or named call, and tool calls parsed out of generated text."""

from __future__ import annotations

import json

import jsonschema
import pytest

from engine.sampling_params import InvalidRequestError
from services.decode.tools import tool_choice

pytestmark = pytest.mark.fast

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters: any object


def test_required_and_named_calls_are_constrained_and_parsed():
    required = tool_choice({"tools": [WEATHER, TIME], "tool_choice": "required"})
    schema = json.loads(required.constraint().value)
    call = {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}
    jsonschema.validate(call, schema)
    with pytest.raises(jsonschema.ValidationError):  # the name picks the arguments' schema
        jsonschema.validate({"name": "get_weather", "arguments": {"unit": "c"}}, schema)
    content, calls = required.calls(json.dumps(call))
    assert content is None and [c["function"]["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["function"]["arguments"]) == call["arguments"]
    named = tool_choice(
        {"tools": [WEATHER, TIME], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    )
    assert json.loads(named.constraint().value) == WEATHER["function"]["parameters"]
    content, calls = named.calls('{"city": "Oslo"}')
    assert content is None and calls[0]["function"] == {
        "name": "get_weather",
        "arguments": '{"city": "Oslo"}',
    }


def test_auto_parses_hermes_calls_and_leaves_plain_text():
    auto = tool_choice({"tools": [WEATHER]})
    assert auto.mode == "auto" and auto.constraint() is None
    text = 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
    content, calls = auto.calls(text)
    assert content == "Let me look." and json.loads(calls[0]["function"]["arguments"]) == {"city": "Oslo"}
    assert auto.calls("It is sunny.") == ("It is sunny.", [])
    assert auto.calls('<tool_call>{"name": "unknown", "arguments": {}}</tool_call>')[1] == []
    assert tool_choice({"tools": [WEATHER], "tool_choice": "none"}).calls("text") == ("text", [])


@pytest.mark.parametrize(
    "body, field",
    [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"tools": "get_weather"}, "tools"),
        ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
        ),
    ],
)
def test_bad_tools_name_the_key(body, field):
    with pytest.raises(InvalidRequestError) as e:
        tool_choice(body)
    assert e.value.field == field
