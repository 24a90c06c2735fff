"""OpenAI tools (services/decode/tools.py) without a model: tool_choice's shapes, the constraint of a
required or named call, and tool calls parsed out of generated text."""

from __future__ import annotations

import json

import jsonschema
import pytest

from engine.sampling_params import InvalidRequestError
from services.decode.tools import ToolStream, tool_choice

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


def _joined(deltas):
    """Content and the calls (name, arguments) a client assembles from stream deltas."""
    content, calls = "", {}
    for delta in deltas:
        content += delta.get("content") or ""
        for call in delta.get("tool_calls", []):
            entry = calls.setdefault(call["index"], ["", ""])
            entry[0] += call.get("function", {}).get("name", "")
            entry[1] += call.get("function", {}).get("arguments", "")
    return content, [tuple(c) for _, c in sorted(calls.items())]


def test_streamed_deltas_assemble_to_the_whole_answer():
    """Text split anywhere, even inside a tag: auto streams content at once but for a possible tag, and
    each call when it closes; named streams the arguments as they come; required sends the call whole."""
    call = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    text = f"Let me look.\n<tool_call>\n{call}\n</tool_call> Done."
    auto = tool_choice({"tools": [WEATHER]})
    for cut in range(1, len(text), 7):
        stream = ToolStream(auto)
        deltas = stream.feed(text[:cut]) + stream.feed(text[cut:])
        more, finish = stream.finish("stop")
        assert _joined(deltas + more) == ("Let me look.\n Done.", [("get_weather", '{"city": "Oslo"}')])
        assert finish == "tool_calls"
    first = ToolStream(auto).feed("Sure <tool")
    assert first == [{"content": "Sure "}]  # "<tool" may open a tag: held
    named = ToolStream(
        tool_choice(
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
        )
    )
    deltas = named.feed('{"city"') + named.feed(': "Oslo"}')
    assert len(deltas) == 3 and _joined(deltas) == ("", [("get_weather", '{"city": "Oslo"}')])
    assert named.finish("stop") == ([], "tool_calls") and named.finish("length")[1] == "length"
    required = ToolStream(tool_choice({"tools": [WEATHER], "tool_choice": "required"}))
    assert required.feed('{"name": "get_weather", ') == required.feed('"arguments": {"city": "Oslo"}}') == []
    more, finish = required.finish("stop")
    assert _joined(more) == ("", [("get_weather", '{"city": "Oslo"}')]) and finish == "tool_calls"
