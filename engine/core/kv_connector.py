"""KV connectors: how a request's KV enters or leaves an engine other than by its own steps.

In the spirit of vLLM's KV connector, a connector has a scheduler side (called by engine.core.scheduler while
it admits and finishes requests) and a worker side (called on the engine thread with the engine's
engine.runner.ModelRunner, which owns the device cache and, in a multi-process engine, has every process
replay its reads and writes):

  scheduler side
    num_external_tokens(request, num_cached_tokens)   prompt tokens whose KV arrives from elsewhere, after
                                   the prefix found in this engine's cache (0: compute them here)
    on_blocks_allocated(request, block_ids, num_external_tokens)   an admitted request holds its blocks
                                   now (cached prefix first): a transfer may start
    request_finished(request)      True: keep the finished request's blocks until its KV is sent
  worker side
    save_kv(runner, request, block_ids)  prefill role: a step computed part of a request's prompt (more
                                   to come): hand the KV now complete to a sender
    send_kv(runner, request, block_ids)  prefill role: the request finished: hand over the rest
    load_kv(runner, block_ids, chunk)    decode role: write an arriving chunk into a request's blocks

Implementations: `KVConnector` (none: colocated), `PrefillConnector` (prompts' KV is gathered for the
sender as the prefill chunks compute it: the prefill-server's gRPC stream, or `pdserve serve`'s
device-to-device path) and
`DecodeConnector` (requests expected from a prefill replica wait in WAITING_FOR_REMOTE_KV; arriving
chunks are inserted (LLMEngine.load_kv); the first token starts them: LLMEngine.remote_kv_arrived).
The daemons own the wire (services/); connectors own what the engine does with the KV.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from pdserve import kvtransfer
from pdserve.engine.core.kv_groups import BlockTables
from pdserve.engine.core.request import Request
from pdserve.kvtransfer import HeadMap, KVChunk, KVLayout

ChunkSink = Callable[[list[KVChunk], bool], None]  # (chunks in plan order, whether they are the last)


class KVConnector:
    """No connector: every prompt is computed here and finished requests' KV stays here (colocated)."""

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

    def save_kv(self, runner, request: Request, block_ids: BlockTables) -> None:
        return None

    def send_kv(self, runner, request: Request, block_ids: BlockTables) -> None:
        return None

    def load_kv(self, runner, block_ids: BlockTables, chunk: KVChunk) -> None:
        raise NotImplementedError(f"{type(self).__name__} receives no KV")


@dataclasses.dataclass
class _Outgoing:
    sink: ChunkSink
    head_map: HeadMap | None
    max_frame_bytes: int
    first_block: int
    plan: tuple = ()  # the frame plan of the prompt's tokens from first_block on (made at the first send)
    sent: int = 0  # frames of the plan handed to the sink so far


class PrefillConnector(KVConnector):
    """Prefill role: for each request a sender expects, its prompt's KV goes to the sender's sink as it is
    computed: after every step that computed part of the prompt, the frames of the plan whose tokens are
    all computed (kvtransfer.gather_request: copies, dispatched at once, heads converted by `head_map`
    when given); when the request finishes, the rest, marked last, and the request's blocks go back to the
    cache. A prompt found cached here is sent from the first step. Engine thread only."""

    def __init__(self, layout: KVLayout):
        self.layout = layout
        self._outgoing: dict[str, _Outgoing] = {}

    def expect(
        self,
        request_id: str,
        sink: ChunkSink,
        head_map: HeadMap | None = None,
        max_frame_bytes: int = kvtransfer.MAX_FRAME_BYTES,
        first_block: int = 0,
    ) -> None:
        """The sender wants the request's KV: the prompt's blocks from `first_block` on (the receiver
        holds those before), heads converted by `head_map`, in the frame plan of `max_frame_bytes` (the
        wire's frames, or kvtransfer.LOCAL_CHUNK_BYTES device to device). `sink(chunks, last)` is called
        on the engine thread and must not block."""
        self._outgoing[request_id] = _Outgoing(sink, head_map, max_frame_bytes, first_block)

    def forget(self, request_id: str) -> None:
        self._outgoing.pop(request_id, None)

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
        bs = self.layout.block_size
        num_tokens = len(request.prompt_ids) - out.first_block * bs
        if not out.plan:
            out.plan = kvtransfer.plan_frames(self.layout, num_tokens, out.max_frame_bytes)
        done = out.sent
        while done < len(out.plan) and out.plan[done].token_end <= computed - out.first_block * bs:
            done += 1
        ready, out.sent = out.plan[out.sent : done], done
        chunks = []
        if ready:
            chunks = runner.gather_kv(
                self.layout,
                block_ids[out.first_block :],
                num_tokens,
                max_frame_bytes=out.max_frame_bytes,
                head_map=out.head_map,
                frames=ready,
            )
        if chunks or last:
            out.sink(chunks, last)


class DecodeConnector(KVConnector):
    """Decode role: a request `expect`ed before it is added waits for blocks like any other. At admission
    its prompt's cached prefix is taken from this engine's cache; the rest arrives from a prefill server
    (WAITING_FOR_REMOTE_KV, blocks for the prompt and the first token), unless it is short: fewer than
    `local_below` tokens, or at most one block after a cache hit (nothing worth a transfer); those are
    computed here. `on_ready(num_external_tokens)` is called either way (engine thread; 0: computed here)
    so the receiver starts the transfer of the prompt's blocks after the cached ones. Chunks are written
    (LLMEngine.load_kv) as they arrive; the receiver then calls LLMEngine.remote_kv_arrived (or
    remote_kv_failed). Engine thread only."""

    def __init__(self, block_size: int, local_below: int = 0):
        self.block_size = block_size
        self.local_below = local_below
        self._expected: dict[str, Callable[[int], None]] = {}

    def expect(self, request_id: str, on_ready: Callable[[int], None]) -> None:
        self._expected[request_id] = on_ready

    def forget(self, request_id: str) -> None:
        self._expected.pop(request_id, None)

    def num_external_tokens(self, request: Request, num_cached_tokens: int) -> int:
        if request.request_id not in self._expected:
            return 0
        uncached = len(request.prompt_ids) - num_cached_tokens
        if uncached < self.local_below or (num_cached_tokens and uncached <= self.block_size):
            return 0
        return uncached

    def on_blocks_allocated(
        self, request: Request, block_ids: Sequence[int], num_external_tokens: int
    ) -> None:
        on_ready = self._expected.pop(request.request_id, None)
        if on_ready is not None:
            on_ready(num_external_tokens)

    def load_kv(self, runner, block_ids: BlockTables, chunk: KVChunk) -> None:
        """Writes one verified chunk (in this engine's layout: on its mesh, or a host array) into a
        request's blocks."""
        runner.insert_kv(chunk, block_ids)
