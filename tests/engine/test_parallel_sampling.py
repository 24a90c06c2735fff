"""n > 1 (vLLM's parallel sampling) on one engine: one prompt computation, its KV forked into n sequences
(the scheduler's block sharing is tests/engine/test_scheduler.py's); sequence i samples exactly as the same
request with n = 1 and seed + i would, so a disaggregated fork equals the colocated one."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.engine.sampling_params import Constraint, InvalidRequestError, SamplingParams

pytestmark = pytest.mark.model


def test_sequence_i_is_the_request_with_seed_plus_i(make_engine, loaded_model):
    """Seeded sampling over a prompt of a full block and a partial one (shared, then copied): the four
    sequences are the four single requests, tokens and logprobs; the prompt's logprobs come with each."""
    engine = make_engine()
    prompt = loaded_model.tokenizer.encode(
        "Once upon a time, in a land far away, there lived a king who had three"
    )
    assert engine.config.block_size < len(prompt) < 2 * engine.config.block_size
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=10, n=4, logprobs=2, ignore_eos=True)
    forked = engine.generate([prompt], dataclasses.replace(params, prompt_logprobs=1))
    singles = engine.generate([prompt] * 4, [dataclasses.replace(params, n=1, seed=11 + i) for i in range(4)])
    assert [s.index for s in forked] == [0, 1, 2, 3]
    assert [s.token_ids for s in forked] == [s.token_ids for s in singles]
    assert len({tuple(s.token_ids) for s in forked}) > 1  # they are not copies of one another
    for f, s in zip(forked, singles, strict=True):
        # (float32 sums over a batch of 4 and of 1 differ in their last bits by CPU: 1.7e-5 seen on a Xeon)
        assert [lp.logprob for lp in f.logprobs] == pytest.approx([lp.logprob for lp in s.logprobs], abs=1e-4)
        assert f.prompt_logprobs == forked[0].prompt_logprobs and len(f.prompt_logprobs) == len(prompt)
    engine.scheduler.kv.pool.check()
    assert engine.scheduler.kv.pool.num_used == 0


def test_each_sequence_keeps_its_own_constraint_and_an_abort_ends_them_all(make_engine, loaded_model):
    engine = make_engine()
    prompt = loaded_model.tokenizer.encode("Answer yes or no:")
    choice = SamplingParams(temperature=1.0, seed=3, max_tokens=8, n=3)
    constrained = dataclasses.replace(choice, constraint=Constraint("choice", choices=("yes", "no", "maybe")))
    answers = engine.generate([prompt], constrained)
    assert len(answers) == 3 and all(a.text in ("yes", "no", "maybe") for a in answers)
    rid = engine.add_request(prompt, dataclasses.replace(choice, max_tokens=50, ignore_eos=True))
    while not any(r.parent_id == rid for r in engine.scheduler.requests.values()):
        engine.step()  # until the prompt is computed and forked
    assert engine.abort(rid) and not engine.scheduler.requests
    engine.scheduler.kv.pool.check()
    assert engine.scheduler.kv.pool.num_used == 0
    with pytest.raises(InvalidRequestError) as refusal:
        engine.make_request(prompt, SamplingParams(n=engine.config.max_num_seqs + 1))
    assert refusal.value.field == "n"


def test_a_hybrid_models_sequences_copy_their_rings(tmp_path, loaded_model):
    """Gemma 3 (sliding layers in rings of blocks, engine.core.kv_groups): each forked sequence gets its
    own copy of every ring block; past the window, the sequences are still the seeded single requests."""
    from pdserve.engine.config import EngineConfig
    from pdserve.testing.families import engine_of, write_family

    write_family("gemma3", tmp_path, loaded_model.config.vocab_size)
    config = EngineConfig(num_blocks=96, max_model_len=512, max_num_seqs=4, max_num_batched_tokens=64)
    engine = engine_of(tmp_path, loaded_model.tokenizer, config)
    assert engine.scheduler.kv.ring_blocks  # (the rings this test is about)
    prompt = list(range(100, 160))  # past the 24-token window
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=40, n=3, ignore_eos=True)
    forked = engine.generate([prompt], params)
    singles = engine.generate([prompt] * 3, [dataclasses.replace(params, n=1, seed=7 + i) for i in range(3)])
    assert [f.token_ids for f in forked] == [s.token_ids for s in singles]
    engine.scheduler.kv.pool.check()
    assert engine.scheduler.kv.pool.num_used == 0
