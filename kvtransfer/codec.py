"""Wire codec: a request's KV chunks <-> a stream of frames (protobuf header + raw payload).

Frame on the wire: [u32 LE header length][u32 LE crc32c(header)][KVFrameHeader][payload]. The encoder
follows plan.plan_frames, so frames arrive by token (then by layer) and each can be inserted on arrival.
The assembler verifies every frame (order, duplicates, crc, shape, range) before it becomes a chunk; a
frame that fails is reported with a FrameError and never turned into a chunk.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

import google_crc32c
import numpy as np

from pdserve.kvtransfer.layout import KVLayout, head_map
from pdserve.kvtransfer.plan import (
    HEADER_RESERVE_BYTES,
    MAX_FRAME_BYTES,
    KVChunk,
    bucket_blocks,
    cdiv,
    plan_frames,
)
from pdserve.kvtransfer.reshard import reshard
from pdserve.v1 import kv_frame_pb2 as pb

_PREFIX = struct.Struct("<II")
_DTYPE_TO_PB = {
    "float32": pb.KV_DTYPE_FLOAT32,
    "bfloat16": pb.KV_DTYPE_BFLOAT16,
    "float16": pb.KV_DTYPE_FLOAT16,
    "float8_e4m3fn": pb.KV_DTYPE_FLOAT8_E4M3FN,
    "float8_e5m2": pb.KV_DTYPE_FLOAT8_E5M2,
    "int8": pb.KV_DTYPE_INT8,
}
_PB_TO_DTYPE = {v: k for k, v in _DTYPE_TO_PB.items()}


class FrameError(ValueError):
    """A frame or stream failed verification. kind: truncated | reordered | duplicate | corrupt | invalid."""

    def __init__(self, kind: str, message: str):
        self.kind = kind
        super().__init__(f"{kind}: {message}")


def crc32c(parts: Iterable) -> int:
    """CRC-32C of the concatenation of C-contiguous byte buffers."""
    crc = 0
    for part in parts:
        crc = google_crc32c.extend(crc, np.frombuffer(part, np.uint8))
    return crc


@dataclass(frozen=True)
class Frame:
    """header: KVFrameHeader; payload: C-contiguous buffers whose concatenation is the payload bytes."""

    header: pb.KVFrameHeader
    payload: tuple


def serialize_frame(frame: Frame | bytes, lead: Callable[[int], bytes] | None = None) -> bytes:
    """gRPC serializer: one copy of the payload into the message bytes (already serialized bytes, e.g. from
    a prefetching sender, pass through). `lead(frame_size)`: bytes put before the frame in the same copy
    (the enclosing message's field tag and length)."""
    if isinstance(frame, bytes):
        return frame
    header = frame.header.SerializeToString()
    parts = (_PREFIX.pack(len(header), google_crc32c.value(header)), header, *frame.payload)
    if lead is not None:
        parts = (lead(sum(memoryview(p).nbytes for p in parts)), *parts)
    return b"".join(parts)


def deserialize_frame(message: bytes) -> Frame:
    """gRPC deserializer: the payload is a zero-copy memoryview into `message`. A damaged prefix or header
    raises FrameError (which fails the RPC on the receiving side)."""
    view = memoryview(message)
    if len(view) < _PREFIX.size:
        raise FrameError("truncated", f"frame of {len(view)} bytes has no prefix")
    header_len, header_crc = _PREFIX.unpack_from(view)
    header_bytes = view[_PREFIX.size : _PREFIX.size + header_len]
    if len(header_bytes) < header_len:
        raise FrameError("truncated", f"header of {header_len} bytes cut at {len(header_bytes)}")
    if google_crc32c.value(bytes(header_bytes)) != header_crc:
        raise FrameError("corrupt", "header crc32c mismatch")
    header = pb.KVFrameHeader.FromString(header_bytes)
    return Frame(header, (view[_PREFIX.size + header_len :],))


class FrameEncoder:
    """Turns a request's chunks into frames, following plan_frames(layout, num_tokens, max_frame_bytes).

    Accepts chunks of any granularity that covers the plan in order: the output of gather_request (one
    chunk per frame) or a single whole-request gather. Device chunks are copied to host one at a time.
    """

    def __init__(
        self, request_id: str, layout: KVLayout, num_tokens: int, max_frame_bytes: int = MAX_FRAME_BYTES
    ):
        self.request_id = request_id
        self.layout = layout
        self.num_tokens = num_tokens
        self.plan = plan_frames(layout, num_tokens, max_frame_bytes)
        self._fingerprint = layout.fingerprint()

    def frames(self, chunks: Iterable[KVChunk], block_ids: list[int] | None = None) -> Iterator[Frame]:
        chunks = iter(chunks)
        chunk, host = None, None
        for plan in self.plan:
            while chunk is None or not _contains(chunk, plan):
                chunk = next(chunks, None)
                if chunk is None:
                    raise ValueError(f"chunks end before frame {plan.seq} of {len(self.plan)}")
                host = np.asarray(chunk.data)
            if host.dtype != self.layout.np_dtype or host.shape[2:] != self.layout.token_shape:
                raise ValueError(f"chunk {host.shape}/{host.dtype} does not match the layout")
            rows = slice(plan.token_start - chunk.token_start, plan.token_end - chunk.token_start)
            first = plan.layer_start - chunk.layer_start
            # One contiguous byte view per layer: no copy until serialize_frame joins them.
            parts = tuple(
                host[layer, rows].reshape(-1).view(np.uint8)
                for layer in range(first, first + plan.num_layers)
            )
            ids = block_ids[plan.block_start : plan.block_start + plan.num_blocks] if block_ids else []
            header = pb.KVFrameHeader(
                request_id=self.request_id,
                seq=plan.seq,
                num_frames=len(self.plan),
                request_num_tokens=self.num_tokens,
                layout_fingerprint=self._fingerprint,
                layer_start=plan.layer_start,
                layer_end=plan.layer_end,
                token_start=plan.token_start,
                token_end=plan.token_end,
                block_ids=ids,
                shape=(plan.num_layers, plan.num_tokens, *self.layout.token_shape),
                dtype=_DTYPE_TO_PB[self.layout.dtype],
                payload_bytes=sum(p.nbytes for p in parts),
                payload_crc32c=crc32c(parts),
                bucket_blocks=plan.bucket,
            )
            if header.ByteSize() + _PREFIX.size > HEADER_RESERVE_BYTES:
                raise ValueError(f"frame header of {header.ByteSize()} B exceeds the reserve")
            yield Frame(header, parts)


def _valid_scales(scales: np.ndarray) -> bool:
    """Whether a quantized frame's scales can be read: a peer whose crc32c holds may still send NaN,
    infinite or negative ones, which would turn a request's attention into NaNs."""
    return bool(np.isfinite(scales).all() and (scales >= 0).all())


def _contains(chunk: KVChunk, plan) -> bool:
    return (
        chunk.layer_start <= plan.layer_start
        and plan.layer_end <= chunk.layer_start + chunk.num_layers
        and chunk.token_start <= plan.token_start
        and plan.token_end <= chunk.token_start + chunk.num_tokens
    )


class FrameAssembler:
    """Receive side of one request: verifies frames in stream order and returns them as chunks.

    add(frame) -> KVChunk in dst's physical layout (heads converted, tokens padded to a bucket of blocks),
    placed with `sharding` if given, else a host array; finish() checks that nothing is missing.
    After any FrameError the assembler refuses further frames.
    """

    def __init__(self, request_id: str, num_tokens: int, src: KVLayout, dst: KVLayout, sharding=None):
        self.request_id, self.num_tokens = request_id, num_tokens
        self.src, self.dst, self.sharding = src, dst, sharding
        self.map = head_map(src, dst)  # raises LayoutMismatchError first
        self._fingerprint = src.fingerprint()
        self._next_seq, self._num_frames, self._failed = 0, None, False
        num_blocks = cdiv(num_tokens, src.block_size)
        self._needed = np.zeros((src.num_cache_layers, num_blocks), bool)  # [cache layer, block]
        for layer in range(src.num_cache_layers):
            self._needed[layer, src.first_needed_block(layer, num_tokens) :] = True
        self._covered = np.zeros_like(self._needed)

    def _fail(self, kind: str, message: str):
        self._failed = True
        raise FrameError(kind, f"request {self.request_id!r}: {message}")

    def _check_header(self, h: pb.KVFrameHeader) -> None:
        if h.request_id != self.request_id:
            self._fail("invalid", f"frame of request {h.request_id!r}")
        if h.seq < self._next_seq:
            self._fail("duplicate", f"frame {h.seq} again after {self._next_seq - 1}")
        if h.seq > self._next_seq:
            self._fail("reordered", f"frame {h.seq} where {self._next_seq} was due")
        if self._num_frames is not None and h.num_frames != self._num_frames:
            self._fail("invalid", f"num_frames changed from {self._num_frames} to {h.num_frames}")
        if h.seq >= h.num_frames:
            self._fail("invalid", f"frame {h.seq} of {h.num_frames}")
        if h.request_num_tokens != self.num_tokens or h.layout_fingerprint != self._fingerprint:
            self._fail("invalid", "frame is for another request length or layout")
        bs = self.src.block_size
        nl, nt = h.layer_end - h.layer_start, h.token_end - h.token_start
        expected = (nl, nt, *self.src.token_shape)
        if h.dtype != _DTYPE_TO_PB[self.src.dtype] or tuple(h.shape) != expected or nl <= 0 or nt <= 0:
            self._fail(
                "invalid", f"shape {tuple(h.shape)} dtype {h.dtype}; expected {expected} {self.src.dtype}"
            )
        if h.token_start % bs or h.layer_end > self.src.num_cache_layers or h.token_end > self.num_tokens:
            self._fail(
                "invalid", f"layers [{h.layer_start}, {h.layer_end}) tokens [{h.token_start}, {h.token_end})"
            )
        if h.token_end % bs and h.token_end != self.num_tokens:
            self._fail("invalid", f"token_end {h.token_end} ends inside a block")
        if h.bucket_blocks and not cdiv(nt, bs) <= h.bucket_blocks <= bucket_blocks(cdiv(nt, bs)):
            self._fail("invalid", f"bucket of {h.bucket_blocks} blocks for {nt} tokens")
        area = (slice(h.layer_start, h.layer_end), slice(h.token_start // bs, cdiv(h.token_end, bs)))
        if self._covered[area].any():
            self._fail("duplicate", f"frame {h.seq} repeats blocks already received")
        if not self._needed[area].all():
            self._fail("invalid", f"frame {h.seq} carries blocks the request does not need")

    def add(self, frame: Frame) -> KVChunk:
        if self._failed:
            raise FrameError("invalid", f"request {self.request_id!r}: stream already failed")
        h = frame.header
        self._check_header(h)
        nbytes = sum(memoryview(p).nbytes for p in frame.payload)
        expected = math.prod(h.shape) * self.src.np_dtype.itemsize
        if nbytes != expected or h.payload_bytes != expected:
            self._fail("truncated", f"frame {h.seq} payload {nbytes} bytes, expected {expected}")
        if crc32c(frame.payload) != h.payload_crc32c:
            self._fail("corrupt", f"frame {h.seq} payload crc32c mismatch")
        self._num_frames = h.num_frames
        self._next_seq += 1
        bs = self.src.block_size
        self._covered[h.layer_start : h.layer_end, h.token_start // bs : cdiv(h.token_end, bs)] = True
        return self._to_chunk(h, frame.payload)

    def _to_chunk(self, h: pb.KVFrameHeader, payload: tuple) -> KVChunk:
        nl, nt = h.shape[0], h.shape[1]
        buf = payload[0] if len(payload) == 1 else b"".join(payload)
        src = np.frombuffer(buf, self.src.np_dtype).reshape(tuple(h.shape))
        if self.src.scale_bytes and not _valid_scales(self.src.scales(src)):
            self._fail("corrupt", f"frame {h.seq} carries scales that are not finite and >= 0")
        padded = (h.bucket_blocks or bucket_blocks(cdiv(nt, self.dst.block_size))) * self.dst.block_size
        if padded == nt and self.map.is_identity:
            data = src  # read-only view of the message; device_put copies it
        else:
            data = np.empty((nl, padded, *self.dst.token_shape), self.dst.np_dtype)
            self.map.apply_numpy(src, data[:, :nt])
            data[:, nt:] = 0
        if self.sharding is not None:
            data = reshard(data, self.sharding)
        return KVChunk(h.layer_start, h.token_start, nt, data)

    def finish(self) -> None:
        """Raises FrameError("truncated") unless every frame and every needed block has arrived."""
        if self._failed:
            raise FrameError("invalid", f"request {self.request_id!r}: stream already failed")
        if self._num_frames is None and self._needed.any():
            self._fail("truncated", "no frames arrived")
        missing = int((self._needed & ~self._covered).sum())
        if self._num_frames is not None and self._next_seq != self._num_frames or missing:
            self._fail(
                "truncated", f"{self._next_seq} of {self._num_frames} frames, {missing} blocks missing"
            )
