"""kvtransfer: moves one request's KV cache from a prefill mesh into a decode mesh.

Caches are paged: cache layers of [num_blocks, block_size, 2 * padded_kv_heads, head_dim] (K of kv head h
at slot 2h, V at 2h+1; MLA: one latent slot), either one stacked array [num_cache_layers, ...] sharded
P(None, None, None, "model", None) or any pytree of per-layer arrays. The block axis is -4.

The API (everything else is internal):

    layout = KVLayout(model, layer_specs, num_kv_heads, head_dim, dtype, block_size, tp_size=..., ...)
    layout.fingerprint() -> str;  layout.check_compatible(peer_layout)  # raises LayoutMismatchError
    layout.scale_scheme, layout.scale_bytes, layout.scales(host_array)   # an int8 cache's per-row scales
    head_map(src_layout, dst_layout) -> HeadMap       # heads "pad"/"replicate" + head_dim conversion

    gather(cache, block_ids, num_tokens, *, layer_start=0, num_layers=None, token_start=0, head_map=None)
        -> KVChunk(layer_start, token_start, num_tokens, data [layers, padded_tokens, slots, dim])
    insert(cache, chunk, block_ids) -> cache          # cache donated, updated in place; use the result
    insert_stream(cache, chunks, block_ids) -> cache
    compile_insert(cache, chunk, block_ids) -> Compiled   # insert's kernel compiled, nothing run
    reshard(arrays, dst_sharding)                     # device_put, or pathwaysutils under JAX_PLATFORMS=proxy
    chunk_sharding(mesh, layout), cache_sharding(mesh, layout)

    FrameEncoder(request_id, layout, num_tokens).frames(chunks, block_ids) -> Iterator[Frame]
    FrameAssembler(request_id, num_tokens, src_layout, dst_layout, sharding).add(frame) -> KVChunk; .finish()
    serialize_frame(frame) -> bytes; deserialize_frame(bytes) -> Frame   # gRPC (de)serializers

    encode_request(request_id, layout, num_tokens, chunks, lead=None) -> Iterator[bytes]   # the sender
    aprefetch(iterable, depth=1) -> AsyncIterator     # frames produced on a thread ahead of the sender
    move_chunk(chunk, dst_sharding) -> KVChunk        # device to device (one process), CPU memory aliased
    distinct_frames(layout, max_request_blocks) -> FramePlans   # one per compiled kernel shape (warmup)

Who calls what: the engine's KV connectors (engine/core/kv_connector.py) gather on the prefill side and
insert on the decode side, on the engine thread; the daemons own the streams (docs/architecture.md tells
one request's whole path).

Padded tokens: chunks have a fixed number of blocks (as many as fit a frame), the last one of a layer
group padded to a power of two capped at that number, so that requests of any length compile a bounded
set of kernels; KVChunk.num_tokens says how many are real, .valid() trims.
"""

from pdserve.kvtransfer.codec import (
    Frame,
    FrameAssembler,
    FrameEncoder,
    FrameError,
    deserialize_frame,
    serialize_frame,
)
from pdserve.kvtransfer.gather import gather, gather_request
from pdserve.kvtransfer.insert import compile_insert, insert, insert_stream
from pdserve.kvtransfer.layout import (
    SCALE_BYTES,
    SCALE_DTYPE,
    HeadMap,
    KVLayout,
    LayerSpec,
    LayoutMismatchError,
    SpecKind,
    head_map,
    scale_scheme,
)
from pdserve.kvtransfer.pipeline import aprefetch
from pdserve.kvtransfer.plan import MAX_FRAME_BYTES, KVChunk, distinct_frames, plan_frames
from pdserve.kvtransfer.reshard import cache_sharding, chunk_sharding, on_pathways, reshard
from pdserve.kvtransfer.transport import LOCAL_CHUNK_BYTES, encode_request, move_chunk

__all__ = [
    "LOCAL_CHUNK_BYTES",
    "MAX_FRAME_BYTES",
    "SCALE_BYTES",
    "SCALE_DTYPE",
    "Frame",
    "FrameAssembler",
    "FrameEncoder",
    "FrameError",
    "HeadMap",
    "KVChunk",
    "KVLayout",
    "LayerSpec",
    "LayoutMismatchError",
    "SpecKind",
    "cache_sharding",
    "aprefetch",
    "chunk_sharding",
    "compile_insert",
    "deserialize_frame",
    "distinct_frames",
    "encode_request",
    "gather",
    "gather_request",
    "head_map",
    "insert",
    "insert_stream",
    "move_chunk",
    "on_pathways",
    "plan_frames",
    "reshard",
    "scale_scheme",
    "serialize_frame",
]
