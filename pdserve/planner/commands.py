"""`pdserve profile` (measure this hardware's step costs into a profile file) and `pdserve simulate` (replay
a synthetic workload against the real scheduler with a profile's costs; prints the load generator's
figures: TTFT, TPOT, ITL and end-to-end percentiles, goodput under an SLO; with --validate, against daemons
started here); `pdserve plan` is in plan_command.py."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import signal
import sys
import time

from pdserve.bench.common import report, write_json
from pdserve.bench.stats import compute_stats, format_summary, throughput_timeline
from pdserve.bench.workload import LengthDist, add_burstiness_flag, add_chat_flags, add_shared_prefix_flag
from pdserve.flags import add_engine_args, engine_config
from pdserve.planner.plan_command import add_plan_parser, check_plots
from pdserve.planner.roofline import CHIPS, MODELS


def add_planner_parsers(sub) -> None:
    profile = sub.add_parser(
        "profile", help="measure this hardware's step costs (a profile file for `pdserve simulate`)"
    )
    add_engine_args(profile)
    profile.add_argument("--out", required=True, metavar="FILE", help="the profile (JSON)")
    profile.add_argument("--rounds", type=int, default=2, help="measured rounds after the warm-up one")
    profile.add_argument(
        "--from-step-log",
        metavar="FILE",
        help="fit the costs to a daemon's step log (its --step-log: the served engine's own steps) instead "
        "of measuring here; the engine flags are then ignored",
    )
    projection = profile.add_argument_group(
        "roofline projection: a profile for a chip not at hand (planner/roofline.py), labelled as such"
    )
    projection.add_argument("--project", metavar="CHIP", choices=sorted(CHIPS), help="the chip to project to")
    projection.add_argument(
        "--from", dest="from_profile", metavar="FILE", help="the measured profile of the model"
    )
    projection.add_argument(
        "--as-model",
        choices=sorted(MODELS),
        help="project this model's sizes at the efficiencies measured on the profile's model",
    )
    projection.add_argument(
        "--efficiency",
        metavar="COMPUTE,MEMORY",
        help="the chip's efficiencies (default: the measured profile's against this host's roofline)",
    )
    projection.add_argument(
        "--host-overhead-ms", type=float, default=2.0, help="the host's share of a step, not scaled"
    )
    profile.add_argument(
        "--request-log",
        metavar="LOG",
        help="with --from-step-log: a decode server's log, to fit the KV transfer's time to its requests",
    )
    profile.add_argument(
        "--warmup",
        action="store_true",
        help="compile every shape first, and record how long that took (a replica's time to ready: load + "
        "warmup); without it the first round compiles what it runs",
    )
    profile.set_defaults(func=cmd_profile)

    simulate = sub.add_parser(
        "simulate", help="replay a workload against the real scheduler with a profile's step costs"
    )
    add_engine_args(simulate)  # (the scheduler's flags; the model's are ignored: the profile has its costs)
    simulate.add_argument(
        "--profile", metavar="FILE", help="from `pdserve profile` (required but with --validate)"
    )
    workload = simulate.add_mutually_exclusive_group(required=True)
    workload.add_argument("--rate", type=float, help="Poisson arrivals, requests/s")
    workload.add_argument(
        "--replay",
        metavar="LOG",
        help="a decode server's log: its requests' arrivals, prompt and output lengths (planner/replay.py)",
    )
    simulate.add_argument("--num-requests", type=int, default=200)
    simulate.add_argument("--prompt-len", type=LengthDist.parse, default=LengthDist(256, 256))
    simulate.add_argument("--output-len", type=LengthDist.parse, default=LengthDist(128, 128))
    add_shared_prefix_flag(simulate)
    add_burstiness_flag(simulate)
    add_chat_flags(simulate)
    simulate.add_argument("--seed", type=int, default=0)
    simulate.add_argument("--slo-ttft-ms", type=float)
    simulate.add_argument("--slo-tpot-ms", type=float)
    simulate.add_argument(
        "--json",
        dest="json_path",
        metavar="OUT",
        help="write the figures as JSON (with the throughput timeline and each replica's queue and KV-use "
        "series)",
    )
    simulate.add_argument(
        "--plots",
        metavar="DIR",
        help="write latency_cdf.png, throughput.png (as `pdserve bench --plots`), queue_kv.png (matplotlib: "
        "the plots extra)",
    )
    validation = simulate.add_argument_group(
        "validation (planner/validate.py): the workload served by real daemons of --model started here, then "
        "simulated from the steps they logged during the other runs; prints each figure's error"
    )
    validation.add_argument("--validate", action="store_true", help="serve, simulate and compare")
    validation.add_argument(
        "--validate-modes",
        default="colocated,disaggregated",
        help="colocated (a decode server computing its prompts) and/or disaggregated (1 prefill + 1 decode)",
    )
    validation.add_argument(
        "--validate-rates",
        metavar="R[,R...]",
        help="the rates served, each a run (default: half of --rate, and --rate); at least two: each run is "
        "predicted from the others",
    )
    validation.add_argument(
        "--validate-cpus",
        metavar="PREFILL:DECODE",
        help="taskset CPU lists of the disaggregated servers, e.g. 0:1 (one core each; default: unpinned)",
    )
    simulate.set_defaults(func=cmd_simulate)
    add_plan_parser(sub)  # (plan_command.py)


def cmd_profile(args: argparse.Namespace) -> int:
    from pdserve.planner.profile import profile_from_step_log

    if args.project:
        profile = _projected(args)
    elif args.from_step_log:
        try:
            profile = profile_from_step_log(args.from_step_log)
        except (OSError, ValueError) as e:
            raise SystemExit(f"profile: --from-step-log: {e}") from None
        if args.request_log:
            from pdserve.planner.profile import transfer_from_request_log

            # (the prefill server's chunk: this profile's own budget, the same by default)
            chunk = profile.engine_info.get("max_num_batched_tokens")
            transfer = transfer_from_request_log(args.request_log, chunk and int(chunk))
            if not transfer:
                raise SystemExit(f"profile: --request-log: {args.request_log}: too few transferred requests")
            profile = dataclasses.replace(profile, transfer=transfer)
    else:
        profile = _measured(args)
    with open(args.out, "w") as f:
        f.write(profile.to_json())
    fit = profile.fit
    if profile.projection:
        print(f"profile: {profile.projection} -> {args.out}", file=sys.stderr)
        return 0
    print(
        f"profile: {fit['fitted']['steps']} steps fitted, relative error p50 {fit['fitted']['p50']:.1%}; "
        f"held out {fit['held_out']['steps']}: p50 {fit['held_out']['p50']:.1%}, "
        f"p90 {fit['held_out']['p90']:.1%} -> {args.out}",
        file=sys.stderr,
    )
    return 0


def _measured(args: argparse.Namespace):
    """A profile of the engine of args' flags, measured here, with its start-up: the engine built (load)
    and, with --warmup, every shape compiled (warmup) before the measured rounds."""
    from pdserve.bench.offline import engine_of
    from pdserve.planner.profile import profile_engine

    start = time.perf_counter()
    engine = engine_of(argparse.Namespace(**{**vars(args), "warmup": False}))  # (timed apart below)
    startup = {"load_s": time.perf_counter() - start}
    if args.warmup:
        start = time.perf_counter()
        startup["compiled_variants"] = engine.warmup(progress=False)
        startup["warmup_s"] = time.perf_counter() - start
    return dataclasses.replace(profile_engine(engine, rounds=args.rounds), startup=startup)


def _projected(args: argparse.Namespace):
    from pdserve.planner.costs import Profile
    from pdserve.planner.roofline import Efficiencies, host_roofline, measured_efficiencies, project, retarget

    if not args.from_profile:
        raise SystemExit("profile: --project needs --from PROFILE (a measured profile of the model)")
    measured = Profile.read(args.from_profile)
    if args.efficiency:
        try:
            compute, memory = (float(x) for x in args.efficiency.split(","))
        except ValueError:
            raise SystemExit(
                f"profile: --efficiency {args.efficiency!r}: COMPUTE,MEMORY (two numbers)"
            ) from None
        efficiencies = Efficiencies(compute, memory, "given")
    else:
        efficiencies = measured_efficiencies(measured, host_roofline())
    if args.as_model:
        measured = retarget(measured, args.as_model, MODELS[args.as_model])
    try:
        return project(measured, CHIPS[args.project], args.tp or 1, efficiencies, args.host_overhead_ms / 1e3)
    except (KeyError, ValueError) as e:
        raise SystemExit(f"profile: --project: {e}") from None


def cmd_simulate(args: argparse.Namespace) -> int:
    from pdserve.planner.costs import Profile
    from pdserve.planner.simulator import queue_series, simulate, synthetic_workload

    if args.validate:
        return _validate(args)
    if args.plots:  # (before the run: a missing extra said at once)
        check_plots("simulate")
    if not args.profile:
        raise SystemExit("simulate: --profile is required (but with --validate)")
    profile = Profile.read(args.profile)
    config, profiled = engine_config(args), profile.engine_info
    config = dataclasses.replace(  # the profiled engine's cache unless the flags say otherwise
        config,
        num_blocks=config.num_blocks or int(profiled.get("kv_blocks", 0)),
        max_model_len=config.max_model_len or int(profiled.get("max_model_len", 0)),
    )
    if not config.num_blocks or not config.max_model_len:
        raise SystemExit("simulate: give --num-blocks and --max-model-len (the profile names neither)")
    if args.replay:
        from pdserve.planner.replay import replay_workload

        try:
            workload = replay_workload(args.replay, args.seed)
        except (OSError, ValueError) as e:
            raise SystemExit(f"simulate: --replay: {e}") from None
    else:
        workload = synthetic_workload(
            args.rate,
            args.num_requests,
            args.prompt_len,
            args.output_len,
            args.seed,
            args.shared_prefix,
            args.burstiness,
            args.turns,
            args.think_time,
        )
    result = simulate(config, profile.costs, workload)
    stats = compute_stats(result.records, None, args.slo_ttft_ms, args.slo_tpot_ms)
    print(format_summary(stats), file=sys.stderr)
    source = {"rate": args.rate, "burstiness": args.burstiness, "turns": args.turns}
    source = {"replay": args.replay} if args.replay else source
    figures = {"simulated": True, "profile": args.profile, **source, **stats}
    series = queue_series(result.steps, config.num_blocks)
    if args.plots:
        figures["plots"] = _plot_simulation(result.records, series, args.plots)
    report(figures, None)  # (stdout: the figures; the file: with the series too)
    write_json({**figures, "timeline": throughput_timeline(result.records), "series": series}, args.json_path)
    return 0


def _plot_simulation(records, series: dict, folder: str) -> list[str]:
    """--plots: the load generator's two plots of the simulated requests, and the replicas' queues."""
    from pdserve.bench.plots import plot_latency_cdfs, plot_queue_series, plot_throughput

    os.makedirs(folder, exist_ok=True)
    paths = [
        plot_latency_cdfs({"simulated": records}, os.path.join(folder, "latency_cdf.png")),
        plot_throughput({"simulated": records}, os.path.join(folder, "throughput.png")),
        plot_queue_series(series, os.path.join(folder, "queue_kv.png")),
    ]
    for path in paths:
        print(f"wrote {path}", file=sys.stderr)
    return [str(p) for p in paths]


def _validate(args: argparse.Namespace) -> int:
    """--validate: the workload at each rate served by each mode's daemons, predicted, and the errors."""
    from pdserve.flags import config_argv
    from pdserve.planner import validate

    if args.replay:
        raise SystemExit("simulate: --validate serves a synthetic workload (--rate), not --replay")
    modes = [m for m in args.validate_modes.split(",") if m]
    if not modes or any(m not in validate.MODES for m in modes):
        raise SystemExit(
            f"simulate: --validate-modes {args.validate_modes!r}: of {', '.join(validate.MODES)}"
        )
    try:
        rates = [float(r) for r in (args.validate_rates or f"{args.rate / 2},{args.rate}").split(",") if r]
    except ValueError:
        raise SystemExit(f"simulate: --validate-rates {args.validate_rates!r}: numbers") from None
    if len(rates) < 2 or min(rates) <= 0:
        raise SystemExit(
            "simulate: --validate-rates: at least two positive rates (each predicted from the others)"
        )
    cpus = None
    if args.validate_cpus:
        prefill, sep, decode = args.validate_cpus.partition(":")
        if not sep or not prefill or not decode:
            raise SystemExit(f"simulate: --validate-cpus {args.validate_cpus!r}: PREFILL:DECODE (e.g. 0:1)")
        cpus = {"prefill": prefill, "decode": decode}
    slo = {"slo_ttft_ms": args.slo_ttft_ms, "slo_tpot_ms": args.slo_tpot_ms}
    load = validate.Load(
        args.prompt_len.spec,
        args.output_len.spec,
        args.num_requests,
        args.seed,
        args.shared_prefix.spec if args.shared_prefix else "",
        args.turns,
        args.think_time,
        args.burstiness,
    )
    echo = functools.partial(print, file=sys.stderr, flush=True)
    # SIGTERM ends the run as Ctrl-C does: through validate.serve's cleanup, which stops the daemons
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    predictions = []
    for mode in modes:
        runs = [
            validate.Run("workload", rate, dataclasses.replace(load, seed=load.seed + i))
            for i, rate in enumerate(rates)
        ]
        served = validate.serve(
            args.model, mode, runs, config_argv(engine_config(args)), cpus, slo, echo=echo
        )
        predictions += validate.predict(served, slo, echo=echo)
    errors, own = validate.summarise(predictions, echo)
    report({"validation": {"runs": predictions, "errors": errors, "errors_own_steps": own}}, args.json_path)
    return 0
