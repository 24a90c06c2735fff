"""Structured output in the engine (engine/constraints.py): outputs of the real model under JSON schemas,
regexes and choices validate, in batches mixing constrained and free rows, greedy and seeded, with chunked
prompts; a free row is untouched by its neighbours' masks; bad constraints are refused at the door."""

from __future__ import annotations

import json
import re

import pytest

from pdserve.engine.sampling_params import Constraint, InvalidRequestError, SamplingParams
from pdserve.testing.constraint_schemas import SCHEMAS

pytestmark = pytest.mark.model

PROMPT = "Describe a person as JSON."
LONG = "Here are the facts about the user you must describe. " * 40  # > 256 tokens: a chunked prompt


def test_outputs_validate_against_their_schemas_in_a_mixed_batch(full_engine):
    """Every test schema once (greedy and seeded alternately, one chunked prompt), a free greedy row and a
    regex row in the same batch: each constrained output validates, and the free row equals its output
    alone."""
    import jsonschema

    engine = full_engine  # the whole model: its JSON ends (the test model's runs on)
    free = SamplingParams(temperature=0.0, max_tokens=24)
    alone = engine.generate([PROMPT], free)[0].token_ids
    params = [
        SamplingParams(
            temperature=0.0 if i % 2 == 0 else 0.8,
            seed=i,
            max_tokens=120,
            constraint=Constraint("json_schema", json.dumps(schema)),
        )
        for i, schema in enumerate(SCHEMAS)
    ]
    regex = SamplingParams(
        temperature=0.7, seed=5, max_tokens=16, constraint=Constraint("regex", r"[A-Z][a-z]{2,6}-\d{3}")
    )
    prompts = [LONG if i == 3 else PROMPT for i in range(len(SCHEMAS))] + [PROMPT, PROMPT]
    out = engine.generate(prompts, [*params, free, regex])
    for schema, completion in zip(SCHEMAS, out, strict=False):
        assert completion.finish_reason == "stop", completion
        jsonschema.validate(json.loads(completion.text), schema)
    assert out[len(SCHEMAS)].token_ids == alone
    assert re.fullmatch(r"[A-Z][a-z]{2,6}-\d{3}", out[-1].text)


def test_a_choice_containing_the_free_answer_changes_nothing(full_engine):
    """A permissive constraint gives the tokens of no constraint: the free greedy answer (ended by EOS)
    among the choices."""
    engine = full_engine  # the whole model: its JSON ends (the test model's runs on)
    question = [{"role": "user", "content": "What is the capital of France? Answer with one word."}]
    prompt = engine.tokenizer.apply_chat_template(question, add_generation_prompt=True)
    free = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12))[0]
    assert free.finish_reason == "stop" and free.text  # ended by the model's EOS
    choice = Constraint("choice", choices=(free.text, "Lyon", "Marseille"))
    constrained = engine.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8, constraint=choice))[
        0
    ]
    assert constrained.token_ids == free.token_ids and constrained.text == free.text


@pytest.mark.parametrize(
    "constraint, message",
    [
        (Constraint("json_schema", "{not json"), "not JSON"),
        (
            Constraint("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "nope"}}})),
            "json_schema",
        ),
        (Constraint("regex", "(unclosed"), "regex"),
        (Constraint("grammar", "start: undefined_rule"), "grammar"),
        (Constraint("choice"), "choice"),
        (Constraint("xml"), "kind"),
    ],
)
def test_bad_constraints_are_refused_naming_the_field(make_engine, constraint, message):
    engine = make_engine()
    with pytest.raises(InvalidRequestError, match=message) as e:
        engine.make_request(PROMPT, SamplingParams(constraint=constraint))
    assert e.value.field == "constraint"


def test_a_dead_end_finishes_the_request_without_an_invalid_token(make_engine, monkeypatch):
    """A constraint that allows no next token (forced here from the third step on: llguidance's languages
    rarely have one) ends the request with constraint_dead_end; the text stops at the last allowed token."""
    engine = make_engine()
    real_fill, steps = engine.masks.constraints.fill, []

    def fill(matchers):
        mask = real_fill(matchers)
        steps.append(len(matchers))
        if len(steps) >= 3:
            mask[:] = 0
        return mask

    monkeypatch.setattr(engine.masks.constraints, "fill", fill)
    params = SamplingParams(temperature=0.0, max_tokens=20, constraint=Constraint("json_object"))
    out = engine.generate([PROMPT], params)[0]
    assert out.finish_reason == "constraint_dead_end" and len(out.token_ids) == 3
    assert out.text == engine.tokenizer.decode(out.token_ids[:2]) and out.text.startswith("{")


def test_a_matcher_past_its_work_limit_ends_the_request_and_the_engine_serves_on(make_engine):
    """A grammar llguidance compiles but cannot follow ('start: "a" start': its parser exceeds its item
    limit at the first token) ends its request as constraint_dead_end, beside a free request."""
    engine = make_engine()
    runaway = SamplingParams(
        temperature=0.0, max_tokens=8, constraint=Constraint("grammar", 'start: "a" start')
    )
    free = SamplingParams(temperature=0.0, max_tokens=4)
    out = engine.generate([PROMPT, PROMPT], [runaway, free])
    assert out[0].finish_reason == "constraint_dead_end" and out[0].text == ""
    assert out[1].finish_reason == "length" and len(out[1].token_ids) == 4
