"""The simulator on the real scheduler: workloads whose answer is computable by hand (fixed step costs,
deterministic arrivals) give exactly those TTFT / TPOT figures; chunking, preemption, prefix hits and
n-forks appear in the trace as the scheduler makes them; the cost model's fit recovers known costs."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from pdserve.bench.stats import compute_stats
from pdserve.bench.workload import LengthDist
from pdserve.engine.config import EngineConfig
from pdserve.planner.costs import PROFILE_VERSION, Chain, Padding, Profile, RowShape, StepCosts
from pdserve.planner.simulator import (
    Arrival,
    Fleet,
    Pool,
    Transfer,
    queue_series,
    simulate,
    synthetic_workload,
)

pytestmark = pytest.mark.fast

CONFIG = EngineConfig(
    block_size=4,
    num_blocks=64,
    max_num_seqs=8,
    max_model_len=128,
    max_num_batched_tokens=16,
    max_prefill_seqs=4,
)
TENTH = StepCosts(fixed_s=0.1)  # every step 100 ms, whatever it holds


def prompt(n: int, start: int = 1000) -> tuple[int, ...]:
    return tuple(range(start, start + n))


def test_fixed_costs_give_the_figures_by_hand():
    """Two 8-token prompts at 0 s: one step computes both (first tokens at 0.1 s), then one decode step
    a token. A third arriving at 0.15 s waits for the step running then (to 0.2 s) and is computed in the
    next: its first token at 0.3 s, TTFT 0.15 s."""
    work = [Arrival(0.0, prompt(8), 4), Arrival(0.0, prompt(8, 2000), 4), Arrival(0.15, prompt(8, 3000), 4)]
    result = simulate(CONFIG, TENTH, work)
    a, b, c = result.records
    assert a.token_times_s == pytest.approx([0.1, 0.2, 0.3, 0.4]) and b.token_times_s == a.token_times_s
    assert c.token_times_s == pytest.approx([0.15, 0.25, 0.35, 0.45])  # since its arrival at 0.15
    assert [r.ttft_s for r in (a, b, c)] == pytest.approx([0.1, 0.1, 0.15])
    assert all(r.tpot_s == pytest.approx(0.1) and r.finish_reason == "length" for r in (a, b, c))
    stats = compute_stats(result.records, slo_ttft_ms=120, slo_tpot_ms=100.5)
    assert stats["good_requests"] == 2 and stats["e2e_ms"]["max"] == pytest.approx(450)
    assert result.steps[0].rows == (("0", 8, 0), ("1", 8, 0))
    assert result.steps[2].rows == (("0", 1, 9), ("1", 1, 9), ("2", 8, 0))  # decodes first, then the prompt


def test_the_queue_and_kv_use_series_follow_the_steps():
    """With two sequence slots, the third prompt waits while the first two decode (its arrival taken at the
    next step boundary), then runs alone; the cache (64 blocks of 4) holds 2 blocks a prompt, a third once
    its 9th token is written, and empties as the last request finishes."""
    work = [Arrival(0.0, prompt(8), 4), Arrival(0.0, prompt(8, 2000), 4), Arrival(0.15, prompt(8, 3000), 4)]
    result = simulate(dataclasses.replace(CONFIG, max_num_seqs=2), TENTH, work)
    series = queue_series(result.steps, CONFIG.num_blocks)
    assert list(series) == ["decode-0"]
    s = series["decode-0"]
    assert s["t_s"] == pytest.approx([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8])
    assert s["running"] == [2, 2, 2, 0, 1, 1, 1, 0] and s["waiting"] == [0, 0, 1, 1, 0, 0, 0, 0]
    assert [round(u * 64) for u in s["kv_use"]] == [4, 6, 6, 0, 2, 3, 3, 0]


def test_a_prompt_over_the_budget_is_computed_in_chunks_beside_running_decodes():
    """A 40-token prompt under a 16-token budget, while one request decodes: chunks of 15, 15 and 10
    (the decode token first in every step), first token after the third chunk."""
    work = [Arrival(0.0, prompt(4), 10), Arrival(0.05, prompt(40, 5000), 2)]
    result = simulate(CONFIG, TENTH, work)
    chunks = [rows for step in result.steps for rid, *rows in step.rows if rid == "1"]
    assert chunks[:3] == [[15, 0], [15, 15], [10, 30]] and chunks[3] == [1, 40]
    assert result.records[1].ttft_s == pytest.approx(0.4 - 0.05)


def test_costs_follow_the_rows():
    """The cost of a step is the model's of its rows: a 16-token prefill and a decode step differ."""
    costs = StepCosts(fixed_s=0.01, per_token_s=0.001, per_kv_read_s=1e-5)
    result = simulate(CONFIG, costs, [Arrival(0.0, prompt(16), 3)])
    durations = [s.end_s - s.start_s for s in result.steps]
    assert durations == pytest.approx([0.01 + 0.016 + 16e-5, 0.01 + 0.001 + 17e-5, 0.01 + 0.001 + 18e-5])


