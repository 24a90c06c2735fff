"""Speculative decoding's host side, model-free: n-gram prompt lookup, and verification that emits only
the target's own samples (engine.core.speculation), checked against engine.model.sampler's real
per-position keys over a toy target."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.engine.core.speculation import NgramProposer, accept
from tests.engine.test_scheduler import CONFIG, make

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
    tokens (min_n <= m <= max_n; the latest followed by k tokens, else the earliest), and no longer
    suffix occurs earlier."""
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
    whole = [i for i in earlier(m) if i + m + k <= len(context)]
    start = (whole[-1] if whole else earlier(m)[0]) + m
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
    """A deterministic toy target: logits that depend on the whole context, and favour copying (the token
    that followed the last token's latest earlier occurrence), as text that quotes its prompt does."""
    rng = np.random.default_rng(abs(hash(context)) % (1 << 32))
    logits = rng.standard_normal(VOCAB) * 1.5
    earlier = [i for i in range(len(context) - 1) if context[i] == context[-1]] if context else []
    if earlier:
        logits[context[earlier[-1] + 1]] += 3.0
    return logits.astype(np.float32)


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


# ---- the scheduler with drafts (model-free: a fake runner accepts what the test says) ------------------


def _spec_config(**overrides):
    """test_scheduler's sizes, more blocks, n-gram drafts (k = 3), every draft verified."""
    import dataclasses

    ngram = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "draft_policy": "all"}'
    return dataclasses.replace(CONFIG, **{"num_blocks": 24, "speculative_config": ngram, **overrides})


def _verify(sched, step, accepted, next_token=7):
    """The fake runner: row r accepts its first accepted(r) drafts, then samples `next_token` (a miss
    unless it equals the next draft)."""
    from pdserve.engine.core.scheduler import SampledToken

    sampled = {}
    for row in step.rows:
        if row.samples:
            a = min(accepted(row), len(row.drafts))
            sampled[row.request_id] = [SampledToken(t) for t in [*row.drafts[:a], next_token]]
    return sched.update_from_output(step, sampled)


def test_drafts_fit_the_budget_max_tokens_and_blocks_and_rejected_ones_roll_back():
    from pdserve.engine.core.request import Status
    from pdserve.engine.core.scheduler import Scheduler

    sched = Scheduler(_spec_config())
    a = make("a", [1, 2, 3, 1, 2, 3, 1, 2], max_tokens=4)  # drafts 1, 2, 3 found: max_tokens leaves 2
    sched.add(a)
    _verify(sched, sched.schedule(), lambda row: 0, next_token=3)  # the prompt, then its first token 3
    assert a.output_ids == [3] and a.num_computed == 8
    step = sched.schedule()
    (row,) = step.rows
    assert row.tokens == [3, 1, 2] and row.drafts == [1, 2] and row.num_logits == 3  # 1 + 2 + 1 = 4 tokens
    assert step.logits_starts() == [0]
    got = _verify(sched, step, lambda row: 1, next_token=9)  # 1 accepted, 2 rejected: the target said 9
    assert [t.token for t in got[0][1]] == [1, 9] and a.output_ids == [3, 1, 9] and a.num_computed == 10
    stats = sched.drafts.stats
    assert stats.num_drafts == 1 and stats.num_draft_tokens == 2
    assert stats.num_accepted_tokens == 1 and stats.accepted_per_position == [1, 0, 0]
    step = sched.schedule()
    assert step.rows[0].drafts == []  # one token left to max_tokens: nothing to verify
    got = _verify(sched, step, lambda row: 0, next_token=5)
    assert a.output_ids == [3, 1, 9, 5] and a.status is Status.FINISHED and sched.kv.pool.num_used == 0

    b = make("b", [5, 6, 5, 6, 5, 6, 5], max_tokens=20)
    sched.add(b)
    _verify(sched, sched.schedule(), lambda row: 0, next_token=6)
    step = sched.schedule()
    assert step.rows[0].drafts == [5, 6, 5]
    _verify(sched, step, lambda row: 2, next_token=1)  # 5, 6 accepted; the 3rd draft (5) rejected for 1
    assert b.output_ids == [6, 5, 6, 1] and b.num_computed == 10  # the fed 6, then 5 and 6: not the 5 after
    assert b.num_computed == b.num_tokens - 1  # the last token is fed next, as without speculation
    sched.abort("b")
    sched.kv.pool.check()
    assert sched.kv.pool.num_used == 0


