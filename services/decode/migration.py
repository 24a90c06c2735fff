"""Live migration between decode servers: a draining decode server (SIGTERM) moves each running request,
with its KV, to a peer (--migrate-to), which decodes on while the draining server relays its tokens to the
request's client; the client's stream (gRPC or HTTP) does not break.

The draining side (Migrator): per request, Detach takes its sequences out of the engine's steps (blocks held)
and gathers their KV at the same step boundary; per sequence, a Migrate call to a peer sends its state as a
resumption (GenerateRequest with resume_token_ids, its seed, adapter and salt) and, once the peer has said
which KV it lacks (MigrateReady, after its own prefix cache), that KV in kvtransfer frames of this engine's
layout. When every sequence of the request runs on its peer (each sent its first output), the request is
aborted here and the peers' outputs go into its stream (services.decode.core.GenerationCore.stream) as if this
engine made them; when one cannot move (no peer, a refusal, a failed transfer), none does: the calls are
cancelled (the peers drop theirs) and the sequences decode here again (Reattach) within the grace period, as
without peers.

The receiving side (MigrationService): the same path as a prompt from a prefill server: the resumption is
admitted to receive KV (engine.core.kv_connector.DecodeConnector sizes it: every token but its last
output), the frames are verified and resharded to this engine's layout (kvtransfer.FrameAssembler: another
TP works) and inserted, and RemoteKVDone without a token starts it decoding from its last output.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time

import grpc
import numpy as np

from pdserve import kvtransfer
from pdserve.engine.boundary import (
    Abort,
    Detach,
    DetachedSequence,
    ExportKV,
    InsertKV,
    KVInsertError,
    Reattach,
    RemoteKVDone,
    TransferReady,
)
from pdserve.engine.core.output import RequestOutput
from pdserve.engine.core.request import FinishReason, Request
from pdserve.engine.multihost import is_multi_process
from pdserve.engine.sampling_params import InvalidRequestError
from pdserve.kvtransfer import KVChunk, KVLayout
from pdserve.services import sampling, wire
from pdserve.services.decode.errors import ServiceError, checked
from pdserve.services.decode.routing import PrefillPool
from pdserve.services.grpc_server import channel_options
from pdserve.services.security import PLAINTEXT, ChannelSecurity
from pdserve.v1 import generation_pb2 as gen_pb
from pdserve.v1 import migration_pb2 as pb
from pdserve.v1 import migration_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Migration"].full_name
REASONS = {name: FinishReason(name) for name in wire.FINISH_NAMES.values()}
# requests moving at once when a server drains: the rest keep decoding here until their turn, so each
# stream pauses for its own move only, not for all of them (docs/benchmark-history.md "Live migration")
MOVES_IN_FLIGHT = 2


# ---- the state on the wire --------------------------------------------------------------------------------
def header_of(state: DetachedSequence, layout: KVLayout, label: str) -> pb.MigrateHeader:
    """A detached sequence as a MigrateHeader: a resumption of one sequence with its own seed."""
    request = gen_pb.GenerateRequest(
        request_id=label, lora_adapter=state.lora_name or "", cache_salt=state.cache_salt or ""
    )
    request.token_ids.ids.extend(state.prompt_ids)
    sampling.params_to_request(dataclasses.replace(state.params, n=1, seed=state.seed), request)
    request.resume_token_ids.extend(state.output_ids)
    return pb.MigrateHeader(
        request=request,
        lora_fingerprint=state.lora_fingerprint or "",
        layout_json=layout.to_json(),
        kv_digest=wire.prompt_digest(state.transfer_digest_ids),
        index=state.index,
    )


def output_of(response: gen_pb.GenerateResponse, index: int) -> RequestOutput:
    """A peer's GenerateResponse as this engine's RequestOutput of sequence `index` (what the stream of
    the request here expects)."""
    return RequestOutput(
        request_id=response.request_id,
        new_token_ids=list(response.token_ids),
        text=response.text,
        finished=bool(response.finish_reason),
        finish_reason=REASONS[wire.FINISH_NAMES[response.finish_reason]] if response.finish_reason else None,
        logprobs=[wire.logprobs_from_proto(lp) for lp in response.logprobs],
        num_prompt_tokens=response.usage.prompt_tokens,
        num_output_tokens=response.usage.completion_tokens,
        num_cached_tokens=response.usage.cached_prompt_tokens,
        index=index,
    )


# ---- the receiving side ------------------------------------------------------------------------------------
class MigrationService(pb_grpc.MigrationServicer):
    """Takes over sequences from draining peers into `core`'s engine (see the module)."""

    def __init__(self, core):
        self.core = core
        self.layout: KVLayout = core.engine.kv_layout
        self.sharding = (
            None if is_multi_process() else kvtransfer.chunk_sharding(core.engine.mesh, self.layout)
        )

    async def Hello(self, request: pb.MigrationHello, context) -> pb.MigrationHelloReply:
        try:
            src = KVLayout.from_json(request.layout_json)
            kvtransfer.head_map(src, self.layout)
        except kvtransfer.LayoutMismatchError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except (ValueError, KeyError, TypeError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"layout_json: {e}")
        if not self.core.draining:  # its sequences may come here: their frames' inserts compiled first
            await self.core.meet_layout(src)
        return pb.MigrationHelloReply(
            layout_json=self.layout.to_json(), server_id=self.core.server_id, accepting=not self.core.draining
        )

    async def Migrate(self, request_iterator, context) -> None:
        messages = aiter(request_iterator)
        try:
            first = await anext(messages)
        except StopAsyncIteration:
            return
        try:
            if first.WhichOneof("kind") != "header":
                raise InvalidRequestError("header", "a Migrate stream starts with its header")
            header = first.header
            src = KVLayout.from_json(header.layout_json)
            kvtransfer.head_map(src, self.layout)  # raises LayoutMismatchError when it cannot convert
            engine_request, label = await self._request(header)
        except kvtransfer.LayoutMismatchError as e:
            self.core.counters.count_migration("in", "refused")
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except (ValueError, KeyError, TypeError) as e:  # InvalidRequestError included
            self.core.counters.count_migration("in", "refused")
            await context.abort(grpc.StatusCode[getattr(e, "status", "INVALID_ARGUMENT")], str(e))
        except ServiceError as e:
            self.core.counters.count_migration("in", "refused")
            await context.abort(e.code, e.message)

        async def receive(outputs: asyncio.Queue) -> None:
            await self._receive(engine_request, label, src, outputs, messages, context)

        try:
            stream = self.core.stream(engine_request, context.time_remaining(), label=label, receive=receive)
            async with contextlib.aclosing(stream) as outputs:
                async for output in outputs:
                    await context.write(pb.MigrateReply(output=wire.output_to_response(output, label)))
        except ServiceError as e:
            await context.abort(e.code, e.message)

    async def _request(self, header: pb.MigrateHeader) -> tuple[Request, str]:
        """The engine request of a header, checked (the KV digest against the tokens it resumes)."""
        given = header.request
        label = self.core.config.limits.check_request_id(given.request_id)
        params = self.core.check_params(sampling.params_from_request(given))
        if not given.sampling.HasField("seed"):
            raise InvalidRequestError("request.sampling.seed", "a moved sequence carries its seed")
        prompt = list(given.token_ids.ids)
        resumed = list(given.resume_token_ids)
        if header.kv_digest != wire.prompt_digest((prompt + resumed)[: len(prompt) + len(resumed) - 1]):
            raise InvalidRequestError("kv_digest", "the KV is not of this prompt and output")
        engine_request = await self.core.prepare(
            lambda: self.core.make_request(
                prompt,
                params,
                label,
                given.lora_adapter,
                given.cache_salt,
                resumed,
                lora_fingerprint=header.lora_fingerprint or None,
            )
        )
        return engine_request, label

    async def _receive(self, request: Request, label: str, src: KVLayout, outputs, messages, context) -> None:
        """The KV of an admitted resumption: says what it lacks, inserts the frames (named by the draining
        server's `label` of the request), starts it. Counted as accepted (with its KV bytes) or failed."""
        try:
            num_bytes = await self._insert(request, label, src, outputs, messages, context)
        except BaseException:
            self.core.counters.count_migration("in", "failed")
            raise
        self.core.counters.count_migration("in", "accepted", kv_bytes=num_bytes)

    async def _insert(self, request: Request, label: str, src: KVLayout, outputs, messages, context) -> int:
        rid, loop, num_bytes = request.request_id, self.core.loop, 0
        ready = checked(await outputs.get())
        if not isinstance(ready, TransferReady):
            raise RuntimeError(f"{type(ready).__name__} before the request's blocks were allocated")
        await context.write(
            pb.MigrateReply(
                ready=pb.MigrateReady(first_block=ready.first_block, num_tokens=ready.num_external_tokens)
            )
        )
        assembler = None
        if ready.num_external_tokens:
            assembler = kvtransfer.FrameAssembler(
                label, ready.num_external_tokens, src, self.layout, sharding=self.sharding
            )
        async for message in messages:
            kind = message.WhichOneof("kind")
            if kind == "kv_frame" and assembler is not None:
                num_bytes += len(message.kv_frame)
                try:
                    frame = kvtransfer.deserialize_frame(message.kv_frame)
                    chunk = await asyncio.to_thread(assembler.add, frame)
                except kvtransfer.FrameError as e:
                    raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"kv_frame: {e}") from None
                loop.submit(InsertKV(rid, chunk, ready.first_block))
            elif kind == "trailer":
                break
            else:
                raise ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"unexpected {kind} in a Migrate stream")
        else:
            raise ServiceError(grpc.StatusCode.CANCELLED, "the draining server went away mid-transfer")
        if assembler is None:
            return 0  # (computed here: DecodeConnector found it cheaper than a transfer)
        try:
            assembler.finish()
            await loop.call(RemoteKVDone(rid, None))
        except (kvtransfer.FrameError, KVInsertError) as e:
            raise ServiceError(grpc.StatusCode.INTERNAL, f"the moved KV: {e}") from None
        return num_bytes


