"""Live migration on drain, with real processes: a decode server given SIGTERM while it streams moves its
running requests, with their KV, to a peer decode server of another TP (--migrate-to) and relays the peer's
tokens: no client sees an error or a break in its output, every output (greedy, seeded, n = 2, penalties
with logprobs, a stop string, a JSON schema; and an OpenAI streamed completion over HTTP) equals the
uninterrupted colocated run's, tokens and text, the draining server exits 0 within its grace period, and
no server keeps a block."""

from __future__ import annotations

import concurrent.futures
import re
import threading

import pytest

from pdserve.engine.sampling_params import Constraint
from pdserve.services.client import Client, build_request
from pdserve.services.sampling import params_from_request
from pdserve.testing.launch import scrape
from tests.helpers import assert_all_free

pytestmark = pytest.mark.daemon

PROMPT = "Once upon a time, in a quiet village by the sea,"
IGNORE_EOS = {"ignore_eos": True}
SCHEMA = '{"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}'
JOBS = [  # Client keywords
    dict(max_tokens=40, ignore_eos=True),
    dict(max_tokens=40, ignore_eos=True, temperature=0.9, seed=7),
    dict(max_tokens=40, ignore_eos=True, temperature=0.8, seed=3, n=2),
    dict(max_tokens=40, ignore_eos=True, temperature=0.7, seed=5, frequency_penalty=0.5, logprobs=2),
    dict(max_tokens=40, temperature=0, stop=[" the", "."]),
    dict(max_tokens=40, temperature=0, constraint=Constraint("json_schema", SCHEMA)),
]


def test_sigterm_moves_running_streams_with_their_kv_to_a_peer_of_another_tp(
    prefill, daemons, colocated, openai
):
    peer = daemons.decode(prefill.address, "decode-peer-tp2", extra=["--tp", "2", "--metrics-port", "0"])
    extra = ["--migrate-to", peer.address, "--http-port", "0"]
    draining = daemons.decode(prefill.address, "decode-draining", extra=extra)
    client = Client(draining.address, max_resumes=0)  # (a break would raise: nothing may resume)
    going = [threading.Event() for _ in range(len(JOBS) + 1)]  # each stream has tokens before the drain
    http = openai.OpenAI(base_url=f"http://{draining.addresses['http']}/v1", api_key="-", max_retries=0)

    def over_http():  # a streamed completion of the OpenAI API, relayed the same way
        text, model = "", http.models.list().data[0].id
        try:
            for chunk in http.completions.create(
                model=model, prompt=PROMPT, stream=True, max_tokens=40, temperature=0, extra_body=IGNORE_EOS
            ):
                text += "".join(choice.text for choice in chunk.choices)
                if len(text) >= 8:
                    going[-1].set()
        finally:
            going[-1].set()
        return text

    def one(i, kw):
        seen = []

        def on_response(response):
            seen.extend(response.token_ids)
            if len(seen) >= 4 or response.finish_reason:
                going[i].set()

        try:
            return client.generate_sequences(
                build_request(PROMPT, **kw), timeout=300, on_response=on_response
            )
        finally:
            going[i].set()

    with concurrent.futures.ThreadPoolExecutor(len(JOBS) + 1) as pool:
        futures = [pool.submit(one, i, kw) for i, kw in enumerate(JOBS)]
        streamed = pool.submit(over_http)
        assert all(event.wait(timeout=120) for event in going)
        draining.proc.send_signal(15)
        results = [f.result() for f in futures]
        assert streamed.result() == colocated(PROMPT, max_tokens=40, ignore_eos=True, field="text")
    for kw, sequences in zip(JOBS, results, strict=True):
        params = params_from_request(build_request("", **kw))  # (n = 2: a sequence of each index)
        reference = colocated.engine.generate([PROMPT], params)
        assert [s.token_ids for s in sequences] == [r.token_ids for r in reference], kw
        assert [s.text for s in sequences] == [r.text for r in reference], kw
        assert all(s.num_resumes == 0 for s in sequences)
    assert draining.terminate() == 0  # exited on its own, within the grace period
    log = draining.log_path.read_text()
    moved = re.search(r"moved (\d+) sequences to peers, 0 stay here; (\d+) bytes of KV sent", log)
    # moves go two at a time: a request that ends before its turn (the stop string's, the schema's, or
    # on a fast box any) has nothing left to move
    assert moved and int(moved.group(1)) >= 1, log[-2000:]
    assert log.count("request moved to a peer") >= 1 and "stays" not in log
    metrics = scrape(peer.addresses["metrics"])
    taken = metrics['pdserve_migrations_total{direction="in",outcome="accepted",role="decode"}']
    assert taken == int(moved.group(1))
    assert metrics['pdserve_migration_kv_bytes_total{direction="in",role="decode"}'] == int(moved.group(2))
    assert_all_free(peer.address, prefill.address)


def test_peers_that_refuse_leave_the_requests_to_finish_where_they_are(
    prefill, full_daemons, daemons, colocated
):
    """A peer serving another model (its KV layout refused at Hello) and a server without the Migration
    service (a prefill server): nothing moves, the stream finishes on the draining server (drained over
    Admin.Drain), exit 0."""
    _, other_model = full_daemons
    peers = f"{prefill.address},{other_model.address}"
    draining = daemons.decode(prefill.address, "decode-refused", extra=["--migrate-to", peers])
    client = Client(draining.address, max_resumes=0)
    kw = dict(max_tokens=40, ignore_eos=True, temperature=0.9, seed=11)
    call = client.stub.Generate(build_request(PROMPT, **kw), timeout=300)
    stream = iter(call)
    tokens = list(next(stream).token_ids)
    assert not Client(draining.address).drain().already_draining  # Admin.Drain: as SIGTERM
    tokens += [t for r in stream for t in r.token_ids]
    assert tokens == colocated(PROMPT, **kw)
    assert draining.terminate() == 0
    log = draining.log_path.read_text()
    assert "no peer to move 1 requests to" in log and "FAILED_PRECONDITION" in log
    assert_all_free(prefill.address)
