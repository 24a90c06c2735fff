"""guidellm and aiperf against pdserve's OpenAI API, as their users run them, beside `pdserve bench` at the
same load.

    bash bench/clients_env.sh loadgen     # once: .venv-loadgen (guidellm), .venv-aiperf (aiperf)
    .venv/bin/python bench/bench_clients.py [--json OUT] [--smoke]

One prefill-server and one decode-server (disaggregated, pdserve.testing.launch, loopback) on the default
model as a Hugging Face folder, float32. guidellm (`guidellm run`, the openai_http backend) and aiperf
(`aiperf profile`, streaming, `ignore_eos`) send synthetic prompts of 128 tokens for 32 output tokens, 4
streams at a time, to /v1/completions and then to /v1/chat/completions; `pdserve bench` sends the same
load over gRPC. Printed for each: errors, the
prompt and output tokens guidellm counted against what the server counted in the same interval
(pdserve_prompt_tokens_total, pdserve_generation_tokens_total), and TTFT / ITL medians and p99 in
milliseconds, guidellm's beside pdserve bench's. --smoke: `pdserve bench` only (guidellm and aiperf live in
their own environments), on the test model, 4 requests of 4 tokens.
"""

from __future__ import annotations

import argparse
import functools
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from pdserve.bench.common import report

ROOT = Path(__file__).resolve().parents[1]
GUIDELLM = ROOT / ".venv-loadgen" / "bin" / "guidellm"
AIPERF = ROOT / ".venv-aiperf" / "bin" / "aiperf"
STREAMS, REQUESTS, PROMPT_TOKENS, OUTPUT_TOKENS = 4, 32, 128, 32


def token_counters(address: str) -> tuple[float, float]:
    """The server's (prompt, generated) token counters."""
    from pdserve.testing.launch import scrape

    values = scrape(address)
    return tuple(
        sum(v for k, v in values.items() if k.startswith(f"pdserve_{name}_tokens_total"))
        for name in ("prompt", "generation")
    )


def with_server_tokens(metrics: str, run) -> dict:
    """`run()`'s summary, with the prompt and output tokens the server counted while it ran."""
    before = token_counters(metrics)
    summary = run()
    after = token_counters(metrics)
    summary["server_prompt_tokens"], summary["server_output_tokens"] = (
        a - b for a, b in zip(after, before, strict=True)
    )
    return summary


def run_guidellm(http: str, model: str, endpoint: str, out: Path) -> dict:
    """One guidellm run: guidellm_summary of its JSON report's first benchmark."""
    command = [
        str(GUIDELLM),
        "run",
        "--backend",
        f"kind=openai_http,target=http://{http},model={model},request_format={endpoint}",
        "--profile",
        f"kind=concurrent,streams={STREAMS}",
        "--constraint",
        f"kind=max_requests,count={REQUESTS}",
        "--data",
        f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
        "--output",
        f"kind=json,path={out}",
        "--disable-console-interactive",
    ]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return guidellm_summary(json.loads(out.read_text())["benchmarks"][0])


def guidellm_summary(benchmark: dict) -> dict:
    """Errors, tokens and latencies (ms) out of a guidellm benchmark report."""
    metrics = benchmark["metrics"]

    def dist(name: str) -> dict:
        stats = metrics[name]["successful"]
        return {"median": stats["median"], "p99": stats["percentiles"]["p99"]}

    requests = benchmark["requests"]
    return {
        "errors": len(requests.get("errored", [])),
        "completed": len(requests.get("successful", [])),
        "prompt_tokens": sum(r.get("prompt_tokens") or 0 for r in requests.get("successful", [])),
        "output_tokens": sum(r.get("output_tokens") or 0 for r in requests.get("successful", [])),
        "ttft_ms": dist("time_to_first_token_ms"),
        "itl_ms": dist("inter_token_latency_ms"),
    }


