"""A prefill-server reached over gRPC (services.decode.prefillers.Prefiller): the Handshake that compares
KV layouts and starts following the replica's KV events (services.decode.prefix_index), and the Prefill
stream whose KV frames are verified and put on the decode mesh as they arrive; each failure is a
PrefillError that says whether the replica is down, refused this request, or is busy."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from pdserve import kvtransfer
from pdserve.engine.core.request import Request
from pdserve.kvtransfer import KVChunk, KVLayout
from pdserve.services import sampling, wire
from pdserve.services.decode.prefillers import FirstToken, PrefillCall, Prefiller, PrefillError
from pdserve.services.decode.prefix_index import ReplicaCache, follow
from pdserve.services.grpc_server import KEEPALIVE_OPTIONS, channel_options, method_path
from pdserve.services.kv_events_zmq import CurveKeys, ReaderCredentials
from pdserve.services.security import PLAINTEXT, ChannelSecurity
from pdserve.services.tracing import TRACEPARENT
from pdserve.v1 import prefill_pb2 as pb

log = logging.getLogger(__name__)

# Refusals of one request (its adapter is missing or differs there; the engine failed on it and serves
# on; the handler raised on it), not a sign of a broken replica.
_REQUEST_REFUSALS = (
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
)
# A replica that is up but busy: its queue is full (RESOURCE_EXHAUSTED, with a retry-after-ms hint), or
# it did not finish within the call's deadline.
_BUSY = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED)
DEFAULT_RETRY_AFTER_MS = 100


def _retry_after_ms(error: grpc.aio.AioRpcError) -> int:
    """The retry-after-ms hint of a busy replica's trailing metadata (a default when absent or odd)."""
    for key, value in error.trailing_metadata() or ():
        if key == "retry-after-ms" and str(value).isdigit():
            return min(int(value), 10_000)
    return DEFAULT_RETRY_AFTER_MS