def test_a_shared_prefix_hits_the_cache_and_n_forks():
    """The second of two prompts sharing 12 tokens computes only its own 4 (blocks of 4); n = 3 gives 3
    records of the request, all of max_tokens."""
    shared = prompt(12)
    work = [Arrival(0.0, shared + prompt(4, 7000), 2), Arrival(1.0, shared + prompt(4, 8000), 2, n=3)]
    result = simulate(CONFIG, TENTH, work)
    second = [rows for step in result.steps for rid, *rows in step.rows if rid == "1"]
    assert second[0] == [4, 12]  # 12 cached tokens, 4 computed
    forks = [r for r in result.records if r.index == 1]
    assert len(forks) == 3 and all(r.output_tokens == 2 for r in forks)


def test_block_pressure_preempts_and_every_request_still_finishes():
    """Too few blocks for eight growing requests: the scheduler preempts (counted in the trace), and
    every request finishes with all its tokens."""
    tight = EngineConfig(
        block_size=4, num_blocks=24, max_num_seqs=8, max_model_len=64, max_num_batched_tokens=32
    )
    work = [Arrival(0.0, prompt(8, 1000 * (i + 1)), 24) for i in range(8)]
    result = simulate(tight, TENTH, work)
    assert result.steps[-1].num_preemptions > 0
    assert [r.output_tokens for r in result.records] == [24] * 8


def test_a_conversations_next_turn_follows_its_answer_and_hits_the_cache():
    """Two turns, 0.5 s of thinking: turn 1 (8 tokens, 3 out) ends at 0.3 s; turn 2 arrives at 0.8 s with
    the conversation so far (8 + 3 answered + its own 8 = 19 tokens), of which the 8 in whole blocks of
    computed KV are found in the prefix cache (the answer's KV is in a block not yet full): 11 computed.
    Turn 1 of a chat workload is the Poisson workload's request of the same seed, at the same time."""
    work = synthetic_workload(1.0, 1, LengthDist(8, 8), LengthDist(3, 3), seed=3, turns=2, think_s=0.5)
    (arrival,) = work
    assert (
        arrival.prompt_ids == synthetic_workload(1.0, 1, LengthDist(8, 8), LengthDist(3, 3), 3)[0].prompt_ids
    )
    ((own, max_tokens),) = arrival.then
    result = simulate(CONFIG, TENTH, work)
    first, second = result.records
    assert first.e2e_s == pytest.approx(0.3) and second.start_s == pytest.approx(0.8)
    assert second.prompt_tokens == 19 and len(own) == 8 and max_tokens == 3
    assert second.ttft_s == pytest.approx(0.1)
    turn2 = [rows for step in result.steps for rows in step.rows if rows[0] == "1"]
    assert turn2[0] == ("1", 11, 8)


def test_a_request_that_cannot_fit_is_an_error_not_a_hang():
    tiny = EngineConfig(
        block_size=4, num_blocks=2, max_num_seqs=2, max_model_len=64, max_num_batched_tokens=16
    )
    with pytest.raises(RuntimeError, match="can never be scheduled"):
        simulate(tiny, TENTH, [Arrival(0.0, prompt(20), 4)])


def test_the_fit_recovers_known_costs_and_the_profile_round_trips():
    truth = StepCosts(fixed_s=0.004, per_token_s=2e-4, per_row_s=3e-4, per_kv_read_s=2e-6, per_pair_s=1e-8)
    rng = np.random.default_rng(0)
    steps = []
    for _ in range(40):
        rows = [
            RowShape(int(rng.integers(1, 64)), int(rng.integers(0, 512))) for _ in range(rng.integers(1, 9))
        ]
        steps.append((tuple(rows), truth.seconds(rows)))
    # steps timed together (a chunk-only step is not waited for): their seconds summed
    chain = Chain([(RowShape(300, 0),), steps[0][0]])
    assert truth.seconds(chain) == pytest.approx(truth.seconds([RowShape(300, 0)]) + steps[0][1])
    steps.append((chain, truth.seconds(chain)))
    fitted = StepCosts.fit(steps)
    assert np.abs(fitted.relative_errors(steps)).max() < 1e-6
    assert fitted.vector() == pytest.approx(truth.vector(), rel=1e-4)
    steps = tuple(steps)
    startup = {"load_s": 3.0, "warmup_s": 41.5, "compiled_variants": 112}  # (pdserve profile --warmup)
    profile = Profile(
        fitted, engine_info={"model": "m", "tp": 1}, fit={"max_rel_error": 0.0}, steps=steps, startup=startup
    )
    assert Profile.from_json(profile.to_json()) == profile
    older = json.loads(profile.to_json())
    del older["startup"]  # a profile written before start-ups were recorded reads with none
    assert Profile.from_json(json.dumps(older)) == dataclasses.replace(profile, startup={})
    first = [[[r.num_tokens, r.num_past] for r in steps[0][0]], steps[0][1]]
    version1 = {**older, "version": 1, "steps": [first]}  # (a step's rows, without the steps around them)
    assert Profile.from_json(json.dumps(version1)).steps == (steps[0],)
    with pytest.raises(ValueError, match="version"):
        Profile.from_json(profile.to_json().replace(f'"version": {PROFILE_VERSION}', '"version": 99'))


