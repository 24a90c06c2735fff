"""Issue 52's validation: the simulator's predictions against real runs of the same workload, colocated.

    .venv/bin/python bench/bench_simulator.py [--rates 0.5,1,2] [--num-requests 40] [--profile FILE]
        [--json OUT] [--smoke]

A profile of the engine measured in this process (pdserve.planner.profile; or --profile FILE, made
with the same engine flags on this box), then, at each rate: `pdserve bench serve` against a colocated
decode-server (`--prefill local`, the same engine flags; its shapes compiled at start-up) with Poisson
arrivals, random prompts of uniform:64:256 tokens and 64 output tokens, and `pdserve simulate`'s replay of
the same arrivals and prompts (the same seed, one per rate: no run's prompts are in the server's prefix
cache from an earlier one). Printed per rate: each figure measured, predicted, and
the prediction's relative error (TTFT, TPOT and end-to-end p50 / p90, goodput under the SLO); all rates
are the validation set, none left out. The profile's own fit errors are reported beside them.

The server writes its step log (--step-log): the profile's error on the served engine's own steps of each
run (does the step-cost model carry from the profile's workload to served traffic?), and each run
predicted again from a profile fitted to the served steps of the other runs (none of its own: `pdserve
profile --from-step-log` on yesterday's log, as an operator would).

--smoke: the test model, one rate, 4 requests of 8 tokens.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from pdserve.bench.common import report
from pdserve.bench.serve import bench
from pdserve.bench.stats import compute_stats
from pdserve.bench.workload import LengthDist
from pdserve.engine.step_log import read_step_log
from pdserve.planner.costs import RowShape
from pdserve.planner.profile import fit_profile
from pdserve.testing.launch import decode_server
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
FIGURES = [(f"{name}_ms", p) for name in ("ttft", "tpot", "e2e") for p in ("p50", "p90")]


def profile_here(gguf: Path, smoke: bool):
    """The profile of the same engine configuration in this process."""
    from pdserve.bench.offline import engine_of
    from pdserve.flags import add_engine_args
    from pdserve.planner.profile import profile_engine

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--model", str(gguf), *ENGINE_ARGS])
    args.warmup = False
    engine = engine_of(args)
    try:
        if smoke:  # (a few small steps: the fit needs five)
            return profile_engine(engine, rounds=1, batches=(1, 3), prompt_lengths=(16, 40))
        return profile_engine(engine)
    finally:
        del engine


def predicted(profile, rate: float, n: int, prompt_len: str, output_len: str, seed: int) -> dict:
    from pdserve.engine.config import EngineConfig
    from pdserve.planner.simulator import poisson_workload, simulate

    e = profile.engine_info
    config = EngineConfig(
        num_blocks=int(e["kv_blocks"]),
        max_model_len=int(e["max_model_len"]),
        max_num_seqs=int(ENGINE_ARGS[ENGINE_ARGS.index("--max-num-seqs") + 1]),
        max_num_batched_tokens=int(e["max_num_batched_tokens"]),
        block_size=int(e["block_size"]),
    )
    work = poisson_workload(rate, n, LengthDist.parse(prompt_len), LengthDist.parse(output_len), seed)
    return simulate(config, profile.costs, work).records


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rates", default="0.5,1,2")
    parser.add_argument("--num-requests", type=int, default=40)
    parser.add_argument("--prompt-len", default="uniform:64:256")
    parser.add_argument("--output-len", default="fixed:64")
    parser.add_argument("--slo-ttft-ms", type=float, default=1000.0)
    parser.add_argument("--slo-tpot-ms", type=float, default=150.0)
    parser.add_argument("--profile", help="a profile file of this engine configuration on this box")
    parser.add_argument(
        "--disaggregated",
        action="store_true",
        help="a prefill server on core 0 and a decode server on core 1 (taskset), predicted from their step "
        "logs of the other rates",
    )
    parser.add_argument("--json", default=None)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",")]
    if args.smoke:
        rates, args.num_requests, args.output_len = rates[:2], 4, "fixed:8"
    gguf = bench_model(args.smoke)
    if args.disaggregated:
        report(disaggregated(args, gguf, rates), args.json)
        return
    from pdserve.planner.costs import Profile

    profile = Profile.read(args.profile) if args.profile else profile_here(gguf, args.smoke)
    logs = Path(tempfile.mkdtemp())
    step_log = logs / "steps.jsonl"  # the served engine's own steps (--step-log)
    server = decode_server(
        gguf,
        "local",
        logs,
        name="validate",
        engine_args=ENGINE_ARGS,
        extra=["--step-log", str(step_log)],
        warmup=not args.smoke,
    )
    runs, workloads, spans = [], [], []
    try:
        warm_up(server.address, args.prompt_len)
        for rate in rates:
            # a seed of its own: prompts no earlier run sent, so none is in the server's prefix cache (the
            # simulator starts each run with an empty one)
            kw = dict(prompt_len=args.prompt_len, output_len=args.output_len, seed=1 + rates.index(rate))
            slo = dict(slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms)
            first = len(read_step_log(step_log)[1])
            measured = bench(
                server.address, rate=rate, num_requests=args.num_requests, progress=False, **kw, **slo
            )["stats"]
            spans.append((first, len(read_step_log(step_log)[1])))
            workloads.append((rate, kw, measured))
            records = predicted(profile, rate, args.num_requests, **kw)
            runs.append(_compare(rate, measured, compute_stats(records, None, **slo)))
            print(_line(runs[-1]), flush=True)
    finally:
        server.terminate()
    engine_info, served = read_step_log(step_log)
    if not served:
        raise SystemExit(f"{step_log}: the server logged no step")
    served = [([RowShape(t, p) for t, p in rows], s) for rows, s in served]
    # the profile's step costs on the served engine's steps of each run: does the cost model carry over?
    on_served = [_step_errors(profile, served[a:b]) for a, b in spans]
    # each run predicted from a profile of the served steps of the other runs (none of its own)
    from_served = []
    for i, (rate, kw, measured) in enumerate(workloads):
        others = [step for j, (a, b) in enumerate(spans) if j != i for step in served[a:b]]
        if len(others) < 10:  # (one rate, or a smoke run: too few to fit)
            continue
        fitted = fit_profile(engine_info, others)
        records = predicted(fitted, rate, args.num_requests, **kw)
        from_served.append(_compare(rate, measured, compute_stats(records, None, **slo)))
        print("from the served steps of the other runs: " + _line(from_served[-1]), flush=True)
    report(
        {
            "profile_fit": profile.fit,
            "runs": runs,
            "profile_on_served_steps": on_served,
            "runs_from_served_steps": from_served,
        },
        args.json,
    )


def disaggregated(args, gguf: Path, rates: list[float]) -> dict:
    """The --disaggregated validation: each rate's run predicted by a 1 + 1 fleet whose prefill and decode
    profiles are fitted to the steps each server logged in the other rates' runs, and whose KV transfer
    takes the median `kv_s` (first KV chunk to the first token, services/decode/timeline.py) of those
    runs' requests."""
    from pdserve.planner.plan import pool
    from pdserve.planner.simulator import Fleet, Transfer, poisson_workload
    from pdserve.testing.launch import prefill_server

    logs = Path(tempfile.mkdtemp())
    step_logs = {role: logs / f"{role}-steps.jsonl" for role in ("prefill", "decode")}
    warm = not args.smoke
    prefill = prefill_server(
        gguf,
        logs,
        engine_args=ENGINE_ARGS,
        extra=["--step-log", str(step_logs["prefill"])],
        cpus="0",
        warmup=warm,
    )
    runs = []  # (rate, workload keywords, measured, {role: (first, end) of its steps}, kv_s of its requests)
    slo = dict(slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms)
    try:
        decode = decode_server(
            gguf,
            prefill.address,
            logs,
            name="validate-decode",
            engine_args=ENGINE_ARGS,
            extra=["--step-log", str(step_logs["decode"]), "--log-format", "json"],
            cpus="1",
            warmup=warm,
        )
        try:
            warm_up(decode.address, args.prompt_len)
            for index, rate in enumerate(rates):
                kw = dict(prompt_len=args.prompt_len, output_len=args.output_len, seed=1 + index)
                first = {role: len(read_step_log(path)[1]) for role, path in step_logs.items()}
                sent_at = time.time()
                measured = bench(
                    decode.address, rate=rate, num_requests=args.num_requests, progress=False, **kw, **slo
                )["stats"]
                spans = {role: (first[role], len(read_step_log(path)[1])) for role, path in step_logs.items()}
                lines = [json.loads(x) for x in decode.log_path.read_text().splitlines() if x.startswith("{")]
                kv_s = [
                    e["kv_s"]
                    for e in lines
                    if e.get("message") == "request ended" and e.get("arrival", 0) >= sent_at and "kv_s" in e
                ]
                runs.append((rate, kw, measured, spans, kv_s))
        finally:
            decode.terminate()
    finally:
        prefill.terminate()
    served = {}
    for role, path in step_logs.items():
        engine_info, steps = read_step_log(path)
        served[role] = (engine_info, [([RowShape(t, p) for t, p in rows], s) for rows, s in steps if rows])
    results = []
    for i, (rate, kw, measured, _, _) in enumerate(runs):
        others = [run for j, run in enumerate(runs) if j != i]
        profiles = {}
        for role, (engine_info, steps) in served.items():
            mine = [step for run in others for step in steps[run[3][role][0] : run[3][role][1]]]
            if len(mine) < 10:
                break
            profiles[role] = fit_profile(engine_info, mine)
        if len(profiles) < 2:  # (one rate, or a smoke run: too few steps to fit)
            continue
        kv_s = [k for run in others for k in run[4]]
        transfer = Transfer(latency_s=float(np.median(kv_s)) if kv_s else 0.0)
        budget = {role: int(p.engine_info["max_num_batched_tokens"]) for role, p in profiles.items()}
        fleet = Fleet(
            pool(profiles["decode"], budget["decode"], 1),
            pool(profiles["prefill"], budget["prefill"], 1),
            transfer,
        )
        work = poisson_workload(
            rate,
            args.num_requests,
            LengthDist.parse(kw["prompt_len"]),
            LengthDist.parse(kw["output_len"]),
            kw["seed"],
        )
        results.append(_compare(rate, measured, compute_stats(fleet.run(work).records, None, **slo)))
        results[-1]["transfer_s"] = transfer.latency_s
        print("disaggregated, from the other runs' step logs: " + _line(results[-1]), flush=True)
    return {"disaggregated": True, "runs": results, "measured": [run[2] for run in runs]}


