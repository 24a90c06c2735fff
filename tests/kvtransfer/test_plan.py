"""Frame plan, block runs, buckets and cache-tree spans: pure host logic."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvtransfer_testlib import make_layout

from pdserve.kvtransfer.plan import (
    HEADER_RESERVE_BYTES,
    MAX_FRAME_BYTES,
    Run,
    block_runs,
    bucket_blocks,
    cdiv,
    chunk_shapes,
    distinct_frames,
    frame_payload_bytes,
    layer_spans,
    plan_frames,
)

pytestmark = pytest.mark.fast


def test_buckets_are_powers_of_two_and_ten_cover_1_to_512():
    assert [bucket_blocks(n) for n in (0, 1, 2, 3, 5, 8, 9, 512)] == [0, 1, 2, 4, 8, 8, 16, 512]
    assert len({bucket_blocks(n) for n in range(1, 513)}) == 10
    assert [bucket_blocks(n, 5) for n in (1, 2, 3, 4, 5)] == [1, 2, 4, 4, 5]  # capped at a full chunk


def test_block_runs_split_mixed_lists():
    assert block_runs([3, 4, 5, 9, 2]) == [Run(0, 3, 3), Run(3, 9, 1), Run(4, 2, 1)]
    assert block_runs([]) == [] and block_runs([7]) == [Run(0, 7, 1)]
    assert block_runs([1, 2, 4, 5]) == [Run(0, 1, 2), Run(2, 4, 2)]


# the layouts and frame budgets the plans are checked over (the smallest fits less than a block of all layers)
LAYOUT_KINDS = st.sampled_from(["full", "sliding", "mla"])
DTYPES = st.sampled_from(["float32", "bfloat16"])
FRAME_BYTES = st.sampled_from([HEADER_RESERVE_BYTES + 512, HEADER_RESERVE_BYTES + 3000, MAX_FRAME_BYTES])


@settings(max_examples=200, deadline=None)
@given(kind=LAYOUT_KINDS, dtype=DTYPES, num_tokens=st.integers(0, 200), max_frame_bytes=FRAME_BYTES)
def test_plan_tiles_exactly_the_needed_blocks_in_order_within_the_budget(
    kind, dtype, num_tokens, max_frame_bytes
):
    layout = make_layout(kind, dtype)
    if layout.block_bytes > max_frame_bytes - HEADER_RESERVE_BYTES:
        with pytest.raises(ValueError, match="exceeds the frame budget"):
            plan_frames(layout, num_tokens, max_frame_bytes)
        return
    plan = plan_frames(layout, num_tokens, max_frame_bytes)
    bs, nblocks = layout.block_size, cdiv(num_tokens, layout.block_size)
    covered = np.zeros((layout.num_cache_layers, nblocks), int)
    for seq, p in enumerate(plan):
        assert p.seq == seq and p.token_start == p.block_start * bs
        assert p.num_tokens == min(p.num_blocks * bs, num_tokens - p.token_start) > 0
        assert p.num_blocks <= p.bucket <= bucket_blocks(p.num_blocks)
        last_of_its_layers = p.block_start + p.num_blocks == nblocks
        assert last_of_its_layers or p.num_blocks == p.bucket  # only the last chunk of its layers is padded
        assert p.num_layers * p.bucket * layout.block_bytes <= max_frame_bytes - HEADER_RESERVE_BYTES
        assert frame_payload_bytes(layout, p) <= max_frame_bytes - HEADER_RESERVE_BYTES
        covered[p.layer_start : p.layer_end, p.block_start : p.block_start + p.num_blocks] += 1
    needed = np.zeros_like(covered)
    for layer in range(layout.num_cache_layers):
        needed[layer, layout.first_needed_block(layer, num_tokens) :] = 1
    np.testing.assert_array_equal(covered, needed)
    order = [(p.token_end, p.layer_start) for p in plan]
    assert order == sorted(order)  # token-major: a prefix of the plan is the KV of a prefix of the tokens


def test_full_chunks_of_all_layers_and_one_padded_last_chunk():
    layout = make_layout()  # 4 layers, 768 B per block and layer
    plan = plan_frames(layout, 4 * 103, HEADER_RESERVE_BYTES + 768 * 40)  # 103 blocks, 10 per frame
    assert [(p.layer_start, p.num_layers, p.num_blocks, p.bucket) for p in plan] == [(0, 4, 10, 10)] * 10 + [
        (0, 4, 3, 4)
    ]
    plan = plan_frames(layout, 4 * 9, HEADER_RESERVE_BYTES + 768 * 40)
    assert [(p.num_blocks, p.bucket) for p in plan] == [(9, 10)]  # capped at the full size, not 16


def test_layers_too_big_for_one_block_per_frame_go_in_groups_of_one_block():
    layout = make_layout()  # 4 layers, 768 B per block and layer: 3 layers of a block fit
    plan = plan_frames(layout, 4 * 5, HEADER_RESERVE_BYTES + 768 * 3)
    assert [(p.layer_start, p.num_layers, p.block_start, p.bucket) for p in plan] == [
        (layer, n, b, 1) for b in range(5) for layer, n in ((0, 3), (3, 1))
    ]


@settings(max_examples=60, deadline=None)
@given(kind=LAYOUT_KINDS, dtype=DTYPES, max_blocks=st.integers(1, 40), max_frame_bytes=FRAME_BYTES)
def test_distinct_frames_are_the_kernel_shapes_of_every_plan(kind, dtype, max_blocks, max_frame_bytes):
    """What a warmup transfers (one frame per compiled gather/insert shape) is exactly the shapes the plans
    of requests of 1..max_blocks blocks hold, each moved to the request's first block."""
    layout = make_layout(kind, dtype)
    if layout.block_bytes > max_frame_bytes - HEADER_RESERVE_BYTES:
        return
    bs = layout.block_size
    planned = {
        (p.layer_start, p.num_layers, p.bucket)
        for n in range(1, max_blocks + 1)
        for p in plan_frames(layout, n * bs, max_frame_bytes)
    }
    frames = distinct_frames(layout, max_blocks, max_frame_bytes)
    assert {(p.layer_start, p.num_layers, p.bucket) for p in frames} == planned
    assert len(frames) == len(planned)  # one each
    for seq, p in enumerate(frames):
        assert (p.seq, p.block_start, p.token_start, p.num_tokens) == (seq, 0, 0, p.num_blocks * bs)
        assert p.num_blocks <= p.bucket <= bucket_blocks(p.num_blocks)


