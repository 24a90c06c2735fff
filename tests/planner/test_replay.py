"""A workload replayed from a decode server's log (both formats), and the TTFT phases its lines carry."""

from __future__ import annotations

import json
import logging

import pytest

from pdserve.planner.costs import Profile, StepCosts
from pdserve.planner.profile import transfer_from_request_log
from pdserve.planner.replay import replay_workload
from pdserve.services.decode.timeline import Timeline
from pdserve.services.logs import JsonFormatter, TextFormatter

pytestmark = pytest.mark.fast


def record(**extra) -> logging.LogRecord:
    entry = logging.LogRecord(
        "pdserve.services.decode.core", logging.INFO, "core.py", 1, "request ended", (), None
    )
    entry.__dict__.update(extra)
    return entry


@pytest.mark.parametrize("formatter", [JsonFormatter(), TextFormatter()], ids=["json", "text"])
def test_a_log_replays_as_its_requests(tmp_path, formatter):
    """Arrivals from the first one's, prompt lengths, tokens per sequence and n come back; a refused
    request (no output) and other lines are left out."""
    lines = [
        formatter.format(record(arrival=1000.5, prompt_tokens=7, output_tokens=12, n=2, max_tokens=64)),
        "2026-12-06 21:00:00,000 INFO pdserve: engine: model=m",
        formatter.format(record(arrival=1000.0, prompt_tokens=30, output_tokens=5, n=1, max_tokens=5)),
        formatter.format(record(arrival=1001.0, prompt_tokens=9, output_tokens=0, n=1, max_tokens=5)),
    ]
    log = tmp_path / "decode.log"
    log.write_text("\n".join(lines) + "\n")
    arrivals = replay_workload(log, seed=3)
    assert [(a.at_s, len(a.prompt_ids), a.max_tokens, a.n) for a in arrivals] == [
        (0.0, 30, 5, 1),
        (0.5, 7, 6, 2),
    ]
    assert replay_workload(log, seed=3) == arrivals  # (prompts drawn from the seed)


def test_a_log_without_request_lines_is_refused(tmp_path):
    log = tmp_path / "decode.log"
    log.write_text(json.dumps({"message": "request ended", "prompt_tokens": 3}) + "\n")  # (no arrival)
    with pytest.raises(ValueError, match="no `request ended` line"):
        replay_workload(log)


def test_ttft_phases_are_the_gaps_between_the_moments_passed():
    timeline = Timeline(10.0)
    timeline.mark("admitted", 10.25)
    timeline.mark("kv_first", 10.5)
    timeline.mark("kv_first", 10.75)  # (a second attempt's)
    timeline.mark("kv_done", 11.0)
    timeline.mark("decoding", 11.125)
    timeline.mark("first_output", 11.25)
    assert timeline.phases() == {
        "queue_s": 0.25,
        "prefill_s": 0.5,
        "kv_s": 0.25,
        "insert_s": 0.125,
        "first_output_s": 0.125,
    }
    colocated = Timeline(0.0, {"admitted": 0.5, "first_output": 2.0})
    assert colocated.phases() == {"queue_s": 0.5, "first_output_s": 1.5}


def test_the_kv_transfer_fits_to_the_requests_of_a_log(tmp_path):
    """kv_s = 20 ms + 0.1 ms a prompt token sent (not cached): the fit gives both back, and the profile
    carries it through its file; given the prefill's chunk, prompts of more than one are left out."""
    lines = [
        json.dumps(
            {
                "message": "request ended",
                "kv_s": 0.02 + 1e-4 * (p - c),
                "prompt_tokens": p,
                "cached_prompt_tokens": c,
            }
        )
        for p, c in [(100, 0), (300, 0), (500, 64), (800, 128), (50, 16)]
    ]
    log = tmp_path / "decode.log"
    log.write_text("\n".join(lines) + "\n")
    fit = transfer_from_request_log(str(log))
    assert fit["latency_s"] == pytest.approx(0.02) and fit["seconds_per_token"] == pytest.approx(1e-4)
    assert fit["requests"] == 5
    profile = Profile(StepCosts(fixed_s=0.01), transfer=fit)
    assert Profile.from_json(profile.to_json()).transfer == fit
    # prompts over a prefill chunk (500, 800 tokens) have their later chunks' compute in kv_s too: 1 s more
    chunked = [
        {**json.loads(line), "kv_s": json.loads(line)["kv_s"] + (p > 400)}
        for line, p in zip(lines, (100, 300, 500, 800, 50), strict=True)
    ]
    chunked.append({**chunked[0], "kv_s": 0.02 + 1e-4 * 200, "prompt_tokens": 200})
    log.write_text("\n".join(json.dumps(r) for r in chunked) + "\n")
    fit = transfer_from_request_log(str(log), chunk_tokens=400)
    assert fit["seconds_per_token"] == pytest.approx(1e-4) and fit["requests"] == 4
    assert transfer_from_request_log(str(log))["seconds_per_token"] > 1e-3  # (all of them: the compute too)
    log.write_text("\n".join(lines[:3]) + "\n")
    assert transfer_from_request_log(str(log)) == {}  # (too few to fit)
