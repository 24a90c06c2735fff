"""The device sampler on synthetic logits: each knob does what it says; randomness is (seed, position)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from engine.sampler import SamplingBatch, sample
from engine.sampling_params import SamplingParams

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