def run_aiperf(http: str, model: str, endpoint_type: str, out: Path) -> dict:
    """One aiperf run: errors, tokens (its own count of the text, and the usage the server reported) and
    latencies (ms) out of its JSON export."""
    command = [
        str(AIPERF),
        "profile",
        "--model",
        model,
        "--url",
        f"http://{http}",
        "--endpoint-type",
        endpoint_type,
        "--streaming",
        "--isl",
        str(PROMPT_TOKENS),
        "--osl",
        str(OUTPUT_TOKENS),
        "--concurrency",
        str(STREAMS),
        "--request-count",
        str(REQUESTS),
        "--tokenizer",
        model,
        "--extra-inputs",
        "ignore_eos:true",
        "--artifact-dir",
        str(out),
        "--ui-type",
        "none",
    ]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    report = json.loads((out / "profile_export_aiperf.json").read_text())

    def dist(name: str) -> dict:
        return {"median": report[name]["p50"], "p99": report[name]["p99"]}

    return {
        "errors": len(report["error_summary"]),
        "completed": int(report["request_count"]["avg"]),
        "prompt_tokens": report["usage_prompt_tokens"]["sum"],
        "output_tokens": report["usage_completion_tokens"]["sum"],
        "output_tokens_retokenized": report["output_token_count"]["sum"],
        "ttft_ms": dist("time_to_first_token"),
        "itl_ms": dist("inter_token_latency"),
    }


def run_pdserve_bench(
    grpc_address: str, out: Path, requests: int = REQUESTS, output_tokens: int = OUTPUT_TOKENS
) -> dict:
    command = [
        str(Path(sys.executable).parent / "pdserve"),
        "bench",
        "--server",
        grpc_address,
        "--concurrency",
        str(STREAMS),
        "--num-requests",
        str(requests),
        "--prompt-len",
        f"fixed:{PROMPT_TOKENS}",
        "--output-len",
        f"fixed:{output_tokens}",
        "--ignore-eos",
        "--no-progress",
        "--json",
        str(out),
    ]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    parser.add_argument("--smoke", action="store_true", help="pdserve bench only, the test model, 4 requests")
    args = parser.parse_args(argv)
    for tool in (GUIDELLM, AIPERF) if not args.smoke else ():
        if not tool.exists():
            raise SystemExit(f"{tool} is missing: bash bench/clients_env.sh loadgen")

    from pdserve.engine.loading.sources import DEFAULT_MODEL, cache_dir, fetch
    from pdserve.testing.launch import ENGINE_ARGS, decode_server, prefill_server
    from pdserve.testing.models import hf_folder, small_model

    if args.smoke:
        folder = small_model()  # (a Hugging Face folder already)
    else:
        folder = hf_folder(
            fetch(DEFAULT_MODEL, progress=False), cache_dir() / "bench-hf" / "SmolLM2-135M-Instruct"
        )
    work = Path(tempfile.mkdtemp(prefix="bench-clients-"))
    prefill = prefill_server(folder, work, engine_args=ENGINE_ARGS)
    decode = decode_server(folder, prefill.address, work, extra=["--metrics-port", "0"])
    result = {}
    try:
        http, metrics = decode.addresses["http"], decode.addresses["metrics"]
        for endpoint in ("/v1/completions", "/v1/chat/completions") if not args.smoke else ():
            out = work / f"guidellm{endpoint.replace('/', '_')}.json"
            run = functools.partial(run_guidellm, http, str(folder), endpoint, out)
            result[f"guidellm {endpoint}"] = with_server_tokens(metrics, run)
        for endpoint_type in ("completions", "chat") if not args.smoke else ():
            out = work / f"aiperf-{endpoint_type}"
            run = functools.partial(run_aiperf, http, str(folder), endpoint_type, out)
            result[f"aiperf {endpoint_type}"] = with_server_tokens(metrics, run)
        sizes = (4, 4) if args.smoke else (REQUESTS, OUTPUT_TOKENS)
        bench = functools.partial(run_pdserve_bench, decode.address, work / "pdserve_bench.json", *sizes)
        result["pdserve bench (gRPC)"] = with_server_tokens(metrics, bench) if args.smoke else bench()
    finally:
        decode.terminate()
        prefill.terminate()
    report(result, args.json)


if __name__ == "__main__":
    main()
