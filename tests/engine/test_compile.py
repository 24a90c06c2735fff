"""After warmup, a mixed workload compiles nothing new (every shape comes from a warmed bucket)."""

from __future__ import annotations

import pytest

from pdserve.engine.sampling_params import SamplingParams
from pdserve.testing.compile_watch import count_compilations

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
