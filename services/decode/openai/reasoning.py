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
output, a required tool call) applies to the answer, after the reasoning, as in vLLM: when the model's
vocabulary has `<think>` and `</think>` as tokens of their own (a thinking model's) and the prompt has not
closed the reasoning already (Qwen3's template with thinking off writes an empty think block), the request
carries `SamplingParams.reasoning_end` (the `</think>` token) and the engine leaves the output free until
it. A model without those tokens does not think: its constraint applies from the first token.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

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


def marker_ids(tokenizer) -> tuple[int, int] | None:
    """The ids of `<think>` and `</think>` when each is one token of the vocabulary; None otherwise."""
    ids = [tokenizer.encode(marker) for marker in (START, END)]
    return (ids[0][0], ids[1][0]) if all(len(i) == 1 for i in ids) else None


def constraint_waits_for(prompt_ids: Sequence[int], markers: tuple[int, int] | None) -> tuple[int, ...]:
    """SamplingParams.reasoning_end of a constrained request with this prompt: the `</think>` token, unless
    the prompt closed the reasoning already (its last `</think>` after its last `<think>`) or the model has
    no such tokens (empty: the constraint applies from the first token)."""
    if markers is None:
        return ()
    start, end = markers
    last = {token: i for i, token in enumerate(prompt_ids) if token in markers}
    if end in last and last[end] > last.get(start, -1):
        return ()
    return (end,)


def _partial_suffix(text: str, marker: str) -> int:
    """The length of the longest end of `text` that begins `marker` (to hold back until more comes)."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0