class RemotePrefiller(Prefiller):
    """A prefill-server reached over gRPC; KV frames are verified and put on the decode mesh on arrival."""

    def __init__(
        self,
        target: str,
        dst: KVLayout,
        deadline_s: float = 120.0,
        security: ChannelSecurity = PLAINTEXT,
        events_resync_s: float = 2.0,
        on_layout: Callable[[KVLayout], Awaitable[None]] | None = None,
    ):
        self.name = target
        self.dst = dst
        self.on_layout = on_layout  # awaited with the replica's layout at each handshake, before its use
        self.deadline_s = deadline_s
        self.events_resync_s = events_resync_s
        self._follower: asyncio.Task | None = None
        self._events_source = ("", b"")  # the endpoint and key followed
        self._greeting: asyncio.Task | None = None  # a Handshake the events asked for (_greet_again)
        self._events_keys = CurveKeys.generate()  # what this server reads the replica's KV events with
        self.features: frozenset[str] = frozenset()  # HandshakeResponse.features
        self.metadata = security.metadata  # the bearer token a replica asks for (--prefill-auth-token-file)
        self.channel = security.open(
            target,
            options=[
                *channel_options(),
                *KEEPALIVE_OPTIONS,
                # a replica that restarts is reconnected within seconds, not gRPC's default 2 minutes
                ("grpc.initial_reconnect_backoff_ms", 500),
                ("grpc.min_reconnect_backoff_ms", 500),
                ("grpc.max_reconnect_backoff_ms", 3_000),
            ],
            aio=True,
        )
        service = pb.DESCRIPTOR.services_by_name["Prefill"]
        self._prefill = self.channel.unary_stream(
            method_path(service, "Prefill"),
            request_serializer=pb.PrefillRequest.SerializeToString,
            response_deserializer=wire.deserialize_prefill_message,
        )
        self._handshake = self.channel.unary_unary(
            method_path(service, "Handshake"),
            request_serializer=pb.HandshakeRequest.SerializeToString,
            response_deserializer=pb.HandshakeResponse.FromString,
        )
        self.src: KVLayout | None = None

    def mark_failed(self, backoff_s: float = 2.0) -> None:
        super().mark_failed(backoff_s)
        self.src = None  # greet it again: it may be a new process (other layout, other event ports)

    def held_less(self, missing: list[int]) -> None:
        super().held_less(missing)
        self.src = None  # its events may come from elsewhere now (a restart on other event ports)

    async def handshake(self) -> KVLayout:
        """Compares layouts (raises PrefillError naming the differences when they do not fit) and follows
        the replica's KV events when it publishes them."""
        try:
            handshake = pb.HandshakeRequest(
                layout_json=self.dst.to_json(), kv_events_key=self._events_keys.public.decode()
            )
            reply = await self._handshake(handshake, timeout=10, metadata=self.metadata)
        except grpc.aio.AioRpcError as e:
            raise PrefillError(f"{self.name}: handshake failed: {e.code().name}: {e.details()}") from e
        src = KVLayout.from_json(reply.layout_json)
        try:
            kvtransfer.head_map(src, self.dst)  # raises LayoutMismatchError when it cannot convert
        except kvtransfer.LayoutMismatchError as e:
            raise PrefillError(f"{self.name}: {e}") from e
        if self.on_layout is not None:
            await self.on_layout(src)
        self.src = src
        self.features = frozenset(reply.features)
        if reply.kv_events_port:
            self._follow_events(reply)
        return src

    def _follow_events(self, reply: pb.HandshakeResponse) -> None:
        host = self.name.rpartition(":")[0]
        endpoint = f"tcp://{host}:{reply.kv_events_port}"
        key = reply.kv_events_key.encode()  # a restart on the same ports has a new one
        if (
            self._follower is not None
            and not self._follower.done()
            and (endpoint, key) == self._events_source
        ):
            return
        if self._follower is not None:
            self._follower.cancel()
        if self.cache is None:  # kept across sources: a restarted replica's replay rebuilds it
            self.cache = ReplicaCache(self.name)
        self._events_source = (endpoint, key)
        replay_endpoint = f"tcp://{host}:{reply.kv_events_replay_port}"
        credentials = ReaderCredentials(self._events_keys, key) if key else None
        self._follower = asyncio.create_task(
            follow(
                self.cache,
                endpoint,
                replay_endpoint,
                reply.kv_events_topic,
                self.events_resync_s,
                credentials,
                on_lost=self._greet_again,
            ),
            name=f"kv-events {self.name}",
        )

    def _greet_again(self) -> None:
        """The events' replay failed: the replica may have restarted (other ports, another CURVE key), so
        the Handshake is repeated (once at a time), which follows its stream anew when that changed."""
        if self._greeting is None or self._greeting.done():
            self._greeting = asyncio.create_task(self._quiet_handshake(), name=f"handshake {self.name}")

    async def _quiet_handshake(self) -> None:
        try:
            await self.handshake()
        except PrefillError as e:  # down or changed: requests find out and say so; the events retry
            log.debug("%s", e)

    async def prefill(
        self, request: Request, dst: KVLayout, sharding, call: PrefillCall
    ) -> AsyncIterator[FirstToken | KVChunk]:
        held, timeout, traceparent = call.held, call.timeout, call.traceparent
        if self.src is None:
            await self.handshake()
        constraint = request.params.constraint
        if constraint is not None and wire.CONSTRAINTS_FEATURE not in self.features:
            raise PrefillError(
                f"{self.name}: samples under no constraint (an older prefill server)", replica_down=False
            )
        message = pb.PrefillRequest(
            request_id=request.request_id,
            prompt_ids=request.prompt_ids,
            seed=request.seed,
            layout_fingerprint=self.dst.fingerprint(),
            lora_adapter=request.lora.name if request.lora else "",
            lora_fingerprint=request.lora.fingerprint if request.lora else "",
            cache_salt=request.cache_salt or "",
            held_block_hashes=held,
            constraint_fingerprint=constraint.fingerprint if constraint is not None else "",
        )
        sampling.params_to_request(request.params, message)
        metadata = self.metadata if traceparent is None else (*self.metadata, (TRACEPARENT, traceparent))
        call = self._prefill(
            message, timeout=min(self.deadline_s, timeout or self.deadline_s), metadata=metadata
        )
        assembler, order = None, wire.PrefillStreamOrder()
        try:
            async for item in call:
                kind = order.read(item)
                if kind == "frame":
                    frame = kvtransfer.deserialize_frame(item.data)
                    yield await asyncio.to_thread(assembler.add, frame)
                elif kind == "header":
                    header = item.header
                    _check_adapter(request, header.lora_adapter, header.lora_fingerprint, self.name)
                    if header.first_block != len(held) or header.prompt_len != len(request.prompt_ids):
                        raise PrefillError(
                            f"{self.name}: KV of {header.prompt_len} tokens from block {header.first_block}, "
                            f"asked for {len(request.prompt_ids)} from block {len(held)}"
                        )
                    if header.prompt_digest != wire.prompt_digest(request.prompt_ids):
                        raise PrefillError(f"{self.name}: KV computed for another prompt")  # a broken replica
                    src = KVLayout.from_json(header.layout_json)
                    num_tokens = header.prompt_len - header.first_block * src.block_size
                    assembler = kvtransfer.FrameAssembler(
                        request.request_id, num_tokens, src, dst, sharding=sharding
                    )
                else:  # the trailer
                    assembler.finish()
                    trailer = item.trailer
                    logprobs = None
                    if trailer.HasField("first_logprobs"):
                        logprobs = wire.logprobs_from_proto(trailer.first_logprobs)
                    prompt_logprobs = []  # (read off the event loop: their size is the prompt's)
                    if trailer.prompt_logprobs:
                        prompt_logprobs = await asyncio.to_thread(
                            list, map(wire.logprobs_from_proto, trailer.prompt_logprobs)
                        )
                    forks = tuple(
                        (f.token, wire.logprobs_from_proto(f.logprobs) if f.HasField("logprobs") else None)
                        for f in trailer.forks
                    )
                    try:
                        aux = wire.draft_aux_from_bytes(trailer.draft_aux) if trailer.draft_aux else None
                    except ValueError as e:
                        raise PrefillError(f"{self.name}: trailer {e}") from None
                    yield FirstToken(
                        trailer.first_token,
                        logprobs,
                        trailer.num_cached_tokens,
                        prompt_logprobs if request.params.prompt_logprobs is not None else None,
                        forks,
                        aux,
                    )
                    return
            order.end()
        except wire.PrefillProtocolError as e:
            raise PrefillError(f"{self.name}: {e}") from e
        except grpc.aio.AioRpcError as e:
            message = f"{self.name}: {e.code().name}: {e.details()}"
            if e.code() in _BUSY:
                raise PrefillError(message, retry_after_ms=_retry_after_ms(e)) from e
            raise PrefillError(message, replica_down=e.code() not in _REQUEST_REFUSALS) from e
        except PrefillError:
            raise
        except Exception as e:  # noqa: BLE001 - anything wrong with a stream makes it unusable, never fatal
            raise PrefillError(f"{self.name}: bad KV stream: {type(e).__name__}: {e}") from e
        finally:
            call.cancel()

    async def close(self) -> None:
        for task in (self._follower, self._greeting):
            if task is not None:
                task.cancel()
        await self.channel.close()


def _check_adapter(request: Request, name: str, fingerprint: str, replica: str) -> None:
    """The KV must come from the request's own adapter (or the base model for a base request)."""
    want = (request.lora.name, request.lora.fingerprint) if request.lora else ("", "")
    if (name, fingerprint) != want:
        raise PrefillError(
            f"{replica}: KV computed with adapter {name or 'none'!r}, the request uses {want[0] or 'none'!r}"
        )
