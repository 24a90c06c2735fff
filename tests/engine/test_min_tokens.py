"""min_tokens: the stop tokens are held back until that many tokens are out (vLLM's meaning), on the
whole default model, which ends its short answers with EOS."""

from __future__ import annotations

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
