"""Reasoning output (vLLM's `--reasoning-parser`): the text a thinking model writes between `<think>` and
`</think>` goes to the chat message's `reasoning` field (vLLM's name since it retired `reasoning_content`),
the rest to `content`, whole or streamed.

Two parsers, for the families pdserve serves that think:
  * `deepseek_r1`: DeepSeek-R1 and its distills. Their template opens the thinking in the prompt, so the
    output is reasoning until `</think>` (a leading `<think>` is dropped); with no `</think>` at all, all of
    it is reasoning (the thinking was cut short).
  * `qwen3`: Qwen3. The output thinks only when it starts with `<think>`; with thinking off
    (`chat_template_kwargs: {"enable_thinking": false}`, the template writes an empty think block into the
    prompt) the output is all content.
Tool calls are parsed in the content only (after the reasoning), as vLLM does. A constraint (structured
output, tool_choice required) applies from the first token in pdserve: a constrained request does not
think. vLLM starts the constraint after the reasoning; that is not built here.
"""

from __future__ import annotations

import dataclasses

START, END = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")


@dataclasses.dataclass
class ReasoningSplit:
    """One output's text split as it streams in: `feed` each text delta, then `finish`; each returns the
    (reasoning, content) text that became certain with it. A possible start of a marker at the end of the
    text so far is held back until the next delta says what it is."""

    parser: str
    _state: str = "start"  # start (nothing decided) -> reasoning -> content
    _held: str = ""

    def __post_init__(self):
        if self.parser not in PARSERS:
            raise ValueError(f"reasoning parser {self.parser!r}: one of {PARSERS}")

    def feed(self, text: str) -> tuple[str, str]:
        self._held += text
        reasoning = content = ""
        if self._state == "start":
            stripped = self._held.lstrip()
            if START.startswith(stripped) and len(stripped) < len(START):  # maybe <think>: wait
                return "", ""
            if stripped.startswith(START):
                self._state, self._held = "reasoning", stripped[len(START) :]
            else:
                self._state = "reasoning" if self.parser == "deepseek_r1" else "content"
        if self._state == "reasoning":
            end = self._held.find(END)
            if end < 0:
                keep = _partial_suffix(self._held, END)
                reasoning, self._held = (
                    self._held[: len(self._held) - keep],
                    self._held[len(self._held) - keep :],
                )
                return reasoning, ""
            reasoning, self._held, self._state = self._held[:end], self._held[end + len(END) :], "content"
        content, self._held = self._held, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What is still held when the output ends: an unfinished marker is text of the part it is in."""
        held, self._held = self._held, ""
        if self._state == "start":  # a few characters that could have been <think>
            self._state = "reasoning" if self.parser == "deepseek_r1" else "content"
        return (held, "") if self._state == "reasoning" else ("", held)


def split(parser: str, text: str) -> tuple[str | None, str | None]:
    """A whole output's (reasoning, content); None for a part with no text (vLLM's nulls)."""
    stream = ReasoningSplit(parser)
    parts = [stream.feed(text), stream.finish()]
    reasoning, content = ("".join(p[i] for p in parts) for i in (0, 1))
    return reasoning or None, content or None


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (to hold back until more comes)."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