def warm_up(address: str, prompt_len: str) -> None:
    """A first pass, not measured: a server's first requests pay one-off costs (allocation, caches); its
    prompts (a seed no run uses) are in no run's way."""
    bench(address, num_requests=8, prompt_len=prompt_len, output_len="fixed:8", seed=1000, progress=False)


def _step_errors(profile, steps) -> dict:
    """The profile's relative error on measured steps: median (its bias) and the median and p90 of its
    size."""
    if not steps:
        return {"steps": 0}
    errors = profile.costs.relative_errors(steps)
    return {
        "steps": len(steps),
        "median": float(np.median(errors)),
        "abs_p50": float(np.median(np.abs(errors))),
        "abs_p90": float(np.percentile(np.abs(errors), 90)),
    }


def _compare(rate: float, measured: dict, sim: dict) -> dict:
    """Each figure measured, predicted and the relative error of the prediction."""
    pairs = {f"{name}_{p}": (measured[name][p], sim[name][p]) for name, p in FIGURES}
    pairs["slo_attainment"] = (measured["slo_attainment"], sim["slo_attainment"])
    return {
        "rate": rate,
        **{
            k: {"measured": m, "predicted": s, "error": (s - m) / m if m else None}
            for k, (m, s) in pairs.items()
        },
    }


def _line(run: dict) -> str:
    cells = [f"{k} {v['measured']:.3g}/{v['predicted']:.3g}" for k, v in run.items() if isinstance(v, dict)]
    return f"rate {run['rate']}: measured/predicted " + ", ".join(cells)


if __name__ == "__main__":
    main()
