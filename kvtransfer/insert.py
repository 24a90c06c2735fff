"""Insert: a verified KVChunk -> the decode cache, at the blocks the decode side allocated.

The cache (same pytree forms as gather) is donated: each kernel updates the touched leaves in place and
returns them, so no second copy of the cache exists; the caller must use the returned cache and never the
argument again. Contiguous runs are written with dynamic_update_slice, scattered blocks with one scatter;
a mixed list is split into runs. The seed's scattered insert wrote into a discarded copy; here every
kernel's result is what is returned.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from kvtransfer.plan import KVChunk, block_runs, cdiv, check_block_ids, layer_spans


def _write_run(leaf, part, start, src, dst, length):
    """leaf[start : start + count, dst : dst + length] = part[:, src : src + length].

    part: [count, bucket, bs, slots, dim]. Reads and rewrites a window of `bucket` blocks that contains the
    run (clamped into the cache), keeping the cache's own blocks outside the run, so one compiled variant
    serves every run length up to bucket with a single dynamic_update_slice.
    """
    count, bucket = part.shape[:2]
    lo = jnp.clip(dst, 0, leaf.shape[1] - bucket)
    window = jax.lax.dynamic_slice(leaf, (start, lo, 0, 0, 0), (count, bucket, *leaf.shape[2:]))
    pos = lo + jnp.arange(bucket)
    rows = jnp.take(part, jnp.clip(pos - dst + src, 0, bucket - 1), axis=1)
    inside = ((pos >= dst) & (pos < dst + length))[None, :, None, None, None]
    return jax.lax.dynamic_update_slice(leaf, jnp.where(inside, rows, window), (start, lo, 0, 0, 0))


def _write_scatter(leaf, part, start, ids):
    """leaf[start + l, ids[b]] = part[l, b] for every l, b with ids[b] < num_blocks (others dropped)."""
    layers = start + jnp.arange(part.shape[0])
    return leaf.at[layers[:, None], ids[None, :]].set(part, mode="drop")


@functools.partial(jax.jit, static_argnames=("counts", "mode"), donate_argnums=(0,))
def _insert_kernel(leaves, chunk, starts, args, *, counts, mode):
    """Writes chunk [layers, bucket * bs, slots, dim] into the leaves that hold its layers (donated).

    mode "run": args = (src block in chunk, dst block, length); mode "scatter": args = ids [bucket].
    """
    block_size = leaves[0].shape[-3]
    blocks = chunk.reshape(chunk.shape[0], -1, block_size, *chunk.shape[2:])  # [layers, bucket, bs, s, d]
    out, offset = [], 0
    for leaf, start, count in zip(leaves, starts, counts, strict=True):
        part = blocks[offset : offset + count]
        offset += count
        view = leaf if leaf.ndim == 5 else leaf[None]
        if mode == "run":
            view = _write_run(view, part, start, *args)
        else:
            view = _write_scatter(view, part, start, args)
        out.append(view if leaf.ndim == 5 else view[0])
    return tuple(out)


def insert(cache, chunk: KVChunk, block_ids: Sequence[int]):
    """Writes `chunk` into `cache` and returns the updated cache (the argument is donated: do not reuse it).

    block_ids: the request's blocks in this cache, in token order (the whole list; the chunk's tokens
    [token_start, +num_tokens) land in block_ids[token_start // block_size :]). Blocks of a run that fills
    at least half of the chunk's bucket go through dynamic_update_slice, the rest through one scatter.
    chunk.data must already be on the cache's mesh with the cache's heads layout (see reshard, HeadMap).
    """
    leaves, treedef = jax.tree.flatten(cache)
    num_cache_blocks, block_size = leaves[0].shape[-4], leaves[0].shape[-3]
    if chunk.num_tokens == 0:
        return cache
    if chunk.token_start % block_size or chunk.data.shape[1] % block_size:
        raise ValueError(f"chunk tokens are not aligned to block size {block_size}")
    first = chunk.token_start // block_size
    dst = list(block_ids[first : first + cdiv(chunk.num_tokens, block_size)])
    if len(dst) != cdiv(chunk.num_tokens, block_size):
        raise ValueError(
            f"{len(block_ids)} block ids do not cover tokens up to {chunk.token_start + chunk.num_tokens}"
        )
    check_block_ids(dst, num_cache_blocks, distinct=True)
    if chunk.data.shape[-2:] != leaves[0].shape[-2:] or chunk.data.dtype != leaves[0].dtype:
        raise ValueError(f"chunk {chunk.data.shape}/{chunk.data.dtype} does not fit cache {leaves[0].shape}")
    spans = layer_spans(leaves, chunk.layer_start, chunk.num_layers)
    bucket = chunk.data.shape[1] // block_size
    counts = tuple(s.count for s in spans)
    starts = tuple(s.local_start for s in spans)

    def run_kernel(mode, args):
        new = _insert_kernel(
            tuple(leaves[s.leaf] for s in spans), chunk.data, starts, args, counts=counts, mode=mode
        )
        for span, leaf in zip(spans, new, strict=True):
            leaves[span.leaf] = leaf

    scattered = np.full(bucket, num_cache_blocks, np.int32)  # out of bounds: dropped
    for run in block_runs(dst):
        if 2 * run.length >= bucket and bucket <= num_cache_blocks:
            run_kernel("run", (run.index, run.start, run.length))
        else:
            scattered[run.index : run.index + run.length] = np.arange(run.start, run.start + run.length)
    if (scattered < num_cache_blocks).any():
        run_kernel("scatter", scattered)
    return jax.tree.unflatten(treedef, leaves)


def insert_stream(cache, chunks: Iterable[KVChunk], block_ids: Sequence[int]):
    """Inserts chunks as they arrive (e.g. from a transport's receive); returns the updated cache.

    Only one received chunk is referenced at a time, so the extra memory is one frame.
    """
    chunks = iter(chunks)
    while (chunk := next(chunks, None)) is not None:
        cache = insert(cache, chunk, block_ids)
        del chunk  # drop it before the next one is produced
    return cache
