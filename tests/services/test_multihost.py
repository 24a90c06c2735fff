"""Daemons spanning several processes (a multi-host slice on this host): a prefill-server over 2 processes x 4
fake CPU devices (TP 8) feeding a decode-server over 2 processes at TP 2, and a one-process decode-server at
TP 2; tokens equal the colocated engine's. The group's failure handling with real signals: SIGTERM of a
leader drains it and stops its worker (exit 0 everywhere); SIGKILL of a worker under load makes its leader
exit EXIT_GROUP_LOST while the decode server finishes every request locally with the right tokens and
leaks no block. The tests of this module share one prefill group and run in order (the last one breaks
it)."""

from __future__ import annotations

import concurrent.futures
import json
import threading

import pytest

from pdserve.engine.sampling_params import Constraint
from pdserve.services.client import Client, build_request
from pdserve.services.group import EXIT_GROUP_LOST
from pdserve.testing.constraint_schemas import SCHEMAS
from pdserve.testing.launch import daemon_group, decode_server, prefill_server
from tests.helpers import assert_all_free

pytestmark = [pytest.mark.daemon, pytest.mark.standalone]  # starts every daemon it uses

WORDS = ["the", "quiet", "harbor", "lantern", "glows", "over", "copper", "waves", "while", "owls"]
WORDS += ["drift", "past", "stone", "bridges", "under", "amber", "skies"]  # 17: a salt's sequence is its own


def long_prompt(n_words: int, salt: int) -> str:
    """Salts below len(WORDS) give prompts that differ from their first word: no two share a block."""
    return " ".join(WORDS[(i * 7 + salt) % len(WORDS)] for i in range(n_words))


# 17 concurrent requests: greedy and seeded, short and one chunked (> 256 tokens: the daemons' step budget)
JOBS = [
    ("Hello, my name is", dict(max_tokens=12)),
    ("The capital of France is", dict(max_tokens=12, temperature=0.8, seed=7)),
    (long_prompt(420, 12), dict(max_tokens=8, ignore_eos=True)),
    (long_prompt(60, 13), dict(max_tokens=8, temperature=0.9, top_p=0.9, seed=3, ignore_eos=True)),
] + [
    (long_prompt(20 + 9 * i, i), dict(max_tokens=6, seed=i, temperature=0.7, ignore_eos=True))
    for i in range(12)
]
# a constrained one: the group samples its first token under the mask the leader ships to the worker
JOBS.append(
    (
        long_prompt(30, 14),
        dict(max_tokens=24, temperature=0.0, constraint=Constraint("json_schema", json.dumps(SCHEMAS[0]))),
    )
)


@pytest.fixture(scope="module")
def prefill_group(model_path, log_dir):
    """A prefill-server over 2 processes x 4 fake CPU devices: [leader, worker]."""

    def start(suffix, extra, ready, env):
        name = f"mp-prefill{suffix}"
        return prefill_server(model_path, log_dir, name=name, extra=extra, wait_ready=ready, env=env)

    group = daemon_group(start, 2, ["--tp", "8", "--cpu-devices", "4"])
    yield group
    for daemon in group:
        daemon.terminate()


@pytest.fixture(scope="module")
def decode_tp2(prefill_group, model_path, log_dir):
    """A one-process decode-server at TP 2 on the prefill group (local fallback on, as by default)."""
    daemon = decode_server(
        model_path, prefill_group[0].address, log_dir, name="decode-tp2", extra=["--tp", "2"]
    )
    yield daemon
    assert daemon.terminate() == 0


def run_jobs(address: str, jobs) -> list[list[int]]:
    client = Client(address)
    try:
        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
            futures = [pool.submit(client.generate, p, timeout=300, **kw) for p, kw in jobs]
            return [f.result().token_ids for f in futures]
    finally:
        client.close()


def test_prefill_group_to_decode_tp2(prefill_group, decode_tp2, colocated):
    """Prefill over 2 processes at TP 8 -> decode at TP 2 in one process: the prompts' KV comes from the
    group (no failed transfer) and the tokens equal the colocated engine's."""
    colocated.prepare(JOBS)
    client = Client(decode_tp2.address)
    before = client.stats()
    assert run_jobs(decode_tp2.address, JOBS) == [colocated(p, **kw) for p, kw in JOBS]
    after = client.stats()
    # every prompt transferred: none shares a block with another (a cached prompt is computed here)
    assert after.num_transfers_total - before.num_transfers_total == len(JOBS)
    assert after.num_transfer_failures_total == before.num_transfer_failures_total
    client.close()
    assert_all_free(decode_tp2.address, prefill_group[0].address)


def test_decode_over_two_processes(prefill_group, model_path, log_dir, colocated):
    """A decode-server over 2 processes (TP 2) on the prefill group (a request of n = 3 too: the worker
    replays the forked sequences' block copies); then SIGTERM on its leader drains it and stops its
    worker."""

    def start(suffix, extra, ready, env):
        prefill, name = prefill_group[0].address, f"mp-decode{suffix}"
        return decode_server(model_path, prefill, log_dir, name=name, extra=extra, wait_ready=ready, env=env)

    group = daemon_group(start, 2, ["--tp", "2", "--no-fallback-local"])
    try:
        jobs = [*JOBS[:2], JOBS[3], JOBS[-1]]
        assert run_jobs(group[0].address, jobs) == [colocated(p, **kw) for p, kw in jobs]
        prompt, kw = long_prompt(40, 15), dict(max_tokens=6, temperature=0.9, ignore_eos=True)
        client = Client(group[0].address)
        try:
            forked = client.generate_sequences(build_request(prompt, n=3, seed=5, **kw), timeout=300)
        finally:
            client.close()
        assert [c.token_ids for c in forked] == [colocated(prompt, seed=5 + i, **kw) for i in range(3)]
        assert_all_free(group[0].address)
    finally:
        # the leader: SIGTERM drains it, then it stops its worker, which exits by itself (a SIGTERM of
        # ours could reach the worker while it exits after `stop`: seen once, on a cold compilation cache,
        # as exit -15)
        codes = [group[0].terminate(), *(worker.wait_exit() for worker in group[1:])]
    assert codes == [0, 0]


def test_worker_killed_under_load(prefill_group, decode_tp2, colocated):
    """The prefill group's worker dies while 8 prompts are in flight: its leader exits EXIT_GROUP_LOST; the
    decode server's requests finish (prefilled locally after the failed transfers) with the colocated
    tokens, and no block leaks."""
    leader, worker = prefill_group
    jobs = [(long_prompt(150 + 11 * i, 40 + i), dict(max_tokens=6, ignore_eos=True)) for i in range(8)]
    colocated.prepare(jobs)
    first_token = threading.Event()
    client = Client(decode_tp2.address)
    try:
        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
            futures = [
                pool.submit(
                    client.generate_request,
                    build_request(p, **kw),
                    timeout=300,
                    on_response=lambda _: first_token.set(),
                )
                for p, kw in jobs
            ]
            # one prompt came back from the group; the others' ~1700 tokens (7+ steps of 256) are still
            # in its queue, whatever the order they arrived in
            assert first_token.wait(300)
            worker.kill()
            results = [f.result() for f in futures]
        assert [r.token_ids for r in results] == [colocated(p, **kw) for p, kw in jobs]
        assert leader.proc.wait(60) == EXIT_GROUP_LOST
        leader.killed = True  # stopped on purpose
        assert client.stats().num_transfer_failures_total >= 1  # prompts in flight at the group failed over
    finally:
        client.close()
    assert_all_free(decode_tp2.address)
