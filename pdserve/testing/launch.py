"""Daemons as real processes on loopback ports, in-process servers on a thread, and reading a daemon's
metrics (`scrape`): used by the tests and the benchmarks to run the real thing."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from pdserve.engine.config import EngineConfig
from pdserve.flags import config_argv

# Small engines for tests and benchmarks: few buckets, chunked prefill past 256 tokens. The test
# process's engines (tests/conftest.py's small_config) and the daemons' (ENGINE_ARGS) are these.
TEST_ENGINE = EngineConfig(num_blocks=192, max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=256)
ENGINE_ARGS = config_argv(TEST_ENGINE)
# A host KV tier (--kv-offloading-size, GiB) for the daemons the tests share and the fault suite's: their
# streams are staged in host memory, and blocks the device evicts are kept there
HOST_TIER_ARGS = ["--kv-offloading-size", "0.05"]
# KV cache events on any free ports: daemons of a test or benchmark share one host (the defaults are
# fixed ports, one daemon a pod)
EPHEMERAL_KV_EVENTS = ["--kv-events-port", "0", "--kv-events-replay-port", "0"]
EPHEMERAL_HTTP = ["--http-port", "0"]  # decode-server's OpenAI API (on by default) on any free port
_READY = re.compile(r"ready on ([0-9.]+):(\d+)")
_EXTRA_PORT = re.compile(r"^(metrics|http|kv-events) on ([0-9.]+):(\d+)")  # printed before "ready on"
_REPLAY_PORT = re.compile(r"\(replay (\d+)")  # of the kv-events line


class Daemon:
    """A daemon process (`prefill-server`, `decode-server` or `pdserve serve`) started on port 0."""

    max_peak_rss_kib = 0  # the largest peak resident memory of the daemons stopped so far (Linux /proc)

    def __init__(
        self,
        argv: list[str],
        name: str,
        log_dir: Path,
        timeout: float = 240.0,
        cpus: str | None = None,
        entry: str = "pdserve.cli:run_cli",  # module:function taking sys.argv[1:]
        wait_ready: bool = True,  # False: a worker of a process group (it serves no port)
        env: dict[str, str] | None = None,  # added to the environment
    ):
        module, function = entry.split(":")
        env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1", **(env or {})}
        env.pop("XLA_FLAGS", None)  # daemons choose their CPU device count themselves (--cpu-devices)
        self.name = name
        self.killed = False  # SIGKILLed on purpose (a fault test)
        self.log_path = log_dir / f"{name}.log"
        self.log = self.log_path.open("w")
        pin = ["taskset", "-c", cpus] if cpus else []  # e.g. "0": one role per core
        self.proc = subprocess.Popen(
            [
                *pin,
                sys.executable,
                "-c",
                f"import sys; from {module} import {function}; sys.exit({function}())",
                *argv,
            ],
            stdout=subprocess.PIPE,
            stderr=self.log,
            text=True,
            env=env,
        )
        self.address = self._wait_ready(timeout) if wait_ready else None
        if not wait_ready:
            threading.Thread(target=self._drain, daemon=True).start()

    def _wait_ready(self, timeout: float) -> str:
        # "metrics" / "http" / "kv-events" / "kv-events-replay" -> host:port, when served
        self.addresses: dict[str, str] = {}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"{self.name} exited {self.proc.returncode}: {self.log_path.read_text()[-3000:]}"
                    )
                continue
            extra = _EXTRA_PORT.search(line)
            if extra:
                self.addresses[extra.group(1)] = f"{extra.group(2)}:{extra.group(3)}"
                replay = _REPLAY_PORT.search(line)
                if replay:
                    self.addresses["kv-events-replay"] = f"{extra.group(2)}:{replay.group(1)}"
            match = _READY.search(line)
            if match:
                threading.Thread(target=self._drain, daemon=True).start()
                return f"{match.group(1)}:{match.group(2)}"
        raise TimeoutError(f"{self.name} not ready after {timeout} s")

    def _drain(self) -> None:
        for _ in self.proc.stdout:
            pass

    def _record_peak_rss(self) -> None:
        try:
            status = Path(f"/proc/{self.proc.pid}/status").read_text()
        except OSError:  # exited already, or no /proc
            return
        for line in status.splitlines():
            if line.startswith("VmHWM:"):
                Daemon.max_peak_rss_kib = max(Daemon.max_peak_rss_kib, int(line.split()[1]))

    def kill(self) -> None:
        self.killed = True
        self._record_peak_rss()
        self.proc.kill()
        self.proc.wait()

    def wait_exit(self, timeout: float = 60.0) -> int:
        """Waits for the process to end by itself (a group's worker, once its leader sent `stop`); returns
        its exit code. Past `timeout` it is killed and TimeoutExpired raised."""
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise
        self.log.close()
        return self.proc.returncode

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM; returns the exit code (0 after a clean drain)."""
        if self.proc.poll() is None:
            self._record_peak_rss()
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise
        self.log.close()
        return self.proc.returncode


def _lazy(warmup: bool) -> list[str]:
    """Tests start daemons with shapes compiled on first use (`--no-warmup`); a benchmark warms them up."""
    return [] if warmup else ["--no-warmup"]


def prefill_server(
    gguf: Path,
    log_dir: Path,
    name: str = "prefill",
    extra=(),
    engine_args=ENGINE_ARGS,
    cpus: str | None = None,
    wait_ready: bool = True,
    env: dict[str, str] | None = None,
    warmup: bool = False,  # compile every shape before serving (benchmarks), as a daemon does by default
    timeout: float = 240.0,
) -> Daemon:
    argv = ["prefill-server", "--model", str(gguf), "--port", "0", *_lazy(warmup), *EPHEMERAL_KV_EVENTS]
    argv += [*engine_args, *extra]
    return Daemon(argv, name, log_dir, timeout=timeout, cpus=cpus, wait_ready=wait_ready, env=env)


def decode_server(
    gguf: Path,
    prefill: str,
    log_dir: Path,
    name="decode",
    extra=(),
    engine_args=ENGINE_ARGS,
    cpus=None,
    wait_ready: bool = True,
    env: dict[str, str] | None = None,
    warmup: bool = False,  # compile every shape before serving (benchmarks), as a daemon does by default
    timeout: float = 240.0,
) -> Daemon:
    argv = ["decode-server", "--model", str(gguf), "--port", "0", *_lazy(warmup), "--prefill", prefill]
    return Daemon(
        [*argv, *EPHEMERAL_KV_EVENTS, *EPHEMERAL_HTTP, *engine_args, *extra],
        name,
        log_dir,
        timeout=timeout,
        cpus=cpus,
        wait_ready=wait_ready,
        env=env,
    )


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


def scrape(address: str, path: str = "/metrics") -> dict[str, float]:
    """A daemon's /metrics (or another path of its metrics port): {'name{labels}': value}."""
    text = urllib.request.urlopen(f"http://{address}{path}", timeout=10).read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values