def test_drafts_give_way_to_decode_tokens_and_never_cause_a_preemption():
    from pdserve.engine.core.scheduler import Scheduler

    # 3 running requests, a budget of 5: 3 decode tokens leave room for 2 drafts (equally worth: one each)
    sched = Scheduler(_spec_config(max_num_batched_tokens=5))
    for i in range(3):
        sched.add(make(f"r{i}", [4, 4, 4, 4], t=i))
    _verify(sched, sched.schedule(), lambda row: 0, next_token=4)  # one prompt a step (budget 5)
    while len(sched.running) < 3:
        _verify(sched, sched.schedule(), lambda row: 0, next_token=4)
    step = sched.schedule()
    assert sum(len(r.tokens) for r in step.rows) <= 5 and len(step.rows) == 3
    assert [len(r.drafts) for r in step.rows] == [1, 1, 0]
    _verify(sched, step, lambda row: 0, next_token=8)

    # blocks for the decode token but not for its drafts: no drafts, nobody preempted
    sched = Scheduler(_spec_config(num_blocks=2))
    sched.add(make("x", [1, 2, 1, 2, 1, 2, 1]))  # 7 tokens: the 8th fills the 2nd block
    _verify(sched, sched.schedule(), lambda row: 0, next_token=2)
    step = sched.schedule()
    assert step.rows[0].tokens == [2] and step.rows[0].drafts == [] and sched.num_preemptions == 0
    _verify(sched, step, lambda row: 0, next_token=2)
    sched.abort("x")
    assert sched.kv.pool.num_used == 0


@settings(max_examples=60, deadline=None)
@given(
    arrivals=st.lists(
        st.tuples(st.lists(st.integers(1, 3), min_size=1, max_size=20), st.integers(1, 12)),
        min_size=1,
        max_size=8,
    ),
    acceptance=st.lists(st.integers(0, 3), min_size=1, max_size=50),
    num_blocks=st.integers(9, 24),  # (one request of 20 + 12 tokens, and 3 drafts, always fits)
)
def test_rolling_back_rejected_drafts_never_leaks_or_double_frees_a_block(arrivals, acceptance, num_blocks):
    """Requests over a 3-token vocabulary (drafts found often) under block pressure, each verification
    accepting what the test draws: every step stays in the token budget, each decoding request's computed
    tokens are all but its last, its blocks cover the slots it was given, and the pool's invariants hold
    at every step; every block is free at the end."""
    from pdserve.engine.core.request import Status
    from pdserve.engine.core.scheduler import Scheduler

    config = _spec_config(num_blocks=num_blocks, max_num_seqs=3)
    sched = Scheduler(config)
    for i, (prompt, max_tokens) in enumerate(arrivals):
        sched.add(make(f"r{i}", prompt, max_tokens=max_tokens, t=i))
    draws = iter(acceptance * 200)
    steps = 0
    while sched.num_unfinished:
        step = sched.schedule()
        if step is None:
            break
        assert sum(len(r.tokens) for r in step.rows) <= config.max_num_batched_tokens
        for row in step.rows:
            held = len(sched.block_ids(row.request_id)) * config.block_size
            assert row.num_past + len(row.tokens) <= held
        _verify(sched, step, lambda row: next(draws), next_token=steps % 3 + 1)
        for request in sched.running:
            assert request.status is Status.RUNNING and request.num_computed == request.num_tokens - 1
        sched.kv.pool.check()
        steps += 1
        assert steps < 2000
    assert sched.kv.pool.num_used == 0 and not sched.requests


