"""How chat models write tool calls into their text, read as it streams (OpenAI `tool_choice` "auto").

  hermes       `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number, between text
               (Hermes, Qwen 2.5 and 3, and most chat templates with tools)
  llama3_json  the whole output is `{"name": ..., "parameters": {...}}` objects separated by ";", maybe
               after `<|python_tag|>` (Llama 3.1 to 3.3's JSON tool calling)
  mistral      `[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}` (Mistral's v3 tokenizers), or
               `name[ARGS]{...}` after each `[TOOL_CALLS]` (v11 and later)
  deepseek_v3  `<｜tool▁calls▁begin｜>`, calls `<｜tool▁call▁begin｜>function<｜tool▁sep｜>name` + a ```json
               fence (V2.5, V3) or `name<｜tool▁sep｜>{...}` (V3.1), each up to `<｜tool▁call▁end｜>`, then
               `<｜tool▁calls▁end｜>`

The decode server takes the format its chat template writes (`detect`) unless `--tool-call-parser` names
one. A parser turns text deltas into events: text (content) or a `ParsedCall`. Text that may still become
a call (a marker's start, a call not yet closed) is held; at `finish` what never became a call is text.
An object naming none of the request's tools is text too.
"""

from __future__ import annotations

import dataclasses
import json
import re

_JSON = json.JSONDecoder()


@dataclasses.dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of the arguments object


Event = str | ParsedCall  # str: content


def _call_of(value, names: frozenset[str], keys: tuple[str, ...] = ("arguments",)) -> ParsedCall | None:
    """`{"name": one of names, <one of keys>: {...}}` as a call (a missing arguments object is {})."""
    if not isinstance(value, dict) or value.get("name") not in names:
        return None
    arguments = next((value[k] for k in keys if k in value), {})
    return ParsedCall(value["name"], json.dumps(arguments)) if isinstance(arguments, dict) else None


def _json_at(text: str, start: int = 0) -> tuple[object, int] | None:
    """The JSON value at `start` (after whitespace) and the index after it; None: not (yet) one."""
    start += len(text[start:]) - len(text[start:].lstrip())
    try:
        return _JSON.raw_decode(text, start)
    except ValueError:
        return None