def test_a_step_costs_what_the_engine_pads_it_to():
    """Buckets of 4, 8 and 16 tokens, 4 sequence slots: 5 tokens compute as 8 (4 slots), 3 as 4 (4 slots:
    the padded tokens, capped by the slots)."""
    padded = StepCosts(per_token_s=1.0, per_row_s=100.0, padding=Padding((4, 8, 16), 4))
    assert padded.seconds([RowShape(5, 0)]) == 8 + 4 * 100
    assert padded.seconds([RowShape(1, 9)] * 3) == 4 + 4 * 100
    assert StepCosts(per_token_s=1.0, per_row_s=100.0).seconds([RowShape(1, 9)] * 3) == 3 + 3 * 100


# ---- fleets: replicas, and prefill and decode pools --------------------------------------------------------
def test_disaggregated_by_hand():
    """An 8-token prompt at 0 s: admitted on the decode replica (blocks for its KV), computed on the
    prefill replica (0-0.1 s), its KV 50 ms on the way, then the decode replica takes it at once (idle):
    the first token at 0.15 s, the others a decode step (0.1 s) each."""
    fleet = Fleet(Pool(CONFIG, TENTH), Pool(CONFIG, TENTH), Transfer(latency_s=0.05))
    result = fleet.run([Arrival(0.0, prompt(8), 3)])
    (record,) = result.records
    assert record.token_times_s == pytest.approx([0.15, 0.25, 0.35])
    assert [(s.replica, s.rows) for s in result.steps] == [
        ("prefill-0", (("prefill:0", 8, 0),)),
        ("decode-0", (("0", 1, 8),)),
        ("decode-0", (("0", 1, 9),)),
    ]


def test_disaggregated_transfer_time_follows_the_kv_bytes():
    """Transfer: 16 tokens of 1 kB at 1 MB/s is 16 ms beside a 10 ms latency: TTFT 0.1 + 0.026 s."""
    transfer = Transfer.over_link(bytes_per_token=1000, bytes_per_s=1e6, latency_s=0.01)
    fleet = Fleet(Pool(CONFIG, TENTH), Pool(CONFIG, TENTH), transfer)
    assert fleet.run([Arrival(0.0, prompt(16), 2)]).records[0].ttft_s == pytest.approx(0.126)


def test_a_chunked_prompts_kv_streams_as_each_chunk_is_computed():
    """A 40-token prompt in chunks of 16, 16 and 8 (0.1 s each): each chunk's KV leaves when its step
    ends, after the chunk before it. At 10 ms a token the stream is the bottleneck: 0.1 -> 0.26, 0.26 ->
    0.42, 0.42 -> 0.50, + 50 ms latency; at 1 ms a token it hides behind the compute but for the last
    chunk's 8 ms."""
    for per_token, ttft in ((0.01, 0.55), (0.001, 0.358)):
        fleet = Fleet(Pool(CONFIG, TENTH), Pool(CONFIG, TENTH), Transfer(0.05, per_token))
        result = fleet.run([Arrival(0.0, prompt(40), 2)])
        chunks = [rows for s in result.steps if s.replica == "prefill-0" for rows in s.rows]
        assert chunks == [("prefill:0", 16, 0), ("prefill:0", 16, 16), ("prefill:0", 8, 32)]
        assert result.records[0].ttft_s == pytest.approx(ttft)


def test_short_prompts_are_computed_on_the_decode_replica():
    """local_prefill_below 16: an 8-token prompt never reaches the prefill pool; a 20-token one does."""
    fleet = Fleet(Pool(CONFIG, TENTH), Pool(CONFIG, TENTH), Transfer(), local_prefill_below=16)
    result = fleet.run([Arrival(0.0, prompt(8), 2), Arrival(1.0, prompt(20, 4000), 2)])
    assert result.records[0].token_times_s == pytest.approx([0.1, 0.2])
    assert {s.replica for s in result.steps if s.end_s <= 1.0} == {"decode-0"}
    assert [s.rows for s in result.steps if s.replica == "prefill-0"] == [
        (("prefill:1", 16, 0),),
        (("prefill:1", 4, 16),),
    ]


