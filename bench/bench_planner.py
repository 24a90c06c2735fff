"""Issue 52's benchmark: the planner's predictions against real runs on this box, per figure, and a plan for
a TPU v5e fleet from a roofline projection.

    .venv/bin/python bench/bench_planner.py [--num-requests 30] [--modes colocated,disaggregated]
        [--workloads short,long,shared,chat] [--no-runs] [--json OUT] [--smoke]

Runs: for each mode, servers of the default model (float32, 1,024 blocks, 32 sequences; their shapes
compiled at start-up) writing their step logs (--step-log) and JSON request logs:
- colocated: a decode server computing its own prompts (`--prefill local`) on both cores;
- disaggregated: a prefill server pinned to core 0 and a decode server to core 1 (taskset), 1P+1D;
and each workload at two Poisson rates (RATES): `short` (64-256-token prompts), `long` (512-768), `shared`
(one of 4 prefixes of 192 tokens, then 32-128 of its own: the prefix cache serves most of each prompt),
`chat` (conversations of 3 turns of 64-128 new tokens each, the next turn 1 s after an answer, its prompt
the conversation so far; rates in conversations/s, a third as many as the others' requests); 64 output
tokens; every run a seed of its own (no run's prompts cached from another). Each run is then
predicted by the simulator (planner.simulator.Fleet) with profiles fitted to the step logs of the same
servers' *other* runs, and the KV transfer fitted to the other runs' request lines (planner/validate.py,
what `pdserve simulate --validate` runs): what an operator has from yesterday's logs. Printed: each run's
figures measured / predicted / error; and over all runs, for each figure on its own (never averaged
across figures), the mean absolute percentage error: TTFT p50 and p90, TPOT p50 and p90, goodput
(requests/s meeting TTFT <= --slo-ttft-ms and TPOT <= --slo-tpot-ms); then the same with each run
simulated on profiles fitted to its own steps ("own steps": the simulator's error alone). The rates
(RATES) and the SLO were set on a 2-core EPYC Zen 4; on a box whose steps take twice as long, `--speed
0.5` halves every rate and doubles both targets, for the same load and margins (a uniform scale: the set
stays the set).
Goal: TPOT <= 10%, TTFT <= 15%, goodput <= 10%.

Projection (no device needed, labelled as such): the colocated runs' profile gives the efficiencies this
engine reaches against this host's roofline (planner.roofline); Llama-3.1-8B's sizes on TPU v5e chips at
TP 4 and 8 (bf16: 16 GB of weights need more than one 16 GiB chip) are projected with them; `pdserve
plan`'s search on a chat workload (512-2048-token prompts, 128-512 output tokens; TTFT <= 1 s, TPOT <= 50
ms at 90%) gives each unit's goodput, the best configuration and the rate it carries on 16 and 64 chips,
and the break-even: the lowest rate at which the best disaggregated fleet needs no more chips than the
best colocated one.

--smoke: the test model, colocated only, short and chat at two rates of 4 requests; the projection on a
small chat workload.
"""

from __future__ import annotations

import argparse
import functools
import math
from pathlib import Path

from pdserve.bench.common import report
from pdserve.bench.workload import LengthDist
from pdserve.planner import validate
from pdserve.planner.plan import Workload, candidates, goodput
from pdserve.planner.profile import fit_profile
from pdserve.planner.roofline import CHIPS, MODELS, host_roofline, measured_efficiencies, project, retarget
from pdserve.planner.simulator import Transfer
from pdserve.testing.launch import ENGINE_ARGS as TEST_ENGINE_ARGS
from pdserve.testing.models import bench_model

ENGINE_ARGS = [
    "--dtype",
    "float32",
    "--num-blocks",
    "1024",
    "--max-model-len",
    "1024",
    "--max-num-seqs",
    "32",
]
CHAT_TURNS, THINK_S = 3, 1.0  # `chat`: conversations of 3 turns, 1 s from an answer to the next turn
WORKLOADS = {  # name -> (prompt lengths, shared prefix, turns of a conversation)
    "short": ("uniform:64:256", "", 1),
    "long": ("uniform:512:768", "", 1),
    "shared": ("uniform:32:128", "192:4", 1),
    "chat": ("uniform:64:128", "", CHAT_TURNS),
}
RATES = {  # (mode, workload) -> two rates (requests/s; chat: conversations/s), one light, one loading the box
    ("colocated", "short"): (0.5, 1.0),
    ("colocated", "long"): (0.3, 0.6),
    ("colocated", "shared"): (0.5, 1.0),
    ("disaggregated", "short"): (0.3, 0.6),
    ("disaggregated", "long"): (0.2, 0.4),
    ("disaggregated", "shared"): (0.3, 0.6),
    ("colocated", "chat"): (0.15, 0.3),
    ("disaggregated", "chat"): (0.1, 0.2),
}
OUTPUT_LEN = "fixed:64"