def _marker_start(text: str, marker: str) -> int:
    """Where a tail of `text` that may grow into `marker` begins (len(text): none)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return len(text) - n
    return len(text)


class _MarkerParser:
    """Text with calls that each start with `marker`: text streams out as content bar a possible marker's
    start; a call is held from its marker until `_body` reads it whole."""

    marker = ""
    markers: tuple[str, ...] = ()  # every piece of text that marks its calls

    def __init__(self, names: frozenset[str]):
        self.names = names
        self.held = ""

    def feed(self, text: str, final: bool = False) -> list[Event]:
        self.held += text
        events: list[Event] = []
        while True:
            start = self.held.find(self.marker)
            if start < 0:
                cut = len(self.held) if final else _marker_start(self.held, self.marker)
                events.append(self.held[:cut])
                self.held = self.held[cut:]
                return [e for e in events if e]
            events.append(self.held[:start])
            self.held = self.held[start:]
            read = self._body(self.held[len(self.marker) :], final)
            if read is None:  # not whole yet
                return [e for e in events if e]
            calls, used = read
            used += len(self.marker)
            events.extend(calls or [self.held[:used]])  # no call of these tools: it was text
            self.held = self.held[used:]

    def finish(self) -> list[Event]:
        return self.feed("", final=True)

    def _body(self, body: str, final: bool) -> tuple[list[ParsedCall], int] | None:
        """(the calls, characters used) of the text after a marker; None: wait for more (never when
        `final`); no calls: the marker and those characters are text."""
        raise NotImplementedError


class HermesParser(_MarkerParser):
    marker, close = "<tool_call>", "</tool_call>"
    markers = (marker, close)

    def _body(self, body, final):
        end = body.find(self.close)
        if end < 0 and not final:
            return None
        used = len(body) if end < 0 else end + len(self.close)
        read = _json_at(body[: len(body) if end < 0 else end])
        call = _call_of(read[0], self.names) if read else None
        return ([call] if call else []), used


class MistralParser(_MarkerParser):
    marker, args = "[TOOL_CALLS]", "[ARGS]"
    markers = (marker, args)
    _named = re.compile(r"\s*([A-Za-z_][\w.-]*)" + re.escape(args))  # v11: name[ARGS]{...}

    def _body(self, body, final):
        if body.lstrip().startswith("["):  # v3: a list of calls
            read = _json_at(body)
            if read is None:
                return ([], len(body)) if final else None
            value, end = read
            calls = [_call_of(v, self.names) for v in value] if isinstance(value, list) and value else [None]
            return ([] if None in calls else calls), end
        named = self._named.match(body)
        read = _json_at(body, named.end()) if named else None
        if read is None:
            return ([], len(body)) if final else None
        call = _call_of({"name": named.group(1), "arguments": read[0]}, self.names)
        return ([call] if call else []), read[1]


class DeepSeekParser(_MarkerParser):
    marker, end = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    call_begin, call_end, sep = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
    markers = (marker, end, call_begin, call_end, sep)
    _call = re.compile(f"{call_begin}(.*?){call_end}", re.DOTALL)
    _fenced = re.compile(rf"\s*function{sep}(.+?)\n```(?:json)?\n(.*)\n```\s*", re.DOTALL)
    _plain = re.compile(rf"\s*(.+?){sep}(.*)", re.DOTALL)

    def _body(self, body, final):
        end = body.find(self.end)
        if end < 0 and not final:
            return None
        block = body if end < 0 else body[:end]
        calls = [self._read(m.group(1)) for m in self._call.finditer(block)] or [None]
        return ([] if None in calls else calls), len(body) if end < 0 else end + len(self.end)

    def _read(self, text: str) -> ParsedCall | None:
        match = self._fenced.fullmatch(text) or self._plain.fullmatch(text)
        read = _json_at(match.group(2)) if match else None
        if read is None or match.group(2)[read[1] :].strip():
            return None
        return _call_of({"name": match.group(1).strip(), "arguments": read[0]}, self.names)


class Llama3JsonParser:
    """The output is calls if it starts with `{` or `<|python_tag|>`, else text."""

    tag = "<|python_tag|>"
    markers = (tag,)

    def __init__(self, names: frozenset[str]):
        self.names = names
        self.held = ""
        self.calls: bool | None = None  # undecided until the first non-blank text

    def feed(self, text: str, final: bool = False) -> list[Event]:
        self.held += text
        if self.calls is None:
            start = self.held.lstrip()
            if not final and (not start or self.tag.startswith(start)):
                return []
            self.calls = start.startswith(("{", self.tag))
        events: list[Event] = []
        at = 0
        while self.calls:
            rest = self.held[at:].lstrip().removeprefix(self.tag).lstrip(" \t\n;")
            at = len(self.held) - len(rest)
            if not rest:
                break
            read = _json_at(self.held, at)
            if read is None and not final:
                break
            call = _call_of(read[0], self.names, ("parameters", "arguments")) if read else None
            if call is None:  # not a call: the rest is text
                self.calls = False
                break
            events.append(call)
            at = read[1]
        if not self.calls or final:
            events.append(self.held[at:])
            at = len(self.held)
        self.held = self.held[at:]
        return [e for e in events if e]

    def finish(self) -> list[Event]:
        return self.feed("", final=True)


PARSERS = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
    "deepseek_v3": DeepSeekParser,
}


def marked_by_special_tokens(fmt: str, tokenizer) -> bool:
    """Whether a marker of `fmt` is one special token of `tokenizer` (engine.tokenizer.Tokenizer): then the
    text the parser reads must keep special tokens (SamplingParams.skip_special_tokens False)."""
    return any(
        len(ids := tokenizer.encode(marker)) == 1 and ids[0] in tokenizer.special_ids
        for marker in PARSERS[fmt].markers
    )


def detect(chat_template: str | None) -> str:
    """The format a chat template asks for (hermes when it says nothing of tools)."""
    template = chat_template or ""
    if MistralParser.marker in template or "[AVAILABLE_TOOLS]" in template:
        return "mistral"
    if Llama3JsonParser.tag in template:
        return "llama3_json"
    if DeepSeekParser.marker in template:
        return "deepseek_v3"
    return "hermes"
