"""Wire codec: frames, (de)serializers, and the assembler's verification of damaged streams."""

import functools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvtransfer_testlib import (
    SENTINEL,
    check_transferred,
    dst_cache,
    make_layout,
    mesh,
    sentinel,
    src_cache,
    to_host,
)

from pdserve.kvtransfer import (
    MAX_FRAME_BYTES,
    SCALE_DTYPE,
    Frame,
    FrameAssembler,
    FrameEncoder,
    FrameError,
    LayoutMismatchError,
    chunk_sharding,
    deserialize_frame,
    gather,
    gather_request,
    insert,
    serialize_frame,
)
from pdserve.kvtransfer.codec import crc32c
from pdserve.kvtransfer.plan import HEADER_RESERVE_BYTES

pytestmark = pytest.mark.fast

SRC, DST = make_layout(dtype="bfloat16", tp=2), make_layout(dtype="bfloat16", tp=4)
SMALL_FRAMES = HEADER_RESERVE_BYTES + 2 * SRC.block_bytes  # two layers of one block per frame
SRC_BLOCKS, DST_BLOCKS, NUM_TOKENS = [3, 4, 5, 9, 1, 20, 21], [7, 2, 3, 4, 30, 11, 12], 26


def wire_frames(max_frame_bytes=SMALL_FRAMES) -> list[bytes]:
    return list(_wire_frames(max_frame_bytes))


@functools.cache
def _wire_frames(max_frame_bytes: int) -> tuple[bytes, ...]:
    src = src_cache(SRC, mesh(0, 2))
    encoder = FrameEncoder("req", SRC, NUM_TOKENS, max_frame_bytes)
    return tuple(
        serialize_frame(f) for f in encoder.frames([gather(src, SRC_BLOCKS, NUM_TOKENS)], SRC_BLOCKS)
    )


def receive(messages, num_tokens=NUM_TOKENS):
    """Inserts a stream of wire frames into a fresh decode cache; returns (cache, FrameError or None)."""
    m = mesh(4, 4)
    assembler = FrameAssembler("req", num_tokens, SRC, DST, chunk_sharding(m, DST))
    cache = dst_cache(DST, m)
    try:
        for message in messages:
            cache = insert(cache, assembler.add(deserialize_frame(message)), DST_BLOCKS)
        assembler.finish()
    except FrameError as e:
        return cache, e
    return cache, None


def test_round_trip_bfloat16_with_heads_padded_from_tp2_to_tp4():
    messages = wire_frames()
    assert len(messages) == 2 * 7  # 2 groups of 2 layers x 7 blocks
    cache, error = receive(messages)
    assert error is None
    check_transferred(cache, SRC, DST, SRC_BLOCKS, DST_BLOCKS, NUM_TOKENS)


def _quantized_frames(src, blocks, num_tokens) -> list[bytes]:
    encoder = FrameEncoder("req", src, num_tokens, SMALL_FRAMES)
    cache = src_cache(src, mesh(0, src.tp_size))
    return [serialize_frame(f) for f in encoder.frames([gather(cache, blocks, num_tokens)], blocks)]


def _receive_into(src, dst, messages, num_tokens, dst_blocks):
    m = mesh(4, dst.tp_size)
    assembler = FrameAssembler("req", num_tokens, src, dst, chunk_sharding(m, dst))
    cache = dst_cache(dst, m)
    for message in messages:
        cache = insert(cache, assembler.add(deserialize_frame(message)), dst_blocks)
    assembler.finish()
    return cache


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float8_e5m2", "int8"])
def test_a_quantized_cache_goes_as_stored_and_a_mismatched_one_is_refused(dtype):
    """A quantized cache's frames carry its bytes (fp8: a quarter of float32's; int8: the same plus each
    head row's bfloat16 scale), inserted exactly, values and scales, from TP 2 to TP 4; a receiver of
    another cache dtype refuses the stream instead of converting it."""
    src, dst = make_layout(dtype=dtype, tp=2), make_layout(dtype=dtype, tp=4)
    scale_bytes = 2 if dtype == "int8" else 0
    assert (src.scale_bytes, src.scale_scheme) == (scale_bytes, "token_head" if scale_bytes else "none")
    head_dim, quarter = src.head_dim, make_layout(dtype="float32", tp=2).block_bytes // 4
    assert src.block_bytes == quarter * (head_dim + scale_bytes) // head_dim
    blocks = [3, 4, 5]
    messages = _quantized_frames(src, blocks, 10)
    assert sum(deserialize_frame(m).header.payload_bytes for m in messages) == 10 * 4 * src.block_bytes // 4
    cache = _receive_into(src, dst, messages, 10, [7, 2, 30])
    check_transferred(cache, src, dst, blocks, [7, 2, 30], 10)
    others = [make_layout(dtype=d, tp=4) for d in ("float32", "int8" if dtype != "int8" else "float8_e4m3fn")]
    for other in others:
        with pytest.raises(LayoutMismatchError, match="dtype: '") as refused:
            FrameAssembler("req", 10, src, other, chunk_sharding(mesh(4, 4), other))
        assert ("scale_scheme" in str(refused.value)) == (src.scale_scheme != other.scale_scheme)


