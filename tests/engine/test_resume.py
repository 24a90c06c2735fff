"""A request resumed at output position k (its first k tokens generated elsewhere, Request.num_resumed)
continues with the tokens and text the uninterrupted run gave: greedy, seeded, with penalties and
min_tokens, across a stop string, under a constraint; and a resumption that cannot be is refused by name."""

from __future__ import annotations

import pytest

from pdserve.engine.sampling_params import Constraint, InvalidRequestError, SamplingParams

pytestmark = pytest.mark.model

PROMPT = "The three primary colours are"


def run(engine, request):
    """(tokens, texts shown after each token count, finish reason) of one request run alone."""
    engine.add_prepared_request(request)
    tokens, shown, finish = list(request.output_ids), {}, None
    text = ""
    while finish is None:
        for output in engine.step().tokens:
            tokens += output.new_token_ids
            text += output.text
            shown[len(tokens)] = text
            if output.finished:
                finish = output.finish_reason.value
    return tokens, shown, finish


def resumed(engine, params, prefix, prompt=PROMPT):
    return run(engine, engine.make_request(prompt, params, resume_token_ids=prefix))


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=20, ignore_eos=True),
        SamplingParams(
            temperature=0.8,
            seed=3,
            frequency_penalty=0.6,
            presence_penalty=0.4,
            repetition_penalty=1.2,
            min_tokens=12,
            max_tokens=20,
        ),
    ],
    ids=["greedy", "seeded", "penalties"],
)
def test_a_resumed_request_continues_as_the_uninterrupted_run(make_engine, params):
    engine = make_engine()
    full, shown, finish = run(engine, engine.make_request(PROMPT, params))
    assert len(full) == 20
    for k in (1, 7, 13):
        tokens, rest, again = resumed(engine, params, full[:k])
        assert tokens == full and again == finish
        assert shown[k] + rest[len(full)] == shown[len(full)]  # the text shown before and after the seam
    assert engine.scheduler.kv.pool.num_used == 0


def test_a_stop_string_across_the_seam_still_ends_the_output(make_engine):
    engine = make_engine()
    prompt = "Paris is the capital of France. Berlin is the capital of Germany. Madrid is the capital of"
    free = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    full, shown, _ = run(engine, engine.make_request(prompt, free))
    j = next(j for j in range(4, 16) if len(shown[j + 2]) > len(shown[j]) + 2)
    stop = shown[len(full)][len(shown[j]) - 2 : len(shown[j + 2])]  # the text of 3 or more tokens
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, stop=(stop,))
    stopped, stopped_shown, reason = run(engine, engine.make_request(prompt, params))
    at = len(stopped)  # its last token completed the stop string, which began tokens before
    assert reason == "stop" and at < len(full) and stop not in stopped_shown[at]
    for k in (at - 2, at - 1):  # the seam inside the stop string: its start held back, not shown
        request = engine.make_request(prompt, params, resume_token_ids=stopped[:k])
        tokens, rest, again = run(engine, request)
        assert (tokens, again) == (stopped, "stop")
        before = max(n for n in stopped_shown if n <= k)  # what the client saw up to the seam
        assert stopped_shown[before] + rest[at] == stopped_shown[at]


def test_a_constrained_request_resumes_under_its_constraint(make_engine):
    engine = make_engine()
    params = SamplingParams(
        temperature=0.0,
        max_tokens=24,
        constraint=Constraint("regex", r"(red|green|blue)(, (red|green|blue))*"),
    )
    full, _, finish = run(engine, engine.make_request(PROMPT, params))
    for k in (1, len(full) // 2):
        tokens, _, again = resumed(engine, params, full[:k])
        assert (tokens, again) == (full, finish)
    other = engine.make_request("x", SamplingParams(max_tokens=4)).prompt_ids  # a token the regex refuses
    with pytest.raises(InvalidRequestError, match="constraint") as refused:
        engine.make_request(PROMPT, params, resume_token_ids=full[:1] + other)
    assert refused.value.field == "resume_token_ids"


@pytest.mark.parametrize(
    ("params", "prefix", "match"),
    [
        (SamplingParams(n=2, max_tokens=8), [1, 2], "one sequence"),
        (SamplingParams(max_tokens=2), [1, 2], "max_tokens"),
        (SamplingParams(max_tokens=8, stop_token_ids=(5,)), [1, 5, 2], "stop token"),
        (SamplingParams(max_tokens=8), [10**7], "token ids"),
    ],
)
def test_a_resumption_that_cannot_be_is_refused_by_name(make_engine, params, prefix, match):
    with pytest.raises(InvalidRequestError, match=match) as refused:
        make_engine().make_request(PROMPT, params, resume_token_ids=prefix)
    assert refused.value.field == "resume_token_ids"


def test_an_output_that_ended_at_a_stop_string_is_not_resumed(make_engine):
    engine = make_engine()
    full, shown, _ = run(engine, engine.make_request(PROMPT, SamplingParams(temperature=0.0, max_tokens=12)))
    stop = shown[len(full)].strip().split()[0]
    with pytest.raises(InvalidRequestError, match="stop string"):
        engine.make_request(PROMPT, SamplingParams(max_tokens=20, stop=(stop,)), resume_token_ids=full)
