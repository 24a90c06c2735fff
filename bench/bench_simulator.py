"""Issue 52's validation: the simulator's predictions against real runs of the same workload, colocated.

    .venv/bin/python bench/bench_simulator.py [--rates 0.5,1,2] [--num-requests 40] [--profile FILE]
        [--json OUT] [--smoke]

A profile of the engine measured in this process (pdserve.planner.profile; or --profile FILE, made
with the same engine flags on this box), then, at each rate: `pdserve bench serve` against a colocated
decode-server (`--prefill local`, the same engine flags; its shapes compiled at start-up) with Poisson
arrivals, random prompts of uniform:64:256 tokens and 64 output tokens, and `pdserve simulate`'s replay of
the same arrivals and prompts (the same seed). Printed per rate: each figure measured, predicted, and
the prediction's relative error (TTFT, TPOT and end-to-end p50 / p90, goodput under the SLO); all rates
are the validation set, none left out. The profile's own fit errors are reported beside them.

--smoke: the test model, one rate, 4 requests of 8 tokens.
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
from pathlib import Path

from pdserve.bench.common import report
from pdserve.bench.serve import bench
from pdserve.bench.stats import compute_stats
from pdserve.bench.workload import LengthDist, arrival_times, make_workload
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
    from pdserve.planner.simulator import Arrival, simulate

    e = profile.engine
    config = EngineConfig(
        num_blocks=int(e["kv_blocks"]),
        max_model_len=int(e["max_model_len"]),
        max_num_seqs=int(ENGINE_ARGS[ENGINE_ARGS.index("--max-num-seqs") + 1]),
        max_num_batched_tokens=int(e["max_num_batched_tokens"]),
        block_size=int(e["block_size"]),
    )
    specs = make_workload(LengthDist.parse(prompt_len), LengthDist.parse(output_len), seed)
    work = [
        Arrival(at, tuple(s.prompt), s.max_tokens)
        for at, s in itertools.islice(zip(arrival_times(rate, seed), specs, strict=False), n)
    ]
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
    parser.add_argument("--json", default=None)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",")]
    if args.smoke:
        rates, args.num_requests, args.output_len = rates[:1], 4, "fixed:8"
    gguf = bench_model(args.smoke)
    from pdserve.planner.costs import Profile

    profile = Profile.read(args.profile) if args.profile else profile_here(gguf, args.smoke)
    logs = Path(tempfile.mkdtemp())
    server = decode_server(
        gguf, "local", logs, name="validate", engine_args=ENGINE_ARGS, warmup=not args.smoke
    )
    runs = []
    try:  # a first pass, not measured: the server's first requests pay one-off costs (allocation, caches)
        bench(
            server.address, num_requests=8, prompt_len=args.prompt_len, output_len="fixed:8", progress=False
        )
        for rate in rates:
            kw = dict(prompt_len=args.prompt_len, output_len=args.output_len, seed=0)
            slo = dict(slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms)
            measured = bench(
                server.address, rate=rate, num_requests=args.num_requests, progress=False, **kw, **slo
            )["stats"]
            records = predicted(profile, rate, args.num_requests, **kw)
            runs.append(_compare(rate, measured, compute_stats(records, None, **slo)))
            print(_line(runs[-1]), flush=True)
    finally:
        server.terminate()
    report({"profile_fit": profile.fit, "runs": runs}, args.json)


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
    cells = [f"{k} {v['measured']:.3g}/{v['predicted']:.3g}" for k, v in run.items() if k != "rate"]
    return f"rate {run['rate']}: measured/predicted " + ", ".join(cells)


if __name__ == "__main__":
    main()
