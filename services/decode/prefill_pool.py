"""Where a decode server gets its prompts prefilled: remote prefill servers (gRPC) or an engine in this
process (`pdserve serve`), behind one interface, and the pool that picks a replica.

`Prefiller.prefill(request, dst_layout, dst_sharding, held=...)` yields, in order: a FirstToken, then
KVChunks already placed on the decode mesh in the decode layout, carrying the prompt's tokens from block
`FirstToken.first_block` on (the blocks before it are the `held` ones, which the decode side has), then
returns. Any failure raises PrefillError and
nothing yielded so far may be used: the caller frees the blocks it reserved and retries elsewhere.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import logging
import socket
import time
from collections.abc import AsyncIterator

import grpc

import kvtransfer
from engine.request import Request, TokenLogprobs
from engine.sampling_params import InvalidRequestError
from kvtransfer import KVChunk, KVLayout
from pdserve.v1 import prefill_pb2 as pb
from services import sampling, wire
from services.engine_loop import EngineLoop
from services.grpc_server import channel_options
from services.prefill.runner import install_connector, prefill_on_engine
from services.security import PLAINTEXT, ChannelSecurity

log = logging.getLogger(__name__)


class PrefillError(RuntimeError):
    """A prefill failed (unreachable, died mid-stream, bad frame, layout mismatch, adapter not there).

    `replica_down`: the replica itself failed (avoid it for a while), rather than refused this request."""

    def __init__(self, message: str, replica_down: bool = True):
        super().__init__(message)
        self.replica_down = replica_down


# Refusals of one request (its adapter is missing or differs there), not a sign of a broken replica.
_REQUEST_REFUSALS = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION)


@dataclasses.dataclass
class FirstToken:
    token: int
    logprobs: TokenLogprobs | None
    num_cached_tokens: int = 0  # prompt tokens the replica found in its prefix cache
    first_block: int = 0  # the chunks that follow start at this block of the prompt


class Prefiller(abc.ABC):
    name: str
    outstanding: int = 0  # requests in flight: the pool picks the replica with the fewest
    down_until: float = 0.0  # after a failure the replica is avoided until then (monotonic seconds)

    @property
    def healthy(self) -> bool:
        return time.monotonic() >= self.down_until

    def mark_failed(self, backoff_s: float = 2.0) -> None:
        self.down_until = time.monotonic() + backoff_s

    @abc.abstractmethod
    def prefill(
        self, request: Request, dst: KVLayout, sharding, timeout: float | None = None, held: list[int] = ()
    ) -> AsyncIterator[FirstToken | KVChunk]:
        """`timeout`: seconds left of the client's deadline (None: none); `held`: hashes of the prompt's
        leading blocks the decode side holds (their KV is not sent)."""

    async def close(self) -> None:
        return None


class RemotePrefiller(Prefiller):
    """A prefill-server reached over gRPC; KV frames are verified and put on the decode mesh on arrival."""

    def __init__(
        self,
        target: str,
        dst: KVLayout,
        deadline_s: float = 120.0,
        security: ChannelSecurity = PLAINTEXT,
    ):
        self.name = target
        self.dst = dst
        self.deadline_s = deadline_s
        self.channel = security.open(
            target,
            options=[
                *channel_options(),
                ("grpc.keepalive_time_ms", 10_000),
                ("grpc.keepalive_timeout_ms", 5_000),
                # a replica that restarts is reconnected within seconds, not gRPC's default 2 minutes
                ("grpc.initial_reconnect_backoff_ms", 500),
                ("grpc.min_reconnect_backoff_ms", 500),
                ("grpc.max_reconnect_backoff_ms", 3_000),
            ],
            aio=True,
        )
        self._prefill = self.channel.unary_stream(
            "/pdserve.v1.Prefill/Prefill",
            request_serializer=pb.PrefillRequest.SerializeToString,
            response_deserializer=wire.deserialize_prefill_message,
        )
        self._handshake = self.channel.unary_unary(
            "/pdserve.v1.Prefill/Handshake",
            request_serializer=pb.HandshakeRequest.SerializeToString,
            response_deserializer=pb.HandshakeResponse.FromString,
        )
        self.src: KVLayout | None = None

    async def handshake(self) -> KVLayout:
        """Compares layouts; raises PrefillError (naming the differences) when they do not fit."""
        try:
            reply = await self._handshake(pb.HandshakeRequest(layout_json=self.dst.to_json()), timeout=10)
        except grpc.aio.AioRpcError as e:
            raise PrefillError(f"{self.name}: handshake failed: {e.code().name}: {e.details()}") from e
        src = KVLayout.from_json(reply.layout_json)
        try:
            kvtransfer.head_map(src, self.dst)  # raises LayoutMismatchError when it cannot convert
        except kvtransfer.LayoutMismatchError as e:
            raise PrefillError(f"{self.name}: {e}") from e
        self.src = src
        return src

    async def prefill(
        self, request: Request, dst: KVLayout, sharding, timeout: float | None = None, held: list[int] = ()
    ) -> AsyncIterator[FirstToken | KVChunk]:
        if self.src is None:
            await self.handshake()
        message = pb.PrefillRequest(
            request_id=request.request_id,
            prompt_ids=request.prompt_ids,
            seed=request.seed,
            layout_fingerprint=self.dst.fingerprint(),
            lora_adapter=request.lora.name if request.lora else "",
            lora_fingerprint=request.lora.fingerprint if request.lora else "",
            held_block_hashes=held,
        )
        sampling.params_to_request(request.params, message)
        call = self._prefill(message, timeout=min(self.deadline_s, timeout or self.deadline_s))
        assembler = None
        try:
            async for item in call:
                if item is None:  # grpc.aio hands out None when the deserializer failed
                    raise PrefillError(f"{self.name}: undecodable Prefill message")
                if isinstance(item, wire.KVFrameBytes):
                    if assembler is None:
                        raise PrefillError(f"{self.name}: KV frame before the header")
                    frame = kvtransfer.deserialize_frame(item.data)
                    yield await asyncio.to_thread(assembler.add, frame)
                elif item.HasField("header"):
                    header = item.header
                    _check_adapter(request, header.lora_adapter, header.lora_fingerprint, self.name)
                    if header.first_block != len(held) or header.prompt_len != len(request.prompt_ids):
                        raise PrefillError(
                            f"{self.name}: KV of {header.prompt_len} tokens from block {header.first_block}, "
                            f"asked for {len(request.prompt_ids)} from block {len(held)}"
                        )
                    src = KVLayout.from_json(header.layout_json)
                    num_tokens = header.prompt_len - header.first_block * src.block_size
                    assembler = kvtransfer.FrameAssembler(
                        request.request_id, num_tokens, src, dst, sharding=sharding
                    )
                    logprobs = None
                    if header.HasField("first_logprobs"):
                        logprobs = wire.logprobs_from_proto(header.first_logprobs)
                    yield FirstToken(
                        header.first_token, logprobs, header.num_cached_tokens, header.first_block
                    )
                elif item.HasField("trailer"):
                    if assembler is None:
                        raise PrefillError(f"{self.name}: trailer before the header")
                    assembler.finish()
                    return
            raise PrefillError(f"{self.name}: stream ended without a trailer")
        except grpc.aio.AioRpcError as e:
            down = e.code() not in _REQUEST_REFUSALS
            raise PrefillError(f"{self.name}: {e.code().name}: {e.details()}", replica_down=down) from e
        except PrefillError:
            raise
        except Exception as e:  # noqa: BLE001 - anything wrong with a stream makes it unusable, never fatal
            raise PrefillError(f"{self.name}: bad KV stream: {type(e).__name__}: {e}") from e
        finally:
            call.cancel()

    async def close(self) -> None:
        await self.channel.close()


class LocalPrefiller(Prefiller):
    """An engine of this process on other devices (the single-controller shape of `pdserve serve`).

    The gather converts heads to the decode layout, in chunks of up to kvtransfer.LOCAL_CHUNK_BYTES; each
    moves with kvtransfer.move_chunk (jax.device_put, host memory aliased between CPU devices, or Pathways'
    reshard under JAX_PLATFORMS=proxy).
    """

    def __init__(self, loop: EngineLoop, src: KVLayout):
        self.name = "local"
        self.loop = loop
        self.src = src
        install_connector(loop.engine)

    async def prefill(
        self, request: Request, dst: KVLayout, sharding, timeout: float | None = None, held: list[int] = ()
    ) -> AsyncIterator[FirstToken | KVChunk]:
        lora = request.lora
        try:
            mine = self.loop.engine.make_request(
                list(request.prompt_ids),
                request.params,
                request.request_id,
                lora=lora.name if lora else None,
                lora_fingerprint=lora.fingerprint if lora else None,
            )
        except InvalidRequestError as e:
            raise PrefillError(f"{self.name}: {e}", replica_down=False) from e
        mine.seed = request.seed
        head_map = kvtransfer.head_map(self.src, dst)
        result = await prefill_on_engine(
            self.loop, mine, head_map, kvtransfer.LOCAL_CHUNK_BYTES, first_block=len(held)
        )
        first = result.first
        logprobs = first.logprobs[0] if first.logprobs else None
        yield FirstToken(first.new_token_ids[0], logprobs, first.num_cached_tokens, len(held))
        chunks = result.chunks
        while chunks:
            yield kvtransfer.move_chunk(chunks.pop(0), sharding)


def _check_adapter(request: Request, name: str, fingerprint: str, replica: str) -> None:
    """The KV must come from the request's own adapter (or the base model for a base request)."""
    want = (request.lora.name, request.lora.fingerprint) if request.lora else ("", "")
    if (name, fingerprint) != want:
        raise PrefillError(
            f"{replica}: KV computed with adapter {name or 'none'!r}, the request uses {want[0] or 'none'!r}"
        )


