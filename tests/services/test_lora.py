"""Multi-LoRA across the daemons: adapters named in Generate follow their request to the prefill server
and back; disaggregated equals colocated_lora with adapters; adapters loaded at run time through Admin; a
prefill server without the adapter (or with other weights, or ignoring it) never makes decode use a KV
computed with other weights; `pdserve serve` with adapters."""

from __future__ import annotations

import concurrent.futures
import json
import os
import shutil
import subprocess
import sys
import urllib.request

import grpc
import pytest

from pdserve.services.client import Client, build_request
from pdserve.testing.launch import decode_server, prefill_server, serve_daemon
from pdserve.testing.lora import write_random_adapter
from pdserve.v1 import admin_pb2
from tests.helpers import Reference, in_process

pytestmark = pytest.mark.daemon

GREEDY = dict(max_tokens=12, temperature=0.0, ignore_eos=True)
SEEDED = dict(max_tokens=12, temperature=0.9, top_p=0.9, seed=5, ignore_eos=True)
TEXTS = ["The capital of France is", "Write a haiku about rain.", "Hello, my name is", "List three colors:"]
LONG = "Summarize: " + "the quick brown fox jumps over the lazy dog, then rests. " * 30  # ~400 tokens
LORA_ARGS = ["--max-loras", "2"]


@pytest.fixture(scope="module")
def adapter_dir(tmp_path_factory, loaded_model):
    root = tmp_path_factory.mktemp("lora")
    cfg = loaded_model.config
    write_random_adapter(root / "alpha", cfg, rank=8, seed=21)
    write_random_adapter(root / "beta", cfg, rank=4, seed=22, targets=("q_proj", "v_proj", "down_proj"))
    write_random_adapter(root / "gamma", cfg, rank=8, seed=23)
    write_random_adapter(root / "gamma-other", cfg, rank=8, seed=24)
    return root


@pytest.fixture(scope="module")
def lora_prefill(model_path, log_dir, adapter_dir):
    daemon = prefill_server(
        model_path,
        log_dir,
        name="prefill-lora",
        extra=[*LORA_ARGS, "--lora", f"alpha={adapter_dir / 'alpha'}", "--lora-root", str(adapter_dir)],
    )
    yield daemon
    assert daemon.terminate() == 0


@pytest.fixture(scope="module")
def lora_decode(model_path, lora_prefill, log_dir, adapter_dir):
    extra = [*LORA_ARGS, "--lora", f"alpha={adapter_dir / 'alpha'}", "--lora-root", str(adapter_dir)]
    extra += ["--metrics-port", "0", "--http-port", "0"]
    daemon = decode_server(model_path, lora_prefill.address, log_dir, name="decode-lora", extra=extra)
    yield daemon
    assert daemon.terminate() == 0


@pytest.fixture(scope="module")
def colocated_lora(make_engine, adapter_dir):
    """The colocated reference engine with the same adapters (tests.helpers.Reference; `lora_adapter`
    names the adapter)."""
    engine = make_engine(max_loras=2)
    for name in ("alpha", "beta", "gamma"):
        engine.loras.load(name, str(adapter_dir / name))
    return Reference(lambda: engine)


def load(address: str, name: str, path) -> admin_pb2.LoraAdapterInfo:
    return Client(address).load_lora(name, str(path))


