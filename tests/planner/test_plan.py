"""The planner on synthetic profiles where the best configuration is known: prefill-heavy traffic under a
tight TPOT target goes to a disaggregated unit (a colocated engine's decodes wait behind every prompt);
short prompts under a tight TTFT target stay colocated (a transfer costs more than it frees); the plan
replicates the best unit to the requested rate within the chip budget."""

from __future__ import annotations

import json

import pytest

from pdserve.bench.workload import LengthDist
from pdserve.planner.costs import Padding, Profile, StepCosts
from pdserve.planner.plan import RATIOS, Candidate, Workload, candidates, goodput, plan
from pdserve.planner.simulator import Transfer

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
ENGINE = {
    "tp": "1",
    "kv_blocks": "1024",
    "max_model_len": "1024",
    "block_size": "16",
    "max_num_seqs": 16,
    "max_num_batched_tokens": 512,
}
# a step: 5 ms, and 1 ms a token (padded to its bucket): a 512-token prompt 0.52 s, 8 decodes 13 ms
PROFILE = Profile(
    StepCosts(fixed_s=0.005, per_token_s=0.001, padding=Padding(BUCKETS, 16)), engine_info=ENGINE
)


def ranked(workload: Workload, transfer: Transfer) -> list:
    scored = [goodput(c, workload, transfer) for c in candidates([PROFILE], [512])]
    return sorted(scored, key=lambda s: -s.per_chip)


@pytest.mark.fast
def test_prefill_heavy_traffic_under_a_tight_tpot_is_disaggregated():
    workload = Workload(LengthDist(512, 512), LengthDist(32, 32), 3000, 20, num_requests=40)
    transfer = Transfer(latency_s=0.01)
    scores = ranked(workload, transfer)
    best, colocated = scores[0], next(s for s in scores if s.candidate.prefill is None)
    assert best.candidate.prefill is not None, [(s.candidate.label, s.per_chip) for s in scores]
    assert best.candidate.prefill_replicas >= best.candidate.decode_replicas
    assert best.per_chip > 2 * colocated.per_chip
    assert best.figures["slo_attainment"] >= 0.9 and best.queues.keys() == {"prefill", "decode"}
    chosen = plan(scores, 2.5 * best.goodput, 64, workload, transfer)  # the fewest chips: copies of the best
    assert chosen.best is best and chosen.units >= 3 and chosen.figures["slo_attainment"] >= 0.9
    assert chosen.prefill_replicas == chosen.units * best.candidate.prefill_replicas
    fewer = plan(scores, 2.5 * best.goodput, chosen.chips - 1, workload, transfer)  # (it no longer fits)
    assert fewer is None or fewer.best is not best


@pytest.mark.fast
def test_short_prompts_under_a_tight_ttft_stay_colocated():
    workload = Workload(LengthDist(16, 16), LengthDist(64, 64), 60, 50, num_requests=40)
    transfer = Transfer(latency_s=0.05)
    scores = ranked(workload, transfer)
    assert scores[0].candidate.prefill is None and scores[0].goodput > 0
    assert all(s.goodput == 0 for s in scores if s.candidate.prefill is not None)  # TTFT > 50 ms transfer
    chosen = plan(scores, 2 * scores[0].goodput, 8, workload, transfer)  # colocated replicas side by side
    assert chosen.best is scores[0] and chosen.prefill_replicas == 0 and chosen.decode_replicas >= 2


@pytest.mark.fast
def test_a_unit_that_never_meets_the_slo_has_no_goodput_and_no_plan():
    workload = Workload(LengthDist(512, 512), LengthDist(8, 8), 100, 20, num_requests=10)
    scored = goodput(Candidate(PROFILE, 1, 512), workload, Transfer())
    assert scored.goodput == 0.0 and scored.queues == {}
    assert plan([scored], 1.0, 8, workload, Transfer()) is None


@pytest.mark.fast
def test_a_workload_too_small_to_load_a_unit_is_said_so():
    """Two short requests meet the SLO however fast they come: no goodput can be told from them."""
    workload = Workload(LengthDist(16, 16), LengthDist(2, 2), 10_000, 1_000, num_requests=2)
    with pytest.raises(ValueError, match="too few requests to load it"):
        goodput(Candidate(PROFILE, 1, 512), workload, Transfer())


@pytest.mark.fast
def test_short_prompts_computed_on_decode_replicas_are_candidates_too():
    """With local_prefill_below 32, a disaggregated unit computes 16-token prompts on its decode replica:
    no transfer, so the 50 ms link no longer rules it out (its goodput is the colocated replica's, on
    more chips)."""
    workload = Workload(LengthDist(16, 16), LengthDist(64, 64), 60, 50, num_requests=40)
    transfer = Transfer(latency_s=0.05)
    units = [c for c in candidates([PROFILE], [512], True, (0, 32)) if c.prefill is not None]
    assert len(units) == 2 * len(RATIOS) and {c.local_prefill_below for c in units} == {0, 32}
    local = next(
        c for c in units if c.local_prefill_below == 32 and c.prefill_replicas == 1 and c.decode_replicas == 1
    )
    assert "prompts < 32 on decode" in local.label
    assert goodput(local, workload, transfer).goodput > 0


