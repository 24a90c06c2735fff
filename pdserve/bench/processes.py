"""Daemons as real processes started here on loopback ports: a `prefill-server` or `decode-server` (or any
pdserve entry point) run as a child process, its ports read from its ready line, stopped with SIGTERM.
`pdserve simulate --validate` serves a workload with them; the tests and benchmarks start theirs through
pdserve.testing.launch, which gives them a small engine."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

# KV cache events on any free ports: daemons started here share one host (the defaults are fixed ports, one
# daemon a pod)
EPHEMERAL_KV_EVENTS = ["--kv-events-port", "0", "--kv-events-replay-port", "0"]
EPHEMERAL_HTTP = ["--http-port", "0"]  # decode-server's OpenAI API (on by default) on any free port
_READY = re.compile(r"ready on ([0-9.]+):(\d+)")
_EXTRA_PORT = re.compile(r"^(metrics|http|kv-events) on ([0-9.]+):(\d+)")  # printed before "ready on"
_REPLAY_PORT = re.compile(r"\(replay (\d+)")  # of the kv-events line
_FAKE_DEVICES = "--xla_force_host_platform_device_count"


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
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        env["XLA_FLAGS"] = _without_fake_devices(env.get("XLA_FLAGS", ""))
        if not env["XLA_FLAGS"]:
            del env["XLA_FLAGS"]
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


def _without_fake_devices(xla_flags: str) -> str:
    """XLA_FLAGS less its fake CPU device count: a daemon chooses its own (--cpu-devices, or its --tp)."""
    return " ".join(f for f in xla_flags.split() if not f.startswith(_FAKE_DEVICES))


def _lazy(warmup: bool) -> list[str]:
    """`--no-warmup` (shapes compiled on first use) unless `warmup`: every shape compiled before serving."""
    return [] if warmup else ["--no-warmup"]


def prefill_server(
    gguf: Path | str,
    log_dir: Path,
    name: str = "prefill",
    extra=(),
    engine_args=(),
    cpus: str | None = None,  # taskset's CPU list, e.g. "0"
    wait_ready: bool = True,
    env: dict[str, str] | None = None,
    warmup: bool = True,  # compile every shape before serving, as a daemon does by default
    timeout: float = 240.0,
) -> Daemon:
    """A `prefill-server` of `gguf` (a model path or name) on free ports, its log in log_dir/name.log."""
    argv = ["prefill-server", "--model", str(gguf), "--port", "0", *_lazy(warmup), *EPHEMERAL_KV_EVENTS]
    argv += [*engine_args, *extra]
    return Daemon(argv, name, log_dir, timeout=timeout, cpus=cpus, wait_ready=wait_ready, env=env)


def decode_server(
    gguf: Path | str,
    prefill: str,
    log_dir: Path,
    name="decode",
    extra=(),
    engine_args=(),
    cpus=None,
    wait_ready: bool = True,
    env: dict[str, str] | None = None,
    warmup: bool = True,
    timeout: float = 240.0,
) -> Daemon:
    """A `decode-server` of `gguf` prefilling on `prefill` (addresses, or "local": colocated), its OpenAI API
    on a free port too."""
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


def scrape(address: str, path: str = "/metrics") -> dict[str, float]:
    """A daemon's /metrics (or another path of its metrics port): {'name{labels}': value}."""
    text = urllib.request.urlopen(f"http://{address}{path}", timeout=10).read().decode()
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return values
