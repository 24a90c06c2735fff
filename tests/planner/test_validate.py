"""planner/validate.py below its daemons: leave-one-out prediction on steps whose costs are known, the
error summary, a load as both the load generator and the simulator take it, and `pdserve simulate
--validate`'s flags refused before anything starts. (bench/bench_planner.py's smoke serves through it with
real daemons; tests/planner/test_served.py holds the simulator against the session's.)"""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from pdserve.bench.processes import _without_fake_devices
from pdserve.bench.serve import bench
from pdserve.bench.stats import compute_stats
from pdserve.bench.workload import LengthDist, SharedPrefix
from pdserve.planner.costs import Padding, Profile, RowShape, StepCosts
from pdserve.planner.plan import pool
from pdserve.planner.simulator import Fleet, synthetic_workload
from pdserve.planner.validate import FIGURES, Load, Run, Served, figure_key, mean_errors, predict

pytestmark = pytest.mark.fast

ENGINE = {
    "tp": "1",
    "kv_blocks": "512",
    "max_model_len": "1024",
    "block_size": "16",
    "max_num_seqs": 8,
    "max_num_batched_tokens": 256,
    "token_buckets": [16, 32, 64, 128, 256],
}
COSTS = StepCosts(
    fixed_s=0.004, per_token_s=0.0005, per_row_s=0.001, padding=Padding((16, 32, 64, 128, 256), 8)
)
SLO = {"slo_ttft_ms": 300.0, "slo_tpot_ms": 50.0}


def test_runs_served_by_steps_of_known_cost_are_predicted_exactly_from_the_others():
    """Each run's 'served' figures and steps are a simulation with COSTS; predict() fits a profile to the
    *other* runs' steps only (a run's own never leak into its prediction: the spans slice them apart),
    recovers COSTS, and predicts every figure with no error; and again from the run's own steps alone."""
    truth = pool(Profile(COSTS, engine_info=ENGINE), 256, 1)
    runs, steps = [], []
    for i, rate in enumerate((2.0, 4.0, 8.0)):
        load = Load("uniform:32:200", "fixed:12", 16, seed=i)
        result = Fleet(truth).run(load.arrivals(rate))
        first = len(steps)
        steps += [(tuple(RowShape(t, p) for _, t, p in s.rows), s.end_s - s.start_s) for s in result.steps]
        measured = compute_stats(result.records, None, **SLO)
        runs.append(Run(f"run{i}", rate, load, measured, {"decode": (first, len(steps))}))
    predictions = predict(Served("colocated", runs, {"decode": (ENGINE, steps)}), SLO, echo=lambda _: None)
    assert [p["rate"] for p in predictions] == [2.0, 4.0, 8.0]
    for p in predictions:
        for part in ("figures", "own_steps"):
            for key, f in p[part].items():
                assert f["measured"] > 0, (p["rate"], key)
                assert f["predicted"] == pytest.approx(f["measured"], rel=1e-6), (p["rate"], part, key)
    # a run whose logged steps took 1.5x what its figures were served with: predicted from its own steps,
    # its TPOT is at least 1.5x too long (slower steps also batch more); from the others', exact (its own
    # steps never leak into that prediction)
    slow = [
        (rows, s * 1.5) if i in range(*runs[1].spans["decode"]) else (rows, s)
        for i, (rows, s) in enumerate(steps)
    ]
    p = predict(Served("colocated", runs, {"decode": (ENGINE, slow)}), SLO, echo=lambda _: None)[1]
    slowed = p["own_steps"]["tpot_ms_p50"]["error"]
    assert 0.5 - 1e-6 <= slowed < 1.0
    assert p["figures"]["tpot_ms_p50"]["error"] == pytest.approx(0.0, abs=1e-6)
    assert mean_errors([p], "own_steps")["tpot_ms_p50"]["mape"] == pytest.approx(slowed)
    # a run whose other runs left too few steps to fit is not predicted
    few = [dataclasses.replace(r, spans={"decode": (0, 3)}) for r in runs[:2]]
    assert predict(Served("colocated", few, {"decode": (ENGINE, steps)}), SLO, echo=lambda _: None) == []


def test_the_mean_errors_are_per_figure_and_leave_out_a_figure_measured_as_zero():
    def run(ttft, goodput):  # (measured, predicted) of two figures; the others measured as 0
        figures = {
            figure_key(name, p): {"measured": 0.0, "predicted": 0.0, "error": None} for name, p in FIGURES
        }
        for key, (m, s) in (("ttft_ms_p50", ttft), ("goodput", goodput)):
            figures[key] = {"measured": m, "predicted": s, "error": (s - m) / m if m else None}
        return {"figures": figures}

    errors = mean_errors([run((100.0, 110.0), (0.0, 0.02)), run((200.0, 140.0), (1.0, 1.05))])
    assert errors["ttft_ms_p50"] == {
        "mape": pytest.approx(0.2),
        "worst": pytest.approx(0.3),
        "runs": 2,
        "goal": 0.15,
        "met": False,
        "mean_abs": pytest.approx(35.0),
    }
    # goodput: the run that measured none is out of the percentage, not of the error in requests/s
    assert errors["goodput"] == {
        "mape": pytest.approx(0.05),
        "worst": pytest.approx(0.05),
        "runs": 1,
        "goal": 0.10,
        "met": True,
        "mean_abs": pytest.approx(0.035),
    }
    assert "tpot_ms_p50" not in errors  # (no run measured it)


def test_a_load_is_the_load_generators_arguments_and_the_simulators_arrivals():
    assert {f.name for f in dataclasses.fields(Load)} <= set(inspect.signature(bench).parameters)
    chat = Load("uniform:8:16", "fixed:4", 3, seed=5, shared_prefix="32:2", turns=2, think_time_s=0.5)
    expected = synthetic_workload(
        1.0, 3, LengthDist(8, 16), LengthDist(4, 4), 5, SharedPrefix(32, 2), 1.0, turns=2, think_s=0.5
    )
    assert chat.arrivals(1.0) == expected and all(a.then for a in expected)
    assert LengthDist.parse(LengthDist(8, 16).spec) == LengthDist(8, 16)
    assert LengthDist.parse(LengthDist(4, 4).spec) == LengthDist(4, 4)
    assert SharedPrefix.parse(SharedPrefix(32, 2).spec) == SharedPrefix(32, 2)


def test_a_daemon_started_here_chooses_its_own_fake_cpu_devices():
    flags = "--xla_cpu_use_thunk_runtime=false --xla_force_host_platform_device_count=8"
    assert _without_fake_devices(flags) == "--xla_cpu_use_thunk_runtime=false"
    assert _without_fake_devices("--xla_force_host_platform_device_count=8") == ""


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--validate", "--validate-modes", "colocated,split"], "--validate-modes 'colocated,split'"),
        (["--validate", "--validate-rates", "1"], "--validate-rates: at least two positive rates"),
        (["--validate", "--validate-rates", "1,x"], "--validate-rates '1,x': numbers"),
        (["--validate", "--validate-cpus", "0"], "--validate-cpus '0': PREFILL:DECODE"),
        ([], "--profile is required"),
    ],
)
def test_simulate_validate_refuses_bad_flags_before_starting_a_daemon(extra, message):
    from pdserve.cli import main

    with pytest.raises(SystemExit, match=message):
        main(["simulate", "--rate", "1", *extra])