def rpc_error(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value


def test_disaggregated_equals_colocated_with_adapters(lora_decode, lora_prefill, adapter_dir, colocated_lora):
    """alpha from start-up flags, beta loaded at run time on both daemons; base, alpha and beta mixed."""
    for address in (lora_prefill.address, lora_decode.address):
        info = load(address, "beta", adapter_dir / "beta")
        assert info.rank == 4 and list(info.target_modules) == ["q_proj", "v_proj", "down_proj"]
    client = Client(lora_decode.address)
    assert list(client.model_info().lora_adapters) == ["alpha", "beta"]
    failures = Client(lora_decode.address).stats().num_transfer_failures_total
    jobs = [
        (text, lora, kw) for text in TEXTS[:2] for lora in (None, "alpha", "beta") for kw in (GREEDY, SEEDED)
    ]
    jobs += [(LONG, "alpha", GREEDY), (LONG, "beta", SEEDED)]  # chunked prefill, KV in several frames
    colocated_lora.prepare([(text, dict(kw, lora_adapter=lora or "")) for text, lora, kw in jobs])
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(
            pool.map(lambda j: client.generate(j[0], lora_adapter=j[1] or "", **j[2]).token_ids, jobs)
        )
    for (text, lora, kw), tokens in zip(jobs, results, strict=True):
        assert tokens == colocated_lora(text, lora_adapter=lora or "", **kw), (text, lora, kw)
    assert results[0] != results[2] != results[4]  # base, alpha, beta differ
    # the next turn after the long ones: the decode server holds their heads, per adapter (delta transfer)
    more = " Now tell it all again in other words, and say how the story ends for everyone in it."
    before = Client(lora_decode.address).stats()
    for lora, kw in (("alpha", SEEDED), ("beta", GREEDY)):
        got = client.generate(LONG + more, lora_adapter=lora, **kw).token_ids
        assert got == colocated_lora(LONG + more, lora_adapter=lora, **kw), lora
    after = Client(lora_decode.address).stats()
    assert after.num_transfers_total - before.num_transfers_total == 2
    assert after.prefix_cache_hits_total - before.prefix_cache_hits_total >= 2 * 256  # held: not sent
    stats = Client(lora_decode.address).stats()
    assert stats.num_transfer_failures_total == failures  # every one prefilled remotely, with its adapter
    assert stats.num_free_blocks + stats.num_cached_blocks == stats.num_blocks
    listed = Client(lora_decode.address).list_loras()
    assert listed.num_slots == 2 and [a.name for a in listed.adapters] == ["alpha", "beta"]
    assert all(a.resident for a in listed.adapters)
    with urllib.request.urlopen(f"http://{lora_decode.addresses['metrics']}/metrics") as response:
        metrics = response.read().decode()
    assert 'pdserve_lora_adapters_loaded{role="decode"} 2.0' in metrics
    assert 'pdserve_lora_slots_used{role="decode"} 2.0' in metrics


def test_prefill_without_the_adapter_or_with_other_weights(
    lora_decode, lora_prefill, adapter_dir, colocated_lora
):
    """gamma: missing on the prefill server, then loaded there from other files. The decode server falls
    back to prefilling here both times (the replica stays in use for other requests)."""
    load(lora_decode.address, "gamma", adapter_dir / "gamma")
    client = Client(lora_decode.address)
    before = client.stats().num_transfer_failures_total
    assert client.generate(TEXTS[0], lora_adapter="gamma", **GREEDY).token_ids == colocated_lora(
        TEXTS[0], lora_adapter="gamma", **GREEDY
    )
    load(lora_prefill.address, "gamma", adapter_dir / "gamma-other")
    assert client.generate(TEXTS[1], lora_adapter="gamma", **GREEDY).token_ids == colocated_lora(
        TEXTS[1], lora_adapter="gamma", **GREEDY
    )
    assert client.stats().num_transfer_failures_total == before + 2
    served = Client(lora_prefill.address).stats().num_requests_total
    assert client.generate(TEXTS[2], lora_adapter="alpha", **GREEDY).token_ids == colocated_lora(
        TEXTS[2], lora_adapter="alpha", **GREEDY
    )
    assert Client(lora_prefill.address).stats().num_requests_total == served + 1
    Client(lora_prefill.address).unload_lora("gamma")


def test_adapter_errors(lora_decode, adapter_dir, tmp_path, loaded_model):
    client = Client(lora_decode.address)
    error = rpc_error(lambda: client.generate("hi", lora_adapter="nope", max_tokens=2))
    assert error.code() == grpc.StatusCode.NOT_FOUND and "'nope' is not loaded" in error.details()
    error = rpc_error(lambda: load(lora_decode.address, "alpha", adapter_dir / "gamma"))
    assert error.code() == grpc.StatusCode.ALREADY_EXISTS
    # outside --lora-root and missing: one answer, that says nothing of other paths
    outside = write_random_adapter(tmp_path / "outside", loaded_model.config, rank=2)
    answers = set()
    for path in (adapter_dir / "missing", outside, adapter_dir / ".." / outside.parent.name / "outside"):
        error = rpc_error(lambda path=path: load(lora_decode.address, "x", path))
        answers.add((error.code(), error.details()))
    assert answers == {(grpc.StatusCode.NOT_FOUND, "path: no adapter folder there under --lora-root")}
    malformed = shutil.copytree(adapter_dir / "beta", adapter_dir / "malformed")
    config = json.loads((malformed / "adapter_config.json").read_text())
    (malformed / "adapter_config.json").write_text(json.dumps({**config, "r": "eight"}))
    error = rpc_error(lambda: load(lora_decode.address, "x", "malformed"))  # (relative to the root)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "must be numbers" in error.details()
    error = rpc_error(lambda: client.unload_lora("nope"))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    load(lora_decode.address, "delta", adapter_dir / "beta")
    client.unload_lora("delta")
    error = rpc_error(lambda: client.generate("hi", lora_adapter="delta", max_tokens=2))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    stats = client.stats()
    assert stats.num_free_blocks + stats.num_cached_blocks == stats.num_blocks and stats.num_running == 0


def test_load_generator_mixes_adapters(lora_decode):
    from pdserve.bench.serve import bench

    result = bench(
        lora_decode.address,
        num_requests=6,
        concurrency=3,
        prompt_len="fixed:16",
        output_len="fixed:4",
        lora_adapters=["", "alpha"],
        progress=False,
    )
    assert result["stats"]["completed"] == 6 and result["config"]["lora_adapters"] == ["", "alpha"]


def test_pdserve_adapters_command(lora_decode, adapter_dir):
    def run(*args):
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        cmd = [sys.executable, "-m", "pdserve.cli", "adapters", *args, "--server", lora_decode.address]
        return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60)

    loaded = run("load", "epsilon", str(adapter_dir / "beta"))
    assert loaded.returncode == 0, loaded.stderr
    assert json.loads(loaded.stdout)["name"] == "epsilon" and json.loads(loaded.stdout)["rank"] == 4
    listed = json.loads(run("list").stdout)
    assert "epsilon" in [a["name"] for a in listed["adapters"]] and listed["num_slots"] == 2
    assert run("unload", "epsilon").returncode == 0
    missing = run("unload", "epsilon")
    assert missing.returncode == 1 and "NOT_FOUND" in missing.stderr


