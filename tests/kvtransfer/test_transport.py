"""Transports: gRPC (in-process server and a real second process), local, errors, and the Pathways seam."""

import json
import subprocess
import sys
import types
from pathlib import Path

import jax
import numpy as np
import pytest
from kvtransfer_testlib import NUM_BLOCKS, check_transferred, dst_cache, make_layout, mesh, src_cache

from kvtransfer import (
    GrpcTransport,
    KVTransport,
    LayoutMismatchError,
    LocalTransport,
    TransportError,
    insert_stream,
    reshard,
)
from kvtransfer.plan import HEADER_RESERVE_BYTES

pytestmark = pytest.mark.fast

SRC, DST = (
    make_layout("sliding", "bfloat16", tp=2),
    make_layout("sliding", "bfloat16", tp=4, strategy="replicate"),
)
SRC_BLOCKS, DST_BLOCKS, NUM_TOKENS = [8, 9, 10, 2, 30, 31], [0, 5, 6, 7, 20, 1], 23
ROOT = Path(__file__).resolve().parents[2]


def test_grpc_transport_in_process():
    frame = HEADER_RESERVE_BYTES + 2 * SRC.block_bytes
    with GrpcTransport(SRC, listen="127.0.0.1:0", max_frame_bytes=frame) as prefill:
        prefill.send("a", src_cache(SRC, mesh(0, 2)), SRC_BLOCKS, NUM_TOKENS)
        with GrpcTransport(DST, mesh=mesh(4, 4), peer=f"127.0.0.1:{prefill.port}") as decode:
            assert isinstance(decode, KVTransport)
            cache = insert_stream(dst_cache(DST, mesh(4, 4)), decode.receive("a", NUM_TOKENS), DST_BLOCKS)
            check_transferred(cache, SRC, DST, SRC_BLOCKS, DST_BLOCKS, NUM_TOKENS)
            with pytest.raises(TransportError, match="NOT_FOUND"):
                list(decode.receive("a", NUM_TOKENS))  # each request is received once


def test_grpc_transport_from_a_second_process():
    requests = [{"id": "p", "blocks": SRC_BLOCKS, "tokens": NUM_TOKENS}]
    cmd = [
        sys.executable,
        "-m",
        "kvtransfer.synthetic",
        "serve",
        SRC.to_json(),
        str(NUM_BLOCKS),
        json.dumps(requests),
        "2",
    ]
    env = {
        "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": str(ROOT),
    }
    peer = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(peer.stdout.readline())
        with GrpcTransport(DST, mesh=mesh(4, 4), peer=f"127.0.0.1:{port}") as decode:
            assert decode.peer_layout() == SRC
            cache = insert_stream(dst_cache(DST, mesh(4, 4)), decode.receive("p", NUM_TOKENS), DST_BLOCKS)
        check_transferred(cache, SRC, DST, SRC_BLOCKS, DST_BLOCKS, NUM_TOKENS)
    finally:
        peer.stdin.close()
        assert peer.wait(timeout=30) == 0


def test_grpc_layouts_are_compared_before_any_transfer():
    with GrpcTransport(SRC, listen="127.0.0.1:0") as prefill:
        prefill.send("a", src_cache(SRC, mesh(0, 2)), SRC_BLOCKS, NUM_TOKENS)
        other = make_layout("sliding", "float32", tp=4)
        decode = GrpcTransport(other, mesh=mesh(4, 4), peer=f"127.0.0.1:{prefill.port}")
        with decode, pytest.raises(LayoutMismatchError, match="dtype: 'bfloat16' != 'float32'"):
            next(decode.receive("a", NUM_TOKENS))
        assert prefill.discard("a")  # nothing was pulled: the request is still there to free


def test_grpc_peer_unreachable_is_a_transport_error():
    decode = GrpcTransport(DST, mesh=mesh(4, 4), peer="127.0.0.1:1")
    with decode, pytest.raises(TransportError, match="GetLayout failed"):
        next(decode.receive("x", 4, timeout=2))


