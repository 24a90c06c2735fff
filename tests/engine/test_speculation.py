"""Speculative decoding's host side, model-free: n-gram prompt lookup, and verification that emits only
the target's own samples (engine.core.speculation), checked against engine.model.sampler's real
per-position keys over a toy target."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.engine.core.speculation import NgramProposer, accept

pytestmark = pytest.mark.fast


def test_ngram_proposes_what_followed_the_latest_longest_match():
    proposer = NgramProposer(k=3, min_n=1, max_n=3)
    #          0  1  2  3  4  5  6  7  8  9
    context = [5, 6, 7, 8, 9, 6, 7, 1, 2, 6, 7]
    # [6, 7] occurs at 1 and 5: the latest (5) is followed by 1, 2, 6
    assert proposer.propose(context) == [1, 2, 6]
    # the longest n wins: [9, 6, 7] matched at 4 beats the later [6, 7] alone
    assert proposer.propose([9, 6, 7, 3, 4, 5, 6, 7, 0, 9, 6, 7]) == [3, 4, 5]
    assert proposer.propose([1, 2, 3, 1, 2]) == [3, 1, 2]  # the match may run into the suffix
    assert proposer.propose([1, 2, 3, 4, 1, 2, 3]) == [4, 1, 2]
    assert proposer.propose([4, 1, 2]) == []  # no earlier occurrence of any suffix
    assert proposer.propose([7, 3, 7], k=5) == [3, 7]  # near the end: fewer than k
    assert NgramProposer(k=2, min_n=2, max_n=2).propose([1, 2, 9, 2]) == []  # only bigrams count
    assert proposer.propose([]) == [] and proposer.propose([3]) == []
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(k=2, min_n=3, max_n=2)
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        NgramProposer(k=0)


@settings(max_examples=200, deadline=None)
@given(
    context=st.lists(st.integers(0, 3), min_size=0, max_size=40),
    k=st.integers(1, 6),
    n=st.tuples(st.integers(1, 4), st.integers(0, 3)),
)
def test_ngram_drafts_are_a_continuation_of_an_earlier_match(context, k, n):
    """Whatever the context: the drafts are what followed an earlier occurrence of the context's last m
    tokens (min_n <= m <= max_n), and no longer suffix occurs earlier."""
    min_n, max_n = n[0], n[0] + n[1]
    drafts = NgramProposer(k=k, min_n=min_n, max_n=max_n).propose(context)
    assert len(drafts) <= k

    def earlier(m):
        suffix = context[len(context) - m :]
        return [i for i in range(len(context) - m) if context[i : i + m] == suffix]

    matches = [m for m in range(min_n, min(max_n, len(context) - 1) + 1) if earlier(m)]
    if not matches:
        assert drafts == []
        return
    m = max(matches)
    start = earlier(m)[-1] + m
    assert drafts == context[start : start + k]


@given(drafts=st.lists(st.integers(0, 3), max_size=6), data=st.data())
def test_accept_emits_the_targets_samples_up_to_the_first_miss(drafts, data):
    sampled = data.draw(st.lists(st.integers(0, 3), min_size=len(drafts) + 1, max_size=len(drafts) + 1))
    emitted = accept(drafts, sampled)
    hits = next((i for i, (d, s) in enumerate(zip(drafts, sampled, strict=False)) if d != s), len(drafts))
    assert emitted == sampled[: hits + 1]
    assert emitted[:-1] == drafts[:hits]
    with pytest.raises(ValueError, match="one more"):
        accept(drafts, sampled[:-1])


VOCAB = 8


def _toy_logits(context: tuple[int, ...]) -> np.ndarray:
    """A deterministic toy target: logits that depend on the whole context."""
    rng = np.random.default_rng(abs(hash(context)) % (1 << 32))
    return (rng.standard_normal(VOCAB) * 1.5).astype(np.float32)


def _sample(logit_rows: np.ndarray, seeds: list[int], positions: list[int], temperature: float):
    """engine.model.sampler on logits [rows, VOCAB]: each row with its seed's key at its position."""
    from pdserve.engine.model.sampler import SamplingBatch, sample
    from pdserve.engine.sampling_params import SamplingParams

    params = [SamplingParams(temperature=temperature, max_tokens=1)] * len(seeds)
    rows = len(seeds)
    batch = SamplingBatch.build(params, list(range(rows)), seeds, positions, None, rows, VOCAB)
    return np.asarray(sample(np.asarray(logit_rows), batch, num_logprobs=0).tokens).tolist()


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_speculation_emits_the_tokens_of_decoding_without_it(temperature):
    """A toy target over 8 tokens, decoded one token a step and speculatively (n-gram drafts verified
    k + 1 positions at a time with the same per-position keys): the same tokens, greedy and seeded, for
    every seed, whatever was drafted or accepted."""
    proposer = NgramProposer(k=3, min_n=1, max_n=2)
    prompt, steps = [1, 2, 3, 1, 2], 24
    accepted_runs = []
    for seed in range(6):
        plain = list(prompt)
        while len(plain) < len(prompt) + steps:
            (token,) = _sample(_toy_logits(tuple(plain))[None], [seed], [len(plain)], temperature)
            plain.append(token)
        spec = list(prompt)
        while len(spec) < len(prompt) + steps:
            drafts = proposer.propose(spec)
            contexts = [tuple(spec + drafts[:i]) for i in range(len(drafts) + 1)]
            positions = [len(spec) + i for i in range(len(drafts) + 1)]
            sampled = _sample(
                np.stack([_toy_logits(c) for c in contexts]), [seed] * len(contexts), positions, temperature
            )
            emitted = accept(drafts, sampled)
            accepted_runs.append(len(emitted) - 1)
            spec += emitted
        assert spec[: len(plain)] == plain, seed
    assert max(accepted_runs) >= 1  # some drafts were accepted, so verification was exercised


def test_a_verified_position_samples_the_targets_distribution():
    """Over 4,000 seeds, the first token a verification step emits (a fixed draft, accepted or not)
    follows the target's softmax (chi-square, p > 0.001): what the draft proposed does not bias it."""
    from scipy.stats import chisquare

    logits = _toy_logits((4, 2))
    p = np.exp(logits.astype(np.float64) - logits.max())
    p /= p.sum()
    draft = int(np.argmax(p))  # the likeliest token drafted: accepted often, rejected otherwise
    seeds = list(range(4000))
    sampled = _sample(np.repeat(logits[None], len(seeds), 0), seeds, [7] * len(seeds), 1.0)
    first = [accept([draft], [token, 0])[0] for token in sampled]
    counts = np.bincount(first, minlength=VOCAB)
    assert 0 < counts[draft] < len(seeds)
    assert chisquare(counts, p * len(seeds)).pvalue > 1e-3
