"""Daemons as real processes on loopback ports (pdserve.bench.processes, with the tests' small engine and
shapes compiled on first use), in-process servers on a thread, and reading a daemon's metrics (`scrape`):
used by the tests and the benchmarks to run the real thing."""

from __future__ import annotations

import asyncio
import functools
import socket
import threading
from pathlib import Path

from pdserve.bench import processes
from pdserve.bench.processes import EPHEMERAL_HTTP, EPHEMERAL_KV_EVENTS, Daemon, scrape
from pdserve.engine.config import EngineConfig
from pdserve.flags import config_argv

__all__ = ["EPHEMERAL_HTTP", "EPHEMERAL_KV_EVENTS", "Daemon", "decode_server", "prefill_server", "scrape"]

# Small engines for tests and benchmarks: few buckets, chunked prefill past 256 tokens. The test
# process's engines (tests/conftest.py's small_config) and the daemons' (ENGINE_ARGS) are these.
TEST_ENGINE = EngineConfig(num_blocks=192, max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=256)
ENGINE_ARGS = config_argv(TEST_ENGINE)
# A host KV tier (--kv-offloading-size, GiB) for the daemons the tests share and the fault suite's: their
# streams are staged in host memory, and blocks the device evicts are kept there
HOST_TIER_ARGS = ["--kv-offloading-size", "0.05"]
# the tests' daemons: the small engine, every shape compiled on first use (a benchmark passes warmup=True and
# its own engine_args)
prefill_server = functools.partial(processes.prefill_server, engine_args=ENGINE_ARGS, warmup=False)
decode_server = functools.partial(processes.decode_server, engine_args=ENGINE_ARGS, warmup=False)


def serve_daemon(
    gguf: Path, log_dir: Path, decode_devices: str, name="serve", extra=(), engine_args=ENGINE_ARGS
) -> Daemon:
    """`pdserve serve`: prefill on device 0, decode on `decode_devices` (indices), fake CPU devices enough
    for both."""
    cpu_devices = max(int(d) for d in decode_devices.split(",")) + 1
    argv = ["serve", "--model", str(gguf), "--port", "0", "--no-warmup", "--cpu-devices", str(cpu_devices)]
    argv += [
        "--prefill-devices",
        "0",
        "--decode-devices",
        decode_devices,
        *EPHEMERAL_KV_EVENTS,
        *EPHEMERAL_HTTP,
    ]
    return Daemon([*argv, *engine_args, *extra], name, log_dir)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def daemon_group(start, num_processes: int, extra=()) -> list[Daemon]:
    """One daemon over `num_processes` processes of this host, started as a LeaderWorkerSet starts a group
    (the same arguments everywhere, the group in LWS_* variables; free loopback ports for the coordinator
    and the group port): `start(name_suffix, extra, wait_ready, env)` starts one (prefill_server or
    decode_server with its other arguments bound). The workers first, then the leader (ready once every
    worker follows). Returns [leader, workers...]."""
    from pdserve.engine.distributed import lws_environ

    extra = [*extra, "--coordinator-port", str(free_port()), "--group-port", str(free_port())]
    workers = [
        start(f"-w{i}", extra, False, lws_environ("127.0.0.1", num_processes, i))
        for i in range(1, num_processes)
    ]
    return [start("", extra, True, lws_environ("127.0.0.1", num_processes, 0)), *workers]


class ServerThread:
    """Runs `serve(..., stop)`-style coroutines on their own event loop thread (in-process servers)."""

    def __init__(self, make_coro):
        self.loop = asyncio.new_event_loop()
        self.stop_event: asyncio.Event | None = None
        self.ready = threading.Event()
        self.error: BaseException | None = None

        async def main():
            self.stop_event = asyncio.Event()
            self.ready.set()
            await make_coro(self.stop_event)

        def run():
            try:
                self.loop.run_until_complete(main())
            except BaseException as e:  # noqa: BLE001 - reported by stop()
                self.error = e
                self.ready.set()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()
        self.ready.wait()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.stop_event.set)
        self.thread.join(60)
        if self.error:
            raise self.error
