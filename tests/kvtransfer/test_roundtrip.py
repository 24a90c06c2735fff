"""Property tests of the daemons' two transfer paths, gather -> encode -> decode -> reshard -> insert
(gRPC) and gather with head conversion -> move -> insert (device to device): they round trip exactly over
random block sets (contiguous, scattered, mixed), dtypes, spec kinds, head layouts and mesh pairs on 8
CPU devices."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvtransfer_testlib import NUM_BLOCKS, check_transferred, dst_cache, make_layout, mesh, src_cache

from pdserve.kvtransfer import (
    LOCAL_CHUNK_BYTES,
    FrameAssembler,
    chunk_sharding,
    deserialize_frame,
    encode_request,
    gather_request,
    head_map,
    insert,
    insert_stream,
    move_chunk,
)
from pdserve.kvtransfer.plan import HEADER_RESERVE_BYTES

pytestmark = pytest.mark.fast

MESH_PAIRS = [(1, 4), (2, 1), (2, 4), (1, 2), (1, 1), (2, 2)]  # (source TP, destination TP)


@st.composite
def block_sets(draw):
    """(source blocks, destination blocks, num_tokens) for a request of 0..12 blocks of 4 tokens."""
    n = draw(st.integers(0, 12))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))

    def pick(pattern):
        if pattern == "contiguous":
            start = int(rng.integers(0, NUM_BLOCKS - n + 1))
            return list(range(start, start + n))
        if pattern == "scattered":
            return rng.permutation(NUM_BLOCKS)[:n].tolist()
        run = int(rng.integers(0, n + 1))  # mixed: a run, then scattered blocks outside it
        start = int(rng.integers(0, NUM_BLOCKS - run + 1))
        rest = np.setdiff1d(np.arange(NUM_BLOCKS), np.arange(start, start + run))
        return list(range(start, start + run)) + rng.permutation(rest)[: n - run].tolist()

    patterns = st.sampled_from(["contiguous", "scattered", "mixed"])
    src, dst = pick(draw(patterns)), pick(draw(patterns))
    num_tokens = 0 if n == 0 else draw(st.integers(4 * n - 3, 4 * n))
    return src, dst, num_tokens


layouts = st.tuples(
    st.sampled_from(["full", "sliding", "mla"]),
    st.sampled_from(["float32", "bfloat16", "int8"]),  # int8: values and their scales
    st.sampled_from(MESH_PAIRS),
    st.sampled_from(["pad", "replicate"]),
    st.sampled_from([1, 16]),  # destination head_dim padding
)


def _layouts(kind, dtype, tps, strategy, head_dim_multiple):
    src = make_layout(kind, dtype, tp=tps[0])
    dst = make_layout(kind, dtype, tp=tps[1], strategy=strategy, head_dim_multiple=head_dim_multiple)
    return src, dst, mesh(0, tps[0]), mesh(4, tps[1])


@settings(max_examples=50, deadline=None)
@given(layouts=layouts, blocks=block_sets(), small_frames=st.booleans(), stacked=st.booleans())
def test_wire_round_trip(layouts, blocks, small_frames, stacked):
    src, dst, src_mesh, dst_mesh = _layouts(*layouts)
    src_blocks, dst_blocks, num_tokens = blocks
    max_frame = HEADER_RESERVE_BYTES + 2 * src.block_bytes if small_frames else 4 << 20
    chunks = gather_request(
        src_cache(src, src_mesh, stacked), src, src_blocks, num_tokens, max_frame_bytes=max_frame
    )
    messages = encode_request("r", src, num_tokens, chunks, max_frame)  # the prefill server's sender
    assembler = FrameAssembler("r", num_tokens, src, dst, chunk_sharding(dst_mesh, dst))
    cache = dst_cache(dst, dst_mesh, not stacked)
    for message in messages:
        chunk = assembler.add(deserialize_frame(message))
        assert chunk.data.sharding == chunk_sharding(dst_mesh, dst)
        cache = insert(cache, chunk, dst_blocks)
    assembler.finish()
    check_transferred(cache, src, dst, src_blocks, dst_blocks, num_tokens)


@settings(max_examples=40, deadline=None)
@given(layouts=layouts, blocks=block_sets(), small_frames=st.booleans())
def test_local_round_trip(layouts, blocks, small_frames):
    src, dst, src_mesh, dst_mesh = _layouts(*layouts)
    src_blocks, dst_blocks, num_tokens = blocks
    max_frame = HEADER_RESERVE_BYTES + 2 * src.block_bytes if small_frames else LOCAL_CHUNK_BYTES
    gathered = gather_request(  # `pdserve serve`'s path: heads converted in the gather, then moved
        src_cache(src, src_mesh),
        src,
        src_blocks,
        num_tokens,
        max_frame_bytes=max_frame,
        head_map=head_map(src, dst),
    )
    chunks = [move_chunk(c, chunk_sharding(dst_mesh, dst)) for c in gathered]
    assert all(c.data.sharding == chunk_sharding(dst_mesh, dst) for c in chunks)
    cache = insert_stream(dst_cache(dst, dst_mesh), chunks, dst_blocks)
    check_transferred(cache, src, dst, src_blocks, dst_blocks, num_tokens)