def test_replicas_share_the_load():
    """Two colocated replicas, four requests at once: two each (the fewest unfinished requests first),
    so each finishes as if alone with one other; two prefill replicas take one prompt each."""
    work = [Arrival(0.0, prompt(8, 1000 * (i + 1)), 2) for i in range(4)]
    result = Fleet(Pool(CONFIG, TENTH, replicas=2)).run(work)
    assert {s.replica for s in result.steps} == {"decode-0", "decode-1"}
    assert all(r.token_times_s == pytest.approx([0.1, 0.2]) for r in result.records)
    result = Fleet(Pool(CONFIG, TENTH), Pool(CONFIG, TENTH, replicas=2)).run(work[:2])
    assert sorted(s.replica for s in result.steps if s.replica.startswith("prefill")) == [
        "prefill-0",
        "prefill-1",
    ]
    assert all(r.ttft_s == pytest.approx(0.1) for r in result.records)


@pytest.mark.parametrize("prefix_routing", [True, False])
def test_prefix_routing_sends_a_shared_prefix_where_it_is_cached(prefix_routing):
    """Four prompts of a shared 40-token prefix and 12 tokens of their own (more than a block: the decode
    replica, which caches the prefix too, has them computed remotely), each after the one before has
    finished, to two prefill replicas: by prefix, the three after the first go where the prefix is cached
    and compute only their own 12 tokens; by the least work queued (in turns on a tie), each replica
    computes the prefix once."""
    shared = prompt(40)
    work = [Arrival(3.0 * i, shared + prompt(12, 5000 + 20 * i), 2) for i in range(4)]
    fleet = Fleet(
        Pool(CONFIG, TENTH), Pool(CONFIG, TENTH, replicas=2), Transfer(), prefix_routing=prefix_routing
    )
    result = fleet.run(work)
    computed = {}
    for step in result.steps:
        if step.replica.startswith("prefill"):
            computed[step.replica] = computed.get(step.replica, 0) + sum(t for _, t, _ in step.rows)
    if prefix_routing:
        assert len(computed) == 1 and sum(computed.values()) == 52 + 3 * 12
    else:
        assert sorted(computed.values()) == [52 + 12, 52 + 12]
    assert all(r.output_tokens == 2 for r in result.records)


def test_n_forks_on_a_disaggregated_fleet():
    """n = 2 through the prefill pool: the decode replica forks at the prefill's first token."""
    result = Fleet(Pool(CONFIG, TENTH), Pool(CONFIG, TENTH)).run([Arrival(0.0, prompt(8), 3, n=2)])
    assert [r.output_tokens for r in result.records] == [3, 3]
    assert all(r.token_times_s == pytest.approx([0.1, 0.2, 0.3]) for r in result.records)


def test_each_compiled_bucket_gets_its_own_factor():
    """Decode steps of 1-8 rows where the 2-token bucket costs 1.6x what the linear terms give (a lone row
    runs another kernel): no linear fit matches them all; the fit gives bucket 2 a factor above the
    others', its steps come out within a few percent, and a bucket it never saw keeps the linear cost."""
    padding = Padding((1, 2, 4, 8, 16), 16)
    truth = StepCosts(fixed_s=0.01, per_row_s=0.002, per_kv_read_s=1e-5, padding=padding)
    rng = np.random.default_rng(2)
    steps = []
    for _ in range(120):
        rows = [RowShape(1, int(rng.integers(10, 400))) for _ in range(int(rng.integers(1, 9)))]
        seconds = truth.seconds(rows) * (1.6 if len(rows) == 2 else 1.0)
        steps.append((rows, seconds))
    fitted = StepCosts.fit(steps, padding)
    linear = dataclasses.replace(fitted, bucket_factors=())
    factors = dict(fitted.bucket_factors)
    assert set(factors) == {1, 2, 4, 8} and factors[2] > 1.3 * max(factors[b] for b in (1, 4, 8))
    pairs = [step for step in steps if len(step[0]) == 2]
    assert np.abs(fitted.relative_errors(pairs)).max() < 0.05 < np.abs(linear.relative_errors(pairs)).min()
    assert fitted.seconds([RowShape(1, 50)] * 12) == linear.seconds([RowShape(1, 50)] * 12)  # (bucket 16)
    assert Profile.from_json(Profile(fitted).to_json()).costs == fitted
