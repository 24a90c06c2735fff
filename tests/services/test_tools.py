"""OpenAI tools (services/decode/tools.py) without a model: tool_choice's shapes, the constraint of a
required or named call, and tool calls parsed out of generated text."""

from __future__ import annotations

import json

import jsonschema
import pytest
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models

from pdserve.engine.core.output import OutputStream
from pdserve.engine.core.request import FinishReason, Request
from pdserve.engine.sampling_params import InvalidRequestError, SamplingParams
from pdserve.engine.tokenizer import Tokenizer
from pdserve.services.decode.tool_formats import detect, marked_by_special_tokens
from pdserve.services.decode.tools import ToolStream, tool_choice

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


# (format, generated text, its content, its calls); each format's text is what its chat templates ask for
FORMAT_CASES = [
    (
        "hermes",
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
        "</tool_call> Done.",
        "Let me look.\n Done.",
        [("get_weather", '{"city": "Oslo"}')],
    ),
    (
        "hermes",
        '<tool_call>{"name": "get_time", "arguments": {}}',
        "",
        [("get_time", "{}")],
    ),  # unclosed at EOS
    ("hermes", "a <tool_call> b", "a <tool_call> b", []),  # not a call: text
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "parameters": {}}',
        "",
        [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")],
    ),
    ("llama3_json", '<|python_tag|>{"name": "get_time", "parameters": {}}', "", [("get_time", "{}")]),
    ("llama3_json", 'It is {"name": "get_time"}', 'It is {"name": "get_time"}', []),  # text first
    ("llama3_json", '{"city": "Oslo"}', '{"city": "Oslo"}', []),  # JSON, not a call
    ("llama3_json", '{"name": "get_time", "parameters": {', '{"name": "get_time", "parameters": {', []),
    (
        "mistral",
        'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
        '{"name": "get_time", "arguments": {}}]',
        "Sure.",
        [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")],
    ),
    (
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]get_time[ARGS]{}',
        "",
        [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")],
    ),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "unknown", "arguments": {}}]',
        '[TOOL_CALLS][{"name": "unknown", "arguments": {}}]',
        [],
    ),
    (
        "deepseek_v3",  # V2.5 / V3: a fenced JSON object per call
        "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
        '{"city": "Oslo"}\n```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n'
        "```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "Checking.",
        [("get_weather", '{"city": "Oslo"}'), ("get_time", "{}")],
    ),
    (
        "deepseek_v3",  # V3.1: name<｜tool▁sep｜>arguments
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
        '{"city": "Oslo"}<｜tool▁call▁end｜><｜tool▁calls▁end｜> Done.',
        " Done.",
        [("get_weather", '{"city": "Oslo"}')],
    ),
    (
        "deepseek_v3",  # cut short: text
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{",
        [],
    ),
]


@pytest.mark.parametrize("fmt, text, content, calls", FORMAT_CASES)
def test_each_format_parses_whole_and_streamed_alike(fmt, text, content, calls):
    """The whole text, and the text streamed in pieces cut anywhere (inside markers and JSON), give the
    same content and calls; text that is no call of these tools stays content."""
    auto = tool_choice({"tools": [WEATHER, TIME]}, format=fmt)
    whole_content, whole_calls = auto.calls(text)
    assert (
        whole_content or "",
        [(c["function"]["name"], c["function"]["arguments"]) for c in whole_calls],
    ) == (
        content.strip(),
        calls,
    )
    for size in (1, 3, 7, len(text)):
        stream = ToolStream(auto)
        deltas = [d for i in range(0, len(text), size) for d in stream.feed(text[i : i + size])]
        more, finish = stream.finish("stop")
        streamed_content, streamed_calls = _joined(deltas + more)
        assert (streamed_content.strip(), streamed_calls) == (content.strip(), calls), size
        assert finish == ("tool_calls" if calls else "stop")


def test_special_token_markers_stay_in_the_text():
    """Mistral's [TOOL_CALLS] is a special token of its tokenizers: the front asks for it in the text
    (skip_special_tokens False), and the engine's output then keeps it."""
    backend = Backend(models.BPE())
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(["[TOOL_CALLS]", "</s>"])
    backend.add_tokens(["get_time", "[ARGS]", "{}"])
    tok = Tokenizer(backend, eos_token_ids=[backend.token_to_id("</s>")])
    assert marked_by_special_tokens("mistral", tok) and not marked_by_special_tokens("hermes", tok)
    ids = tok.encode("[TOOL_CALLS]get_time[ARGS]{}")
    for skip, text in ((True, "get_time[ARGS]{}"), (False, "[TOOL_CALLS]get_time[ARGS]{}")):
        params = SamplingParams(max_tokens=len(ids), skip_special_tokens=skip)
        request = Request("r", [0], params, seed=0)
        stream = OutputStream(request, tok)
        shown = ""
        for i, token in enumerate(ids):
            request.output_ids.append(token)
            if i == len(ids) - 1:  # as the scheduler ends it at max_tokens
                request.finish_reason = FinishReason.LENGTH
            output = stream.on_tokens([token], [None])
            shown += output.text
        assert shown == text and output.finished
    auto = tool_choice({"tools": [TIME]}, format="mistral")
    assert auto.calls(text)[1][0]["function"] == {"name": "get_time", "arguments": "{}"}


def test_formats_are_detected_from_the_chat_template():
    assert detect("{% for m in messages %}<|im_start|>{{ m.content }}{% endfor %}") == "hermes"  # no tools
    assert detect("<tools>{{ tools }}</tools> ... <tool_call>") == "hermes"  # Qwen 2.5
    assert detect('{{- "<|python_tag|>" + tool_call.name }}') == "llama3_json"  # Llama 3.1
    assert detect("[AVAILABLE_TOOLS] {{ tools }} [/AVAILABLE_TOOLS] ... [TOOL_CALLS]") == "mistral"
    assert detect("{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>'}}") == "deepseek_v3"


def test_streamed_deltas_assemble_to_the_whole_answer():
    """Auto streams content at once but for a possible tag, and each call when it closes; named and
    required stream the call's name first, then its arguments as they come."""
    auto = tool_choice({"tools": [WEATHER]})
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
    required = tool_choice({"tools": [WEATHER, TIME], "tool_choice": "required"})
    text = '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"} }'
    for size in (1, 5, len(text)):
        stream = ToolStream(required)
        pieces = [stream.feed(text[i : i + size]) for i in range(0, len(text), size)]
        more, finish = stream.finish("stop")
        assert _joined([d for p in pieces for d in p] + more) == (
            "",
            [("get_weather", '{"city": "Oslo", "unit": "c"}')],
        )
        assert finish == "tool_calls"
        if size == 1:  # the name as soon as it is whole, the arguments before the call ends
            sent = [i for i, p in enumerate(pieces) if p]
            assert sent[0] == len('{"name": "get_weather", "arguments":') - 1
            assert _joined([d for p in pieces[:-3] for d in p])[1][0][1] == '{"city": "Oslo", "unit": "c"'
    cut = ToolStream(required)
    deltas = cut.feed('{"name": "get_time", "arguments": {"a": [1')
    more, finish = cut.finish("length")  # cut short: what came is sent, no tool_calls finish
    assert _joined(deltas + more) == ("", [("get_time", '{"a": [1')]) and finish == "length"
