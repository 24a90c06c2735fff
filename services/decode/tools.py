"""OpenAI tools on the chat API: `tools` + `tool_choice` -> the request's constraint (and the chat template's
`tools`), and the generated text -> `tool_calls`.

  tool_choice "none"        the tools go to the template; the output is text
  tool_choice "auto"        the same; calls the model writes in its own format (services.decode.tool_formats:
                            Hermes `<tool_call>`, Llama 3's JSON, Mistral's `[TOOL_CALLS]`) are parsed out of
                            the text into `tool_calls`
  tool_choice "required"    the output is constrained to one call: {"name": one of the tools,
                            "arguments": that tool's parameters}
  {"type": "function", ...} the output is constrained to the named function's arguments
A call ends the choice with finish_reason "tool_calls".
"""

from __future__ import annotations

import dataclasses
import json
import re
import uuid

from pdserve.engine.sampling_params import Constraint, InvalidRequestError
from pdserve.services.decode.tool_formats import PARSERS, ParsedCall

_ANY_OBJECT = {"type": "object"}
# a required call's text up to its arguments (llguidance keeps the schema's property order)
_REQUIRED_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')


@dataclasses.dataclass(frozen=True)
class ToolChoice:
    tools: tuple[dict, ...]  # each tool's OpenAI "function" object
    mode: str  # "none", "auto", "required" or "named"
    name: str | None = None  # the named function
    format: str = "hermes"  # how the model writes calls (tool_formats.PARSERS), for "auto"

    @property
    def template_tools(self) -> list[dict]:
        """What the chat template gets as `tools` (OpenAI's shape, as transformers passes it)."""
        return [{"type": "function", "function": f} for f in self.tools]

    def constraint(self) -> Constraint | None:
        """The constraint that forces a call (None: free text)."""
        params = {f["name"]: f.get("parameters") or _ANY_OBJECT for f in self.tools}
        if self.mode == "named":
            return Constraint("json_schema", json.dumps(params[self.name]))
        if self.mode != "required":
            return None
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": schema},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for name, schema in params.items()
        ]
        return Constraint("json_schema", json.dumps(calls[0] if len(calls) == 1 else {"anyOf": calls}))

    def parser(self):
        """A fresh reader of the model's own call format (tool_formats), for "auto"."""
        return PARSERS[self.format](frozenset(f["name"] for f in self.tools))

    def calls(self, text: str) -> tuple[str | None, list[dict]]:
        """(the message's content, its tool calls) from the whole generated text; ValueError when a
        required call's text is not its JSON (it stopped short)."""
        if self.mode == "named":
            return None, [_call(self.name, text)]
        if self.mode == "required":  # the arguments as generated, as ToolStream sends them
            head = _REQUIRED_HEAD.match(text)
            arguments = _without_call_close(text[head.end() :]).lstrip() if head else ""
            json.loads(arguments)
            return None, [_call(json.loads(head.group(1)), arguments)]
        if self.mode == "auto":
            parser = self.parser()
            events = parser.feed(text) + parser.finish()
            calls = [_call(e.name, e.arguments) for e in events if isinstance(e, ParsedCall)]
            if calls:
                content = "".join(e for e in events if isinstance(e, str)).strip()
                return content or None, calls
        return text, []


