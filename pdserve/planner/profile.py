"""Measuring a profile: the engine in this process runs a mixed workload (prompts of several lengths
arriving while others decode, so steps hold decode rows, prefill chunks over past context, or both), every
step is timed to its end, and the cost model (planner.costs.StepCosts) is fitted to the steps; the fit's
errors on the same steps and on held-out ones (every fifth) go in the profile with the engine's summary.
A served engine's step log (engine.step_log) is fitted the same way (profile_from_step_log)."""

from __future__ import annotations

import time

import numpy as np

from pdserve.engine.step_log import Logged, engine_description, read_step_log
from pdserve.planner.costs import Chain, Padding, Profile, RowShape, StepCosts, logged_rows

PROMPT_LENGTHS = (16, 64, 200, 480)
BATCHES = (1, 4, 16, 32)


def measure_steps(
    engine,
    rounds: int = 2,
    seed: int = 0,
    batches: tuple[int, ...] = BATCHES,
    prompt_lengths: tuple[int, ...] = PROMPT_LENGTHS,
) -> list[tuple[list[RowShape], float]]:
    """(rows, seconds) of every step of a workload on `engine`: for each of `batches`, that many
    requests of `prompt_lengths` (drawn at random) arriving one per step, each generating 24 tokens. The
    first round warms up (compiles) and is not returned."""
    from pdserve.engine.sampling_params import SamplingParams

    rng = np.random.default_rng(seed)
    measured: list[tuple[list[RowShape], float]] = []
    for round_ in range(rounds + 1):
        for batch in batches:
            waiting = [
                rng.integers(100, 20000, int(rng.choice(prompt_lengths))).tolist() for _ in range(batch)
            ]
            params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
            while waiting or engine.has_unfinished:
                if waiting:
                    engine.add_request(waiting.pop(), params)
                scheduled = engine.schedule_step()
                if scheduled is None:  # (nothing runnable: only before the next arrival)
                    if not waiting:
                        break
                    continue
                start = time.perf_counter()
                engine.run_step(scheduled)
                engine.synchronize()
                seconds = time.perf_counter() - start
                if round_:
                    measured.append(([RowShape(len(r.tokens), r.num_past) for r in scheduled.rows], seconds))
    return measured


def profile_engine(engine, rounds: int = 2, **workload) -> Profile:
    """A profile of `engine`: its steps measured (measure_steps' `workload` keywords), then fit_profile."""
    return fit_profile(engine_description(engine), measure_steps(engine, rounds, **workload))


def fit_profile(engine_info: dict, steps: list[tuple[list[RowShape], float]]) -> Profile:
    """The step costs of the engine `engine_info` describes (engine.step_log.engine_description: its
    padding is read from it) fitted on four of five `steps`, checked on the fifth."""
    held_out = steps[4::5]
    fitted = [s for i, s in enumerate(steps) if i % 5 != 4]
    padding = Padding(tuple(engine_info["token_buckets"]), int(engine_info["max_num_seqs"]))
    costs = StepCosts.fit(fitted, padding)

    def errors(some):
        if not some:
            return {"steps": 0}
        e = np.abs(costs.relative_errors(some))
        return {"steps": len(some), "p50": float(np.median(e)), "p90": float(np.percentile(e, 90))}

    fit = {"fitted": errors(fitted), "held_out": errors(held_out)}
    steps = tuple((tuple(rows), seconds) for rows, seconds in steps)
    return Profile(costs, engine_info=engine_info, fit=fit, steps=steps)


def measured_steps_of(logged: list[Logged]) -> list[tuple[tuple[RowShape, ...] | Chain, float]]:
    """A step log's entries (engine.step_log.read_step_log) as measured points for a fit (a Chain where
    one time covers several steps)."""
    return [(logged_rows(steps), seconds) for steps, seconds in logged if steps[-1]]


def profile_from_step_log(path: str) -> Profile:
    """A profile fitted to a daemon's step log (`--step-log`): the served engine's own steps."""
    engine_info, logged = read_step_log(path)
    return fit_profile({**engine_info, "step_log": str(path)}, measured_steps_of(logged))


def transfer_from_request_log(path: str, chunk_tokens: int | None = None) -> dict:
    """The KV transfer's time fitted to a decode server's requests (their `request ended` lines:
    planner/replay.py): fit_transfer of their kv_s, prompt tokens and cached prompt tokens. {} when the log
    has too few transferred requests."""
    from pdserve.planner.replay import ended_requests

    return fit_transfer(ended_requests(path, TRANSFER_FIELDS), chunk_tokens)


TRANSFER_FIELDS = ("kv_s", "prompt_tokens", "cached_prompt_tokens")  # of a `request ended` line
MIN_TRANSFERS = 4  # requests a transfer's fit needs


def fit_transfer(rows: list[dict], chunk_tokens: int | None = None) -> dict:
    """The KV transfer's time over `rows` (dicts of TRANSFER_FIELDS): `kv_s` (the first KV chunk to the
    first token) = latency_s + seconds_per_token x the prompt tokens sent (those not cached on the decode
    server), non-negative least squares. The prefill server streams each prefill chunk's KV as it is
    computed, so a prompt of more than one chunk's tokens (`chunk_tokens`: the prefill server's
    max_num_batched_tokens) has its later chunks' compute in kv_s too: with `chunk_tokens`, only prompts
    of one chunk are fitted (all of them when fewer than MIN_TRANSFERS are). {}: fewer than MIN_TRANSFERS
    rows."""
    from scipy.optimize import nnls

    def sent(r):
        return r["prompt_tokens"] - r["cached_prompt_tokens"]

    if chunk_tokens is not None:
        one_chunk = [r for r in rows if sent(r) <= chunk_tokens]
        rows = one_chunk if len(one_chunk) >= MIN_TRANSFERS else rows
    if len(rows) < MIN_TRANSFERS:
        return {}
    tokens = np.array([sent(r) for r in rows])
    seconds = np.array([r["kv_s"] for r in rows])
    (latency, per_token), _ = nnls(np.stack([np.ones_like(tokens), tokens], axis=1), seconds)
    return {"latency_s": float(latency), "seconds_per_token": float(per_token), "requests": len(rows)}
