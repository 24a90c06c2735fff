"""Prompt logprobs (SamplingParams.prompt_logprobs): each prompt position's logits score the prompt's next
token, in the same steps that compute the prompt's KV, whatever the chunking and batching; the prefix
cache is not read for them; and they equal transformers' on the same weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from pdserve.engine.sampling_params import SamplingParams
from tests.conftest import requires_reference

pytestmark = pytest.mark.model


def log_softmax(x: np.ndarray) -> np.ndarray:
    return x - np.logaddexp.reduce(x, axis=-1, keepdims=True)


def test_each_position_scores_the_next_prompt_token(make_engine, loaded_model):
    """Against the engine's own logits after each prefix (prompt_logits): the token's logprob, its rank,
    the top n in order; a prompt chunked over three steps beside another request; asked again, the
    prompt's cached blocks are not read (every position computed anew) and the values are the same. (The
    session's engine: its chunks of 256 tokens show what smaller ones would, and it is compiled already.)"""
    engine = make_engine()
    budget = engine.config.max_num_batched_tokens
    tokenizer = loaded_model.tokenizer
    prompt = tokenizer.encode("The quick brown fox jumps over the lazy dog, and then it runs away. " * 36)
    assert 2 * budget < len(prompt) < engine.config.max_model_len - 8
    asked = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3)
    other = SamplingParams(temperature=0, max_tokens=8)
    first, _ = engine.generate([prompt, tokenizer.encode("Hello there")], [asked, other])
    entries = first.prompt_logprobs
    assert len(entries) == len(prompt) and entries[0] is None
    for position in (1, 9, budget + 1, len(prompt) - 1):
        expected = log_softmax(engine.prompt_logits(prompt[:position]))
        entry = entries[position]
        assert entry.token_id == prompt[position]
        assert abs(entry.logprob - expected[prompt[position]]) < 1e-4
        assert entry.rank == int(np.sum(expected > expected[prompt[position]])) + 1
        assert [t for t, _ in entry.top] == np.argsort(-expected)[:3].tolist()
        np.testing.assert_allclose([v for _, v in entry.top], np.sort(expected)[::-1][:3], atol=1e-4)
    again = engine.generate([prompt], [asked])[0]
    assert again.num_cached_tokens == 0 and again.token_ids == first.token_ids
    assert [(e.token_id, e.rank) for e in again.prompt_logprobs[1:]] == [
        (e.token_id, e.rank) for e in entries[1:]
    ]
    np.testing.assert_allclose(
        [e.logprob for e in again.prompt_logprobs[1:]], [e.logprob for e in entries[1:]], atol=1e-5
    )
    assert engine.generate([prompt], [other])[0].num_cached_tokens > 0  # the cache itself is there
    assert engine.scheduler.kv.pool.num_used == 0


@pytest.mark.reference
@requires_reference
def test_prompt_logprobs_equal_transformers(make_engine, model_path, loaded_model):
    """The test model's prompt logprobs against transformers' log-softmax of its logits at every position,
    on the parity prompts of the reference fixtures (their first 200 tokens)."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    data = np.load(Path(__file__).parents[1] / "fixtures" / "reference_smollm2.npz")
    prompts = [data[k].tolist()[:200] for k in sorted(data.files) if k.startswith("prompt_")]
    prompts = [p for p in prompts if len(p) > 1]
    engine = make_engine()
    results = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    for prompt, result in zip(prompts, results, strict=True):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt])).logits[0].double().numpy()
        expected = log_softmax(logits)[np.arange(len(prompt) - 1), prompt[1:]]
        got = np.array([e.logprob for e in result.prompt_logprobs[1:]])
        np.testing.assert_allclose(got, expected, atol=2e-3)


def test_prompt_logprobs_are_bounded_by_the_message_that_carries_them(make_engine):
    from pdserve.engine.sampling_params import MAX_PROMPT_LOGPROB_ENTRIES, InvalidRequestError

    engine = make_engine()
    prompt = [5] * (MAX_PROMPT_LOGPROB_ENTRIES // 21 + 1)
    with pytest.raises(InvalidRequestError, match="the limit is") as refusal:
        engine.make_request(prompt, SamplingParams(max_tokens=1, prompt_logprobs=20))
    assert refusal.value.field == "prompt_logprobs"
    with pytest.raises(InvalidRequestError) as refusal:
        engine.make_request([5], SamplingParams(max_tokens=1, prompt_logprobs=engine.config.max_logprobs + 1))
    assert refusal.value.field == "prompt_logprobs"


def test_prompt_logprobs_count_once_for_each_of_n_sequences(make_engine):
    """Each of the n sequences' first output (and each choice of an HTTP answer) carries the prompt's
    logprobs: n counts against the entries cap, so the largest answer stays bounded whatever n is."""
    from pdserve.engine.sampling_params import InvalidRequestError

    engine, prompt = make_engine(), list(range(1000, 1900))
    engine.make_request(prompt, SamplingParams(max_tokens=1, prompt_logprobs=20, n=8))  # 151,200 entries
    with pytest.raises(InvalidRequestError) as refusal:  # (checked before n against max_num_seqs)
        engine.make_request(prompt, SamplingParams(max_tokens=1, prompt_logprobs=20, n=14))
    assert str(refusal.value) == (
        "prompt_logprobs: 900 prompt tokens x 21 logprobs x n=14: the limit is 262144 entries"
    )