@pytest.mark.fast
def test_bursty_arrivals_need_more_headroom_than_poisson():
    """The same mean rate in clumps (burstiness 0.25, as `pdserve bench serve --burstiness`): the queue
    builds in each clump, so one colocated replica carries less within a TTFT target than under Poisson
    arrivals."""
    colocated = Candidate(PROFILE, 1, 512)
    poisson = Workload(LengthDist(256, 256), LengthDist(16, 16), 1000, 100, num_requests=80)
    bursty = Workload(LengthDist(256, 256), LengthDist(16, 16), 1000, 100, num_requests=80, burstiness=0.25)
    assert (
        0 < goodput(colocated, bursty, Transfer()).goodput < goodput(colocated, poisson, Transfer()).goodput
    )


@pytest.mark.fast
def test_prefill_routing_is_searched_where_a_unit_has_prefill_replicas_to_choose_from():
    both = candidates([PROFILE], [512], prefix_routing=(True, False))
    several = [c for c in both if c.prefill is not None and c.prefill_replicas > 1]
    assert several and {c.prefix_routing for c in several} == {True, False}
    assert all(c.prefix_routing for c in both if c.prefill is None or c.prefill_replicas == 1)
    assert len({c.label for c in both}) == len(both)  # (a routing is in its label)
    off = next(c for c in several if not c.prefix_routing)
    assert off.label.endswith("least-outstanding routing")
    assert off.fleet(Transfer()).routing.policy == "least-outstanding"


@pytest.mark.fast
def test_the_command_line_ranks_plans_and_simulates_bursty_shared_prefix_arrivals(tmp_path):
    """`pdserve plan` ranks the configurations (each one's rates simulated, by rate: its goodput the last
    that meets the target, the next one above it misses it); `pdserve simulate` takes the arrivals'
    burstiness and shared prefixes."""
    from pdserve.cli import main

    out = tmp_path / "plan.json"
    assert main([*plan_argv(tmp_path), "--json", str(out)]) == 0
    ranking = json.loads(out.read_text())["ranking"]
    assert ranking and ranking[0]["configuration"].startswith("colocated")
    workload = Workload(LengthDist(256, 256), LengthDist(16, 16), 1000, 100, num_requests=40)
    scored = goodput(Candidate(PROFILE, 1, 512), workload, Transfer())
    rates = [rate for rate, _ in scored.curve]
    assert rates == sorted(rates) and scored.goodput in rates
    met = dict(scored.curve)
    assert met[scored.goodput] >= 0.9 > met[min(r for r in rates if r > scored.goodput)]
    sim = tmp_path / "sim.json"
    argv = ["simulate", *COMMON, *SLO, "--profile", str(tmp_path / "profile.json"), "--rate", "1"]
    argv += ["--burstiness", "0.5", "--shared-prefix", "128:2", "--num-requests", "20", "--json", str(sim)]
    assert main(argv) == 0
    simulated = json.loads(sim.read_text())
    assert simulated["burstiness"] == 0.5 and simulated["completed"] == 20
    series = simulated["series"]["decode-0"]
    assert len(series["t_s"]) == len(series["running"]) == len(series["kv_use"]) > 20
    assert max(series["running"]) > 1 and 0 < max(series["kv_use"]) <= 1 and series["running"][-1] == 0
    assert sum(simulated["timeline"]["requests_per_s"]) == pytest.approx(20)


@pytest.mark.model  # (matplotlib: the plots extra, which the fast tier does not install)
def test_plan_and_simulate_plot_where_people_would_rather_look(tmp_path):
    from pdserve.cli import main

    assert main([*plan_argv(tmp_path), "--plots", str(tmp_path / "plots")]) == 0
    assert (tmp_path / "plots" / "goodput_vs_rate.png").stat().st_size > 0
    argv = ["simulate", *COMMON, "--profile", str(tmp_path / "profile.json"), "--rate", "1"]
    assert main([*argv, "--num-requests", "10", "--plots", str(tmp_path / "sim")]) == 0
    for name in ("latency_cdf.png", "throughput.png", "queue_kv.png"):
        assert (tmp_path / "sim" / name).stat().st_size > 0


COMMON = ["--prompt-len", "fixed:256", "--output-len", "fixed:16"]
SLO = ["--slo-ttft-ms", "1000", "--slo-tpot-ms", "100"]


def plan_argv(tmp_path) -> list[str]:
    """`pdserve plan` of PROFILE (written to tmp_path), colocated only."""
    profile = tmp_path / "profile.json"
    profile.write_text(PROFILE.to_json())
    argv = ["plan", "--profile", str(profile), *COMMON, *SLO, "--rate", "2", "--chips", "4"]
    return [*argv, "--num-requests", "40", "--top", "3", "--no-disaggregated"]
