"""Model families beyond Llama against transformers, each on a tiny random-weight checkpoint that
transformers itself writes in the test set-up (its own config class, save_pretrained) over the SmolLM2
vocabulary: last-position logits within 1e-3 in float32, and 32 identical greedy tokens, batched, with
chunked prefill, and at TP 2 with padded heads."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from tests.families import engine_of, hf_greedy, write_qwen3

pytestmark = pytest.mark.model

PROMPT_LENGTHS = (7, 45, 150)  # the longest is prefilled in three chunks (64-token steps)
SMALL = dict(num_blocks=96, max_model_len=512, max_num_seqs=4, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, loaded_model):
    pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("qwen3")
    return write_qwen3(path, loaded_model.config.vocab_size), path


def _engine(path, tokenizer, **overrides):
    from engine.config import EngineConfig

    return engine_of(path, tokenizer, dataclasses.replace(EngineConfig(**SMALL), **overrides))


def test_qwen3_matches_transformers(qwen3, loaded_model):
    import jax

    from engine.sampling_params import SamplingParams

    model, path = qwen3
    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, loaded_model.config.vocab_size, n).tolist() for n in PROMPT_LENGTHS]
    expected = [hf_greedy(model, p, 32) for p in prompts]
    engine = _engine(path, loaded_model.tokenizer)
    assert engine.model.config.qk_norm and engine.model.config.head_dim == 32
    for prompt, (logits, _) in zip(prompts, expected, strict=True):
        assert np.max(np.abs(engine.prompt_logits(prompt) - logits)) <= 1e-3
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    tokens = [tokens for _, tokens in expected]
    assert [c.token_ids for c in engine.generate(prompts, greedy)] == tokens  # batched, chunked prefill
    tp2 = _engine(path, loaded_model.tokenizer, tp=2)
    assert len(jax.devices()) >= 2 and tp2.config.tp == 2
    assert [c.token_ids for c in tp2.generate(prompts, greedy)] == tokens
