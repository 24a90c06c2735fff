"""Prefix caching with the real model: the tokens are those computed without it (greedy and seeded),
for batches mixing shared and unshared prefixes, prompts chunked after a cache hit, and TP 2."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from pdserve.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.model

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def workload(tokenizer):
    """Prompts sharing a 300-token head (past one 256-token chunk), one whose own part is longer than a
    chunk, and unshared ones; params greedy and seeded."""
    rng = np.random.default_rng(0)
    system = rng.integers(100, 30000, 300).tolist()
    prompts = [
        system + tokenizer.encode(" What is the capital of France?"),
        system + tokenizer.encode(" Name three colours."),
        system + rng.integers(100, 30000, 280).tolist(),  # its own part is chunked after the hit
        tokenizer.encode("Unshared: the quick brown fox"),
        rng.integers(100, 30000, 40).tolist(),
    ]
    params = [GREEDY, SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=12, ignore_eos=True)]
    return prompts, [params[i % 2] for i in range(len(prompts))]


def run_twice(engine, prompts, params):
    """Round 1 fills the cache; round 2 (the same requests plus the next turn of the first two) hits it."""
    first = engine.generate(prompts, params)
    follow_ups = [p + c.token_ids for p, c in zip(prompts[:2], first, strict=False)]  # next turns' prompts
    second = engine.generate(prompts + follow_ups, params + params[:2])
    return first, second


def test_caching_on_gives_the_tokens_of_caching_off(make_engine, loaded_model):
    prompts, params = workload(loaded_model.tokenizer)
    on = make_engine()
    off = make_engine(enable_prefix_caching=False)
    first_on, second_on = run_twice(on, prompts, params)
    first_off, second_off = run_twice(off, prompts, params)
    assert [c.token_ids for c in first_on + second_on] == [c.token_ids for c in first_off + second_off]
    hits = [c.num_cached_tokens for c in second_on]
    assert all(h > 0 for h in hits[:3] + hits[5:]), hits  # repeats and follow-ups reuse their prefix
    assert hits[0] == len(prompts[0]) // 16 * 16 or hits[0] == (len(prompts[0]) - 1) // 16 * 16
    assert hits[5] >= len(prompts[0]) - 16  # whole blocks: the follow-up reuses turn 1's prompt
    assert all(c.num_cached_tokens == 0 for c in first_off + second_off)
    stats = on.scheduler.kv.stats
    assert 0 < stats.hits < stats.queries
    on.scheduler.kv.pool.check()


def test_tensor_parallel_2_with_caching(make_engine, loaded_model):
    prompts, params = workload(loaded_model.tokenizer)
    prompts, params = prompts[:2], params[:2]  # a shared head, greedy and seeded
    reference = run_twice(make_engine(enable_prefix_caching=False), prompts, params)
    tp2 = make_engine(devices=jax.devices()[:2], tp=2)
    first, second = run_twice(tp2, prompts, params)
    assert [c.token_ids for c in first + second] == [c.token_ids for c in reference[0] + reference[1]]
    assert sum(c.num_cached_tokens for c in second) > 0


def test_cache_salts_keep_tenants_apart(make_engine, loaded_model):
    """vLLM's cache_salt: a prompt cached under one salt is not found under another, nor unsalted; the
    same salt hits. The tokens are the same every time."""
    engine = make_engine()
    prompt = loaded_model.tokenizer.encode("A system prompt that two tenants send word for word. " * 6)
    first = engine.generate([prompt], GREEDY, cache_salt="tenant-a")[0]
    other = engine.generate([prompt], GREEDY, cache_salt="tenant-b")[0]
    unsalted = engine.generate([prompt], GREEDY)[0]
    again = engine.generate([prompt], GREEDY, cache_salt="tenant-a")[0]
    assert [c.num_cached_tokens for c in (first, other, unsalted)] == [0, 0, 0]
    assert again.num_cached_tokens == (len(prompt) - 1) // 16 * 16
    assert first.token_ids == other.token_ids == unsalted.token_ids == again.token_ids
    with pytest.raises(ValueError, match="cache_salt"):
        engine.make_request(prompt, GREEDY, cache_salt="x" * 257)


def test_a_host_tier_serves_what_the_device_evicted_with_the_same_tokens(make_engine, loaded_model):
    """--kv-offloading-size: after prompts longer than the device cache push a conversation's blocks out,
    its repeats and next turns find them in the host tier (one finds its head on the device and the rest
    in host memory); the tokens are an engine's without the tier (greedy and seeded), and every block of
    both tiers is free or cached at the end."""
    prompts, params = workload(loaded_model.tokenizer)
    rng = np.random.default_rng(5)
    flood = [rng.integers(100, 30000, 1000).tolist() for _ in range(4)]  # 252 blocks > the device's 192
    head = prompts[0][:160] + [7]  # the shared system prompt's first 10 blocks

    def run(engine):
        first = engine.generate(prompts, params)
        for prompt in flood:
            engine.generate([prompt], GREEDY)
        loaded = engine.generate([head], GREEDY)  # its 10 blocks back on the device
        hits = engine.scheduler.kv.stats.host_hits
        follow_ups = [p + c.token_ids for p, c in zip(prompts[:2], first, strict=False)]
        second = engine.generate(prompts + follow_ups, params + params[:2])
        return first + loaded + second, engine.scheduler.kv.stats.host_hits - hits

    tiered = make_engine(kv_offloading_size=0.05)
    outputs, host_hits = run(tiered)
    reference, _ = run(make_engine())
    assert [c.token_ids for c in outputs] == [c.token_ids for c in reference]
    loaded, second = outputs[len(prompts)], outputs[len(prompts) + 1 :]
    assert loaded.num_cached_tokens == 160
    assert second[0].num_cached_tokens == (len(prompts[0]) - 1) // 16 * 16  # 10 device, 8 host blocks
    assert all(c.num_cached_tokens > 0 for c in second[:3] + second[5:])
    assert host_hits >= 8 * 16
    kv = tiered.scheduler.kv
    assert kv.pool.num_used == 0 and kv.host.num_in_flight == 0 and kv.host.num_cached > 0
    kv.pool.check(), kv.host.check()