def test_openai_api_model_names_an_adapter(lora_decode, colocated_lora, loaded_model):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"http://{lora_decode.addresses['http']}/v1", api_key="unused")
    base, *cards = client.models.list().data  # the served name first, then the adapters
    models = {m.id: m for m in cards}
    assert "alpha" in models and models["alpha"].parent == base.id
    reply = client.completions.create(model="alpha", prompt=TEXTS[1], max_tokens=12, temperature=0)
    expected = colocated_lora(TEXTS[1], "text", lora_adapter="alpha", max_tokens=12, temperature=0.0)
    assert reply.model == "alpha" and reply.choices[0].text == expected
    with pytest.raises(openai.NotFoundError, match="not loaded"):
        client.completions.create(
            model=base.id, prompt="hi", max_tokens=2, extra_body={"lora_adapter": "nope"}
        )
    with pytest.raises(openai.NotFoundError, match="The model `x` does not exist"):
        client.completions.create(model="x", prompt="hi", max_tokens=2)


def test_prefill_ignoring_the_adapter_is_never_used(make_engine, colocated_lora):
    """A prefill server that ignores lora_adapter (an older build) prefills with the base weights; its
    header says so, and the decode server prefills the request here instead."""
    from pdserve.services.decode.core import GenerationCore
    from pdserve.services.decode.server import serve as serve_decode
    from pdserve.services.prefill import server as prefill_module

    class AdapterBlind(prefill_module.PrefillService):
        async def _prefill(self, request, context):
            request.ClearField("lora_adapter")
            request.ClearField("lora_fingerprint")
            async for message in super()._prefill(request, context):
                yield message

    expected = {lora: colocated_lora(TEXTS[3], lora_adapter=lora, **GREEDY) for lora in ("alpha", "")}
    blind = AdapterBlind.for_engine(make_engine())
    with in_process(lambda stop, ready: prefill_module.serve(blind, 0, stop, on_ready=ready)) as address:
        # the decode server: on a thread here too, over the reference engine (which has alpha loaded)
        core = GenerationCore.for_engine(colocated_lora.engine, prefill_targets=[address])
        with in_process(lambda stop, ready: serve_decode(core, 0, stop, on_ready=ready)) as decode:
            client = Client(decode)
            assert client.generate(TEXTS[3], lora_adapter="alpha", **GREEDY).token_ids == expected["alpha"]
            assert client.stats().num_transfer_failures_total >= 1
            assert client.generate(TEXTS[3], **GREEDY).token_ids == expected[""]


