"""Gather and insert on one mesh: block lists of every shape, cache pytrees, donation, compile counts."""

import jax
import numpy as np
import pytest
from kvtransfer_testlib import SENTINEL, check_transferred, dst_cache, make_layout, mesh, src_cache, to_host

from pdserve.kvtransfer import gather, insert
from pdserve.kvtransfer.gather import gather_kernel
from pdserve.kvtransfer.insert import insert_kernel, insert_scratch_bytes
from pdserve.testing.kv_cache import make_cache

pytestmark = pytest.mark.fast

LAYOUT = make_layout(tp=2)


def move(src_blocks, dst_blocks, num_tokens, stacked_src=True, stacked_dst=True):
    m = mesh(0, 2)
    src = src_cache(LAYOUT, m, stacked_src)
    chunk = gather(src, src_blocks, num_tokens)
    cache = insert(dst_cache(LAYOUT, m, stacked_dst), chunk, dst_blocks)
    check_transferred(cache, LAYOUT, LAYOUT, src_blocks, dst_blocks, num_tokens)
    return chunk, cache


def test_scattered_insert_writes_every_block():
    """Regression for the seed, whose scattered insert wrote into a discarded copy."""
    _, cache = move([0, 1, 2, 3], [9, 2, 17, 30], 16)
    host = to_host(cache)
    assert not (host[:, [9, 2, 17, 30]] == SENTINEL).any()


@pytest.mark.parametrize(
    ("src_blocks", "dst_blocks", "num_tokens"),
    [
        ([5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22, 23, 24, 25, 26, 27], 32),  # contiguous, exact bucket
        ([5, 6, 7, 8, 9], [3, 4, 5, 6, 7], 18),  # contiguous run shorter than its bucket, partial last block
        ([1, 2, 3, 4, 5, 9, 30], [10, 11, 12, 13, 14, 0, 31], 25),  # mixed: a run and scattered blocks
        ([4], [0], 3),  # one partly filled block
        ([28, 29, 30, 31], [29, 30, 31, 0], 16),  # runs that touch the end of the cache
        ([31, 30, 29], [1, 3, 5], 12),  # descending source ids: gather, not slice
    ],
)
def test_round_trip_on_one_mesh(src_blocks, dst_blocks, num_tokens):
    chunk, _ = move(src_blocks, dst_blocks, num_tokens)
    assert chunk.data.shape[1] == 4 * (1 << (len(src_blocks) - 1).bit_length())  # bucketed tokens


def test_empty_block_list_is_a_no_op():
    m = mesh(0, 2)
    chunk = gather(src_cache(LAYOUT, m), [], 0)
    assert chunk.data.shape == (4, 0, 8, 8) and chunk.num_tokens == 0
    cache = dst_cache(LAYOUT, m)
    assert insert(cache, chunk, []) is cache


def test_per_layer_list_caches_work_like_the_stacked_one():
    move([3, 4, 9], [7, 1, 2], 10, stacked_src=False, stacked_dst=True)
    move([3, 4, 9], [7, 1, 2], 10, stacked_src=True, stacked_dst=False)
    _, cache = move([3, 4, 9], [7, 8, 2], 12, stacked_src=False, stacked_dst=False)
    assert isinstance(cache, list) and len(cache) == 4


def test_gather_selects_layers_and_token_range():
    m = mesh(0, 2)
    chunk = gather(src_cache(LAYOUT, m, stacked=False), [6, 2], 7, layer_start=1, num_layers=2, token_start=8)
    host = make_cache(LAYOUT, 32)
    np.testing.assert_array_equal(np.asarray(chunk.valid()), host[1:3, [6, 2]].reshape(2, 8, 8, 8)[:, :7])
    assert (chunk.layer_start, chunk.token_start, chunk.num_tokens) == (1, 8, 7)


def _pointers(cache):
    return [
        s.data.unsafe_buffer_pointer() for leaf in jax.tree.leaves(cache) for s in leaf.addressable_shards
    ]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float8_e4m3fn", "int8"])
