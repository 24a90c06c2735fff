"""Transports: one interface, two ways to move a request's KV from a prefill cache into a decode cache.

- LocalTransport: both roles in one process on disjoint device sets; chunks stay device arrays and move
  with jax.device_put (or Pathways reshard), heads converted on the source side in the gather itself.
- GrpcTransport: separate processes; the decode side pulls a stream of frames (codec.py) from the
  prefill side's KVTransfer service, verifies each and puts it on its own mesh.
"""

from __future__ import annotations

import abc
import threading
from collections.abc import Iterator, Sequence
from concurrent import futures

import grpc
import jax
import numpy as np
from jax.sharding import Mesh

from kvtransfer.codec import FrameAssembler, FrameEncoder, deserialize_frame, serialize_frame
from kvtransfer.gather import gather_request
from kvtransfer.layout import KVLayout, head_map
from kvtransfer.pipeline import prefetch
from kvtransfer.plan import MAX_FRAME_BYTES, KVChunk
from kvtransfer.reshard import chunk_sharding, on_pathways, reshard

SERVICE = "pdserve.v1.KVTransfer"
PULL_METHOD = f"/{SERVICE}/Pull"  # unary_stream: utf-8 request id -> KV frames
LAYOUT_METHOD = f"/{SERVICE}/GetLayout"  # unary_unary: b"" -> KVLayout JSON


def grpc_options(max_frame_bytes: int) -> list[tuple[str, int]]:
    """Channel/server options: messages a little above the frame size (gRPC's default is 4 MiB)."""
    limit = max(max_frame_bytes, 4 << 20) + (64 << 10)
    return [("grpc.max_receive_message_length", limit), ("grpc.max_send_message_length", limit)]


class TransportError(RuntimeError):
    """The transfer could not happen (unknown request, peer unreachable or failed mid-stream)."""


class _Outbox:
    """Chunks offered by send(), each request taken by exactly one receive()."""

    def __init__(self):
        self._lock = threading.Lock()
        self._items: dict[str, tuple[list[KVChunk], list[int], int]] = {}

    def put(self, request_id: str, item: tuple[list[KVChunk], list[int], int]) -> None:
        with self._lock:
            if request_id in self._items:
                raise ValueError(f"request {request_id!r} already sent")
            self._items[request_id] = item

    def take(self, request_id: str) -> tuple[list[KVChunk], list[int], int]:
        with self._lock:
            if request_id not in self._items:
                raise TransportError(f"no KV sent for request {request_id!r}")
            return self._items.pop(request_id)

    def discard(self, request_id: str) -> bool:
        with self._lock:
            return self._items.pop(request_id, None) is not None


def _drain(chunks: list[KVChunk]) -> Iterator[KVChunk]:
    """Yields chunks, dropping each from the list so its memory goes once it has been used."""
    while chunks:
        yield chunks.pop(0)


class KVTransport(abc.ABC):
    """Moves one request's KV from the prefill side to the decode side.

    send() runs on the prefill side right after prefill: it dispatches the request's gathers at once, so
    the engine may keep donating its cache, and offers the chunks to one receive() of that request_id.
    receive() runs on the decode side: it yields KVChunks on the destination mesh in the destination's
    physical layout, in plan order (by layer, then token), each verified before it is yielded, ready for
    insert(); any failure raises (FrameError, LayoutMismatchError, TransportError) and ends the stream,
    so a request is never decoded from a partial cache: free its blocks and retry.
    discard() drops a request that will not be received (client cancel).
    """

    def __init__(self, layout: KVLayout, max_frame_bytes: int = MAX_FRAME_BYTES):
        self.layout = layout
        self.max_frame_bytes = max_frame_bytes
        self._outbox = _Outbox()

    @abc.abstractmethod
    def send(self, request_id: str, cache, block_ids: Sequence[int], num_tokens: int) -> None: ...

    @abc.abstractmethod
    def receive(self, request_id: str, num_tokens: int) -> Iterator[KVChunk]: ...

    def discard(self, request_id: str) -> bool:
        return self._outbox.discard(request_id)

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Releases servers and channels; the default has none."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


LOCAL_CHUNK_BYTES = 64 << 20  # no wire: chunks as large as this, so a request is a few kernels


def _to_mesh(data, sharding):
    """A chunk onto the destination sharding. Between CPU devices of one process the bytes are already
    in host memory: the destination array aliases the chunk (no copy) where XLA allows it."""
    cpu = all(d.platform == "cpu" for d in (*data.devices(), *sharding.device_set))
    if cpu and not on_pathways():
        return jax.device_put(np.asarray(data), sharding, may_alias=True)
    return reshard(data, sharding)