def test_chunk_shapes_stay_few_for_1_to_512_blocks():
    # A 30-layer model like the default one: every request length maps to a handful of chunk shapes.
    from pdserve.kvtransfer import KVLayout, LayerSpec

    layout = KVLayout("smollm2", (LayerSpec(),) * 30, 3, 64, "bfloat16", 16, tp_size=1)
    assert chunk_shapes(layout, 512) == {(30, 1), (30, 2), (30, 4), (30, 8), (30, 11)}
    assert chunk_shapes(layout.with_physical(), 512) == chunk_shapes(layout, 512)
    f32 = KVLayout("smollm2", (LayerSpec(),) * 30, 3, 64, "float32", 16, tp_size=1)
    assert chunk_shapes(f32, 512) == {(30, 1), (30, 2), (30, 4), (30, 5)}  # 5 blocks: 3.5 MiB


class _Leaf:
    def __init__(self, *shape):
        self.shape, self.ndim = shape, len(shape)


def test_layer_spans_map_layers_onto_leaves():
    leaves = [_Leaf(3, 8, 4, 2, 2), _Leaf(8, 4, 2, 2), _Leaf(2, 8, 4, 2, 2)]  # layers 0-2, 3, 4-5
    spans = layer_spans(leaves, 2, 3)
    assert [(s.leaf, s.local_start, s.count) for s in spans] == [(0, 2, 1), (1, 0, 1), (2, 0, 1)]
    with pytest.raises(ValueError, match="outside a 6-layer cache"):
        layer_spans(leaves, 4, 3)
    with pytest.raises(ValueError, match="cache leaves must be"):
        layer_spans([_Leaf(3, 8, 4, 2, 2), _Leaf(8, 4, 3, 2)], 0, 1)
