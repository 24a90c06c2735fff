"""guidellm against pdserve's OpenAI API, as its users run it, beside `pdserve bench` at the same load.

    bash bench/clients_env.sh loadgen          # once: .venv-loadgen with guidellm (torch CPU beside it)
    .venv/bin/python bench/bench_guidellm.py [--json OUT]

One prefill-server and one decode-server (disaggregated, pdserve.testing.launch, loopback) on the default
model as a Hugging Face folder, float32. guidellm (`guidellm run`, the openai_http backend) sends synthetic
prompts of 128 tokens for 32 output tokens, 4 streams at a time, to /v1/completions and then to
/v1/chat/completions; `pdserve bench` sends the same load over gRPC. Printed for each: errors, the
output tokens guidellm counted against what the server counted in the same interval
(pdserve_generation_tokens_total), and TTFT / ITL medians and p99 in milliseconds, guidellm's beside
pdserve bench's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
GUIDELLM = ROOT / ".venv-loadgen" / "bin" / "guidellm"
STREAMS, REQUESTS, PROMPT_TOKENS, OUTPUT_TOKENS = 4, 32, 128, 32


def generation_tokens(address: str) -> float:
    from tests.helpers import scrape

    return sum(v for k, v in scrape(address).items() if k.startswith("pdserve_generation_tokens_total"))


def run_guidellm(http: str, model: str, endpoint: str, out: Path) -> dict:
    """One guidellm run; its JSON report's first benchmark."""
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
    return json.loads(out.read_text())["benchmarks"][0]


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
        "output_tokens": sum(r.get("output_tokens") or 0 for r in requests.get("successful", [])),
        "ttft_ms": dist("time_to_first_token_ms"),
        "itl_ms": dist("inter_token_latency_ms"),
    }


def run_pdserve_bench(grpc_address: str, out: Path) -> dict:
    command = [
        str(Path(sys.executable).parent / "pdserve"),
        "bench",
        "--server",
        grpc_address,
        "--concurrency",
        str(STREAMS),
        "--num-requests",
        str(REQUESTS),
        "--prompt-len",
        f"fixed:{PROMPT_TOKENS}",
        "--output-len",
        f"fixed:{OUTPUT_TOKENS}",
        "--ignore-eos",
        "--no-progress",
        "--json",
        str(out),
    ]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not GUIDELLM.exists():
        raise SystemExit(f"{GUIDELLM} is missing: bash bench/clients_env.sh loadgen")

    from pdserve.engine.loading.sources import DEFAULT_MODEL, cache_dir, fetch
    from pdserve.testing.launch import ENGINE_ARGS, decode_server, prefill_server
    from pdserve.testing.models import hf_folder

    folder = hf_folder(
        fetch(DEFAULT_MODEL, progress=False), cache_dir() / "bench-hf" / "SmolLM2-135M-Instruct"
    )
    work = Path(tempfile.mkdtemp(prefix="bench-guidellm-"))
    prefill = prefill_server(folder, work, engine_args=ENGINE_ARGS)
    decode = decode_server(folder, prefill.address, work, extra=["--metrics-port", "0"])
    result = {}
    try:
        http, metrics = decode.addresses["http"], decode.addresses["metrics"]
        for endpoint in ("/v1/completions", "/v1/chat/completions"):
            before = generation_tokens(metrics)
            report = run_guidellm(
                http, str(folder), endpoint, work / f"guidellm{endpoint.replace('/', '_')}.json"
            )
            summary = guidellm_summary(report)
            summary["server_output_tokens"] = generation_tokens(metrics) - before
            result[f"guidellm {endpoint}"] = summary
        bench = run_pdserve_bench(decode.address, work / "pdserve_bench.json")
        result["pdserve bench (gRPC)"] = bench
    finally:
        decode.terminate()
        prefill.terminate()
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
