"""The reasoning parsers (services.decode.openai.reasoning): whole and streamed in any pieces alike."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pdserve.services.decode.openai.reasoning import ReasoningSplit, split

pytestmark = pytest.mark.fast


@pytest.mark.parametrize(
    "parser, text, expected",
    [
        ("deepseek_r1", "<think>Add them.</think>\n\n4", ("Add them.", "\n\n4")),
        ("deepseek_r1", "Add them.</think>4", ("Add them.", "4")),  # the template opened the thinking
        ("deepseek_r1", "Still adding", ("Still adding", None)),  # cut short: all reasoning
        ("qwen3", "<think>\nAdd them.\n</think>\n\n4", ("\nAdd them.\n", "\n\n4")),
        ("qwen3", "4", (None, "4")),  # thinking off: all content
        ("qwen3", "<think>Still", ("Still", None)),
        ("qwen3", "<thin", (None, "<thin")),  # not a marker after all
        ("qwen3", "a <think>b</think>", (None, "a <think>b</think>")),  # a marker only at the start
        ("qwen3", "<think></think>4", (None, "4")),
    ],
)
def test_split(parser, text, expected):
    assert split(parser, text) == expected


@given(
    st.sampled_from(["deepseek_r1", "qwen3"]),
    st.lists(
        st.sampled_from(["<think>", "</think>", "<", "</", "think", ">", "a", " ", "\n", "4"]), max_size=12
    ),
    st.data(),
)
def test_streamed_in_any_pieces_equals_whole(parser, words, data):
    text = "".join(words)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=6)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    stream = ReasoningSplit(parser)
    parts = [stream.feed(p) for p in pieces] + [stream.finish()]
    reasoning, content = ("".join(p[i] for p in parts) for i in (0, 1))
    assert (reasoning or None, content or None) == split(parser, text)


def test_the_constraint_waits_for_the_reasoning_unless_the_prompt_closed_it():
    from pdserve.services.decode.openai.reasoning import constraint_waits_for, marker_ids

    start, end = 7, 8
    assert constraint_waits_for([1, 2, 3], (start, end)) == (end,)  # Qwen3 thinking: the model opens it
    assert constraint_waits_for([1, start, 9], (start, end)) == (end,)  # DeepSeek-R1: the template opened it
    assert constraint_waits_for([1, start, 9, end, 5], (start, end)) == ()  # thinking off: closed
    assert constraint_waits_for([start, end, 1, start], (start, end)) == (end,)  # an earlier turn's, closed
    assert constraint_waits_for([1, 2], None) == ()  # a model without think tokens does not think

    class Tokens:
        def __init__(self, vocab):
            self.vocab = vocab

        def encode(self, text):
            return [self.vocab[text]] if text in self.vocab else [1, 2, 3]

    assert marker_ids(Tokens({"<think>": 7, "</think>": 8})) == (7, 8)
    assert marker_ids(Tokens({})) is None
