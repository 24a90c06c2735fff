"""The simulator against the session's real daemons (a prefill server and a decode server on loopback):
a workload sent to them, profiles fitted to the steps each logged while serving it (--step-log), and the
same workload simulated on a disaggregated fleet of those profiles: the client's figures agree within a
loose bound, a factor of 4 (bench/bench_planner.py holds the tight one, on the default model).
The simulation comes out low (TTFT, TPOT and e2e p50 0.63-0.91 of the measured on the test model): what
the daemons spend outside their steps (the prefill RPC, KV frames and inserts, the relay) is not in a
step log, and on this tiny model it is a large share."""

from __future__ import annotations

import json
import time

import pytest

from pdserve.bench.serve import bench
from pdserve.bench.stats import compute_stats
from pdserve.bench.workload import LengthDist
from pdserve.engine.step_log import read_step_log
from pdserve.planner.plan import pool
from pdserve.planner.profile import fit_profile, measured_steps_of
from pdserve.planner.replay import ended_requests, replay_workload
from pdserve.planner.simulator import Fleet, Transfer, synthetic_workload
from pdserve.testing.launch import scrape

pytestmark = pytest.mark.daemon

RATE, NUM_REQUESTS, SEED, MAX_RUNS = 4.0, 24, 52, 10  # (seeds no other test sends: no prompt is cached)
PROMPTS, OUTPUTS = "uniform:24:96", "fixed:16"


def test_a_disaggregated_simulation_of_the_served_steps_agrees_with_the_daemons(prefill, decode, log_dir):
    logs = {role: log_dir / f"{role}-steps.jsonl" for role in ("prefill", "decode")}
    # the session's daemons compile (or load from the persistent cache) each shape on first use, outside the
    # steps a profile is fitted to: the measured run is the first of up to MAX_RUNS (each with new prompts:
    # none is cached) during which neither daemon compiled anything (their pdserve_xla_compilations; from an
    # empty cache, alone: the fourth or fifth run; a compiling run's TTFT p50 was 1.2-11.5 s, 0.25 s after)
    for seed in range(SEED, SEED + MAX_RUNS):
        compiled = _compilations(prefill, decode)
        before = {role: len(read_step_log(path)[1]) for role, path in logs.items()}
        phase_counts = _phase_counts(decode)
        sent_at = time.time()
        measured = bench(
            decode.address,
            rate=RATE,
            num_requests=NUM_REQUESTS,
            prompt_len=PROMPTS,
            output_len=OUTPUTS,
            seed=seed,
            progress=False,
        )["stats"]
        if _compilations(prefill, decode) == compiled:
            break
    else:
        pytest.fail(f"the daemons still compiled during each of {MAX_RUNS} runs of the workload")
    assert measured["completed"] == NUM_REQUESTS
    profiles = {}
    for role, path in logs.items():
        engine_info, steps = read_step_log(path)
        served = measured_steps_of(steps[before[role] :])
        profiles[role] = fit_profile(engine_info, served)
    budget = {role: int(p.engine_info["max_num_batched_tokens"]) for role, p in profiles.items()}
    fleet = Fleet(
        pool(profiles["decode"], budget["decode"], 1),
        pool(profiles["prefill"], budget["prefill"], 1),
        Transfer(latency_s=0.0),
    )
    work = synthetic_workload(RATE, NUM_REQUESTS, LengthDist.parse(PROMPTS), LengthDist.parse(OUTPUTS), seed)
    predicted = compute_stats(fleet.run(work).records)
    figures = {
        f"{name}_{p}": (measured[f"{name}_ms"][p], predicted[f"{name}_ms"][p])
        for name in ("ttft", "tpot", "e2e")
        for p in ("p50",)
    }
    # seen here alone: 0.63-1.0 (what the steps leave out is below); the bound is for gross errors (a lost
    # step, a unit): the measured side moves with the box's load (one full daemon-tier run fell outside
    # 0.4-2.5), and bench/bench_planner.py holds the accuracy
    for name, (m, s) in figures.items():
        assert 0.25 < s / m < 4.0, f"{name}: measured {m:.0f} ms, predicted {s:.0f} ms ({figures})"

    # the decode server's log lines of these requests: a replay's workload, and where their TTFT went
    lines = [json.loads(line) for line in decode.log_path.read_text().splitlines() if line.startswith("{")]
    ended = [e for e in lines if e.get("message") == "request ended" and e.get("arrival", 0) >= sent_at]
    assert len(ended) == NUM_REQUESTS and len(ended_requests(decode.log_path)) >= NUM_REQUESTS
    for entry in ended:
        phases = [entry[k] for k in ("queue_s", "prefill_s", "kv_s", "insert_s", "first_output_s")]
        assert entry["max_tokens"] == 16 and entry["n"] == 1 and entry["output_tokens"] == 16
        assert sum(phases) == pytest.approx(entry["ttft_s"], abs=0.006), entry  # (each rounded to 1 ms)
    replayed = [a for a in replay_workload(decode.log_path) if a.max_tokens == 16]
    assert sorted(len(a.prompt_ids) for a in replayed[-NUM_REQUESTS:]) == sorted(
        len(a.prompt_ids) for a in work
    )
    # and in its metrics: every phase of a transfer counted once for each of them
    counted = [a - b for a, b in zip(_phase_counts(decode), phase_counts, strict=True)]
    assert all(n >= NUM_REQUESTS for n in counted), counted


def _compilations(*daemons) -> list[float]:
    return [scrape(d.addresses["metrics"])["pdserve_xla_compilations_total"] for d in daemons]


def _phase_counts(decode) -> list[float]:
    values = scrape(decode.addresses["metrics"])
    return [
        values.get(f'pdserve_ttft_phase_seconds_count{{phase="{phase}"}}', 0.0)
        for phase in ("queue", "prefill", "kv", "insert", "first_output")
    ]