class LocalTransport(KVTransport):
    """Within one process: source cache laid out as `layout`, destination as dst_layout on dst_mesh.
    No wire, so chunks are up to max_frame_bytes = LOCAL_CHUNK_BYTES (a few per request)."""

    def __init__(
        self, layout: KVLayout, dst_layout: KVLayout, dst_mesh: Mesh, max_frame_bytes=LOCAL_CHUNK_BYTES
    ):
        super().__init__(layout, max_frame_bytes)
        self.dst_layout = dst_layout
        self._map = head_map(layout, dst_layout)  # checks compatibility before any transfer
        self._sharding = chunk_sharding(dst_mesh, dst_layout)

    def send(self, request_id, cache, block_ids, num_tokens):
        chunks = gather_request(
            cache,
            self.layout,
            list(block_ids),
            num_tokens,
            max_frame_bytes=self.max_frame_bytes,
            head_map=self._map,
        )
        self._outbox.put(request_id, (chunks, list(block_ids), num_tokens))

    def receive(self, request_id, num_tokens):
        chunks, _, sent_tokens = self._outbox.take(request_id)
        if sent_tokens != num_tokens:
            raise TransportError(f"request {request_id!r} sent {sent_tokens} tokens, expected {num_tokens}")
        for chunk in _drain(chunks):
            yield KVChunk(
                chunk.layer_start, chunk.token_start, chunk.num_tokens, _to_mesh(chunk.data, self._sharding)
            )


class GrpcTransport(KVTransport):
    """Over gRPC. Prefill side: GrpcTransport(layout, listen="127.0.0.1:0") serves the KVTransfer service
    (see .port; or mount .handler() on a server of your own) and send() queues requests for it.
    Decode side: GrpcTransport(layout, mesh=..., peer=addr)
    receive()s from that server; it compares layouts (GetLayout) before the first transfer.
    """

    def __init__(
        self,
        layout: KVLayout,
        *,
        mesh: Mesh | None = None,
        listen: str | None = None,
        peer: str | None = None,
        max_frame_bytes: int = MAX_FRAME_BYTES,
        max_workers: int = 4,
        prefetch_depth: int = 1,
    ):
        super().__init__(layout, max_frame_bytes)
        self._sharding = chunk_sharding(mesh, layout) if mesh is not None else None
        self._server, self.port, self._channel, self._peer_layout = None, None, None, None
        self.prefetch_depth = prefetch_depth
        options = grpc_options(max_frame_bytes)
        if listen is not None:
            self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=options)
            self._server.add_generic_rpc_handlers((self.handler(),))
            self.port = self._server.add_insecure_port(listen)
            self._server.start()
        if peer is not None:
            self._channel = grpc.insecure_channel(peer, options=options)
            self._pull = self._channel.unary_stream(PULL_METHOD)  # raw bytes: deserialize_frame below
            self._get_layout = self._channel.unary_unary(LAYOUT_METHOD)

    def handler(self) -> grpc.GenericRpcHandler:
        """The KVTransfer service, for a server the caller owns (or the one started by `listen`)."""
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Pull": grpc.unary_stream_rpc_method_handler(
                    self._serve_pull, response_serializer=serialize_frame
                ),
                "GetLayout": grpc.unary_unary_rpc_method_handler(self._serve_layout),
            },
        )

    def _serve_layout(self, request: bytes, context) -> bytes:
        return self.layout.to_json().encode()

    def _serve_pull(self, request: bytes, context):
        request_id = request.decode()
        try:
            chunks, block_ids, num_tokens = self._outbox.take(request_id)
        except TransportError as e:
            context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        encoder = FrameEncoder(request_id, self.layout, num_tokens, self.max_frame_bytes)
        # The next frame is copied to host, checksummed and serialized while gRPC sends this one.
        frames = map(serialize_frame, encoder.frames(_drain(chunks), block_ids))
        yield from prefetch(frames, self.prefetch_depth)

    def send(self, request_id, cache, block_ids, num_tokens):
        chunks = gather_request(
            cache, self.layout, list(block_ids), num_tokens, max_frame_bytes=self.max_frame_bytes
        )
        self._outbox.put(request_id, (chunks, list(block_ids), num_tokens))

    def peer_layout(self) -> KVLayout:
        if self._peer_layout is None:
            try:
                self._peer_layout = KVLayout.from_json(self._get_layout(b"", timeout=30))
            except grpc.RpcError as e:
                raise TransportError(f"GetLayout failed: {e.code()} {e.details()}") from e
        return self._peer_layout

    def receive(self, request_id, num_tokens, timeout: float | None = None):
        if self._channel is None:
            raise TransportError("receive() needs a transport created with peer=")
        assembler = FrameAssembler(request_id, num_tokens, self.peer_layout(), self.layout, self._sharding)
        call = self._pull(request_id.encode(), timeout=timeout)
        # gRPC receives the next frame on a thread while this one is verified, put on the mesh and
        # inserted; at most prefetch_depth frames wait (bounded memory).
        messages = prefetch(call, self.prefetch_depth, on_close=call.cancel)
        try:
            for message in messages:
                chunk = assembler.add(deserialize_frame(message))
                del message  # the chunk is on the mesh (a copy): release the received bytes first
                yield chunk
                del chunk
            assembler.finish()
        except grpc.RpcError as e:
            raise TransportError(f"Pull {request_id!r} failed: {e.code()} {e.details()}") from e
        finally:
            messages.close()
            call.cancel()

    def close(self) -> None:
        if self._channel is not None:
            self._channel.close()
        if self._server is not None:
            self._server.stop(grace=None)
