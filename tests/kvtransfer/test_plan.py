"""Frame plan, block runs, buckets and cache-tree spans: pure host logic."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvtransfer_testlib import make_layout

from kvtransfer.plan import (
    HEADER_RESERVE_BYTES,
    MAX_FRAME_BYTES,
    Run,
    block_runs,
    bucket_blocks,
    cdiv,
    chunk_shapes,
    frame_payload_bytes,
    layer_spans,
    plan_frames,
)


def test_buckets_are_powers_of_two_and_ten_cover_1_to_512():
    assert [bucket_blocks(n) for n in (0, 1, 2, 3, 5, 8, 9, 512)] == [0, 1, 2, 4, 8, 8, 16, 512]
    assert len({bucket_blocks(n) for n in range(1, 513)}) == 10


def test_block_runs_split_mixed_lists():
    assert block_runs([3, 4, 5, 9, 2]) == [Run(0, 3, 3), Run(3, 9, 1), Run(4, 2, 1)]
    assert block_runs([]) == [] and block_runs([7]) == [Run(0, 7, 1)]
    assert block_runs([1, 2, 4, 5]) == [Run(0, 1, 2), Run(2, 4, 2)]


@settings(max_examples=200, deadline=None)
@given(
    kind=st.sampled_from(["full", "sliding", "mla"]),
    dtype=st.sampled_from(["float32", "bfloat16"]),
    num_tokens=st.integers(0, 200),
    max_frame_bytes=st.sampled_from(
        [HEADER_RESERVE_BYTES + 512, HEADER_RESERVE_BYTES + 3000, MAX_FRAME_BYTES]
    ),
)
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
        assert p.bucket == bucket_blocks(p.num_blocks)
        assert p.num_layers * p.bucket * layout.block_bytes <= max_frame_bytes - HEADER_RESERVE_BYTES
        assert frame_payload_bytes(layout, p) <= max_frame_bytes - HEADER_RESERVE_BYTES
        covered[p.layer_start : p.layer_end, p.block_start : p.block_start + p.num_blocks] += 1
    needed = np.zeros_like(covered)
    for layer in range(layout.num_cache_layers):
        needed[layer, layout.first_needed_block(layer, num_tokens) :] = 1
    np.testing.assert_array_equal(covered, needed)
    order = [(p.layer_start, p.token_start) for p in plan]
    assert order == sorted(order)


def test_big_layers_split_into_power_of_two_token_runs():
    layout = make_layout()  # 768 B per block and layer
    plan = plan_frames(layout, 4 * 100, HEADER_RESERVE_BYTES + 768 * 40)  # 100 blocks, 32 per frame max
    assert [(p.layer_start, p.num_blocks, p.bucket) for p in plan[:4]] == [
        (0, 32, 32),
        (0, 32, 32),
        (0, 32, 32),
        (0, 4, 4),
    ]
    assert len(plan) == 16


def test_chunk_shapes_stay_few_for_1_to_512_blocks():
    # A 30-layer model like the default one: every request length maps to a handful of chunk shapes.
    from kvtransfer import KVLayout, LayerSpec

    layout = KVLayout("smollm2", (LayerSpec(),) * 30, 3, 64, "bfloat16", 16, tp_size=1)
    shapes = chunk_shapes(layout, 512)
    assert len(shapes) <= 3 * 10, shapes
    assert {bucket for _, bucket in shapes} <= {1 << i for i in range(10)}


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
