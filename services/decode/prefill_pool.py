"""Where a decode server gets its prompts prefilled: remote prefill servers (gRPC) or an engine in this
process (`pdserve serve`), behind one interface, and the pool that picks a replica (`Routing`: by the
prompt blocks each replica holds, per its KV events, and the work queued on it).

`Prefiller.prefill(request, dst_layout, dst_sharding, held=...)` yields, in order: KVChunks already placed
on the decode mesh in the decode layout, carrying the prompt's tokens from block len(held) on (the blocks
before are the `held` ones, which the decode side has), each as soon as the replica has computed and sent
it, then the FirstToken, which confirms them all. Any failure raises PrefillError and nothing yielded so
far may be used: the caller rewrites the same blocks from another replica, or prefills them itself.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import logging
import math
import socket
import time
from collections.abc import AsyncIterator

import grpc
import numpy as np

from pdserve import kvtransfer
from pdserve.engine.core.request import Request, TokenLogprobs
from pdserve.engine.sampling_params import InvalidRequestError
from pdserve.kvtransfer import KVChunk, KVLayout
from pdserve.services import sampling, wire
from pdserve.services.decode.config import Routing
from pdserve.services.decode.prefix_index import ReplicaCache, follow
from pdserve.services.engine_loop import EngineLoop, EngineStopped
from pdserve.services.grpc_server import KEEPALIVE_OPTIONS, channel_options, method_path
from pdserve.services.kv_events_zmq import CurveKeys, ReaderCredentials
from pdserve.services.prefill_stream import PrefillFailed, PrefillStream, install_connector
from pdserve.services.security import PLAINTEXT, ChannelSecurity
from pdserve.v1 import prefill_pb2 as pb

log = logging.getLogger(__name__)


class PrefillError(RuntimeError):
    """A prefill failed (unreachable, died mid-stream, bad frame, layout mismatch, adapter not there).

    `replica_down`: the replica itself failed (avoid it for a while, forget what it was known to cache),
    rather than refused this request. `retry_after_ms`: the replica is busy (RESOURCE_EXHAUSTED, or too
    slow for the deadline): it is up, what it caches is still known, and it may take the request after
    that long."""

    def __init__(self, message: str, replica_down: bool = True, retry_after_ms: int | None = None):
        super().__init__(message)
        self.replica_down = replica_down and retry_after_ms is None
        self.retry_after_ms = retry_after_ms


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


@dataclasses.dataclass
class FirstToken:
    token: int
    logprobs: TokenLogprobs | None
    num_cached_tokens: int = 0  # prompt tokens the replica found in its prefix cache
    prompt_logprobs: list[TokenLogprobs] | None = None  # one per prompt position after the first, if asked
    # n > 1: the first tokens (and logprobs, if asked) of sequences 1..n-1
    forks: tuple[tuple[int, TokenLogprobs | None], ...] = ()
    # An EAGLE-3 head's input at the last prompt position (float32 [aux width]); None: none sent
    draft_aux: np.ndarray | None = None


class Prefiller(abc.ABC):
    name: str
    outstanding: int = 0  # requests in flight from this decode server
    pending_tokens: int = 0  # of those, the prompt tokens it is expected to compute (not cached there)
    down_until: float = 0.0  # after a failure the replica is avoided until then (monotonic seconds)
    cache: ReplicaCache | None = None  # what its prefix cache holds, per its KV events (None: unknown)

    @property
    def healthy(self) -> bool:
        return time.monotonic() >= self.down_until

    def mark_failed(self, backoff_s: float = 2.0) -> None:
        """The replica failed (unreachable, died): avoided for a while; what it cached may be gone."""
        self.down_until = time.monotonic() + backoff_s
        if self.cache is not None:
            self.cache.forget()

    def held_less(self, missing: list[int]) -> None:
        """A prefill here found the blocks `missing` uncached although the events said they were."""
        if self.cache is not None:
            self.cache.forget(missing)

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
        events_resync_s: float = 2.0,
    ):
        self.name = target
        self.dst = dst
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
        self, request: Request, dst: KVLayout, sharding, timeout: float | None = None, held: list[int] = ()
    ) -> AsyncIterator[FirstToken | KVChunk]:
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
        call = self._prefill(
            message, timeout=min(self.deadline_s, timeout or self.deadline_s), metadata=self.metadata
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
                dataclasses.replace(request.params, max_tokens=1),  # the first token
                request.request_id,
                lora=lora.name if lora else None,
                lora_fingerprint=lora.fingerprint if lora else None,
                seed=request.seed,
                cache_salt=request.cache_salt,
            )
        except InvalidRequestError as e:
            raise PrefillError(f"{self.name}: {e}", replica_down=False) from e
        stream = PrefillStream(
            self.loop, mine, kvtransfer.head_map(self.src, dst), kvtransfer.LOCAL_CHUNK_BYTES, len(held)
        )
        try:
            await stream.start()
            async for chunk in stream.achunks():  # each as its tokens are computed
                yield kvtransfer.move_chunk(chunk, sharding)
            first, *others = await stream.first_tokens()
        except PrefillFailed as e:  # the prefill engine failed on this request and serves on
            raise PrefillError(f"{self.name}: {e}", replica_down=False) from e
        except EngineStopped as e:
            raise PrefillError(f"{self.name}: the prefill engine stopped: {e}") from e
        finally:
            stream.close()
        logprobs = first.logprobs[0] if first.logprobs else None
        prompt_logprobs = first.prompt_logprobs[1:] if first.prompt_logprobs is not None else None
        forks = tuple((o.new_token_ids[0], o.logprobs[0] if o.logprobs else None) for o in others)
        aux = None if first.draft_aux is None else np.asarray(first.draft_aux, np.float32)
        yield FirstToken(
            first.new_token_ids[0], logprobs, first.num_cached_tokens, prompt_logprobs, forks, aux
        )


def check_first_token(
    first: FirstToken, request: Request, vocab_size: int, replica: str, draft_aux_width: int = 0
) -> None:
    """A replica's trailer, range-checked like a client's request (PrefillError, the replica at fault):
    the first token in the vocabulary, the cached tokens within the prompt, the logprobs only as asked
    (the sampled token's first, at most the top-n asked for, each id in the vocabulary, each logprob a
    finite number <= 0), one more first token for each sequence after the first (n > 1), checked alike,
    the prompt logprobs as asked (one per prompt token after the first, for that token, its rank in the
    vocabulary), and a draft head's input exactly where this server has a head (`draft_aux_width` finite
    values; 0: no head, none sent)."""

    def refuse(what: str):
        raise PrefillError(f"{replica}: trailer {what}")

    aux = first.draft_aux
    if (aux is not None) != bool(draft_aux_width):
        refuse(f"draft_aux {'sent' if aux is not None else 'missing'}: this server's draft head reads "
               f"{draft_aux_width} values")  # fmt: skip
    if aux is not None and (aux.shape != (draft_aux_width,) or not np.isfinite(aux).all()):
        refuse(f"draft_aux of {aux.size} values, not {draft_aux_width} finite ones")

    if not 0 <= first.num_cached_tokens <= len(request.prompt_ids):
        refuse(f"num_cached_tokens {first.num_cached_tokens} outside [0, {len(request.prompt_ids)}]")
    if len(first.forks) != request.params.n - 1:
        refuse(f"has {len(first.forks) + 1} first tokens for a request of n={request.params.n}")
    for token, lp in [(first.token, first.logprobs), *first.forks]:
        _check_sampled(token, lp, request.params.logprobs, vocab_size, refuse)
    asked, prompt = request.params.prompt_logprobs, request.prompt_ids
    if asked is None:
        return
    entries = first.prompt_logprobs or []
    if [e.token_id for e in entries] != prompt[1:]:
        refuse(f"prompt_logprobs are not those of the prompt's {len(prompt) - 1} tokens after the first")
    for entry in entries:
        if len(entry.top) > asked or not 1 <= entry.rank <= vocab_size:
            refuse(f"prompt_logprobs entry of token {entry.token_id} differs from what was asked")
        _check_entry(entry, vocab_size, refuse, "prompt_logprobs")


def _check_sampled(token: int, lp: TokenLogprobs | None, asked: int | None, vocab_size: int, refuse) -> None:
    """A sampled first token in the vocabulary, with its logprobs exactly as asked."""
    if not 0 <= token < vocab_size:
        refuse(f"first_token {token} outside the vocabulary [0, {vocab_size})")
    if lp is None:
        if asked is not None:
            refuse("lacks the first token's logprobs")
    elif asked is None or lp.token_id != token or len(lp.top) > asked:
        refuse(f"first_logprobs differ from what was asked ({asked} for token {token})")
    else:
        _check_entry(lp, vocab_size, refuse, "first_logprobs")


def _check_entry(lp: TokenLogprobs, vocab_size: int, refuse, field: str) -> None:
    """Each id of a logprobs entry in the vocabulary, each logprob a finite number <= 0."""
    for token, value in [(lp.token_id, lp.logprob), *lp.top]:
        if not 0 <= token < vocab_size or not math.isfinite(value) or value > 1e-3:
            refuse(f"{field} entry ({token}, {value}) out of range")


def _check_adapter(request: Request, name: str, fingerprint: str, replica: str) -> None:
    """The KV must come from the request's own adapter (or the base model for a base request)."""
    want = (request.lora.name, request.lora.fingerprint) if request.lora else ("", "")
    if (name, fingerprint) != want:
        raise PrefillError(
            f"{replica}: KV computed with adapter {name or 'none'!r}, the request uses {want[0] or 'none'!r}"
        )


