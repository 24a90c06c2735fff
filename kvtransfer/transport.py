"""The two paths a request's KV takes between engines: the code the daemons run, and what
bench/bench_kvtransfer.py measures.

- Over a byte stream (gRPC between processes): the prefill side gathers the request's chunks
  (gather_request), `encode_request` turns them into serialized frames, produced on a thread one frame
  ahead of the sender (pipeline.aprefetch); the decode side's FrameAssembler verifies each frame and puts
  it on the decode mesh, and the engine inserts it while the next one is on the wire.
- Device to device (one process on disjoint device sets, `pdserve serve`): the gather converts heads to
  the destination layout in the same pass, in chunks of up to LOCAL_CHUNK_BYTES (no wire: a few kernels
  per request), and `move_chunk` puts each on the destination mesh (jax.device_put; aliased host memory
  between CPU devices; Pathways reshard under JAX_PLATFORMS=proxy).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import jax
import numpy as np

from pdserve.kvtransfer.codec import FrameEncoder, serialize_frame
from pdserve.kvtransfer.layout import KVLayout
from pdserve.kvtransfer.plan import MAX_FRAME_BYTES, KVChunk
from pdserve.kvtransfer.reshard import on_pathways, reshard

LOCAL_CHUNK_BYTES = 64 << 20  # no wire: chunks as large as this, so a request is a few kernels


def encode_request(
    request_id: str,
    layout: KVLayout,
    num_tokens: int,
    chunks: Iterable[KVChunk],
    max_frame_bytes: int = MAX_FRAME_BYTES,
    lead: Callable[[int], bytes] | None = None,
) -> Iterator[bytes]:
    """The serialized frames of one request (chunks: its gather_request output, same max_frame_bytes, or
    an iterator that yields them as they are computed), in plan order; `lead(frame_size)` puts the
    caller's message prefix before each, in the same copy. A list's chunks are dropped from it once
    framed, so their memory goes as the stream advances."""
    encoder = FrameEncoder(request_id, layout, num_tokens, max_frame_bytes)
    source = _drain(chunks) if isinstance(chunks, list) else chunks
    for frame in encoder.frames(source):
        data = serialize_frame(frame, lead)
        del frame
        yield data


def _drain(chunks: list[KVChunk]) -> Iterator[KVChunk]:
    while chunks:
        yield chunks.pop(0)


def move_chunk(chunk: KVChunk, sharding) -> KVChunk:
    """A chunk onto the destination sharding. Between CPU devices of one process the bytes are already in
    host memory: the destination array aliases the chunk (no copy) where XLA allows it."""
    data = chunk.data
    if isinstance(data, np.ndarray):  # staged in host memory by the sender
        return KVChunk(chunk.layer_start, chunk.token_start, chunk.num_tokens, jax.device_put(data, sharding))
    cpu = all(d.platform == "cpu" for d in (*data.devices(), *sharding.device_set))
    if cpu and not on_pathways():
        moved = jax.device_put(np.asarray(data), sharding, may_alias=True)
    else:
        moved = reshard(data, sharding)
    return KVChunk(chunk.layer_start, chunk.token_start, chunk.num_tokens, moved)
