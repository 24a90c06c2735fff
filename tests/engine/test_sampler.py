"""The device sampler on synthetic logits: each knob does what it says; randomness is (seed, position)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from pdserve.engine.model.sampler import SamplingBatch, sample
from pdserve.engine.multihost import sample_batch, sample_op
from pdserve.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.fast

VOCAB = 8
LOGITS = np.log(np.array([0.40, 0.25, 0.15, 0.10, 0.05, 0.03, 0.015, 0.005], np.float32))


def run(params, seeds=None, positions=None, logits=None, history=None, num_logprobs=0):
    n = len(params)
    logits = np.tile(LOGITS, (n, 1)) if logits is None else logits
    batch = SamplingBatch.build(
        params, list(range(n)), seeds or [0] * n, positions or [0] * n, history, n, VOCAB
    )
    return sample(jnp.asarray(logits), batch, num_logprobs=num_logprobs)


def draws(params: SamplingParams, count=400) -> np.ndarray:
    result = run([params] * count, seeds=list(range(count)), positions=[3] * count)
    return np.asarray(result.tokens)


def test_greedy_is_argmax():
    assert run([SamplingParams(temperature=0.0)]).tokens.tolist() == [0]


def test_top_k_top_p_min_p_restrict_the_support():
    assert set(draws(SamplingParams(temperature=1.0, top_k=2)).tolist()) == {0, 1}
    assert set(draws(SamplingParams(temperature=1.0, top_p=0.5)).tolist()) == {0, 1}  # 0.40 < 0.5 <= 0.65
    assert set(draws(SamplingParams(temperature=1.0, top_p=0.3)).tolist()) == {0}
    assert set(draws(SamplingParams(temperature=1.0, min_p=0.3)).tolist()) == {0, 1, 2}  # >= 0.12
    full = set(draws(SamplingParams(temperature=1.0), count=2000).tolist())
    assert full >= {0, 1, 2, 3, 4, 5}


def test_temperature_sampling_follows_the_distribution():
    counts = np.bincount(draws(SamplingParams(temperature=1.0), count=4000), minlength=VOCAB) / 4000
    assert np.allclose(counts, np.exp(LOGITS), atol=0.03)
    sharp = np.bincount(draws(SamplingParams(temperature=0.3), count=2000), minlength=VOCAB) / 2000
    assert sharp[0] > 0.75


def test_same_seed_and_position_same_token_regardless_of_batch_neighbours():
    p = SamplingParams(temperature=1.0)
    alone = run([p], seeds=[42], positions=[9]).tokens.tolist()
    mixed = run(
        [SamplingParams(temperature=0.0), p, SamplingParams(temperature=2.0, top_k=3)],
        seeds=[1, 42, 5],
        positions=[0, 9, 100],
    ).tokens.tolist()
    assert mixed[1] == alone[0]
    by_position = {run([p], seeds=[42], positions=[i]).tokens.tolist()[0] for i in range(40)}
    assert len(by_position) > 1  # the position moves the key


def test_large_seeds_use_all_64_bits():
    p = SamplingParams(temperature=1.0)
    low = [run([p], seeds=[5], positions=[i]).tokens.tolist()[0] for i in range(30)]
    high = [run([p], seeds=[5 + (1 << 40)], positions=[i]).tokens.tolist()[0] for i in range(30)]
    assert low != high


def test_penalties_discourage_repeats():
    history = [([0], [0, 0, 0])]
    rep = run([SamplingParams(temperature=0.0, repetition_penalty=10.0)], history=history)
    assert rep.tokens.tolist() == [1]
    freq = run([SamplingParams(temperature=0.0, frequency_penalty=0.3)], history=history)
    assert freq.tokens.tolist() == [1]  # 3 * 0.3 beats log(0.40 / 0.25)
    presence = run([SamplingParams(temperature=0.0, presence_penalty=0.3)], history=history)
    assert presence.tokens.tolist() == [0]  # 0.3 does not: log(0.40/0.25) = 0.47


def test_logprobs_are_the_model_distribution():
    result = run([SamplingParams(temperature=0.0, logprobs=3)], num_logprobs=3)
    assert result.top_ids.tolist() == [[0, 1, 2]]
    assert np.allclose(result.top_logprobs[0], LOGITS[:3], atol=1e-5)
    assert float(result.logprob[0]) == pytest.approx(float(LOGITS[0]), abs=1e-5)


def _bitmask(allowed_rows, vocab):
    """Rows of allowed token ids -> [rows, ceil(vocab / 32)] int32: bit t % 32 of word t // 32."""
    bits = np.zeros((len(allowed_rows), -(-vocab // 32) * 32), np.uint8)
    for row, tokens in enumerate(allowed_rows):
        bits[row, list(tokens)] = 1
    return np.packbits(bits, axis=1, bitorder="little").view(np.int32)


def test_a_rows_bitmask_restricts_its_tokens_and_leaves_other_rows_and_logprobs_alone():
    vocab = 70  # three words: tokens 33 and 69 sit in the second and third
    rng = np.random.default_rng(0)
    logits = np.tile(rng.normal(size=vocab).astype(np.float32), (3, 1))
    allowed = [{33, 69}, {1, 3, 40}, range(vocab)]  # greedy, sampled, unconstrained
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.5, seed=1),
        SamplingParams(temperature=0.0),
    ]
    masked = _bitmask(allowed, vocab)

    def step(position, mask):
        batch = SamplingBatch.build(params, [0, 1, 2], [0, 1, 2], [position] * 3, None, 3, vocab, mask)
        return sample(jnp.asarray(logits), batch, num_logprobs=2)

    free = step(0, None)
    drawn = set()
    for position in range(60):
        result = step(position, masked)
        tokens = result.tokens.tolist()
        assert tokens[0] == max(allowed[0], key=lambda t: logits[0, t]) and tokens[1] in allowed[1]
        assert tokens[2] == free.tokens.tolist()[2]  # all ones: as if no mask
        drawn.add(tokens[1])
    assert drawn == allowed[1]  # every allowed token is reachable
    np.testing.assert_array_equal(np.asarray(result.top_ids), np.asarray(free.top_ids))  # the model's own


def test_a_sample_operation_carries_only_the_constrained_rows_masks():
    """engine.multihost's `sample` op ships the bitmask rows of constrained requests only, and a worker
    rebuilds the same SamplingBatch (padding rows and free rows all ones)."""
    vocab = 70
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.5, seed=3)] * 2
    mask = _bitmask([(), {1, 40}, (), {69}], vocab)
    mask[[0, 2]] = -1  # free rows: all ones, as the engine fills them
    batch = SamplingBatch.build(params, [0, 1, 2, 3], [0, 1, 2, 3], [5] * 4, None, 8, vocab, mask)
    op = sample_op(batch)
    assert op.arrays["allowed_rows"].tolist() == [1, 3] and op.arrays["allowed"].shape == (2, 3)
    rebuilt = sample_batch(op)
    for field in dataclasses.fields(SamplingBatch):
        got, want = getattr(rebuilt, field.name), getattr(batch, field.name)
        assert (got is None and want is None) or np.array_equal(got, want), field.name
    free = sample_op(SamplingBatch.build(params, [0, 1, 2, 3], [0] * 4, [5] * 4, None, 8, vocab))
    assert free.arrays["allowed"].size == 0
    assert np.array_equal(sample_batch(free).allowed, np.full((8, 3), -1, np.int32))
