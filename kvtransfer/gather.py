"""Gather: a request's blocks in a paged cache -> a KVChunk of per-layer token slices.

The cache is any pytree whose leaves are [num_blocks, block_size, slots, dim] (one layer) or
[layers, num_blocks, block_size, slots, dim] (stacked layers); its cache layers are the leaves' layers in
flatten order. The block axis is -4 everywhere.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pdserve.kvtransfer.bits import as_bits, from_bits
from pdserve.kvtransfer.layout import HeadMap, KVLayout
from pdserve.kvtransfer.plan import (
    MAX_FRAME_BYTES,
    FramePlan,
    KVChunk,
    block_runs,
    bucket_blocks,
    cdiv,
    check_block_ids,
    layer_spans,
    leaf_layer_counts,
    plan_frames,
)


@functools.partial(jax.jit, static_argnames=("counts", "bucket", "mode", "head_map"))
def gather_kernel(leaves, starts, ids, *, counts, bucket, mode, head_map):
    """-> [sum(counts), bucket * block_size, slots, dim].

    mode "slice": blocks ids[0] .. ids[0] + bucket (one contiguous run, in bounds);
    mode "take": blocks ids (length bucket, padded with valid ids).
    """
    parts = []
    for leaf, start, count in zip(leaves, starts, counts, strict=True):
        leaf = as_bits(leaf)
        x = jax.lax.dynamic_slice_in_dim(leaf, start, count, axis=0) if leaf.ndim == 5 else leaf[None]
        if mode == "slice":
            x = jax.lax.dynamic_slice_in_dim(x, ids[0], bucket, axis=1)  # [count, bucket, bs, slots, dim]
        else:
            x = jnp.take(x, ids, axis=1, mode="clip")
        parts.append(x)
    x = jnp.concatenate(parts, axis=0) if len(parts) > 1 else parts[0]
    x = x.reshape(x.shape[0], -1, *x.shape[3:])  # [layers, bucket * bs, slots, dim]
    x = head_map.apply_jax(x) if head_map is not None else x
    return from_bits(x, leaves[0].dtype)


def gather(
    cache,
    block_ids: Sequence[int],
    num_tokens: int,
    *,
    layer_start: int = 0,
    num_layers: int | None = None,
    token_start: int = 0,
    head_map: HeadMap | None = None,
    bucket: int | None = None,
) -> KVChunk:
    """Reads tokens [token_start, token_start + num_tokens) of a request from `cache`.

    block_ids: the blocks holding exactly those tokens, in token order (len == ceil(num_tokens /
    block_size); the last may be partly filled). Layers [layer_start, +num_layers) of the cache (default:
    all). A contiguous run is read with a slice, anything else with a gather; the token axis is padded to
    `bucket` blocks (default: the next power of two, so requests of 1..512 blocks compile at most 10
    variants per layer count; gather_request passes the frame plan's fixed chunk sizes).
    head_map, if given, converts the heads axis to another physical layout in the same pass.
    The cache is only read; dispatch is asynchronous.
    """
    leaves = jax.tree.leaves(cache)
    num_cache_blocks, block_size = leaves[0].shape[-4], leaves[0].shape[-3]
    if num_layers is None:
        num_layers = sum(leaf_layer_counts(leaves)) - layer_start
    spans = layer_spans(leaves, layer_start, num_layers)
    if len(block_ids) != cdiv(num_tokens, block_size):
        raise ValueError(f"{len(block_ids)} blocks for {num_tokens} tokens of block size {block_size}")
    check_block_ids(block_ids, num_cache_blocks, distinct=False)
    if token_start % block_size:
        raise ValueError(f"token_start {token_start} is not a multiple of block size {block_size}")
    layers = sum(span.count for span in spans)
    if not block_ids:
        slots, dim = head_map.dst_token_shape if head_map else leaves[0].shape[-2:]
        return KVChunk(layer_start, token_start, 0, jnp.zeros((layers, 0, slots, dim), leaves[0].dtype))
    if bucket is None:
        bucket = bucket_blocks(len(block_ids))
    elif bucket < len(block_ids):
        raise ValueError(f"bucket {bucket} is smaller than {len(block_ids)} blocks")
    runs = block_runs(block_ids)
    if len(runs) == 1 and runs[0].start + bucket <= num_cache_blocks:
        mode, ids = "slice", np.array([runs[0].start], np.int32)
    else:
        mode = "take"
        ids = np.full(bucket, block_ids[-1], np.int32)
        ids[: len(block_ids)] = block_ids
    data = gather_kernel(
        tuple(leaves[s.leaf] for s in spans),
        tuple(s.local_start for s in spans),
        ids,
        counts=tuple(s.count for s in spans),
        bucket=bucket,
        mode=mode,
        head_map=None if head_map is None or head_map.is_identity else head_map,
    )
    return KVChunk(layer_start, token_start, num_tokens, data)


def gather_request(
    cache,
    layout: KVLayout,
    block_ids: Sequence[int],
    num_tokens: int,
    *,
    max_frame_bytes: int = MAX_FRAME_BYTES,
    head_map: HeadMap | None = None,
    frames: Sequence[FramePlan] | None = None,
) -> list[KVChunk]:
    """A request of `num_tokens` tokens as the chunks of its frame plan (see plan.plan_frames), all
    dispatched at once; `frames`: only these entries of the plan (streaming a prompt as it computes:
    `block_ids` need only reach their last block).

    Holding the returned chunks keeps the request's KV alive even if the engine later donates `cache`.
    """
    if frames is None:
        frames = plan_frames(layout, num_tokens, max_frame_bytes)
        if len(block_ids) != cdiv(num_tokens, layout.block_size):
            raise ValueError(
                f"{len(block_ids)} blocks for {num_tokens} tokens of block size {layout.block_size}"
            )
    elif frames and len(block_ids) < max(p.block_start + p.num_blocks for p in frames):
        raise ValueError(f"{len(block_ids)} blocks do not reach the frames' last block")
    return [
        gather(
            cache,
            block_ids[p.block_start : p.block_start + p.num_blocks],
            p.num_tokens,
            layer_start=p.layer_start,
            num_layers=p.num_layers,
            token_start=p.token_start,
            head_map=head_map,
            bucket=p.bucket,
        )
        for p in frames
    ]
