"""The process group's operation stream (services/group.py) between real processes on loopback: operations
arrive at every worker in order and intact, a worker with another engine is refused, a worker that dies
breaks the group on the leader's side, and a leader that goes away makes its workers exit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from pdserve.engine.distributed import ProcessGroup
from pdserve.engine.multihost import DeviceOp
from pdserve.services.group import EXIT_GROUP_LOST, Leader
from pdserve.testing.launch import free_port

pytestmark = pytest.mark.fast

ROOT = Path(__file__).resolve().parents[2]


def leader(num_processes: int, secret_file: Path | None = None) -> Leader:
    group = ProcessGroup("127.0.0.1:1", num_processes, 0, group_port=free_port(), secret_file=secret_file)
    return Leader(group, "engine-a", "127.0.0.1")


def follower(
    lead: Leader, process_id: int, fingerprint: str = "engine-a", secret_file: Path | None = None
) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
    argv = [sys.executable, str(ROOT / "tests/services/group_follower.py")]
    argv += [f"127.0.0.1:{lead.port}", str(process_id), fingerprint]
    argv += [str(secret_file)] if secret_file else []
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def test_operations_reach_every_worker_in_order():
    lead = leader(3)
    workers = [follower(lead, i) for i in (1, 2)]
    lead.wait_for_workers(120)
    tables = np.arange(12, dtype=np.int32).reshape(3, 4)
    lead.publish(DeviceOp("step", {"block_tables": tables, "flags": np.array([True, False])}))
    lead.publish(DeviceOp("gather_kv", args={"block_ids": [4, 2], "head_map": None}))
    lead.stop()
    expected = [
        {
            "kind": "step",
            "args": {},
            "arrays": {"block_tables": ["int32", tables.tolist()], "flags": ["bool", [True, False]]},
        },
        {"kind": "gather_kv", "args": {"block_ids": [4, 2], "head_map": None}, "arrays": {}},
        {"kind": "stop", "args": {}, "arrays": {}},
    ]
    for w in workers:
        out, err = w.communicate(timeout=60)
        assert w.returncode == 0, err
        assert [json.loads(line) for line in out.splitlines()[1:]] == expected
    assert not lead.lost.is_set()


def test_a_would_be_worker_without_the_secret_gets_no_slot_and_no_operation(tmp_path):
    """With --group-secret-file, a caller without the secret (or with another) is refused before it gets
    a slot; the worker with it then takes that slot and receives the operations."""
    secret, wrong = tmp_path / "secret", tmp_path / "wrong"
    secret.write_text("group-secret-1\n")
    wrong.write_text("group-secret-2\n")
    lead = leader(2, secret)
    for intruder_secret in (None, wrong):
        intruder = follower(lead, 1, secret_file=intruder_secret)
        out, err = intruder.communicate(timeout=60)
        assert intruder.returncode == EXIT_GROUP_LOST and "UNAUTHENTICATED" in err
        # not one operation; the refusal may end the process before it prints that it follows
        assert out.splitlines() in ([], ["following"])
    worker = follower(lead, 1, secret_file=secret)
    lead.wait_for_workers(120)
    lead.publish(DeviceOp("gather_kv", args={"block_ids": [1]}))
    lead.stop()
    out, err = worker.communicate(timeout=60)
    assert worker.returncode == 0, err
    assert [json.loads(line)["kind"] for line in out.splitlines()[1:]] == ["gather_kv", "stop"]


def test_a_worker_of_another_engine_is_refused():
    lead = leader(2)
    w = follower(lead, 1, fingerprint="engine-b")
    _, err = w.communicate(timeout=60)
    assert w.returncode == EXIT_GROUP_LOST
    assert "FAILED_PRECONDITION" in err and "differs from the leader's" in err
    lead.stop(1)


def test_a_dead_worker_breaks_the_group_and_a_gone_leader_ends_its_workers():
    lead = leader(3)
    workers = [follower(lead, i) for i in (1, 2)]
    lead.wait_for_workers(120)
    lost = threading.Event()
    lead.on_lost(lost.set)
    lead.publish(DeviceOp("step", {"tokens": np.zeros(4, np.int32)}))
    workers[0].kill()
    assert lost.wait(30) and "worker 1" in lead.lost_reason
    with pytest.raises(RuntimeError, match="broken"):
        lead.publish(DeviceOp("step", {"tokens": np.zeros(4, np.int32)}))
    lead._server.stop(0)  # the leader's port goes away without `stop`: what its death looks like
    _, err = workers[1].communicate(timeout=60)
    assert workers[1].returncode == EXIT_GROUP_LOST, err
    assert "the leader's stream failed" in err