@dataclasses.dataclass
class Route:
    replica: Prefiller
    expected_hit_tokens: int  # prompt tokens the replica holds, per its events
    reason: str  # "prefix": for what it holds; "load": nothing held anywhere, the least busy; "hint": named
    # by the request's endpoint picker (services.decode.config.PREFILL_HINT_HEADER)


class PrefillPool:
    """Prefill replicas; `pick()` chooses one per `routing`.

    Targets are host:port, or dns:///name:port (a Kubernetes headless service): every address the name
    resolves to becomes a replica, re-resolved by `refresh()`. `security`: TLS / mutual TLS to the replicas.
    """

    def __init__(
        self,
        targets: list[str],
        dst: KVLayout,
        security: ChannelSecurity = PLAINTEXT,
        routing: Routing = Routing(),
    ):
        self.targets = targets
        self.dst = dst
        self.security = security
        self.routing = routing
        self.replicas: dict[str, Prefiller] = {}
        self._turn = 0

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
            self.replicas[addr] = RemotePrefiller(
                addr, self.dst, security=self.security, events_resync_s=self.routing.events_resync_s
            )
        for addr in self.replicas.keys() - wanted:
            await self.replicas.pop(addr).close()

    def pick(
        self,
        exclude: set[str] = frozenset(),
        block_hashes: list[int] = (),
        num_tokens: int = 0,
        prefer: str | None = None,
    ) -> Route | None:
        """The replica for a prompt of `num_tokens` tokens whose full blocks hash to `block_hashes`
        (kv_cache_manager.hash_blocks), among the healthy ones not in `exclude` (all not excluded when
        none is healthy); None when there is none.

        `prefer`: HOST:PORT an endpoint picker chose (reason "hint"): the candidate of that address, else
        the only candidate on that host (the picker names a pod by its IP and the InferencePool's target
        port, not the Prefill port). Anything else is not one of our replicas and is ignored: a hint never
        adds a target, so TLS and peer names stay those of the pool."""
        candidates = [r for r in self.replicas.values() if r.healthy and r.name not in exclude]
        if not candidates:
            candidates = [r for r in self.replicas.values() if r.name not in exclude]
        if not candidates:
            return None
        hits = {r.name: 0 for r in candidates}
        if self.routing.policy == "prefix" and block_hashes:
            for r in candidates:
                if r.cache is not None:
                    hits[r.name] = r.cache.matched_blocks(block_hashes) * self.dst.block_size
        hinted = _hinted(candidates, prefer) if prefer else None
        if hinted is not None:
            return Route(hinted, hits[hinted.name], "hint")
        if not any(hits.values()):
            least = min(r.outstanding for r in candidates)
            tied = [r for r in candidates if r.outstanding == least]
            self._turn += 1
            return Route(tied[self._turn % len(tied)], 0, "load")
        weight = self.routing.load_weight
        best = min(
            candidates,
            key=lambda r: (num_tokens - hits[r.name] + weight * r.pending_tokens, r.outstanding),
        )
        return Route(best, hits[best.name], "prefix" if hits[best.name] else "load")

    async def close(self) -> None:
        for replica in self.replicas.values():
            await replica.close()


def _host(address: str) -> str:
    return address.rpartition(":")[0].strip("[]")


def _hinted(candidates: list[Prefiller], address: str) -> Prefiller | None:
    """The candidate at `address` (HOST:PORT), else the only one on its host; None: not one of them."""
    exact = [r for r in candidates if r.name == address]
    same_host = [r for r in candidates if _host(r.name) == _host(address)]
    if exact:
        return exact[0]
    return same_host[0] if len(same_host) == 1 else None
