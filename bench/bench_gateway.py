"""What serving behind an inference gateway costs a decode server: its /metrics scraped at 20 Hz (llm-d's
router polls every 50 ms) and its KV cache events published to a subscriber (the router's precise prefix
scorer), each against the same server without it, measured in one run with alternating rounds.

    .venv/bin/python bench/bench_gateway.py [--rounds N] [--json OUT] [--smoke]

Three colocated decode-servers on this machine, one publishing KV events (--kv-events=plain; a ZMQ
subscriber here reads every message, as the router does) and two without, a decode server's default (the
second is a control: how much two identical servers differ here); only one is loaded at a time. Each
round runs 8 concurrent streams of 96 tokens (distinct prompts: every request stores new blocks, so the
publisher has work) on each, once with a thread here scraping the loaded server's metrics every 50 ms
(PICKER_PATH, what deploy/components/inference-gateway points the picker at) and once without.
First, the CPU a scrape costs the server to render (/metrics and PICKER_PATH, no HTTP). Then the
figures: decode tokens/s (after the last first token), medians over rounds; ratios scraped / not scraped
and events on / off, per round (the same minutes of this noisy machine), their median and range (targets:
median >= 0.98). --smoke: the scrape's rendering cost only (the rest needs the daemons), on the test
model, 20 renders.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import zmq

from pdserve.bench.common import report
from pdserve.engine.loading.sources import DEFAULT_MODEL, fetch
from pdserve.services.client import Client
from pdserve.services.metrics import PICKER_PATH
from pdserve.testing.launch import decode_server

ENGINE_ARGS = ["--max-model-len", "1024", "--num-blocks", "512", "--max-num-seqs", "8"]
STREAMS, DECODE_TOKENS, SCRAPE_EVERY_S = 8, 96, 0.05


def decode_rate(client: Client, salt: int) -> float:
    """Tokens per second of STREAMS concurrent requests (distinct 48-token prompts) decoding DECODE_TOKENS
    tokens each, from the last first token on."""

    def one(i: int) -> tuple[float, float, int]:
        ids = np.random.default_rng((salt, i)).integers(100, 40000, 48).tolist()
        r = client.generate(ids, max_tokens=DECODE_TOKENS, ignore_eos=True)
        return r.token_times_s[0], r.token_times_s[-1], len(r.token_ids) - 1

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(STREAMS) as pool:
        runs = list(pool.map(one, range(STREAMS)))
    wall = time.perf_counter() - start
    return sum(n for *_, n in runs) / max(wall - max(first for first, *_ in runs), 1e-9)


class Scraper:
    """GETs PICKER_PATH of a metrics port every SCRAPE_EVERY_S seconds on a thread while `with`-ed."""

    def __init__(self, address: str):
        self.address, self.count, self._stop = address, 0, threading.Event()

    def _run(self):
        while not self._stop.is_set():
            started = time.monotonic()
            urllib.request.urlopen(f"http://{self.address}{PICKER_PATH}", timeout=10).read()
            self.count += 1
            self._stop.wait(max(0.0, SCRAPE_EVERY_S - (time.monotonic() - started)))

    def __enter__(self):
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


class Subscriber:
    """Reads every KV events message of a daemon on a thread (the router's subscription)."""

    def __init__(self, address: str):
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, b"kv@")
        self.socket.connect(f"tcp://{address}")
        self.messages = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        while not self._stop.is_set():
            if self.socket.poll(100):
                self.socket.recv_multipart()
                self.messages += 1

    def close(self):
        self._stop.set()
        self._thread.join()
        self.context.destroy(linger=0)


