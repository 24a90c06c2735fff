"""KV connectors: how a request's KV enters or leaves an engine other than by its own steps.

In the spirit of vLLM's KV connector, a connector has a scheduler side (called by engine.core.scheduler while
it admits and finishes requests) and a worker side (called on the engine thread with the engine's
engine.model_runner.ModelRunner, which owns the device cache and, in a multi-process engine, has every
process replay its reads and writes). Nothing here calls out: what a connector has for the daemons
(TransferReady, KVReady) waits in it until the engine takes it into the step's outputs (`take_outputs`).

  scheduler side
    admits(request)                False: the request waits (back-pressure: no room to stage its KV)
    num_external_tokens(request, num_cached_tokens)   prompt tokens whose KV arrives from elsewhere, after
                                   the prefix found in this engine's cache (0: compute them here)
    on_blocks_allocated(request, block_ids, num_external_tokens)   an admitted request holds its blocks
                                   now (cached prefix first): a transfer may start
    request_finished(request)      True: keep the finished request's blocks until its KV is sent
  worker side
    save_kv(runner, request, block_ids)  prefill role: a step computed part of a request's prompt (more
                                   to come): gather the KV now complete for the sender
    send_kv(runner, request, block_ids)  prefill role: the request finished: gather the rest
    load_kv(runner, block_ids, chunk)    decode role: write an arriving chunk into a request's blocks

Implementations: `KVConnector` (none: colocated), `PrefillConnector` (the prompts' KV of requests added
with SendKV is gathered as the prefill chunks compute it: the prefill-server's gRPC stream, or `pdserve
serve`'s device-to-device path) and `DecodeConnector` (requests added with ReceiveKV wait in
WAITING_FOR_REMOTE_KV; arriving chunks are inserted; the first token starts them). The daemons own the
wire (services/); connectors own what the engine does with the KV.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from pdserve import kvtransfer
from pdserve.engine.core.block_pool import blocks_for_tokens
from pdserve.engine.core.host_pool import HostBlockPool
from pdserve.engine.core.kv_groups import BlockTables
from pdserve.engine.core.request import Request
from pdserve.kvtransfer import HeadMap, KVChunk, KVLayout


@dataclasses.dataclass(frozen=True)
class ReceiveKV:
    """Decode role: the prompt's KV (after this engine's cached prefix) may arrive from a prefill server;
    the DecodeConnector decides at admission (TransferReady says)."""


@dataclasses.dataclass(frozen=True)
class SendKV:
    """Prefill role: the prompt's KV from block `first_block` on (the receiver holds the blocks before) goes
    out as KVReady outputs, heads converted by `head_map`, in the frame plan of `max_frame_bytes` (the
    wire's frames, or kvtransfer.LOCAL_CHUNK_BYTES device to device)."""

    head_map: HeadMap | None = None
    max_frame_bytes: int = kvtransfer.MAX_FRAME_BYTES
    first_block: int = 0


@dataclasses.dataclass(frozen=True)
class TransferReady:
    """A request expected to receive KV holds its blocks: `num_external_tokens` prompt tokens, from block
    `first_block` on, are to arrive (0: it is computed here: short, or nearly all cached)."""

    request_id: str
    num_external_tokens: int
    first_block: int


@dataclasses.dataclass(frozen=True)
class KVReady:
    """Chunks of a SendKV request's prompt KV (in plan order), ready to send; `last`: no more follow."""

    request_id: str
    chunks: tuple[KVChunk, ...]
    last: bool


class KVConnector:
    """No connector: every prompt is computed here and finished requests' KV stays here (colocated)."""

    def expect(self, request_id: str, kv) -> None:
        """The request (added next) moves KV as `kv` says (ReceiveKV, SendKV)."""
        raise TypeError(f"{type(self).__name__} moves no KV ({type(kv).__name__})")

    def admits(self, request: Request) -> bool:
        return True

    def num_external_tokens(self, request: Request, num_cached_tokens: int) -> int:
        return 0

    def on_blocks_allocated(
        self, request: Request, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        return None

    def request_finished(self, request: Request) -> bool:
        return False

    def forget(self, request_id: str) -> None:
        """Whatever the connector keeps for the request is dropped (it ended, or its caller gave up)."""
        return None

    def take_outputs(self) -> list[TransferReady | KVReady]:
        """What the connector has for the daemons since the last call (engine thread)."""
        return []

    def save_kv(self, runner, request: Request, block_ids: BlockTables) -> None:
        return None

    def send_kv(self, runner, request: Request, block_ids: BlockTables) -> None:
        return None

    def load_kv(self, runner, block_ids: BlockTables, chunk: KVChunk) -> None:
        raise NotImplementedError(f"{type(self).__name__} receives no KV")


@dataclasses.dataclass
class _Outgoing:
    send: SendKV
    plan: tuple = ()  # the frame plan of the prompt's tokens from first_block on (made at the first send)
    sent: int = 0  # frames of the plan gathered so far


class PrefillConnector(KVConnector):
    """Prefill role: for each request added with SendKV, its prompt's KV goes out as it is computed: after
    every step that computed part of the prompt, the frames of the plan whose tokens are all computed
    (kvtransfer.gather_request: copies, dispatched at once, heads converted); when the request finishes,
    the rest, marked last, and the request's blocks go back to the cache. A prompt found cached here is
    sent from the first step. Engine thread only.

    With `staging` (the host tier's slots, engine/core/host_pool.py), the gathered copies are staged in
    host memory: copied to the host as they are gathered and handed out as host arrays, so a reader that
    lags holds no device memory. A request is admitted only when slots for its prompt's blocks can be
    reserved (back-pressure on the scheduler, never an out-of-memory); they are given back when its
    sender forgets it (the stream ended or was cut). A prompt larger than the whole tier goes unstaged."""

    def __init__(self, layout: KVLayout, staging: HostBlockPool | None = None):
        self.layout = layout
        self.staging = staging
        self._outgoing: dict[str, _Outgoing] = {}
        self._ready: list[KVReady] = []
        self._staged: dict[str, int] = {}  # request id -> slots reserved (0: too large, not staged)

    def expect(self, request_id: str, kv) -> None:
        if not isinstance(kv, SendKV):
            super().expect(request_id, kv)
        self._outgoing[request_id] = _Outgoing(kv)

    def forget(self, request_id: str) -> None:
        self._outgoing.pop(request_id, None)
        slots = self._staged.pop(request_id, 0)
        if slots:
            self.staging.unreserve(slots)

    def admits(self, request: Request) -> bool:
        rid = request.request_id
        out = self._outgoing.get(rid)
        if self.staging is None or out is None or rid in self._staged:
            return True
        bs = self.layout.block_size
        slots = blocks_for_tokens(len(request.prompt_ids) - out.send.first_block * bs, bs)
        if slots > self.staging.num_slots:
            self._staged[rid] = 0
            return True
        if not self.staging.reserve(slots):
            return False
        self._staged[rid] = slots
        return True

    def take_outputs(self) -> list[KVReady]:
        """The chunks gathered since the last call; staged ones as host arrays (their copies were started
        as they were gathered; this waits for the rest)."""
        ready, self._ready = self._ready, []
        return [
            dataclasses.replace(r, chunks=tuple(_on_host(c) for c in r.chunks))
            if self._staged.get(r.request_id)
            else r
            for r in ready
        ]

    def request_finished(self, request: Request) -> bool:
        return request.request_id in self._outgoing

    def save_kv(self, runner, request: Request, block_ids: BlockTables) -> None:
        out = self._outgoing.get(request.request_id)
        if out is not None:
            self._send(runner, request, block_ids, out, request.num_computed, last=False)

    def send_kv(self, runner, request: Request, block_ids: BlockTables) -> None:
        out = self._outgoing.pop(request.request_id)
        self._send(runner, request, block_ids, out, len(request.prompt_ids), last=True)

    def _send(
        self, runner, request: Request, block_ids: BlockTables, out: _Outgoing, computed: int, last: bool
    ) -> None:
        bs, send = self.layout.block_size, out.send
        num_tokens = len(request.prompt_ids) - send.first_block * bs
        if not out.plan:
            out.plan = kvtransfer.plan_frames(self.layout, num_tokens, send.max_frame_bytes)
        done = out.sent
        while done < len(out.plan) and out.plan[done].token_end <= computed - send.first_block * bs:
            done += 1
        ready, out.sent = out.plan[out.sent : done], done
        chunks = []
        if ready:
            chunks = runner.gather_kv(
                self.layout,
                block_ids[send.first_block :],
                num_tokens,
                max_frame_bytes=send.max_frame_bytes,
                head_map=send.head_map,
                frames=ready,
            )
        if self._staged.get(request.request_id):
            for chunk in chunks:
                chunk.data.copy_to_host_async()
        if chunks or last:
            self._ready.append(KVReady(request.request_id, tuple(chunks), last))


def _on_host(chunk: KVChunk) -> KVChunk:
    return dataclasses.replace(chunk, data=np.asarray(chunk.data))


class DecodeConnector(KVConnector):
    """Decode role: a request added with ReceiveKV waits for blocks like any other. At admission its
    prompt's cached prefix is taken from this engine's cache; the rest arrives from a prefill server
    (WAITING_FOR_REMOTE_KV, blocks for the prompt and the first token), unless it is short: fewer than
    `local_below` tokens, or at most one block after a cache hit (nothing worth a transfer); those are
    computed here. Either way a TransferReady says so at admission (0 tokens: computed here), so the
    receiver starts the transfer of the prompt's blocks after the cached ones. Chunks are written as
    they arrive (boundary.InsertKV); a failed one is kept for its attempt (`insert_failed`,
    `take_insert_failure`). Engine thread only."""

    def __init__(self, block_size: int, local_below: int = 0):
        self.block_size = block_size
        self.local_below = local_below
        self._expected: set[str] = set()
        self._ready: list[TransferReady] = []
        self._insert_failures: dict[str, tuple[int, str]] = {}  # request id -> (attempt, first error)

    def expect(self, request_id: str, kv) -> None:
        if not isinstance(kv, ReceiveKV):
            super().expect(request_id, kv)
        self._expected.add(request_id)

    def forget(self, request_id: str) -> None:
        self._expected.discard(request_id)
        self._insert_failures.pop(request_id, None)

    def take_outputs(self) -> list[TransferReady]:
        ready, self._ready = self._ready, []
        return ready

    def num_external_tokens(self, request: Request, num_cached_tokens: int) -> int:
        if request.request_id not in self._expected:
            return 0
        uncached = request.num_transfer_tokens - num_cached_tokens
        if uncached < self.local_below or (num_cached_tokens and uncached <= self.block_size):
            return 0
        return uncached

    def on_blocks_allocated(
        self, request: Request, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        rid = request.request_id
        if rid in self._expected:
            self._expected.discard(rid)
            first_block = (request.num_transfer_tokens - num_external_tokens) // self.block_size
            first_block = first_block if num_external_tokens else 0
            self._ready.append(TransferReady(rid, num_external_tokens, first_block))

    def load_kv(self, runner, block_ids: BlockTables, chunk: KVChunk) -> None:
        """Writes one verified chunk (in this engine's layout: on its mesh, or a host array) into a
        request's blocks."""
        runner.insert_kv(chunk, block_ids)

    def insert_failed(self, request_id: str, attempt: int, error: str) -> None:
        """An insert of transfer `attempt` failed: that attempt cannot start the request."""
        if self._insert_failures.get(request_id, (None,))[0] != attempt:
            self._insert_failures[request_id] = (attempt, error)

    def take_insert_failure(self, request_id: str, attempt: int) -> str | None:
        """The first error of an insert of transfer `attempt` (None: they all succeeded); forgets it."""
        failure = self._insert_failures.pop(request_id, None)
        return failure[1] if failure is not None and failure[0] == attempt else None
