"""`pdserve profile` (measure this hardware's step costs into a profile file) and `pdserve simulate` (replay
a synthetic workload against the real scheduler with a profile's costs; prints the load generator's
figures: TTFT, TPOT, ITL and end-to-end percentiles, goodput under an SLO)."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import sys

from pdserve.bench.common import report
from pdserve.bench.stats import compute_stats, format_summary
from pdserve.bench.workload import LengthDist, arrival_times, make_workload
from pdserve.flags import add_engine_args, engine_config


def add_planner_parsers(sub) -> None:
    profile = sub.add_parser(
        "profile", help="measure this hardware's step costs (a profile file for `pdserve simulate`)"
    )
    add_engine_args(profile)
    profile.add_argument("--out", required=True, metavar="FILE", help="the profile (JSON)")
    profile.add_argument("--rounds", type=int, default=2, help="measured rounds after the warm-up one")
    profile.set_defaults(func=cmd_profile, warmup=False)  # (its first round compiles what it runs)

    simulate = sub.add_parser(
        "simulate", help="replay a workload against the real scheduler with a profile's step costs"
    )
    add_engine_args(simulate)  # (the scheduler's flags; the model's are ignored: the profile has its costs)
    simulate.add_argument("--profile", required=True, metavar="FILE", help="from `pdserve profile`")
    simulate.add_argument("--rate", type=float, required=True, help="Poisson arrivals, requests/s")
    simulate.add_argument("--num-requests", type=int, default=200)
    simulate.add_argument("--prompt-len", type=LengthDist.parse, default=LengthDist(256, 256))
    simulate.add_argument("--output-len", type=LengthDist.parse, default=LengthDist(128, 128))
    simulate.add_argument("--seed", type=int, default=0)
    simulate.add_argument("--slo-ttft-ms", type=float)
    simulate.add_argument("--slo-tpot-ms", type=float)
    simulate.add_argument("--json", dest="json_path", metavar="OUT", help="write the figures as JSON")
    simulate.set_defaults(func=cmd_simulate)


def cmd_profile(args: argparse.Namespace) -> int:
    from pdserve.bench.offline import engine_of
    from pdserve.planner.profile import profile_engine

    profile = profile_engine(engine_of(args), rounds=args.rounds)
    with open(args.out, "w") as f:
        f.write(profile.to_json())
    fit = profile.fit
    print(
        f"profile: {fit['fitted']['steps']} steps fitted, relative error p50 {fit['fitted']['p50']:.1%}; "
        f"held out {fit['held_out']['steps']}: p50 {fit['held_out']['p50']:.1%}, "
        f"p90 {fit['held_out']['p90']:.1%} -> {args.out}",
        file=sys.stderr,
    )
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    from pdserve.planner.costs import Profile
    from pdserve.planner.simulator import Arrival, simulate

    profile = Profile.read(args.profile)
    config, profiled = engine_config(args), profile.engine
    config = dataclasses.replace(  # the profiled engine's cache unless the flags say otherwise
        config,
        num_blocks=config.num_blocks or int(profiled.get("kv_blocks", 0)),
        max_model_len=config.max_model_len or int(profiled.get("max_model_len", 0)),
    )
    if not config.num_blocks or not config.max_model_len:
        raise SystemExit("simulate: give --num-blocks and --max-model-len (the profile names neither)")
    # the arrivals and prompts `pdserve bench serve` sends for the same flags and seed
    specs = make_workload(args.prompt_len, args.output_len, args.seed)
    times = arrival_times(args.rate, args.seed)
    workload = [
        Arrival(at, tuple(spec.prompt), spec.max_tokens)
        for at, spec in itertools.islice(zip(times, specs, strict=False), args.num_requests)
    ]
    result = simulate(config, profile.costs, workload)
    stats = compute_stats(result.records, None, args.slo_ttft_ms, args.slo_tpot_ms)
    print(format_summary(stats), file=sys.stderr)
    report({"simulated": True, "profile": args.profile, "rate": args.rate, **stats}, args.json_path)
    return 0