def serve_mode(args, gguf: Path, mode: str, workloads: list[str]) -> validate.Served:
    """`mode`'s servers (planner/validate.py), each workload at its two rates."""
    runs = []
    for name in workloads:
        prompt_len, shared, turns = WORKLOADS[name]
        for rate in (1.0, 2.0) if args.smoke else [r * args.speed for r in RATES[(mode, name)]]:
            load = validate.Load(
                prompt_len,
                OUTPUT_LEN,
                max(1, args.num_requests // turns),  # (conversations: about as many turns)
                seed=1 + len(runs),  # (every run's own: no run's prompts cached from another)
                shared_prefix=shared,
                turns=turns,
                think_time_s=THINK_S if turns > 1 else 0.0,
            )
            runs.append(validate.Run(name, rate, load))
    return validate.serve(
        gguf,
        mode,
        runs,
        TEST_ENGINE_ARGS if args.smoke else ENGINE_ARGS,
        {"prefill": "0", "decode": "1"},
        _slo(args),
        warmup=not args.smoke,
        echo=functools.partial(print, flush=True),
    )


def _slo(args) -> dict:
    return {"slo_ttft_ms": args.slo_ttft_ms / args.speed, "slo_tpot_ms": args.slo_tpot_ms / args.speed}


def projection(args, served: validate.Served) -> dict:
    """The TPU v5e plan for Llama-3.1-8B's sizes (see the module)."""
    info, steps = served.steps["decode"]
    measured = fit_profile(info, [s for s in steps if s[0]])
    efficiencies = measured_efficiencies(measured, host_roofline())
    big = retarget(measured, "llama-3.1-8b", MODELS["llama-3.1-8b"])
    profiles = [project(big, CHIPS["tpu-v5e"], tp, efficiencies) for tp in (4, 8)]
    chat = Workload(
        LengthDist(512, 2048), LengthDist(128, 512), 1000, 50, num_requests=args.projection_requests
    )
    transfer = Transfer.over_link(
        float(profiles[0].engine_info["kv_bytes_per_token"]), 100e9 / 8
    )  # 100 Gbit/s DCN
    scored, unloaded = [], []
    for candidate in candidates(profiles, [512]):
        try:
            scored.append(goodput(candidate, chat, transfer, start=4.0))
        except ValueError as e:  # (too few requests to load it: a smoke run's)
            unloaded.append(str(e))
    scored.sort(key=lambda s: -s.per_chip)
    ranking = [
        {
            "configuration": s.candidate.label,
            "chips": s.candidate.chips,
            "goodput": s.goodput,
            "per_chip": s.per_chip,
        }
        for s in scored
    ]
    for row in ranking:
        print(
            f"projected: {row['configuration']:<56} {row['chips']:>3} chips, goodput {row['goodput']:.3g}/s",
            flush=True,
        )

    def best_within(chips: int, disaggregated: bool | None = None) -> dict | None:
        fits = [
            (math.floor(chips / s.candidate.chips) * s.goodput, s)
            for s in scored
            if s.goodput > 0
            and s.candidate.chips <= chips
            and (disaggregated is None or (s.candidate.prefill is not None) == disaggregated)
        ]
        if not fits:
            return None
        rate, s = max(fits, key=lambda f: f[0])
        return {
            "configuration": s.candidate.label,
            "units": math.floor(chips / s.candidate.chips),
            "rate": rate,
        }

    def chips_for(rate: float, disaggregated: bool) -> int:
        return min(
            (
                math.ceil(rate / s.goodput) * s.candidate.chips
                for s in scored
                if s.goodput > 0 and (s.candidate.prefill is not None) == disaggregated
            ),
            default=math.inf,
        )

    rates = [r / 4 for r in range(1, 4 * 400)]  # 0.25 .. 400 requests/s
    break_even = next((r for r in rates if chips_for(r, True) <= chips_for(r, False)), None)
    return {
        "projection": profiles[0].projection,
        "efficiencies": {
            "compute": efficiencies.compute,
            "memory": efficiencies.memory,
            "source": efficiencies.source,
        },
        "ranking": ranking,
        "fleet_16": best_within(16),
        "fleet_64": best_within(64),
        "break_even_rate": break_even,
        "not_loaded": unloaded,
        "chips_at_break_even": None
        if break_even is None
        else {"colocated": chips_for(break_even, False), "disaggregated": chips_for(break_even, True)},
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-requests", type=int, default=30)
    parser.add_argument("--modes", default="colocated,disaggregated")
    parser.add_argument("--workloads", default="short,long,shared,chat")
    parser.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=200.0)
    parser.add_argument(
        "--speed",
        type=float,
        default=1.0,
        help="this box's speed against the EPYC the rates and SLO were set on: every rate times it, both SLO "
        "targets divided by it (0.5 where steps take twice as long: the same load, the same margins)",
    )
    parser.add_argument("--projection-requests", type=int, default=150)
    parser.add_argument(
        "--no-runs", action="store_true", help="the projection only (on a short run's profile)"
    )
    parser.add_argument("--json", default=None)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    modes, workloads = args.modes.split(","), args.workloads.split(",")
    if args.smoke:
        modes, workloads, args.num_requests, args.projection_requests = (
            ["colocated"],
            ["short", "chat"],
            4,
            20,
        )
    gguf = bench_model(args.smoke)
    result, predictions, served_by_mode = {}, [], {}
    for mode in modes:
        served = serve_mode(args, gguf, mode, workloads[:1] if args.no_runs else workloads)
        served_by_mode[mode] = served
        if not args.no_runs:
            predictions += validate.predict(served, _slo(args), echo=functools.partial(print, flush=True))
    if predictions:
        result["speed"], result["slo"] = args.speed, _slo(args)
        result["runs"] = predictions
        result["mape"], result["mape_own_steps"] = validate.summarise(
            predictions, functools.partial(print, flush=True)
        )
    result["tpu_v5e_plan"] = projection(
        args, served_by_mode.get("colocated") or next(iter(served_by_mode.values()))
    )
    report(result, args.json)


if __name__ == "__main__":
    main()
