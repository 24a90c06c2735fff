"""OpenAI tools on the chat API: `tools` + `tool_choice` -> the request's constraint (and the chat template's
`tools`), and the generated text -> `tool_calls`.

  tool_choice "none"        the tools go to the template; the output is text
  tool_choice "auto"        the same; tool calls the model writes in the Hermes format that Qwen, Hermes and
                            most chat templates with tools use (`<tool_call>{"name": ..., "arguments":
                            {...}}</tool_call>`) are parsed out of the text into `tool_calls`
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

from engine.sampling_params import Constraint, InvalidRequestError

_HERMES_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.DOTALL)
_ANY_OBJECT = {"type": "object"}


@dataclasses.dataclass(frozen=True)
class ToolChoice:
    tools: tuple[dict, ...]  # each tool's OpenAI "function" object
    mode: str  # "none", "auto", "required" or "named"
    name: str | None = None  # the named function

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

    def calls(self, text: str) -> tuple[str | None, list[dict]]:
        """(the message's content, its tool calls) from the generated text."""
        if self.mode == "named":
            return None, [_call(self.name, text)]
        if self.mode == "required":
            call = json.loads(text)
            return None, [_call(call["name"], json.dumps(call["arguments"]))]
        if self.mode == "auto":
            calls = []
            for match in _HERMES_CALL.finditer(text):
                try:
                    call = json.loads(match.group(1))
                except ValueError:
                    continue
                if isinstance(call, dict) and call.get("name") in {f["name"] for f in self.tools}:
                    calls.append(_call(call["name"], json.dumps(call.get("arguments", {}))))
            if calls:
                content = _HERMES_CALL.sub("", text).strip()
                return content or None, calls
        return text, []


_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


class ToolStream:
    """A streamed chat's text deltas -> OpenAI stream deltas: text goes out as content as it comes, but for
    what may be the start of a Hermes call (held until it closes: then the call, with auto); the named
    call's arguments go out as they are generated; a required call, once whole."""

    def __init__(self, choice: ToolChoice):
        self.choice = choice
        self.held = ""
        self.num_calls = 0

    def feed(self, text: str) -> list[dict]:
        """Deltas for the next piece of generated text."""
        mode = self.choice.mode
        if mode == "none":
            return [{"content": text}] if text else []
        if mode == "named":
            deltas = [] if self.num_calls else [{"tool_calls": [{"index": 0, **_call(self.choice.name, "")}]}]
            self.num_calls = 1
            if text:
                deltas.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
            return deltas
        self.held += text
        return self._auto_deltas() if mode == "auto" else []

    def _auto_deltas(self) -> list[dict]:
        deltas = []
        while True:
            start = self.held.find(_OPEN)
            if start < 0:  # keep back a tail that may be the start of a tag
                keep = next((n for n in range(len(_OPEN) - 1, 0, -1) if self.held.endswith(_OPEN[:n])), 0)
                text, self.held = self.held[: len(self.held) - keep], self.held[len(self.held) - keep :]
                return deltas + ([{"content": text}] if text else [])
            if start:
                deltas.append({"content": self.held[:start]})
            end = self.held.find(_CLOSE, start)
            if end < 0:
                self.held = self.held[start:]
                return deltas
            block, self.held = self.held[start : end + len(_CLOSE)], self.held[end + len(_CLOSE) :]
            _, calls = self.choice.calls(block)
            if calls:
                deltas.append({"tool_calls": [{"index": self.num_calls, **calls[0]}]})
                self.num_calls += 1
            else:  # not a call of these tools: it was text
                deltas.append({"content": block})

    def finish(self, finish_reason: str | None) -> tuple[list[dict], str | None]:
        """The last deltas and the choice's finish reason ("tool_calls" when calls were made)."""
        deltas = []
        if self.choice.mode == "required" and finish_reason == "stop":
            try:
                _, calls = self.choice.calls(self.held)
                deltas.append({"tool_calls": [{"index": 0, **calls[0]}]})
                self.num_calls = 1
            except (ValueError, KeyError, TypeError):
                deltas.append({"content": self.held})
        elif self.held:
            deltas.append({"content": self.held})
        self.held = ""
        return deltas, "tool_calls" if self.num_calls and finish_reason == "stop" else finish_reason


def _call(name: str, arguments: str) -> dict:
    return {
        "id": "call_" + uuid.uuid4().hex[:24],
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def tool_choice(body: dict) -> ToolChoice | None:
    """The body's tools and tool_choice (None: no tools); InvalidRequestError names the bad key."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if not tools:
        if choice not in (None, "none"):
            raise InvalidRequestError("tool_choice", "needs tools")
        return None
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
        return ToolChoice(functions, choice or "auto")
    name = choice.get("function", {}).get("name") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or name not in names:
        raise InvalidRequestError(
            "tool_choice",
            f'"none", "auto", "required" or {{"type": "function", "function": {{"name": one of {names}}}}}',
        )
    return ToolChoice(functions, "named", name)