def test_serve_shape_with_adapters(model_path, log_dir, adapter_dir, colocated_lora, daemons):
    """`pdserve serve`, prefill TP 1 -> decode TP 2 (heterogeneous TP in one process, base model and
    adapters): the local prefill engine has the --lora adapters and those loaded through Admin; the
    adapters' heads are padded for each side's TP."""
    extra = [*LORA_ARGS, "--lora", f"alpha={adapter_dir / 'alpha'}", "--lora-root", str(adapter_dir)]
    daemon = daemons.add(serve_daemon(model_path, log_dir, "1,2", name="serve-lora", extra=extra))
    client = Client(daemon.address)
    load(daemon.address, "beta", adapter_dir / "beta")
    info = client.model_info()
    assert list(info.lora_adapters) == ["alpha", "beta"] and info.tensor_parallel == 2
    for lora in (None, "alpha", "beta"):
        got = client.generate(TEXTS[0], lora_adapter=lora or "", **SEEDED).token_ids
        assert got == colocated_lora(TEXTS[0], lora_adapter=lora or "", **SEEDED), lora
    assert client.stats().num_transfer_failures_total == 0


def test_run_time_loads_are_off_without_a_lora_root(decode, adapter_dir):
    """The session's decode server has no --lora-root: Admin loads nothing, whatever the path."""
    error = rpc_error(lambda: load(decode.address, "x", adapter_dir / "beta"))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and "--lora-root" in error.details()


def test_a_drain_moves_a_request_with_its_adapter_and_keeps_one_the_peer_lacks(
    model_path, log_dir, lora_prefill, lora_decode, adapter_dir, colocated_lora
):
    """A decode server with alpha and "solo" (gamma's weights under a name no other daemon has) drains
    into lora_decode: the alpha request moves (the peer checks the adapter's weights by fingerprint), the
    solo one finishes where it is; both streams unbroken and equal to the colocated engine's."""
    extra = [
        *LORA_ARGS,
        "--lora",
        f"alpha={adapter_dir / 'alpha'}",
        "--lora",
        f"solo={adapter_dir / 'gamma'}",
    ]
    extra += ["--migrate-to", lora_decode.address]
    draining = decode_server(
        model_path, lora_prefill.address, log_dir, name="decode-lora-draining", extra=extra
    )
    try:
        client = Client(draining.address, max_resumes=0)
        kw = dict(max_tokens=32, temperature=0.9, seed=9, ignore_eos=True)
        calls = [
            client.stub.Generate(build_request(TEXTS[0], lora_adapter=a, **kw), timeout=300)
            for a in ("alpha", "solo")
        ]
        streams = [iter(call) for call in calls]
        tokens = [list(next(stream).token_ids) for stream in streams]  # both decoding
        draining.proc.send_signal(15)
        for got, stream in zip(tokens, streams, strict=True):
            got += [t for r in stream for t in r.token_ids]
        for got, adapter in zip(tokens, ("alpha", "gamma"), strict=True):  # (solo: gamma's weights)
            assert got == colocated_lora(TEXTS[0], lora_adapter=adapter, **kw), adapter
        assert draining.terminate() == 0
        assert "moved 1 sequences to peers, 1 stay here" in draining.log_path.read_text()
    finally:
        draining.terminate()
