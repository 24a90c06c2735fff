"""The step log a daemon writes (--step-log) and the profile fitted to it: a log written with known step
costs gives those costs back; a malformed or mixed log is refused naming its line."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.engine.step_log import StepLogWriter, read_step_log
from pdserve.planner.costs import Padding, RowShape, StepCosts
from pdserve.planner.profile import profile_from_step_log

pytestmark = pytest.mark.fast

ENGINE = {
    "model": "m",
    "tp": "1",
    "compile_cache": "warm",
    "max_num_batched_tokens": 64,
    "max_num_seqs": 8,
    "token_buckets": [8, 16, 32, 64],
    "block_size": 16,
}


def test_a_log_written_with_known_costs_fits_them_back(tmp_path):
    padding = Padding((8, 16, 32, 64), 8)
    truth = StepCosts(
        fixed_s=0.004, per_token_s=2e-4, per_row_s=3e-4, per_kv_read_s=2e-6, per_pair_s=1e-8, padding=padding
    )
    rng = np.random.default_rng(1)
    path = tmp_path / "steps.jsonl"
    writer = StepLogWriter(path, ENGINE)
    for i in range(60):
        rows = [(int(rng.integers(1, 8)), int(rng.integers(0, 400))) for _ in range(rng.integers(1, 9))]
        # every third: a chunk-only step (a prompt's first 64 tokens) timed with the one that sampled
        before = [[(64, 0)]] if i % 3 == 0 else []
        seconds = sum(truth.seconds(RowShape(*r) for r in step) for step in [*before, rows])
        writer.write(rows, seconds, before)
    writer.close()
    StepLogWriter(path, {**ENGINE, "compile_cache": "cold"}).close()  # a restart appending: the same engine
    engine, steps = read_step_log(path)
    assert len(steps) == 60 and engine["token_buckets"] == [8, 16, 32, 64]
    assert steps[0][0][0] == [(64, 0)] and len(steps[0][0]) == 2 and len(steps[1][0]) == 1
    profile = profile_from_step_log(path)
    assert profile.costs.padding == padding and profile.engine_info["step_log"] == str(path)
    assert profile.fit["held_out"]["steps"] == 12 and profile.fit["held_out"]["p90"] < 1e-6
    # (every step here pads to the 8 sequence slots: the fixed and per-row costs are one column, so the
    # coefficients are not unique; what is: the seconds of steps it has not seen)
    unseen = [
        [RowShape(int(rng.integers(1, 8)), int(rng.integers(0, 400))) for _ in range(5)] for _ in range(9)
    ]
    assert [profile.costs.seconds(r) for r in unseen] == pytest.approx([truth.seconds(r) for r in unseen])


def test_a_malformed_or_mixed_log_is_refused_naming_the_line(tmp_path):
    path = tmp_path / "steps.jsonl"
    writer = StepLogWriter(path, ENGINE)
    writer.write([(1, 10)], 0.01)
    writer.close()
    good = path.read_text()
    path.write_text(good + '{"rows": [[1]], "seconds": 0.1}\n')
    with pytest.raises(ValueError, match=r"steps.jsonl:3: not a step"):
        read_step_log(path)
    path.write_text(good + "{oops\n")
    with pytest.raises(ValueError, match=r"steps.jsonl:3"):
        read_step_log(path)
    path.write_text(good)
    StepLogWriter(path, {**ENGINE, "tp": "2"}).close()
    with pytest.raises(ValueError, match="another engine"):
        read_step_log(path)
    path.write_text('{"rows": [[1, 2]], "seconds": 0.1}\n')
    with pytest.raises(ValueError, match="no engine line"):
        read_step_log(path)