def test_drafts_are_verified_where_they_are_worth_the_steps_cost():
    """plan_drafts: the likeliest drafts first (a row's later drafts are worth less: all before must be
    accepted), as many as maximize expected tokens per second of step given each bucket's cost."""
    from pdserve.engine.core.speculation import SpeculationStats, acceptance_estimate, plan_drafts

    buckets = (1, 2, 4, 8, 16)
    proposals = [(0.9, 3), (0.2, 3)]  # two decode rows: one that quotes well, one that does not
    assert plan_drafts(2, 2, proposals, 14, buckets, None) == [3, 3]  # costs not weighed: every draft
    assert plan_drafts(2, 2, proposals, 4, buckets, None) == [3, 1]  # the budget: the worthiest first
    assert plan_drafts(2, 2, proposals, 14, buckets, {}) == [0, 0]  # a step without drafts is timed first
    flat = dict.fromkeys(buckets, 1.0)  # memory-bound: a bigger step costs nothing more
    assert plan_drafts(2, 2, proposals, 14, buckets, flat) == [3, 3]
    linear = {b: float(b) for b in buckets}  # compute-bound: every token costs the same
    assert plan_drafts(2, 2, proposals, 14, buckets, linear) == [0, 0]
    # a step of 6 tokens (a prefill chunk) pads to 8 anyway: two drafts ride free, the 0.9 row's
    stepped = {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.2, 16: 4.0}
    assert plan_drafts(6, 2, proposals, 10, buckets, stepped) == [2, 0]

    # a bucket not measured yet costs what the largest measured below it does: tried, then measured
    assert plan_drafts(6, 2, proposals, 10, buckets, {8: 1.0}) == [3, 3]

    stats = SpeculationStats(3)
    assert acceptance_estimate(0, 0, stats) == 0.5  # nothing known yet
    stats.observe(4, 1)  # the engine so far: 1 of 4 accepted
    assert acceptance_estimate(0, 0, stats) == 0.25
    assert acceptance_estimate(12, 12, stats) == (12 + 1) / 16  # its own record weighs more as it grows


def test_the_cost_policy_learns_step_costs_and_still_verifies_every_draft_now_and_then():
    """draft_policy "cost": the scheduler keeps each bucket's step time (a moving average); once larger
    steps are seen to cost in proportion to their tokens, drafts stop, but for one step in EXPLORE_EVERY,
    which measures them again."""
    from pdserve.engine.core.draft_planner import EXPLORE_EVERY
    from pdserve.engine.core.scheduler import Scheduler

    config = _spec_config(
        speculative_config='{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}',
        max_num_seqs=1,
    )
    assert config.speculation.draft_policy == "cost"
    sched = Scheduler(config)
    sched.add(make("q", [1, 2] * 3, max_tokens=60))
    _verify(sched, sched.schedule(), lambda row: 0, next_token=1)
    drafted = []
    for _ in range(2 * EXPLORE_EVERY):
        step = sched.schedule()
        drafted.append(len(step.rows[0].drafts))
        num_tokens = len(step.rows[0].tokens)
        sched.drafts.observe_step_time(num_tokens, float(num_tokens))  # seconds: one per token (a CPU)
        _verify(sched, step, lambda row: 0, next_token=step.rows[0].tokens[-1] % 2 + 1)  # all rejected
    assert drafted[:2] == [0, 3]  # a step without drafts is timed, then one with all (not yet timed)
    assert sched.drafts.step_costs[1] == 1.0 and sched.drafts.step_costs[4] > 1.0
    assert drafted.count(0) >= 2 * EXPLORE_EVERY - 4  # not worth it: drafts only when exploring
    assert drafted[EXPLORE_EVERY - 2] == 3 or drafted[EXPLORE_EVERY - 1] == 3  # explored
    sched.abort("q")
