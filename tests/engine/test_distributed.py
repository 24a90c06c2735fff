"""Joining a multi-process JAX job: where its shape comes from, and two real processes on one mesh."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.engine.distributed import ProcessGroup, add_distributed_args, process_group
from pdserve.testing.launch import free_port

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[2]


def parse(*argv):
    parser = argparse.ArgumentParser()
    add_distributed_args(parser)
    return parser.parse_args(list(argv))


def test_flags_then_leaderworkerset_env_then_single_process():
    lws = {"LWS_LEADER_ADDRESS": "pd-0.pd.ns", "LWS_GROUP_SIZE": "4", "LWS_WORKER_INDEX": "3"}
    flags = parse("--coordinator-address", "10.0.0.1:9000", "--num-processes", "2", "--process-id", "1")
    assert process_group(flags, lws) == ProcessGroup("10.0.0.1:9000", 2, 1)
    assert process_group(parse(), lws) == ProcessGroup("pd-0.pd.ns:8476", 4, 3)
    leader = process_group(parse("--coordinator-port", "7000"), {**lws, "LWS_WORKER_INDEX": "0"})
    assert leader == ProcessGroup("pd-0.pd.ns:7000", 4, 0) and leader.is_leader
    assert process_group(parse(), {**lws, "LWS_GROUP_SIZE": "1"}) is None
    assert process_group(parse(), {}) is None
    with pytest.raises(ValueError, match="go together"):
        process_group(parse("--num-processes", "2"), {})
    with pytest.raises(ValueError, match="out of range"):
        process_group(parse(), {**lws, "LWS_WORKER_INDEX": "4"})


def test_two_processes_share_one_mesh():
    port = free_port()
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    env["PYTHONPATH"] = str(ROOT)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                str(ROOT / "tests/engine/distributed_worker.py"),
                "--coordinator-address",
                f"127.0.0.1:{port}",
                "--num-processes",
                "2",
                "--process-id",
                str(i),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        for i in range(2)
    ]
    # gloo logs to stdout too, from C, unsynchronized with Python's buffer: its text can even continue the
    # worker's JSON line, so the object is decoded where it starts and whatever follows it is ignored
    texts = [p.communicate(timeout=180)[0] for p in procs]
    outs = [json.JSONDecoder().raw_decode(text, text.rindex('{"process"'))[0] for text in texts]
    assert [p.returncode for p in procs] == [0, 0]
    assert outs == [{"process": i, "devices": 4, "sum": 28.0, "num_blocks": 100} for i in range(2)]