@pytest.mark.parametrize("stacked", [True, False])
@pytest.mark.parametrize("dst_blocks", [[3, 4, 5, 6], [3, 9, 1, 20], [40, 41, 42, 7]])  # run, lone, mixed
def test_insert_donates_the_cache_and_updates_it_in_place(dtype, stacked, dst_blocks):
    layout = make_layout(dtype=dtype, tp=2)
    m = mesh(0, 2)
    chunk = gather(src_cache(layout, m), [0, 1, 2, 3], 16)
    cache = dst_cache(layout, m, stacked, num_blocks=128)
    cache_bytes = sum(leaf.nbytes for leaf in jax.tree.leaves(cache))
    # XLA's scratch for the kernel is at most the chunk: no second copy of the cache (32 chunks).
    scratch = insert_scratch_bytes(cache, chunk, dst_blocks)
    assert scratch <= chunk.data.nbytes < cache_bytes / 4, (scratch, chunk.data.nbytes)
    before = _pointers(cache)
    new = insert(cache, chunk, dst_blocks)
    assert all(leaf.is_deleted() for leaf in jax.tree.leaves(cache)), "the old cache must be donated"
    assert _pointers(new) == before, "the cache moved"
    with pytest.raises(RuntimeError, match="deleted"):
        np.asarray(jax.tree.leaves(cache)[0])
    check_transferred(new, layout, layout, [0, 1, 2, 3], dst_blocks, 16)


def test_insert_rejects_bad_block_lists_and_shapes():
    m = mesh(0, 2)
    chunk = gather(src_cache(LAYOUT, m), [0, 1], 8)
    with pytest.raises(ValueError, match="duplicate"):
        insert(dst_cache(LAYOUT, m), chunk, [3, 3])
    with pytest.raises(ValueError, match="outside"):
        insert(dst_cache(LAYOUT, m), chunk, [3, 32])
    with pytest.raises(ValueError, match="do not cover"):
        insert(dst_cache(LAYOUT, m), chunk, [3])
    with pytest.raises(ValueError, match="does not fit"):
        insert(dst_cache(make_layout(tp=2, strategy="replicate"), m), chunk, [3, 4])
    with pytest.raises(ValueError, match="blocks for 9 tokens"):
        gather(src_cache(LAYOUT, m), [0, 1], 9)


def test_compiled_variants_stay_bounded_over_request_lengths():
    """Requests of 1..40 blocks compile at most two gather (slice, take) variants and one insert variant
    per bucket: 7 buckets (1..64) here, not 40 lengths."""
    m = mesh(0, 2)
    src, cache = src_cache(LAYOUT, m, num_blocks=64), dst_cache(LAYOUT, m, num_blocks=64)
    gathers, inserts = gather_kernel._cache_size(), insert_kernel._cache_size()
    rng = np.random.default_rng(0)
    for num_blocks in range(1, 41):
        blocks = sorted(rng.choice(64, num_blocks, replace=False).tolist())
        chunk = gather(src, list(range(num_blocks)), num_blocks * 4 - 1)
        cache = insert(cache, chunk, blocks)
        chunk = gather(src, blocks, num_blocks * 4)
        cache = insert(cache, chunk, list(range(64 - num_blocks, 64)))
    assert gather_kernel._cache_size() - gathers <= 2 * 7
    assert insert_kernel._cache_size() - inserts <= 7


def test_gather_pads_to_a_given_bucket_and_insert_takes_it():
    m = mesh(0, 2)
    chunk = gather(src_cache(LAYOUT, m), [3, 4, 5, 9, 1], 18, bucket=6)  # not a power of two
    assert chunk.data.shape[1] == 6 * 4 and chunk.num_tokens == 18
    cache = insert(dst_cache(LAYOUT, m), chunk, [7, 8, 9, 2, 30])
    check_transferred(cache, LAYOUT, LAYOUT, [3, 4, 5, 9, 1], [7, 8, 9, 2, 30], 18)
    with pytest.raises(ValueError, match="bucket 4 is smaller than 5 blocks"):
        gather(src_cache(LAYOUT, m), [3, 4, 5, 9, 1], 18, bucket=4)
