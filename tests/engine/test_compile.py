"""After warmup, a mixed workload compiles nothing new (every shape comes from a warmed bucket)."""

from __future__ import annotations

import json

import pytest

from pdserve.engine.sampling_params import SamplingParams
from pdserve.testing.compile_watch import count_compilations
from pdserve.testing.eagle3 import write_random_head

pytestmark = pytest.mark.model

# Few buckets (the property does not depend on their number): steps of 1 to 16 tokens (a long prompt in
# chunks of 16), 1 to 4 rows.
WARMUP_CONFIG = dict(
    max_model_len=256, max_num_seqs=4, num_blocks=64, max_prefill_seqs=2, max_num_batched_tokens=16
)


def test_warmup_covers_a_mixed_workload(make_engine):
    engine = make_engine(**WARMUP_CONFIG)
    with count_compilations() as counted:
        variants = engine.runner.warmup(progress=False)
    runner = engine.runner
    shapes = len(runner.step_shapes()) + len(runner.score_shapes()) + len(runner.sampler_shapes())
    shapes += len(runner.copy_shapes())
    assert counted() > 0 and variants == shapes
    prompts = ["Hi", "Tell me a story about a dragon " * 3, "x " * 150, "1 2 3", "The sky is", "Once"]
    params = [
        SamplingParams(temperature=0, max_tokens=20),
        SamplingParams(temperature=0.7, top_p=0.9, seed=1, max_tokens=30),
        SamplingParams(temperature=1.0, top_k=20, repetition_penalty=1.2, seed=2, max_tokens=12, logprobs=2),
        SamplingParams(temperature=0, presence_penalty=0.5, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.5, min_p=0.1, seed=3, max_tokens=25, prompt_logprobs=2),
        SamplingParams(temperature=0.9, seed=4, max_tokens=10, n=3),  # forked: 3 sampling rows, 2 copies
    ]
    with count_compilations() as counted:
        results = engine.generate(prompts, params)
        chat = engine.tokenizer.encode_chat([{"role": "user", "content": "What is 2+2?"}])
        results += engine.generate([chat], SamplingParams(temperature=0, max_tokens=8))
        assert engine.prompt_logits(chat).shape == (engine.model.config.vocab_size,)
    assert counted() == 0
    assert all(r.finish_reason in ("stop", "length") for r in results)


@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_warmup_covers_speculative_decoding(make_engine, loaded_model, tmp_path, method):
    """With speculation the steps return more logits rows (EngineConfig.logits_bucket) and the sampler
    takes as many; an EAGLE-3 head's steps also return the aux states, and its pass runs after each step:
    warmup compiles those, and decoding with drafts (penalties, logprobs, n > 1, a prompt in chunks beside
    drafting rows) compiles nothing new."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "draft_policy": "all"}
    if method == "eagle3":
        head = write_random_head(tmp_path / "head", loaded_model.config)
        spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3, "draft_policy": "all"}
    engine = make_engine(**WARMUP_CONFIG, speculative_config=json.dumps(spec))
    engine.runner.warmup(progress=False)
    quote = "one two three four one two three four one two three four one two"
    prompts = [quote, quote + " three", "x " * 40, quote + " four one"]
    params = [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=5, max_tokens=20, logprobs=2, repetition_penalty=1.1),
        SamplingParams(temperature=0, max_tokens=8),
        SamplingParams(temperature=0.9, seed=6, max_tokens=12, n=2, ignore_eos=True),
    ]
    before = engine.scheduler.drafts.stats.num_drafts
    with count_compilations() as counted:
        engine.generate(prompts, params)
    assert counted() == 0 and engine.scheduler.drafts.stats.num_drafts > before