class ToolStream:
    """A streamed chat's text deltas -> OpenAI stream deltas. "none": content. "auto": content as it comes
    but for what may become a call (tool_formats holds it), each call once whole. "named" and "required":
    the call's header, then its arguments as they are generated."""

    def __init__(self, choice: ToolChoice):
        self.choice = choice
        self.parser = choice.parser() if choice.mode == "auto" else None
        self.held = ""  # a required call's text not sent yet
        self.arguments_sent = False
        self.num_calls = 0

    def feed(self, text: str) -> list[dict]:
        """Deltas for the next piece of generated text."""
        mode = self.choice.mode
        if mode == "none":
            return [{"content": text}] if text else []
        if mode == "auto":
            return self._deltas(self.parser.feed(text))
        if mode == "named":
            deltas = [] if self.num_calls else [self._header(self.choice.name)]
            self.num_calls = 1
            return deltas + ([_arguments(text)] if text else [])
        self.held += text  # required: {"name": "...", "arguments": {...}}
        deltas = []
        if not self.num_calls:
            head = _REQUIRED_HEAD.match(self.held)
            if head is None:
                return []
            deltas.append(self._header(json.loads(head.group(1))))
            self.held = self.held[head.end() :]
        if not self.arguments_sent:  # blanks before the arguments are the call's
            self.held = self.held.lstrip()
        # the arguments, less a tail of closing braces and blanks that may be the call's own "}"
        cut = len(self.held.rstrip("} \t\r\n"))
        if cut:
            self.arguments_sent = True
            deltas.append(_arguments(self.held[:cut]))
            self.held = self.held[cut:]
        return deltas

    def _header(self, name: str) -> dict:
        self.num_calls += 1
        return {"tool_calls": [{"index": self.num_calls - 1, **_call(name, "")}]}

    def _deltas(self, events) -> list[dict]:
        deltas = []
        for event in events:
            if isinstance(event, str):
                deltas.append({"content": event})
            else:
                deltas.append(
                    {"tool_calls": [{"index": self.num_calls, **_call(event.name, event.arguments)}]}
                )
                self.num_calls += 1
        return deltas

    def finish(self, finish_reason: str | None) -> tuple[list[dict], str | None]:
        """The last deltas and the choice's finish reason ("tool_calls" when calls were made)."""
        deltas = []
        if self.parser is not None:
            deltas = self._deltas(self.parser.finish())
        elif self.choice.mode == "required" and self.num_calls:
            # the call's own closing brace ends it (when it stopped, not cut)
            tail = _without_call_close(self.held) if finish_reason == "stop" else self.held.rstrip()
            deltas = [_arguments(tail)] if tail else []
        elif self.held:
            deltas = [{"content": self.held}]
        self.held = ""
        return deltas, "tool_calls" if self.num_calls and finish_reason == "stop" else finish_reason


def _without_call_close(text: str) -> str:
    """A required call's text from its arguments on, less the call's own closing brace."""
    return text.rstrip().removesuffix("}").rstrip()


def _arguments(text: str) -> dict:
    return {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}


def _call(name: str, arguments: str) -> dict:
    return {
        "id": "call_" + uuid.uuid4().hex[:24],
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def tool_choice(body: dict, format: str = "hermes", max_tools: int = 128) -> ToolChoice | None:
    """The body's tools and tool_choice (None: no tools); InvalidRequestError names the bad key. `format`:
    how the model writes calls (tool_formats); `max_tools`: how many a request may carry."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools:
        if choice not in (None, "none"):
            raise InvalidRequestError("tool_choice", "needs tools")
        return None
    if isinstance(tools, list) and len(tools) > max_tools:
        raise InvalidRequestError("tools", f"{len(tools)} tools: the limit is {max_tools}")
    if not isinstance(tools, list) or not all(
        isinstance(t, dict)
        and t.get("type") == "function"
        and isinstance(t.get("function"), dict)
        and isinstance(t["function"].get("name"), str)
        and isinstance(t["function"].get("parameters", {}), dict)
        for t in tools
    ):
        raise InvalidRequestError(
            "tools", 'must be a list of {"type": "function", "function": {"name", ...}}'
        )
    functions = tuple(t["function"] for t in tools)
    names = [f["name"] for f in functions]
    if choice is None or choice in ("none", "auto", "required"):
        return ToolChoice(functions, choice or "auto", format=format)
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or name not in names:
        raise InvalidRequestError(
            "tool_choice",
            f'"none", "auto", "required" or {{"type": "function", "function": {{"name": one of {names}}}}}',
        )
    return ToolChoice(functions, "named", name, format)
