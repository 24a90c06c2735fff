"""Timing an engine in this process: the seconds of its decode steps at a batch size, and speculative
decoding against decoding without it (the same prompts on several engines, interleaved rounds, outputs
checked equal).

numpy and the standard library at import: bench/bench_vs_commit.py's workers load this file from this tree
while importing the `pdserve` of another commit.
"""

from __future__ import annotations

import statistics
import time

import numpy as np


def decode_step_times(
    engine,
    batch: int,
    steps: int,
    lora: list[str | None] | None = None,
    prompt_len: int = 32,
    params: list | None = None,
) -> list[float]:
    """Seconds of each of `steps` decode steps with `batch` running requests (`prompt_len`-token prompts,
    greedy), sampling included; the requests are aborted afterwards.

    `lora`: the adapter of each request, cycled (default: the base model for all); `params`: each
    request's SamplingParams, cycled (default: greedy, ignoring EOS)."""
    from pdserve.engine.sampling_params import SamplingParams

    params = params or [SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)]
    rng = np.random.default_rng(batch)
    ids = {
        engine.add_request(
            rng.integers(100, 40000, prompt_len).tolist(),
            params[i % len(params)],
            lora=lora[i % len(lora)] if lora else None,
        )
        for i in range(batch)
    }
    started: set[str] = set()
    while started != ids:  # every prompt computed (its first token out)
        started |= {output.request_id for output in engine.step().tokens}
    engine.step()  # first decode step after the last prefill
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    for request_id in ids:
        engine.abort(request_id)
    return times


def pdserve_decode_step(engine, batch: int, steps: int, lora: list[str | None] | None = None) -> float:
    """Mean seconds per decode step (see decode_step_times)."""
    return sum(decode_step_times(engine, batch, steps, lora)) / steps


def timed_together(engine, prompts, params) -> dict:
    """Runs the prompts together; returns their tokens, the decode's output tokens per second (from the
    first token of any to the last of all) and the mean TPOT of the requests."""
    ids = [engine.add_request(p, params) for p in prompts]
    times: dict[str, list[float]] = {rid: [] for rid in ids}
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    done = set()
    while len(done) < len(ids):
        outputs = engine.step().tokens
        now = time.perf_counter()
        for output in outputs:
            tokens[output.request_id] += output.new_token_ids
            times[output.request_id] += [now] * len(output.new_token_ids)
            if output.finished:
                done.add(output.request_id)
    first, last = min(t[0] for t in times.values()), max(t[-1] for t in times.values())
    generated = sum(len(t) - 1 for t in tokens.values())  # after each request's first token
    tpot = [(t[-1] - t[0]) / (len(t) - 1) for t in times.values() if len(t) > 1]
    return {
        "tokens": [tokens[rid] for rid in ids],
        "tokens_per_s": generated / (last - first),
        "tpot_ms": 1000 * sum(tpot) / len(tpot),
    }


def compare(engines: dict, prompts, params, rounds: int, exact: bool = True) -> dict:
    """The engines (by label; "off": the reference) on the same prompts: each warmed up on them once, then
    `rounds` interleaved runs; outputs checked equal token for token (`exact`; else the share of outputs
    equal to "off"'s is reported, `outputs_equal_<label>`). Per label the median tokens/s and TPOT, and
    with speculation their ratios to "off", the mean accepted length and the draft acceptance rate over
    the rounds."""
    for engine in engines.values():
        timed_together(engine, prompts, params)  # warm-up (the cost policy learns this workload's steps)
    before = {label: e.stats().speculation for label, e in engines.items()}
    results: dict[str, list[dict]] = {label: [] for label in engines}
    for _ in range(rounds):  # interleaved: the machine's drift touches every engine alike
        for label, engine in engines.items():
            results[label].append(timed_together(engine, prompts, params))
    tokens = results["off"][0]["tokens"]
    assert not exact or all(r["tokens"] == tokens for runs in results.values() for r in runs), (
        "outputs differ"
    )
    row = {"output_tokens": sum(len(t) for t in tokens)}
    for label, engine in engines.items():
        row[f"tokens_per_s_{label}"] = statistics.median(r["tokens_per_s"] for r in results[label])
        row[f"tpot_ms_{label}"] = statistics.median(r["tpot_ms"] for r in results[label])
        if label == "off":
            continue
        if not exact:
            runs = results[label]
            row[f"outputs_equal_{label}"] = sum(
                a == b for r in runs for a, b in zip(r["tokens"], tokens, strict=True)
            ) / (len(runs) * len(tokens))
        now, then = engine.stats().speculation, before[label]
        verifying = now.num_drafts - then.num_drafts
        accepted = now.num_accepted_tokens - then.num_accepted_tokens
        drafted = now.num_draft_tokens - then.num_draft_tokens
        row[f"mean_accepted_length_{label}"] = 1 + accepted / verifying if verifying else 1.0
        row[f"draft_acceptance_rate_{label}"] = accepted / drafted if drafted else 0.0
        row[f"tokens_per_s_ratio_{label}"] = row[f"tokens_per_s_{label}"] / row["tokens_per_s_off"]
        row[f"tpot_ratio_{label}"] = row[f"tpot_ms_{label}"] / row["tpot_ms_off"]
    return row