# ---- the draining side -------------------------------------------------------------------------------------
@dataclasses.dataclass
class Peer:
    name: str
    stub: pb_grpc.MigrationStub
    layout: KVLayout


class Migrator:
    """Moves `core`'s running requests to the decode servers of `targets` (ADDR or dns:///NAME:PORT, as
    --prefill's) reached with `security`; see the module."""

    def __init__(self, core, targets: list[str], security: ChannelSecurity = PLAINTEXT):
        self.core, self.targets, self.security = core, targets, security
        self.layout: KVLayout = core.engine.kv_layout
        self._channels: list = []
        self.moved = self.kept = 0  # sequences moved, and those that stayed (counted at drain)
        self.bytes_sent = 0  # KV frames' bytes sent to peers

    async def peers(self) -> list[Peer]:
        """The targets that answer Hello, accept, fit this layout and are not this server."""
        peers = []
        for target in self.targets:
            for address in await asyncio.to_thread(PrefillPool.resolve, target):
                channel = self.security.open(address, channel_options(), aio=True)
                self._channels.append(channel)
                stub = pb_grpc.MigrationStub(channel)
                try:
                    hello = pb.MigrationHello(layout_json=self.layout.to_json())
                    reply = await stub.Hello(hello, timeout=5, metadata=self.security.metadata)
                except grpc.aio.AioRpcError as e:
                    log.warning("migration peer %s: %s: %s", address, e.code().name, e.details())
                    continue
                if reply.server_id == self.core.server_id or not reply.accepting:
                    continue
                peers.append(Peer(address, stub, KVLayout.from_json(reply.layout_json)))
        return peers

    async def migrate_all(self, timeout_s: float = 30.0) -> None:
        """Moves every request streaming now to a peer (round robin), MOVES_IN_FLIGHT at a time (the
        others decode here meanwhile: each stream pauses only for its own move), for at most `timeout_s`;
        those that cannot move (or not in time) stay. Logs each move and the drain's total."""
        active = dict(self.core.active)
        if not active:
            return
        began = time.monotonic()
        peers = await self.peers()
        if not peers:
            log.warning("draining: no peer to move %d requests to; they finish here", len(active))
            self._count("stayed", sum(stream.request.params.n for stream in active.values()))
            return
        log.info("draining: moving %d requests to %d peers", len(active), len(peers))
        gate = asyncio.Semaphore(MOVES_IN_FLIGHT)

        async def move(rid: str, peer: Peer) -> None:
            try:
                await gate.acquire()
            except asyncio.CancelledError:  # out of time before its turn: it never left, it stays
                stream = self.core.active.get(rid)
                self._count("stayed", stream.request.params.n if stream is not None else 0)
                raise
            try:
                await self._move_request(rid, peer)
            finally:
                gate.release()

        moves = [move(rid, peers[i % len(peers)]) for i, rid in enumerate(active)]
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.gather(*moves)
        except TimeoutError:
            log.warning("draining: moving requests took over %g s; the rest stay here", timeout_s)
        self.core.counters.drain_handoff_seconds = seconds = time.monotonic() - began
        log.info(
            "draining: moved %d sequences to peers, %d stay here; %d bytes of KV sent in %.2f s",
            self.moved,
            self.kept,
            self.bytes_sent,
            seconds,
        )

    async def _move_request(self, rid: str, peer: Peer) -> None:
        stream = self.core.active.get(rid)
        if stream is None:
            return
        began = time.monotonic()
        detaching = asyncio.ensure_future(self.core.loop.call(Detach(rid, export_kv=True)))
        try:
            states = await asyncio.shield(detaching)
            detach_s = time.monotonic() - began
        except asyncio.CancelledError:  # out of time while the engine detached it: it decodes here again
            states = await detaching
            if states:
                await self.core.loop.call(Reattach(tuple(s.request_id for s in states)))
                self._count("stayed", len(states))
            raise
        if not states:  # finished meanwhile (nothing to move), or its prompt still computing: it stays
            if stream.request.finish_reason is None:
                log.info(
                    "request %s stays: not decoding yet", stream.label, extra={"request_id": stream.label}
                )
                self._count("stayed", stream.request.params.n)
            return
        started = [asyncio.get_running_loop().create_future() for _ in states]
        decided = asyncio.get_running_loop().create_future()
        tasks = [
            asyncio.create_task(
                self._move_sequence(s, peer, stream, f, decided), name=f"migrate {s.request_id}"
            )
            for s, f in zip(states, started, strict=True)
        ]
        stream.on_close.extend(task.cancel for task in tasks)
        try:
            results = await asyncio.gather(*started, return_exceptions=True)
        except asyncio.CancelledError:  # out of time: it stays, decoding here again
            results = [asyncio.CancelledError()]
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            log.warning("request %s stays: %s", stream.label, failed[0], extra={"request_id": stream.label})
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.core.loop.call(Reattach(tuple(s.request_id for s in states)))
            self._count("stayed", len(states))
            decided.set_result(False)
            return
        self.core.loop.submit(Abort(rid))  # it runs on the peers now: free it here
        num_bytes = sum(r[0] for r in results)
        ready_s, transfer_s = max(r[1] for r in results), max(r[2] for r in results)
        self._count("moved", len(states), num_bytes)
        decided.set_result(True)
        log.info(
            "request moved to a peer",
            extra={
                "request_id": stream.label,
                "peer": peer.name,
                "sequences": len(states),
                "kv_bytes": num_bytes,
                "detach_s": round(detach_s, 3),  # out of this engine's steps, its KV gathered
                "ready_s": round(ready_s, 3),  # from its header to the peer's blocks allocated
                "transfer_s": round(transfer_s, 3),  # its KV: exported, encoded, sent
                "move_s": round(time.monotonic() - began, 3),  # from its detach to the peer's first output
            },
        )

    def _count(self, outcome: str, sequences: int, num_bytes: int = 0) -> None:
        if outcome == "moved":
            self.moved += sequences
            self.bytes_sent += num_bytes
        else:
            self.kept += sequences
        self.core.counters.count_migration("out", outcome, sequences, num_bytes)

    async def _move_sequence(
        self,
        state: DetachedSequence,
        peer: Peer,
        stream,
        started: asyncio.Future,
        decided: asyncio.Future,
    ) -> None:
        """One sequence's Migrate call: header, the KV the peer lacks, then (once every sequence of the
        request moved: `decided`) its outputs into the request's stream until it ends."""
        call = peer.stub.Migrate(metadata=self.security.metadata)
        try:
            first, num_bytes, ready_s, transfer_s = await self._transfer(call, state, stream.label)
        except BaseException as e:  # noqa: BLE001 - any failure keeps the sequence here
            call.cancel()
            if not started.done():
                started.set_exception(e if isinstance(e, Exception) else RuntimeError("cancelled"))
            return
        started.set_result((num_bytes, ready_s, transfer_s))
        index = state.index
        del state  # (its exported KV: device memory, not held while relaying)
        if not await decided:
            call.cancel()
            return
        try:
            reply = first
            while reply is not grpc.aio.EOF:
                output = output_of(reply.output, index)
                stream.outputs.put_nowait(output)
                if output.finished:
                    return
                reply = await call.read()
            raise ServiceError(grpc.StatusCode.UNAVAILABLE, f"peer {peer.name} ended the stream early")
        except grpc.aio.AioRpcError as e:
            message = f"the peer {peer.name} this request moved to failed: {e.code().name}: {e.details()}"
            stream.outputs.put_nowait(ServiceError(grpc.StatusCode.UNAVAILABLE, message))
        except ServiceError as e:
            stream.outputs.put_nowait(e)
        finally:
            call.cancel()

    async def _transfer(
        self, call, state: DetachedSequence, label: str
    ) -> tuple[pb.MigrateReply, int, float, float]:
        """Header, ready, frames, trailer; returns the peer's first output (it decodes the sequence), the
        KV bytes sent, the seconds until the peer was ready and those the export, encoding and sending
        took."""
        sent = time.monotonic()
        await call.write(pb.MigrateMessage(header=header_of(state, self.layout, label)))
        reply = await call.read()
        if reply is grpc.aio.EOF or reply.WhichOneof("kind") != "ready":
            raise RuntimeError("the peer did not say which KV it lacks")
        ready, num_frames, num_bytes, began = reply.ready, 0, 0, time.monotonic()
        ready_s = began - sent
        if ready.num_tokens:
            block_size = self.layout.block_size
            if ready.num_tokens != state.num_kv_tokens - ready.first_block * block_size:
                raise RuntimeError(
                    f"the peer asks for {ready.num_tokens} tokens from block {ready.first_block}"
                )
            if ready.first_block == 0 and state.kv:  # exported at its detach: no second step boundary
                chunks = state.kv
            else:  # the peer holds its first blocks (prefix cache): only the rest
                chunks = await self.core.loop.call(ExportKV(state.request_id, ready.first_block))
            frames = await asyncio.to_thread(_encoded, label, self.layout, ready.num_tokens, chunks)
            for data in frames:
                await call.write(pb.MigrateMessage(kv_frame=data))
                num_frames, num_bytes = num_frames + 1, num_bytes + len(data)
        await call.write(
            pb.MigrateMessage(trailer=pb.MigrateTrailer(num_frames=num_frames, num_bytes=num_bytes))
        )
        await call.done_writing()
        transfer_s = time.monotonic() - began
        reply = await call.read()
        if reply is grpc.aio.EOF or reply.WhichOneof("kind") != "output":
            raise RuntimeError("the peer ended the move without an output")
        return reply, num_bytes, ready_s, transfer_s

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()


def _encoded(request_id: str, layout: KVLayout, num_tokens: int, chunks) -> list[bytes]:
    """The serialized frames of exported chunks (on the host first), on a worker thread."""
    host = [KVChunk(c.layer_start, c.token_start, c.num_tokens, np.asarray(c.data)) for c in chunks]
    return list(kvtransfer.encode_request(request_id, layout, num_tokens, host))