class PrefillPool:
    """Prefill replicas; `pick()` returns the healthy one with the least outstanding work.

    Targets are host:port, or dns:///name:port (a Kubernetes headless service): every address the name
    resolves to becomes a replica, re-resolved by `refresh()`. `security`: TLS / mutual TLS to the replicas.
    """

    def __init__(self, targets: list[str], dst: KVLayout, security: ChannelSecurity = PLAINTEXT):
        self.targets = targets
        self.dst = dst
        self.security = security
        self.replicas: dict[str, Prefiller] = {}

    @classmethod
    def of(cls, replica: Prefiller, dst: KVLayout) -> PrefillPool:
        """A pool of one given replica (the local prefill engine of `pdserve serve`): nothing to resolve."""
        pool = cls([], dst)
        pool.replicas[replica.name] = replica
        return pool

    @staticmethod
    def resolve(target: str) -> list[str]:
        if not target.startswith("dns:///"):
            return [target]
        host, _, port = target[len("dns:///") :].rpartition(":")
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        addresses = {info[4][0] for info in infos}
        return sorted(f"[{a}]:{port}" if ":" in a else f"{a}:{port}" for a in addresses)

    async def refresh(self) -> None:
        wanted = {addr for target in self.targets for addr in self.resolve(target)}
        for addr in wanted - self.replicas.keys():
            self.replicas[addr] = RemotePrefiller(addr, self.dst, security=self.security)
        for addr in self.replicas.keys() - wanted:
            await self.replicas.pop(addr).close()

    def pick(self, exclude: set[str] = frozenset()) -> Prefiller | None:
        candidates = [r for r in self.replicas.values() if r.healthy and r.name not in exclude]
        if not candidates:
            candidates = [r for r in self.replicas.values() if r.name not in exclude]
        return min(candidates, key=lambda r: r.outstanding, default=None)

    async def close(self) -> None:
        for replica in self.replicas.values():
            await replica.close()
