"""A daemon's signal handling, in a real process: SIGTERM starts the drain (main returns), and a SIGTERM
that arrives while the process tears down afterwards (an orchestrator's second one, or a test's after an
Admin.Drain), even once the interpreter has put back the default handlers, leaves the clean exit alone."""

from __future__ import annotations

import signal
import subprocess
import sys

import pytest

pytestmark = pytest.mark.fast

DAEMON = """
import sys
from pdserve.services.grpc_server import run_until_signal

class Teardown:  # an object the interpreter's finalization collects: it lasts until the second SIGTERM
    def __del__(self):
        print("teardown", flush=True)
        sys.stdin.readline()

async def main(stop):
    print("serving", flush=True)
    await stop.wait()

run_until_signal(main)
keep = Teardown()
"""


def test_a_sigterm_during_teardown_keeps_the_clean_exit():
    proc = subprocess.Popen(
        [sys.executable, "-c", DAEMON], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "serving"
        proc.send_signal(signal.SIGTERM)
        assert proc.stdout.readline().strip() == "teardown"  # (Python's own handlers are gone by now)
        proc.send_signal(signal.SIGTERM)
        proc.send_signal(signal.SIGINT)
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.wait(timeout=60) == 0
    finally:
        proc.kill()