def study(rounds: int) -> dict:
    gguf = fetch(DEFAULT_MODEL, progress=False)
    logs = Path(tempfile.mkdtemp(prefix="bench-gateway-"))
    extra = ["--metrics-port", "0"]
    events_on = decode_server(
        gguf, "local", logs, name="events-on", engine_args=ENGINE_ARGS, extra=[*extra, "--kv-events=plain"]
    )
    off = [
        decode_server(
            gguf,
            "local",
            logs,
            name=f"events-off-{i}",
            engine_args=ENGINE_ARGS,
            extra=extra,  # (a decode server's default: no events)
        )
        for i in range(2)
    ]
    subscriber = Subscriber(events_on.addresses["kv-events"])
    try:
        # the second server without events is the control: two identical servers differ by this much
        daemons = {"events on": events_on, "events off": off[0], "events off (control)": off[1]}
        clients = {k: Client(d.address) for k, d in daemons.items()}
        for client in clients.values():  # compile the shapes the rounds meet (the daemons start lazily)
            decode_rate(client, 0)
        rates = {(k, s): [] for k in daemons for s in ("scraped", "not scraped")}
        scrapes = 0
        for r in range(1, rounds + 1):
            # alternating, and in the other order every other round: drift and order effects cancel
            order = list(daemons) if r % 2 else list(daemons)[::-1]
            for k in order:
                for scraped in (False, True) if r % 2 else (True, False):
                    if scraped:
                        with Scraper(daemons[k].addresses["metrics"]) as scraper:
                            rates[(k, "scraped")].append(decode_rate(clients[k], 2 * r + 1))
                        scrapes += scraper.count
                    else:
                        rates[(k, "not scraped")].append(decode_rate(clients[k], 2 * r))
            print(f"round {r} done", flush=True)

        def paired(a, b):  # per-round ratios (same moment of this machine): median, min, max
            ratios = [x / y for x, y in zip(rates[a], rates[b], strict=True)]
            return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}

        return {
            "decode_tok_s (medians)": {f"{k} / {s}": statistics.median(v) for (k, s), v in rates.items()},
            "scraped / not scraped (events on)": paired(
                ("events on", "scraped"), ("events on", "not scraped")
            ),
            "scraped / not scraped (events off)": paired(
                ("events off", "scraped"), ("events off", "not scraped")
            ),
            "events on / off (not scraped)": paired(
                ("events on", "not scraped"), ("events off", "not scraped")
            ),
            "events on / off (scraped)": paired(("events on", "scraped"), ("events off", "scraped")),
            "control: events off / events off, another server (not scraped)": paired(
                ("events off", "not scraped"), ("events off (control)", "not scraped")
            ),
            "control: events off / events off, another server (scraped)": paired(
                ("events off", "scraped"), ("events off (control)", "scraped")
            ),
            "scrapes": scrapes,
            "kv_event_messages_received": subscriber.messages,
        }
    finally:
        subscriber.close()
        for daemon in (events_on, *off):
            daemon.terminate()


def scrape_cost(repeats: int = 500, smoke: bool = False) -> dict:
    """CPU of rendering one scrape in the server (no HTTP), /metrics vs PICKER_PATH, after 1000 requests'
    histograms are filled; and what it is at 20 Hz in % of one core."""
    import timeit

    from prometheus_client import generate_latest

    from pdserve.engine.config import EngineConfig
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.engine.loading.sources import load_model
    from pdserve.services.admin import Counters
    from pdserve.services.engine_loop import EngineLoop
    from pdserve.services.metrics import Metrics
    from pdserve.testing.models import bench_model

    engine = LLMEngine(load_model(bench_model(smoke)), EngineConfig(num_blocks=512))
    metrics = Metrics("decode", EngineLoop(engine), Counters())
    for _ in range(1000):
        metrics.observe_request([0.05 * j for j in range(64)], 0.0)
    out = {}
    for path, registry in (("/metrics", metrics.registry), (PICKER_PATH, metrics.picker_registry)):
        seconds = timeit.timeit(lambda r=registry: generate_latest(r), number=repeats) / repeats
        out[path] = {"render_ms": seconds * 1e3, "core_percent_at_20hz": seconds * 20 * 100}
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--json", help="also write the result here")
    parser.add_argument("--scrape-cost-only", action="store_true", help="only the rendering cost of a scrape")
    parser.add_argument("--smoke", action="store_true", help="the scrape cost only, test model, 20 renders")
    args = parser.parse_args(argv)
    if args.smoke:
        args.scrape_cost_only = True
    result = {"scrape_cost": scrape_cost(20, smoke=True) if args.smoke else scrape_cost()}
    if not args.scrape_cost_only:
        result |= study(args.rounds)
    report(result, args.json)


if __name__ == "__main__":
    main()
