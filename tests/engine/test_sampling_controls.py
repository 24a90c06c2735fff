"""min_tokens (the stop tokens held back until that many tokens are out, vLLM's meaning; on the whole
default model, which ends its short answers with EOS) and logit_bias (added to the logits on device)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pdserve.engine.sampling_params import InvalidRequestError, SamplingParams

pytestmark = pytest.mark.model


def test_min_tokens_holds_back_eos(full_engine):
    tokenizer = full_engine.tokenizer
    prompt = tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    (free,) = full_engine.generate([prompt], SamplingParams(temperature=0, max_tokens=32))
    assert free.finish_reason == "stop" and len(free.token_ids) < 12  # answered, then EOS
    (held,) = full_engine.generate([prompt], SamplingParams(temperature=0, max_tokens=32, min_tokens=12))
    assert len(held.token_ids) >= 12 and not set(held.token_ids[:12]) & tokenizer.eos_token_ids
    assert held.token_ids[: len(free.token_ids) - 1] == free.token_ids[:-1]  # the same answer before it
    with pytest.raises(InvalidRequestError) as refusal:
        full_engine.make_request(prompt, SamplingParams(max_tokens=4, min_tokens=5))
    assert refusal.value.field == "min_tokens"


def test_logit_bias_forces_and_bans_tokens(make_engine, loaded_model):
    engine = make_engine()
    prompt = loaded_model.tokenizer.encode("The capital of France is")
    greedy = SamplingParams(temperature=0, max_tokens=4)
    (free,) = engine.generate([prompt], greedy)
    forced = loaded_model.tokenizer.encode(" banana")[0]
    (pushed,) = engine.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=4, logit_bias=((forced, 100.0),))
    )
    assert pushed.token_ids == [forced] * 4
    banned = SamplingParams(temperature=0, max_tokens=1, logit_bias=((free.token_ids[0], -100.0),))
    (other,) = engine.generate([prompt], banned)
    logits = engine.prompt_logits(prompt)
    assert other.token_ids == [int(np.argsort(-logits)[1])]  # the runner-up
    top = [int(t) for t in np.argsort(-logits)[:20]]
    sampled = SamplingParams(
        temperature=1.5, seed=7, max_tokens=1, logit_bias=tuple((t, -100.0) for t in sorted(top))
    )
    for seed in range(8):
        (result,) = engine.generate([prompt], dataclasses.replace(sampled, seed=seed))
        assert result.token_ids[0] not in top
    with pytest.raises(InvalidRequestError) as refusal:
        engine.make_request(prompt, SamplingParams(max_tokens=1, logit_bias=((5, 101.0),)))
    assert refusal.value.field == "logit_bias"


def test_allowed_token_ids_and_bad_words(make_engine, loaded_model):
    """allowed_token_ids: every token among them; bad_words: a one-token word never appears, and a
    two-token word's second token is banned right after its first (vLLM's meaning)."""
    engine, tokenizer = make_engine(), loaded_model.tokenizer
    prompt = tokenizer.encode("The capital of France is")
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    (free,) = engine.generate([prompt], greedy)
    allowed = (free.token_ids[1], 11, 13)
    (narrowed,) = engine.generate(
        [prompt], dataclasses.replace(greedy, temperature=1.0, seed=2, allowed_token_ids=allowed)
    )
    assert set(narrowed.token_ids) <= set(allowed)
    first = tokenizer.decode(free.token_ids[:1])
    (other,) = engine.generate([prompt], dataclasses.replace(greedy, bad_words=(first,)))
    assert free.token_ids[0] not in other.token_ids
    pair = tokenizer.decode(free.token_ids[:2])
    assert tuple(tokenizer.encode(pair)) == tuple(free.token_ids[:2])  # (a word of those two tokens)
    (after,) = engine.generate([prompt], dataclasses.replace(greedy, bad_words=(pair,)))
    assert after.token_ids[0] == free.token_ids[0] and after.token_ids[1] != free.token_ids[1]
    with pytest.raises(InvalidRequestError) as refusal:
        engine.make_request(prompt, SamplingParams(allowed_token_ids=(10**7,)))
    assert refusal.value.field == "allowed_token_ids"


def test_allowed_token_ids_are_one_mask_a_request_shared_by_its_forks(make_engine, loaded_model, monkeypatch):
    """The per-request cost of a mask: a list of repeated ids (what a hostile client sends) is deduplicated
    and turned into the vocabulary's bitmask once, in make_request, never per step or per sequence; the
    n = 4 sequences of 6 tokens each sample only among the ids."""
    from pdserve.engine import input_processor

    engine, built = make_engine(), []
    real = input_processor.token_mask
    monkeypatch.setattr(
        input_processor, "token_mask", lambda ids, vocab: built.append(len(ids)) or real(ids, vocab)
    )
    allowed = (5, 7, 11) * 10_000 + tuple(range(100, 140))  # (at most the vocabulary's 49,152 ids)
    params = SamplingParams(n=4, max_tokens=6, seed=3, ignore_eos=True, allowed_token_ids=allowed)
    request = engine.make_request(loaded_model.tokenizer.encode("Hello"), params)
    assert request.params.allowed_token_ids == (5, 7, 11, *range(100, 140)) and built == [43]
    engine.add_prepared_request(request)
    sequences = {}
    while engine.has_unfinished:
        for output in engine.step().tokens:
            sequences.setdefault(output.index, []).extend(output.new_token_ids)
    assert built == [43] and len(sequences) == 4
    assert all(len(ids) == 6 and set(ids) <= set(allowed) for ids in sequences.values())


def test_min_tokens_holds_back_stop_strings_too(make_engine, loaded_model):
    """A stop string is matched only in the text after the first min_tokens tokens (vLLM's meaning): the
    first token's text stops the output at once, and not while min_tokens holds it back."""
    engine = make_engine()
    prompt = loaded_model.tokenizer.encode("The capital of France is")
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    (free,) = engine.generate([prompt], greedy)
    stop = loaded_model.tokenizer.decode(free.token_ids[:1])
    (stopped,) = engine.generate([prompt], dataclasses.replace(greedy, stop=(stop,)))
    assert stopped.text == "" and stopped.finish_reason == "stop"
    (held,) = engine.generate([prompt], dataclasses.replace(greedy, stop=(stop,), min_tokens=3))
    assert held.token_ids[:3] == free.token_ids[:3] and held.text.startswith(stop)


def test_a_constraint_waits_for_the_end_of_the_reasoning(make_engine, loaded_model):
    """reasoning_end (a reasoning parser's `</think>`): the output is free until it ends with those tokens,
    then constrained; without it the constraint holds from the first token. Here the "marker" is the
    greedy output's second token, so the first two tokens are the free ones."""
    from pdserve.engine.sampling_params import Constraint

    engine = make_engine()
    prompt = loaded_model.tokenizer.encode("The capital of France is")
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    (free,) = engine.generate([prompt], greedy)
    assert free.token_ids[1] != free.token_ids[0]
    choice = dataclasses.replace(
        greedy, ignore_eos=False, constraint=Constraint("choice", choices=("yes", "no"))
    )
    (constrained,) = engine.generate([prompt], choice)
    assert constrained.text in ("yes", "no")
    (thought,) = engine.generate([prompt], dataclasses.replace(choice, reasoning_end=(free.token_ids[1],)))
    assert thought.token_ids[:2] == free.token_ids[:2]
    answer = loaded_model.tokenizer.decode(thought.token_ids[2:], skip_special_tokens=True)
    assert answer in ("yes", "no") and thought.finish_reason == "stop"