def test_int8_frames_with_damaged_scales_are_refused_and_never_inserted():
    """A scale byte flipped in transit fails the frame's crc32c; a peer that sends NaN, infinite or negative
    scales under a valid crc32c is refused too (they would turn the request's attention into NaNs). Either
    way the frame's blocks are never written."""
    src = dst = make_layout(dtype="int8", tp=2)
    blocks, dst_blocks, num_tokens = [3, 4, 5], [7, 2, 30], 10
    messages = _quantized_frames(src, blocks, num_tokens)
    frame = deserialize_frame(messages[1])
    row = src.padded_head_dim  # bytes of one head row; its last two are the scale
    scale_at = len(messages[1]) - frame.header.payload_bytes + 3 * row - 1  # the 3rd row's scale, high byte
    damaged = _flip(messages[1], scale_at)
    hostile = []
    for bad_scale in (np.nan, np.inf, -1.0):
        payload = np.frombuffer(frame.payload[0], np.int8).reshape(tuple(frame.header.shape)).copy()
        payload[0, 0, 1, -2:] = np.asarray([bad_scale], SCALE_DTYPE).view(np.int8)
        header = type(frame.header)()
        header.CopyFrom(frame.header)
        header.payload_crc32c = crc32c([payload])
        hostile.append(serialize_frame(Frame(header, (payload,))))
    m = mesh(4, 2)
    for bad, why in [(damaged, "payload crc32c"), *((h, "scales") for h in hostile)]:
        assembler = FrameAssembler("req", num_tokens, src, dst, chunk_sharding(m, dst))
        cache = insert(dst_cache(dst, m), assembler.add(deserialize_frame(messages[0])), dst_blocks)
        with pytest.raises(FrameError, match=why) as refused:
            assembler.add(deserialize_frame(bad))
        assert refused.value.kind == "corrupt"
        h = frame.header
        written = dst_blocks[h.token_start // 4 : -(-h.token_end // 4)]
        assert (to_host(cache)[h.layer_start : h.layer_end, written] == sentinel(dst)).all()


def test_header_records_ranges_blocks_shape_dtype_and_crc():
    frame = deserialize_frame(wire_frames()[6])  # token-major: 2 layer groups a block, 4th block's first
    h = frame.header
    assert (h.seq, h.num_frames, h.layer_start, h.layer_end, h.token_start, h.token_end) == (
        6,
        14,
        0,
        2,
        12,
        16,
    )
    assert list(h.block_ids) == [9] and list(h.shape) == [2, 4, 8, 8] and h.payload_bytes == 2 * 4 * 8 * 8 * 2
    assert h.bucket_blocks == 1
    assert h.dtype == 2  # KV_DTYPE_BFLOAT16
    assert isinstance(frame.payload[0], memoryview) and frame.payload[0].nbytes == h.payload_bytes


def test_deserializer_gives_zero_copy_views():
    message = wire_frames()[0]
    payload = deserialize_frame(message).payload[0]
    assert payload.obj is message  # a view of the received bytes, not a copy


def test_frames_respect_the_4_mib_default_with_headers():
    layout = make_layout(
        dtype="float32", head_dim_multiple=128
    )  # 6 slots x 128 x 4 B x 4 tokens = 12 KiB/block
    src = src_cache(layout, mesh(0, 1), num_blocks=1024)
    blocks = list(range(0, 1024, 2))  # 512 scattered blocks = 6 MiB per layer
    chunks = gather_request(src, layout, blocks, 512 * 4)
    sizes = [len(serialize_frame(f)) for f in FrameEncoder("r", layout, 512 * 4).frames(chunks, blocks)]
    assert max(sizes) <= MAX_FRAME_BYTES and max(sizes) > MAX_FRAME_BYTES // 2
    assert sum(sizes) >= 4 * 512 * layout.block_bytes


def _flip(message: bytes, offset: int) -> bytes:
    damaged = bytearray(message)
    damaged[offset] ^= 0x40
    return bytes(damaged)


def _assert_rejected(messages, kind, bad_index):
    """The stream fails with `kind`, and the bad frame's blocks were never inserted."""
    cache, error = receive(messages)
    assert error is not None and error.kind == kind, error
    bad = deserialize_frame(wire_frames()[bad_index]).header
    blocks = DST_BLOCKS[bad.token_start // 4 : -(-bad.token_end // 4)]
    assert (to_host(cache)[bad.layer_start : bad.layer_end, blocks] == SENTINEL).all()


def test_corrupted_payload_is_detected_and_never_inserted():
    messages = wire_frames()
    messages[5] = _flip(messages[5], len(messages[5]) - 7)
    _assert_rejected(messages, "corrupt", 5)


def test_corrupted_header_is_detected():
    messages = wire_frames()
    with pytest.raises(FrameError, match="corrupt: header crc32c"):
        deserialize_frame(_flip(messages[2], 12))


def test_truncated_frame_is_detected_and_never_inserted():
    messages = wire_frames()
    messages[6] = messages[6][:-10]
    _assert_rejected(messages, "truncated", 6)
    with pytest.raises(FrameError, match="truncated"):
        deserialize_frame(messages[6][:6])


@settings(max_examples=60, deadline=None)
@given(
    index=st.integers(0, 13),
    offset=st.integers(0, 1 << 20),
    xor=st.integers(1, 255),
    cut=st.sampled_from([0, 0, 1, 7, 100]),
)
def test_fuzzed_frames_are_detected_and_never_inserted(index, offset, xor, cut):
    """Any byte of any frame damaged (and the frame possibly cut short): the stream fails, and the damaged
    frame's blocks were never written."""
    messages = wire_frames()
    damaged = bytearray(messages[index])
    damaged[offset % len(damaged)] ^= xor
    messages[index] = bytes(damaged[: max(1, len(damaged) - cut)])
    cache, error = receive(messages)
    assert error is not None
    bad = deserialize_frame(wire_frames()[index]).header
    blocks = DST_BLOCKS[bad.token_start // 4 : -(-bad.token_end // 4)]
    assert (to_host(cache)[bad.layer_start : bad.layer_end, blocks] == SENTINEL).all()


def test_truncated_stream_is_detected_at_the_end():
    messages = wire_frames()
    cache, error = receive(messages[:-1])
    assert error is not None and error.kind == "truncated" and "13 of 14 frames" in str(error)
    cache, error = receive([])
    assert error is not None and error.kind == "truncated"


def test_reordered_frames_are_detected_and_never_inserted():
    messages = wire_frames()
    messages[4], messages[5] = messages[5], messages[4]
    _assert_rejected(messages, "reordered", 5)


def test_duplicated_frame_is_detected():
    messages = wire_frames()
    _, error = receive(messages[:8] + [messages[7]] + messages[8:])
    assert error is not None and error.kind == "duplicate"


def test_frames_of_another_request_or_layout_are_refused():
    messages = wire_frames()
    _, error = receive(messages, num_tokens=NUM_TOKENS - 1)
    assert error is not None and error.kind == "invalid"
    assembler = FrameAssembler("other", NUM_TOKENS, SRC, DST)
    with pytest.raises(FrameError, match="frame of request 'req'"):
        assembler.add(deserialize_frame(messages[0]))
    with pytest.raises(FrameError, match="already failed"):
        assembler.add(deserialize_frame(messages[0]))


def test_host_assembly_without_a_mesh_pads_tokens_to_a_bucket():
    assembler = FrameAssembler("req", NUM_TOKENS, SRC, DST)
    chunks = [assembler.add(deserialize_frame(m)) for m in wire_frames()[:13]]
    chunk = chunks[12]  # tokens 24..25 of layers 0-1: one partly filled block (token-major order)
    assert isinstance(chunk.data, np.ndarray) and chunk.data.shape == (2, 4, 8, 8) and chunk.num_tokens == 2
    assert (chunk.data[:, 2:] == 0).all() and (chunk.data[:, :2, 6:] == 0).all()  # padding, dummy head
