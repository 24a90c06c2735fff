"""Host-side planning, free of device code: chunks, block runs, length buckets, the frame plan, cache trees.

A request's KV moves as a sequence of chunks; each chunk is one frame on the wire. The plan is a pure
function of (layout, num_tokens, max_payload_bytes), so both ends can reason about the same sequence, and
its chunk shapes come from a small set (full chunks of a fixed size, the last one of a layer group
bucketed to a power of two), which bounds compilation.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pdserve.kvtransfer.layout import KVLayout

MAX_FRAME_BYTES = 4 << 20  # default gRPC message limit, header included
HEADER_RESERVE_BYTES = 16 << 10  # room left in a frame for the prefix and the protobuf header
MAX_FRAME_BLOCKS = 1024  # caps the block ids listed in one header


@dataclass(frozen=True)
class KVChunk:
    """KV of cache layers [layer_start, layer_start + num_layers) for request tokens
    [token_start, token_start + num_tokens).

    data: [num_layers, padded_tokens, num_head_slots, padded_head_dim], a jax.Array or np.ndarray;
    padded_tokens is a multiple of block_size and >= num_tokens; entries past num_tokens are padding
    (never valid KV: insert writes the tail of the last block, which decode overwrites before reading,
    and drops whole padding blocks). token_start is a multiple of block_size.
    """

    layer_start: int
    token_start: int
    num_tokens: int
    data: Any

    @property
    def num_layers(self) -> int:
        return self.data.shape[0]

    def valid(self) -> Any:
        """data[:, :num_tokens]: the real tokens only (free for numpy; a small compile per length for jax)."""
        return self.data[:, : self.num_tokens]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def bucket_blocks(num_blocks: int, cap: int | None = None) -> int:
    """Smallest power of two >= num_blocks (0 for 0), or `cap` if that is smaller (cap >= num_blocks):
    10 buckets cover 1..512 blocks."""
    bucket = 0 if num_blocks <= 0 else 1 << (num_blocks - 1).bit_length()
    return bucket if cap is None else min(bucket, max(cap, num_blocks))


@dataclass(frozen=True)
class Run:
    index: int  # position of the run's first block in the list
    start: int  # first block id
    length: int


def block_runs(block_ids: Sequence[int]) -> list[Run]:
    """Maximal runs of consecutive block ids, in list order: [3, 4, 5, 9, 2] -> (0,3,3), (3,9,1), (4,2,1)."""
    runs: list[Run] = []
    for i, block in enumerate(block_ids):
        if runs and block == runs[-1].start + runs[-1].length:
            last = runs[-1]
            runs[-1] = Run(last.index, last.start, last.length + 1)
        else:
            runs.append(Run(i, block, 1))
    return runs


@dataclass(frozen=True)
class FramePlan:
    """One chunk of the plan: cache layers [layer_start, +num_layers), request blocks [block_start,
    +num_blocks) holding tokens [token_start, +num_tokens). bucket: the padded block count of its chunk."""

    seq: int
    layer_start: int
    num_layers: int
    block_start: int
    num_blocks: int
    token_start: int
    num_tokens: int
    bucket: int

    @property
    def layer_end(self) -> int:
        return self.layer_start + self.num_layers

    @property
    def token_end(self) -> int:
        return self.token_start + self.num_tokens


def _layer_segments(layout: KVLayout, num_tokens: int) -> list[tuple[int, int, int]]:
    """(first, end, first needed block) of each run of cache layers that need the same blocks."""
    segments: list[tuple[int, int, int]] = []
    for layer in range(layout.num_cache_layers):
        first = layout.first_needed_block(layer, num_tokens)
        if segments and segments[-1][2] == first:
            segments[-1] = (segments[-1][0], layer + 1, first)
        else:
            segments.append((layer, layer + 1, first))
    return segments


def chunk_geometry(layout: KVLayout, num_layers: int, budget: int) -> tuple[int, int]:
    """(layers, blocks) of a full chunk of a run of num_layers cache layers that need the same blocks:
    all of them and as many blocks as fit the budget if one block of all of them fits, else as many layers
    as fit with one block."""
    block_bytes = layout.block_bytes
    if num_layers * block_bytes <= budget:
        return num_layers, min(MAX_FRAME_BLOCKS, budget // (num_layers * block_bytes))
    return budget // block_bytes, 1


def plan_frames(
    layout: KVLayout, num_tokens: int, max_frame_bytes: int = MAX_FRAME_BYTES
) -> tuple[FramePlan, ...]:
    """The chunks of a request, in the order they are sent: by the token they end at, then by layer, so
    a prefix of the plan covers the KV of a prefix of the tokens (the sender streams each frame as soon
    as the prefill chunks computing its tokens have run).

    Fixed geometry (chunk_geometry): every chunk of a layer group (the layers that need the same blocks)
    holds the same number of blocks (as many as fit the budget) except the group's last, whose bucket is
    the next power of two capped at that number, so each stage copies (almost) only real bytes and a
    model compiles a handful of chunk shapes whatever the request length. Each chunk's payload (bucketed)
    fits max_frame_bytes - HEADER_RESERVE_BYTES. Sliding window layers start at their first needed block.
    """
    budget = max_frame_bytes - HEADER_RESERVE_BYTES
    if layout.block_bytes > budget:
        raise ValueError(
            f"one block of one layer ({layout.block_bytes} B) exceeds the frame budget ({budget} B)"
        )
    total_blocks = cdiv(num_tokens, layout.block_size)
    bs = layout.block_size
    chunks: list[tuple[int, int, int, int, int]] = []  # layer, layers, block, blocks, bucket
    for layer_start, layer_end, first_block in _layer_segments(layout, num_tokens) if total_blocks else []:
        group, full = chunk_geometry(layout, layer_end - layer_start, budget)
        for layer in range(layer_start, layer_end, group):
            for block in range(first_block, total_blocks, full):
                nblocks = min(full, total_blocks - block)
                chunks.append(
                    (layer, min(group, layer_end - layer), block, nblocks, bucket_blocks(nblocks, full))
                )
    chunks.sort(key=lambda c: (c[2] + c[3], c[0]))  # by last block, then by layer
    return tuple(
        FramePlan(
            seq,
            layer,
            nlayers,
            block,
            nblocks,
            block * bs,
            min(nblocks * bs, num_tokens - block * bs),
            bucket,
        )
        for seq, (layer, nlayers, block, nblocks, bucket) in enumerate(chunks)
    )


def distinct_frames(
    layout: KVLayout, max_request_blocks: int, max_frame_bytes: int = MAX_FRAME_BYTES
) -> tuple[FramePlan, ...]:
    """One frame of each (layer_start, num_layers, bucket) the plans of requests of 1..max_request_blocks
    blocks hold (what decides a gather or insert kernel's compiled shape), moved to the request's first
    block and token: the transfers a warmup runs so that serving compiles none."""
    budget = max_frame_bytes - HEADER_RESERVE_BYTES
    bs = layout.block_size
    frames: dict[tuple[int, int, int], FramePlan] = {}
    for total_blocks in range(1, max_request_blocks + 1):  # as plan_frames cuts each, without the frames
        for layer_start, layer_end, first_block in _layer_segments(layout, total_blocks * bs):
            group, full = chunk_geometry(layout, layer_end - layer_start, budget)
            span = total_blocks - first_block  # a run of full chunks, then the rest
            sizes = ([full] if span >= full else []) + ([span % full] if span % full else [])
            for layer, nblocks in itertools.product(range(layer_start, layer_end, group), sizes):
                nlayers, bucket = min(group, layer_end - layer), bucket_blocks(nblocks, full)
                if (layer, nlayers, bucket) not in frames:
                    frame = FramePlan(len(frames), layer, nlayers, 0, nblocks, 0, nblocks * bs, bucket)
                    frames[layer, nlayers, bucket] = frame
    return tuple(frames.values())


def chunk_shapes(layout: KVLayout, max_request_blocks: int, max_frame_bytes: int = MAX_FRAME_BYTES) -> set:
    """Distinct (num_layers, bucket) chunk shapes over requests of 1..max_request_blocks full blocks:
    what bounds the number of compiled gather/insert variants."""
    return {(p.num_layers, p.bucket) for p in distinct_frames(layout, max_request_blocks, max_frame_bytes)}


@dataclass(frozen=True)
class Span:
    """The part of a chunk's layers that lies in one cache leaf."""

    leaf: int  # index into the flattened cache leaves
    local_start: int  # first layer inside that leaf
    count: int


def leaf_layer_counts(leaves: Sequence[Any]) -> list[int]:
    """Layers per leaf: a 5-D leaf [layers, num_blocks, block_size, slots, dim] holds shape[0], 4-D: 1."""
    counts = []
    for leaf in leaves:
        if leaf.ndim not in (4, 5) or leaf.shape[-4:][1:] != leaves[0].shape[-4:][1:]:
            raise ValueError(f"cache leaves must be [..., num_blocks, block_size, slots, dim]: {leaf.shape}")
        counts.append(leaf.shape[0] if leaf.ndim == 5 else 1)
    return counts


def layer_spans(leaves: Sequence[Any], layer_start: int, num_layers: int) -> tuple[Span, ...]:
    """Where cache layers [layer_start, layer_start + num_layers) live among the leaves, in order."""
    counts = leaf_layer_counts(leaves)
    if layer_start < 0 or layer_start + num_layers > sum(counts):
        raise ValueError(
            f"layers [{layer_start}, {layer_start + num_layers}) outside a {sum(counts)}-layer cache"
        )
    spans, first = [], 0
    for leaf, count in enumerate(counts):
        lo, hi = max(layer_start, first), min(layer_start + num_layers, first + count)
        if lo < hi:
            spans.append(Span(leaf, lo - first, hi - lo))
        first += count
    return tuple(spans)


def check_block_ids(block_ids: Sequence[int], num_blocks: int, *, distinct: bool) -> None:
    if any(not 0 <= b < num_blocks for b in block_ids):
        raise ValueError(f"block ids outside [0, {num_blocks}): {list(block_ids)}")
    if distinct and len(set(block_ids)) != len(block_ids):
        raise ValueError(f"duplicate block ids: {list(block_ids)}")


def frame_payload_bytes(layout: KVLayout, plan: FramePlan) -> int:
    return plan.num_layers * plan.num_tokens * math.prod(layout.token_shape) * layout.np_dtype.itemsize
