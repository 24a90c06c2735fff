"""Live migration from the image users deploy, across real network namespaces: builds deploy/Dockerfile,
runs a prefill container and two decode containers (each `--migrate-to` the other) on a container network,
streams answers through decode-a, stops it mid-stream (`docker stop`: SIGTERM, then SIGKILL after
--stop-timeout) and checks that every stream finishes without an error on the client, with the tokens the
same requests get from decode-b alone, and that decode-a exits 0 having moved its requests. Prints one
line per check; exit 0 when all pass. Takes minutes (an image build, three daemons starting): not in CI.

    bash scripts/docker_base.sh    # only where no registry is reachable: a local python:3.12-slim
    .venv/bin/python scripts/docker_drain_check.py [--streams 6] [--tokens 200] [--no-build] [--keep]

Needs dockerd and the host's venv (the client runs on the host and reaches the containers' addresses on
the network's bridge). The daemons run at float32 so that outputs compare exactly (bfloat16 is the CPU
default; a batch's composition may then move a near tie).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NETWORK = "pdserve-drain-check"
PREFILL, DECODE_A, DECODE_B = "pdserve-prefill", "pdserve-decode-a", "pdserve-decode-b"
ENGINE = ["--dtype", "float32", "--num-blocks", "512", "--max-num-seqs", "16", "--max-model-len", "1024"]
PROMPTS = [
    "Once upon a time, in a quiet village by the sea,",
    "The three laws of thermodynamics are",
    "def fibonacci(n):",
    "A short history of the printing press:",
    "Ten tips for a good night's sleep:",
    "The capital of France is Paris, and the capital of Italy is",
    "Write a letter to a friend about your summer:",
    "In the beginning of the twentieth century,",
]


def docker(*args: str, check: bool = True, capture: bool = True) -> str:
    done = subprocess.run(["docker", *args], check=False, capture_output=capture, text=True)
    if check and done.returncode:
        raise RuntimeError(f"docker {' '.join(args)}: {done.stderr.strip() if capture else done.returncode}")
    return (done.stdout or "").strip()


def ip_of(name: str) -> str:
    return docker("inspect", "-f", f'{{{{(index .NetworkSettings.Networks "{NETWORK}").IPAddress}}}}', name)


def wait_serving(address: str, timeout: float) -> None:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with grpc.insecure_channel(address) as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=3)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
        time.sleep(2)
    raise TimeoutError(f"{address} not SERVING after {timeout:.0f} s")


def clean() -> None:
    for name in (PREFILL, DECODE_A, DECODE_B):
        docker("rm", "-f", name, check=False)
    docker("network", "rm", NETWORK, check=False)


def start(image: str, name: str, command: str, args: list[str]) -> None:
    docker("run", "-d", "--name", name, "--network", NETWORK, "--entrypoint", command, image, *args)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--image", default="pdserve:dev")
    parser.add_argument("--no-build", action="store_true", help="use --image as it is")
    parser.add_argument("--streams", type=int, default=6)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--stop-timeout", type=int, default=120, help="docker stop's, before SIGKILL")
    parser.add_argument("--keep", action="store_true", help="leave the containers and network")
    args = parser.parse_args(argv)
    from pdserve.services.client import Client, build_request

    checks: list[tuple[str, bool, str]] = []

    def check(name: str, ok: bool, detail: str = "") -> None:
        checks.append((name, ok, detail))
        print(f"{'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)

    if not args.no_build:
        began = time.monotonic()
        built = subprocess.run(
            ["docker", "build", "-f", "deploy/Dockerfile", "-t", args.image, "."], cwd=ROOT, check=False
        )
        check("image builds", built.returncode == 0, f"{args.image} in {time.monotonic() - began:.0f} s")
        if built.returncode:
            return 1
    clean()
    docker("network", "create", NETWORK)
    try:
        start(args.image, PREFILL, "prefill-server", ["--host", "0.0.0.0", "--port", "50051", *ENGINE])
        for name, peer in ((DECODE_A, DECODE_B), (DECODE_B, DECODE_A)):
            decode_args = ["--host", "0.0.0.0", "--port", "50052", "--prefill", f"{PREFILL}:50051"]
            decode_args += ["--migrate-to", f"{peer}:50052", "--drain-timeout", str(args.stop_timeout - 10)]
            start(args.image, name, "decode-server", [*decode_args, *ENGINE])
        began = time.monotonic()
        ports = {PREFILL: 50051, DECODE_A: 50052, DECODE_B: 50052}
        addresses = {name: f"{ip_of(name)}:{port}" for name, port in ports.items()}
        for address in addresses.values():
            wait_serving(address, timeout=900)
        check("three daemons serving", True, f"in {time.monotonic() - began:.0f} s")

        prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(args.streams)]
        kw = dict(max_tokens=args.tokens, ignore_eos=True)
        client = Client(addresses[DECODE_A], max_resumes=0)  # a break would raise: nothing may resume
        going = [threading.Event() for _ in prompts]

        def one(i: int):
            seen: list[int] = []

            def on_response(response):
                seen.extend(response.token_ids)
                if len(seen) >= args.tokens // 4:
                    going[i].set()

            try:
                return client.generate_request(
                    build_request(prompts[i], **kw), timeout=900, on_response=on_response
                )
            finally:
                going[i].set()

        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            futures = [pool.submit(one, i) for i in range(len(prompts))]
            for event in going:
                event.wait(timeout=900)
            stopped = time.monotonic()
            stopper = threading.Thread(
                target=docker, args=("stop", "-t", str(args.stop_timeout), DECODE_A), daemon=True
            )
            stopper.start()
            results, errors = [], []
            for future in futures:
                try:
                    results.append(future.result())
                except Exception as e:  # noqa: BLE001 - what a client saw, reported
                    results.append(None)
                    errors.append(f"{type(e).__name__}: {e}")
            stopper.join(args.stop_timeout + 30)
        check("no stream broke at the client", not errors, "; ".join(errors[:3]))
        code = docker("inspect", "-f", "{{.State.ExitCode}}", DECODE_A)
        check(
            "decode-a exited 0 after docker stop",
            code == "0",
            f"exit {code}, {time.monotonic() - stopped:.1f} s after the stop",
        )
        logs = subprocess.run(["docker", "logs", DECODE_A], capture_output=True, text=True, check=False)
        log = logs.stdout + logs.stderr
        moved = [line for line in log.splitlines() if "draining: moved" in line]
        check("decode-a moved its requests to decode-b", bool(moved), moved[-1] if moved else "no log line")
        reference = Client(addresses[DECODE_B])
        wrong = sum(
            r is None or r.token_ids != reference.generate(p, **kw).token_ids
            for p, r in zip(prompts, results, strict=True)
        )
        check("outputs equal decode-b's alone", wrong == 0, f"{len(prompts) - wrong} of {len(prompts)} equal")
        stats = reference.stats()
        check(
            "decode-b holds no block",
            stats.num_free_blocks + stats.num_cached_blocks == stats.num_blocks and stats.num_running == 0,
            f"{stats.num_free_blocks} free + {stats.num_cached_blocks} cached of {stats.num_blocks}",
        )
    finally:
        if not args.keep:
            clean()
    print(json.dumps({name: ok for name, ok, _ in checks}))
    return 0 if all(ok for _, ok, _ in checks) else 1


if __name__ == "__main__":
    sys.exit(main())
