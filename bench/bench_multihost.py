"""The cost of running one daemon over two processes: a decode-server (prefilling locally) at TP 8 on 8 fake
CPU devices, as one process vs as a group of 2 processes x 4 devices (services/group.py: every device
operation streamed from the leader to the worker, collectives over gloo between the processes), measured in
one run with alternating rounds.

    .venv/bin/python bench/bench_multihost.py [--rounds N] [--json OUT] [--smoke]

Figures: TTFT of a 256-token prompt (median), decode tokens/s of 1 stream and of 8 concurrent streams (64
tokens each), and their ratios (group / single process). Both daemons share this machine's cores.

The group's ratio holds several costs. To separate them the same engine also runs without a daemon or
a stream (the Python API, the same requests): in one process with XLA's in-process collectives; in one
process with gloo collectives (what a multi-process job on CPU uses for every collective, its own devices'
included); and in 2 processes that each call the same `generate` in lockstep (their collectives meet; no
operation is sent). Then:
  stream    = 2-process daemon / 2-process lockstep engines (same job, same collectives): the stream's cost
  daemon    = 1-process daemon / 1-process engine (gRPC, the engine thread; for comparison)
  gloo      = 1-process engine with gloo / without: CPU collectives through gloo
  boundary  = 2-process lockstep engines / 1-process engine with gloo: crossing the processes

--smoke: the 1-process engine only (the rest needs daemons or a 2-process job), the test model, one round
of 4 decode tokens.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pdserve.bench.common import ratio, report
from pdserve.bench.prompts import random_prompt
from pdserve.engine.distributed import add_distributed_args
from pdserve.engine.loading.sources import DEFAULT_MODEL, fetch
from pdserve.services.client import Client
from pdserve.testing.launch import daemon_group, decode_server, free_port
from pdserve.testing.models import bench_model

ENGINE_ARGS = ["--max-model-len", "1024", "--num-blocks", "256", "--max-num-seqs", "8", "--tp", "8"]
PROMPT_TOKENS, DECODE_TOKENS = 256, 64


def ttft(client: Client, salt: int) -> float:
    return client.generate(random_prompt(PROMPT_TOKENS, salt), max_tokens=1).ttft_s


def decode_rate(client: Client, streams: int, salt: int) -> float:
    """Tokens per second of `streams` concurrent requests decoding DECODE_TOKENS tokens each (after their
    first token: prefill excluded)."""

    def one(i: int) -> tuple[float, float, int]:
        r = client.generate(random_prompt(16, salt * 100 + i), max_tokens=DECODE_TOKENS, ignore_eos=True)
        return r.token_times_s[0], r.token_times_s[-1], len(r.token_ids) - 1

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        runs = list(pool.map(one, range(streams)))
    wall = time.perf_counter() - start
    decode_wall = wall - max(first for first, _, _ in runs)  # from the last first token on
    return sum(n for _, _, n in runs) / max(decode_wall, 1e-9)


FIGURES = ("ttft_s", "decode_b1_tok_s", "decode_b8_tok_s")


def daemons_study(rounds: int) -> dict:
    """Medians of FIGURES for a 1-process and a 2-process decode-server, alternating rounds."""
    gguf = fetch(DEFAULT_MODEL, progress=False)
    logs = Path(tempfile.mkdtemp(prefix="bench-multihost-"))
    single = decode_server(
        gguf, "local", logs, name="single", engine_args=[*ENGINE_ARGS, "--cpu-devices", "8"]
    )

    def start(suffix, extra, ready, env):
        name = f"group{suffix}"
        return decode_server(
            gguf, "local", logs, name=name, engine_args=ENGINE_ARGS, extra=extra, wait_ready=ready, env=env
        )

    group = daemon_group(start, 2, ["--cpu-devices", "4"])
    try:
        clients = {"single process": Client(single.address), "2 processes": Client(group[0].address)}
        for client in clients.values():  # compile every shape the rounds meet (the daemons start lazily)
            ttft(client, 0)
            decode_rate(client, 8, 0)
            decode_rate(client, 1, 0)
        figures = {k: {f: [] for f in FIGURES} for k in clients}
        for r in range(1, rounds + 1):
            for k, client in clients.items():  # alternating: both see the same drift of this machine
                figures[k]["ttft_s"].append(ttft(client, r))
                figures[k]["decode_b1_tok_s"].append(decode_rate(client, 1, r))
                figures[k]["decode_b8_tok_s"].append(decode_rate(client, 8, r))
            print(f"round {r} done", flush=True)
        return {k: {f: statistics.median(v) for f, v in fs.items()} for k, fs in figures.items()}
    finally:
        for daemon in [*group, single]:
            daemon.terminate()


def lockstep_engine(args: argparse.Namespace) -> None:
    """One process of the lockstep reference (--lockstep-process): joins the job, runs the same requests
    as every other process of it, prints its medians of FIGURES as JSON."""
    from pdserve.engine.distributed import join, process_group

    join(process_group(args))
    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.sampling_params import SamplingParams

    config = EngineConfig(tp=8, max_model_len=1024, num_blocks=256, max_num_seqs=8)
    model = str(bench_model(True)) if args.smoke else None
    engine = LLMEngine.from_model(model, config, warmup=False, progress=False)
    decode_tokens = 4 if args.smoke else DECODE_TOKENS
    decode = SamplingParams(max_tokens=decode_tokens, temperature=0, ignore_eos=True)

    def run(salt: int) -> dict:
        start = time.perf_counter()
        engine.generate([random_prompt(PROMPT_TOKENS, salt)], SamplingParams(max_tokens=1))
        figures = {"ttft_s": time.perf_counter() - start}
        for streams in (1, 8):
            prompts = [random_prompt(16, salt * 100 + i) for i in range(streams)]
            engine.generate(prompts, SamplingParams(max_tokens=1))  # prefilled first: decode alone is timed
            start = time.perf_counter()
            engine.generate(prompts, decode)
            figures[f"decode_b{streams}_tok_s"] = streams * decode_tokens / (time.perf_counter() - start)
        return figures

    run(0)
    runs = [run(r) for r in range(1, args.rounds + 1)]
    print(json.dumps({f: statistics.median(r[f] for r in runs) for f in FIGURES}), flush=True)


def lockstep(num_processes: int, rounds: int, join: bool = True, smoke: bool = False) -> dict:
    """The engine over `num_processes` processes x 8 / num_processes devices, each running the same requests
    (process 0's figures); `join` False (one process): no JAX job, XLA's in-process collectives."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={8 // num_processes}"
    argv = [
        sys.executable,
        __file__,
        "--lockstep-process",
        "--rounds",
        str(rounds),
        *(["--smoke"] if smoke else []),
    ]
    if join:
        argv += ["--coordinator-address", f"127.0.0.1:{free_port()}", "--num-processes", str(num_processes)]
    procs = [
        subprocess.Popen(
            [*argv, *(["--process-id", str(i)] if join else [])], stdout=subprocess.PIPE, text=True, env=env
        )
        for i in range(num_processes)
    ]
    outs = [p.communicate()[0] for p in procs]
    return json.loads(outs[0].strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--lockstep-process", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--smoke", action="store_true", help="the 1-process engine only, the test model")
    add_distributed_args(parser)
    args = parser.parse_args(argv)
    if args.lockstep_process:
        lockstep_engine(args)
        return
    if args.smoke:
        engines = {"single process": lockstep(1, 1, join=False, smoke=True)}
        report({"config": {"tp": 8, "smoke": True}, "engines": engines}, args.json)
        return
    daemons = daemons_study(args.rounds)
    engines = {
        "single process": lockstep(1, args.rounds, join=False),
        "single process, gloo": lockstep(1, args.rounds),
        "2 processes": lockstep(2, args.rounds),
    }

    def ratios_of(a: dict, b: dict) -> dict:
        return {f: ratio(a[f], b[f]) for f in FIGURES}

    config = {"tp": 8, "prompt_tokens": PROMPT_TOKENS, "decode_tokens": DECODE_TOKENS, "rounds": args.rounds}
    ratios = {
        "2-process daemon / 1-process daemon": ratios_of(daemons["2 processes"], daemons["single process"]),
        "stream: 2-process daemon / 2-process lockstep engines": ratios_of(
            daemons["2 processes"], engines["2 processes"]
        ),
        "daemon: 1-process daemon / 1-process engine": ratios_of(
            daemons["single process"], engines["single process"]
        ),
        "gloo: 1-process engine with gloo / without": ratios_of(
            engines["single process, gloo"], engines["single process"]
        ),
        "boundary: 2-process engines / 1-process engine with gloo": ratios_of(
            engines["2 processes"], engines["single process, gloo"]
        ),
    }
    report({"config": config, "daemons": daemons, "engines": engines, "ratios": ratios}, args.json)


if __name__ == "__main__":
    main()
