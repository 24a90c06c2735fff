"""The daemons' transfer paths at the kvtransfer level: the sender's frames, gathered chunks that outlive
a donated cache, device-to-device moves, and the Pathways seam. (The same code over real gRPC between
real processes: tests/services.)"""

import subprocess
import sys
import types
from pathlib import Path

import jax
import numpy as np
import pytest
from kvtransfer_testlib import check_transferred, dst_cache, make_layout, mesh, src_cache

from pdserve.kvtransfer import (
    LOCAL_CHUNK_BYTES,
    FrameAssembler,
    LayoutMismatchError,
    chunk_sharding,
    deserialize_frame,
    encode_request,
    gather_request,
    head_map,
    insert_stream,
    move_chunk,
    reshard,
)
from pdserve.kvtransfer.plan import HEADER_RESERVE_BYTES

pytestmark = pytest.mark.fast

SRC, DST = (
    make_layout("sliding", "bfloat16", tp=2),
    make_layout("sliding", "bfloat16", tp=4, strategy="replicate"),
)
SRC_BLOCKS, DST_BLOCKS, NUM_TOKENS = [8, 9, 10, 2, 30, 31], [0, 5, 6, 7, 20, 1], 23
ROOT = Path(__file__).resolve().parents[2]


def test_sender_frames_drain_the_chunks_and_carry_the_callers_prefix():
    frame = HEADER_RESERVE_BYTES + 2 * SRC.block_bytes  # many frames
    chunks = gather_request(src_cache(SRC, mesh(0, 2)), SRC, SRC_BLOCKS, NUM_TOKENS, max_frame_bytes=frame)
    num_chunks = len(chunks)
    messages = encode_request("a", SRC, NUM_TOKENS, chunks, frame, lead=lambda size: b"<%d>" % size)
    first = next(messages)
    lead, frame_bytes = first.split(b">", 1)
    assert lead == b"<%d" % len(frame_bytes)  # the caller's prefix, sized for the frame after it
    assert len(chunks) == num_chunks - 1  # each chunk leaves the list once framed
    rest = list(messages)
    assert not chunks and len(rest) == num_chunks - 1
    assembler = FrameAssembler("a", NUM_TOKENS, SRC, DST, chunk_sharding(mesh(4, 4), DST))
    received = [assembler.add(deserialize_frame(m[m.index(b">") + 1 :])) for m in [first, *rest]]
    assembler.finish()
    cache = insert_stream(dst_cache(DST, mesh(4, 4)), received, DST_BLOCKS)
    check_transferred(cache, SRC, DST, SRC_BLOCKS, DST_BLOCKS, NUM_TOKENS)


def test_device_to_device_moves_and_survives_the_engine_donating_its_cache():
    """The gather dispatches copies, so the prefill engine may donate its cache right after."""
    src = src_cache(SRC, mesh(0, 2))
    gathered = gather_request(
        src, SRC, SRC_BLOCKS, NUM_TOKENS, max_frame_bytes=LOCAL_CHUNK_BYTES, head_map=head_map(SRC, DST)
    )
    jax.jit(lambda c: c * 0, donate_argnums=0)(src)  # the engine's next step
    assert src.is_deleted()
    chunks = [move_chunk(c, chunk_sharding(mesh(4, 4), DST)) for c in gathered]
    assert all(c.data.sharding.mesh == mesh(4, 4) for c in chunks)
    cache = insert_stream(dst_cache(DST, mesh(4, 4)), chunks, DST_BLOCKS)
    check_transferred(cache, SRC, DST, SRC_BLOCKS, DST_BLOCKS, NUM_TOKENS)
    with pytest.raises(LayoutMismatchError):
        head_map(SRC, make_layout("full", "bfloat16"))


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
