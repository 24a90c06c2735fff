"""Insert: a verified KVChunk -> the decode cache, at the blocks the decode side allocated.

The cache (same pytree forms as gather) is donated: each kernel updates the touched leaves in place and
returns them, so no second copy of the cache exists; the caller must use the returned cache and never the
argument again. A chunk's destination blocks are split into runs; each run is written with
dynamic_update_slice in power-of-two pieces, and lone blocks with one scatter (on XLA:CPU with 16-bit
dtypes, whose scatter copies the cache, with one-block dynamic_update_slices instead). One kernel per chunk,
compiled once per chunk shape (and per use of the scatter). The seed's scattered insert wrote into a
discarded copy; here every kernel's result is what is returned.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvtransfer.bits import as_bits, from_bits
from kvtransfer.plan import KVChunk, block_runs, cdiv, check_block_ids, layer_spans


def _write(view, piece, start, dst):
    """view[start : start + count, dst : dst + k] = piece (raw bits [count, k, bs, slots, dim]), in place.

    Written as raw bits: XLA:CPU has no bfloat16 data movement and would otherwise convert (copy) the
    whole donated cache around the update.
    """
    update = jax.lax.dynamic_update_slice(as_bits(view), piece, (start, dst, 0, 0, 0))
    return from_bits(update, view.dtype)


def _scatter(view, part, start, ids):
    """view[start + l, ids[b]] = part[l, b] for every l, b with ids[b] < num_blocks (others dropped)."""
    layers = start + jnp.arange(part.shape[0])
    return view.at[layers[:, None], ids[None, :]].set(part, mode="drop")


@functools.partial(jax.jit, static_argnames=("layer_counts", "use_scatter"), donate_argnums=(0,))
def _insert_kernel(leaves, chunk, starts, table, counts, scatter_ids, *, layer_counts, use_scatter):
    """Writes chunk [layers, bucket * bs, slots, dim] into the leaves holding its layers (donated).

    table[c, j] = (source block in chunk, destination block) of the j-th piece of 2**c blocks, j <
    counts[c]: each piece is one dynamic_update_slice. If use_scatter, blocks with scatter_ids[b] <
    num_blocks go through one scatter as well.
    """
    block_size = leaves[0].shape[-3]
    # As bits from the start: XLA:CPU would otherwise slice bfloat16 pieces through float32 copies.
    blocks = as_bits(chunk).reshape(
        chunk.shape[0], -1, block_size, *chunk.shape[2:]
    )  # [layers, bucket, bs, s, d]
    offsets = np.cumsum((0, *layer_counts))
    parts = [blocks[a:b] for a, b in zip(offsets[:-1], offsets[1:], strict=True)]
    views = tuple(leaf if leaf.ndim == 5 else leaf[None] for leaf in leaves)
    for c in range(table.shape[0]):

        def write_piece(j, views, c=c):
            src, dst = table[c, j, 0], table[c, j, 1]
            pieces = [jax.lax.dynamic_slice_in_dim(part, src, 1 << c, axis=1) for part in parts]
            return tuple(_write(v, p, s, dst) for v, p, s in zip(views, pieces, starts, strict=True))

        views = jax.lax.fori_loop(0, counts[c], write_piece, views)
    if use_scatter:  # only for dtypes XLA scatters natively, so the bits can go back to the dtype freely
        parts = [from_bits(p, chunk.dtype) for p in parts]
        views = tuple(_scatter(v, p, s, scatter_ids) for v, p, s in zip(views, parts, starts, strict=True))
    return tuple(v if leaf.ndim == 5 else v[0] for v, leaf in zip(views, leaves, strict=True))


def _native_scatter(leaf) -> bool:
    """Whether XLA updates this cache in place with a scatter (XLA:CPU copies bfloat16/float16 caches)."""
    return leaf.dtype.itemsize >= 4 or next(iter(leaf.devices())).platform != "cpu"


def plan_pieces(dst_blocks: Sequence[int], bucket: int, num_cache_blocks: int, use_scatter: bool):
    """Host: the chunk's destination blocks -> runs -> power-of-two pieces (one table row per size), and
    the lone blocks left to the scatter (if use_scatter). A run of n blocks becomes popcount(n) pieces."""
    classes = bucket.bit_length()  # piece sizes 1, 2, 4, ..., bucket
    table = np.zeros((classes, bucket, 2), np.int32)
    counts = np.zeros(classes, np.int32)
    scatter_ids = np.full(bucket, num_cache_blocks, np.int32)  # out of bounds: dropped
    for run in block_runs(dst_blocks):
        if run.length == 1 and use_scatter:
            scatter_ids[run.index] = run.start
            continue
        done = 0
        for c in reversed(range(classes)):
            if run.length - done >= 1 << c:
                table[c, counts[c]] = (run.index + done, run.start + done)
                counts[c] += 1
                done += 1 << c
    return table, counts, scatter_ids


def _kernel_call(cache, chunk: KVChunk, block_ids: Sequence[int]):
    """Validates and returns (leaves, treedef, spans, kernel args, kernel static kwargs)."""
    leaves, treedef = jax.tree.flatten(cache)
    num_cache_blocks, block_size = leaves[0].shape[-4], leaves[0].shape[-3]
    if chunk.token_start % block_size or chunk.data.shape[1] % block_size:
        raise ValueError(f"chunk tokens are not aligned to block size {block_size}")
    first = chunk.token_start // block_size
    dst = list(block_ids[first : first + cdiv(chunk.num_tokens, block_size)])
    if len(dst) != cdiv(chunk.num_tokens, block_size):
        raise ValueError(
            f"{len(block_ids)} block ids do not cover tokens to {chunk.token_start + chunk.num_tokens}"
        )
    check_block_ids(dst, num_cache_blocks, distinct=True)
    if chunk.data.shape[-2:] != leaves[0].shape[-2:] or chunk.data.dtype != leaves[0].dtype:
        raise ValueError(f"chunk {chunk.data.shape}/{chunk.data.dtype} does not fit cache {leaves[0].shape}")
    spans = layer_spans(leaves, chunk.layer_start, chunk.num_layers)
    use_scatter = _native_scatter(leaves[0])
    table, counts, scatter_ids = plan_pieces(
        dst, chunk.data.shape[1] // block_size, num_cache_blocks, use_scatter
    )
    args = (
        tuple(leaves[s.leaf] for s in spans),
        chunk.data,
        tuple(s.local_start for s in spans),
        table,
        counts,
        scatter_ids,
    )
    kwargs = dict(
        layer_counts=tuple(s.count for s in spans),
        use_scatter=bool(use_scatter and (scatter_ids < num_cache_blocks).any()),
    )
    return leaves, treedef, spans, args, kwargs


def insert(cache, chunk: KVChunk, block_ids: Sequence[int]):
    """Writes `chunk` into `cache` and returns the updated cache (the argument is donated: do not reuse it).

    block_ids: the request's blocks in this cache, in token order (the whole list; the chunk's tokens
    [token_start, +num_tokens) land in block_ids[token_start // block_size :]).
    chunk.data must already be on the cache's mesh with the cache's heads layout (see reshard, HeadMap).
    """
    if chunk.num_tokens == 0:
        return cache
    leaves, treedef, spans, args, kwargs = _kernel_call(cache, chunk, block_ids)
    for span, leaf in zip(spans, _insert_kernel(*args, **kwargs), strict=True):
        leaves[span.leaf] = leaf
    return jax.tree.unflatten(treedef, leaves)


def insert_scratch_bytes(cache, chunk: KVChunk, block_ids: Sequence[int]) -> int:
    """Scratch memory XLA allocates to insert this chunk (the cache itself is updated in place): the
    extra memory of an insert beyond the chunk. Compiles, does not run."""
    _, _, _, args, kwargs = _kernel_call(cache, chunk, block_ids)
    return _insert_kernel.lower(*args, **kwargs).compile().memory_analysis().temp_size_in_bytes


def insert_stream(cache, chunks: Iterable[KVChunk], block_ids: Sequence[int]):
    """Inserts chunks as they arrive (e.g. from a transport's receive); returns the updated cache.

    Only one received chunk is referenced at a time, so the extra memory is one frame.
    """
    chunks = iter(chunks)
    while (chunk := next(chunks, None)) is not None:
        cache = insert(cache, chunk, block_ids)
        del chunk  # drop it before the next one is produced
    return cache
