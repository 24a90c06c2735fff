"""Daemons spanning several processes (a multi-host slice on this host): a prefill-server over 2 processes x 4
fake CPU devices (TP 8) feeding a decode-server at TP 2, and a decode-server over 2 processes; tokens equal
the colocated engine's. Then the group's failure handling with real signals: SIGTERM of a leader drains it
and stops its workers (exit 0 everywhere), SIGKILL of a worker under load makes its leader exit
EXIT_GROUP_LOST while the decode server finishes every request locally with the right tokens and leaks no
block. The tests of this module share one prefill group and run in order (the last one breaks it)."""

from __future__ import annotations

import concurrent.futures
import threading

import pytest

from services.client import Client, build_request
from services.group import EXIT_GROUP_LOST
from services.launch import daemon_group, decode_server, prefill_server
from tests.helpers import assert_all_free

pytestmark = pytest.mark.daemon

WORDS = ["the", "quiet", "harbor", "lantern", "glows", "over", "copper", "waves", "while", "owls"]


def long_prompt(n_words: int, salt: int) -> str:
    return " ".join(WORDS[(i * 7 + salt) % len(WORDS)] for i in range(n_words))


# greedy and seeded, short and chunked (> 256 tokens: the daemons' step budget), an adapter-free mix
JOBS = [
    ("Hello, my name is", dict(max_tokens=12)),
    ("The capital of France is", dict(max_tokens=12, temperature=0.8, seed=7)),
    (long_prompt(420, 1), dict(max_tokens=8, ignore_eos=True)),
    (long_prompt(300, 2), dict(max_tokens=8, temperature=0.9, top_p=0.9, seed=3, ignore_eos=True)),
] + [
    (long_prompt(20 + 9 * i, i), dict(max_tokens=6, seed=i, temperature=0.7, ignore_eos=True))
    for i in range(12)
]


@pytest.fixture(scope="module")
def prefill_group(gguf_path, log_dir):
    """A prefill-server over 2 processes x 4 fake CPU devices: [leader, worker]."""

    def start(suffix, extra, ready, env):
        name = f"mp-prefill{suffix}"
        return prefill_server(gguf_path, log_dir, name=name, extra=extra, wait_ready=ready, env=env)

    group = daemon_group(start, 2, ["--tp", "8", "--cpu-devices", "4"])
    yield group
    for daemon in group:
        daemon.terminate()


def run_jobs(address: str, jobs) -> list[list[int]]:
    client = Client(address)
    try:
        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
            futures = [pool.submit(client.generate, p, timeout=300, **kw) for p, kw in jobs]
            return [f.result().token_ids for f in futures]
    finally:
        client.close()


def test_prefill_over_two_processes_to_decode_tp2(prefill_group, gguf_path, log_dir, daemons, colocated):
    colocated.prepare(JOBS)
    leader = prefill_group[0]
    decode = daemons.add(
        decode_server(
            gguf_path,
            leader.address,
            log_dir,
            name="decode-of-mp",
            extra=["--tp", "2", "--no-fallback-local"],
        )
    )
    assert run_jobs(decode.address, JOBS) == [colocated(p, **kw) for p, kw in JOBS]
    assert_all_free(decode.address, leader.address)


def test_decode_over_two_processes(prefill_group, gguf_path, log_dir, colocated):
    def start(suffix, extra, ready, env):
        prefill, name = prefill_group[0].address, f"mp-decode{suffix}"
        return decode_server(gguf_path, prefill, log_dir, name=name, extra=extra, wait_ready=ready, env=env)

    group = daemon_group(start, 2, ["--tp", "2", "--no-fallback-local"])
    try:
        jobs = JOBS[:4] + JOBS[-4:]
        assert run_jobs(group[0].address, jobs) == [colocated(p, **kw) for p, kw in jobs]
        assert_all_free(group[0].address)
    finally:
        codes = [d.terminate() for d in group]  # the leader first: it drains, then stops its worker
    assert codes == [0, 0]


def test_worker_killed_under_load(prefill_group, gguf_path, log_dir, daemons, colocated):
    """The prefill group's worker dies mid-load: its leader exits EXIT_GROUP_LOST; the decode server's
    requests finish (prefilled locally after the failed transfers) with the colocated tokens."""
    leader, worker = prefill_group
    decode = daemons.add(decode_server(gguf_path, leader.address, log_dir, name="decode-survivor"))
    jobs = [(long_prompt(150 + 11 * i, 40 + i), dict(max_tokens=6, ignore_eos=True)) for i in range(8)]
    colocated.prepare(jobs)
    first_token = threading.Event()
    client = Client(decode.address)
    try:
        with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
            futures = [
                pool.submit(
                    client.generate_request,
                    build_request(p, **kw),
                    timeout=300,
                    on_response=(lambda _: first_token.set()) if i == 0 else None,
                )
                for i, (p, kw) in enumerate(jobs)
            ]
            # the group prefilled the first prompt; the others (~1900 tokens, 8+ steps) are in its queue
            assert first_token.wait(300)
            worker.kill()
            results = [f.result() for f in futures]
    finally:
        client.close()
    assert [r.token_ids for r in results] == [colocated(p, **kw) for p, kw in jobs]
    assert leader.proc.wait(60) == EXIT_GROUP_LOST
    leader.killed = True  # stopped on purpose
    stats = Client(decode.address).stats()
    assert stats.num_transfer_failures_total >= 1  # some prompts were in flight at the group, and failed over
    assert_all_free(decode.address)