def test_local_transport_moves_device_arrays_between_meshes():
    transport = LocalTransport(SRC, DST, mesh(4, 4))
    transport.send("a", src_cache(SRC, mesh(0, 2)), SRC_BLOCKS, NUM_TOKENS)
    chunks = list(transport.receive("a", NUM_TOKENS))
    assert all(isinstance(c.data, jax.Array) and c.data.sharding.mesh == mesh(4, 4) for c in chunks)
    cache = insert_stream(dst_cache(DST, mesh(4, 4)), chunks, DST_BLOCKS)
    check_transferred(cache, SRC, DST, SRC_BLOCKS, DST_BLOCKS, NUM_TOKENS)
    with pytest.raises(TransportError, match="no KV sent"):
        next(transport.receive("a", NUM_TOKENS))
    with pytest.raises(LayoutMismatchError):
        LocalTransport(SRC, make_layout("full", "bfloat16"), mesh(4, 4))


def test_send_survives_the_engine_donating_its_cache():
    """send() dispatches its gathers at once, so the prefill engine may donate the cache right after."""
    src = src_cache(SRC, mesh(0, 2))
    transport = LocalTransport(SRC, DST, mesh(4, 4))
    transport.send("a", src, SRC_BLOCKS, NUM_TOKENS)
    jax.jit(lambda c: c * 0, donate_argnums=0)(src)  # the engine's next step
    assert src.is_deleted()
    cache = insert_stream(dst_cache(DST, mesh(4, 4)), transport.receive("a", NUM_TOKENS), DST_BLOCKS)
    check_transferred(cache, SRC, DST, SRC_BLOCKS, DST_BLOCKS, NUM_TOKENS)


def test_reshard_uses_pathways_only_under_proxy(monkeypatch):
    calls = []
    fake = types.ModuleType("pathwaysutils.experimental.reshard")
    fake.reshard = lambda tree, shardings, donate: calls.append((tree, shardings, donate)) or tree
    monkeypatch.setitem(sys.modules, "pathwaysutils", types.ModuleType("pathwaysutils"))
    monkeypatch.setitem(
        sys.modules, "pathwaysutils.experimental", types.ModuleType("pathwaysutils.experimental")
    )
    monkeypatch.setitem(sys.modules, "pathwaysutils.experimental.reshard", fake)
    sys.modules["pathwaysutils.experimental"].reshard = fake
    sharding = jax.sharding.NamedSharding(mesh(0, 2), jax.sharding.PartitionSpec())
    x = [np.zeros(2), np.ones(2)]

    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    moved = reshard(x, sharding)
    assert calls == [] and all(a.sharding == sharding for a in moved)

    monkeypatch.setenv("JAX_PLATFORMS", "proxy")
    assert reshard(x, sharding) is x
    assert calls == [(x, [sharding, sharding], False)]


def test_importing_kvtransfer_does_not_import_pathwaysutils():
    code = "import kvtransfer, sys; assert 'pathwaysutils' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, env={"JAX_PLATFORMS": "cpu"})


@pytest.mark.parametrize("depth", [1, 3])
def test_grpc_receive_pipeline_any_depth_and_early_close(depth):
    frame = HEADER_RESERVE_BYTES + 2 * SRC.block_bytes  # 14 frames: the receive thread runs ahead
    with GrpcTransport(SRC, listen="127.0.0.1:0", max_frame_bytes=frame, prefetch_depth=depth) as prefill:
        src = src_cache(SRC, mesh(0, 2))
        prefill.send("a", src, SRC_BLOCKS, NUM_TOKENS)
        prefill.send("b", src, SRC_BLOCKS, NUM_TOKENS)
        peer = f"127.0.0.1:{prefill.port}"
        with GrpcTransport(DST, mesh=mesh(4, 4), peer=peer, prefetch_depth=depth) as decode:
            cache = insert_stream(dst_cache(DST, mesh(4, 4)), decode.receive("a", NUM_TOKENS), DST_BLOCKS)
            check_transferred(cache, SRC, DST, SRC_BLOCKS, DST_BLOCKS, NUM_TOKENS)
            chunks = decode.receive("b", NUM_TOKENS)
            next(chunks)
            chunks.close()  # a cancelled request: the receive thread stops, the call is cancelled
