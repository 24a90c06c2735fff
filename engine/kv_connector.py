"""KV connectors: how a request's KV enters or leaves an engine other than by its own steps.

In the spirit of vLLM's KV connector, a connector has a scheduler side (called by engine.scheduler while
it admits and finishes requests) and a worker side (called on the engine thread with the device cache):

  scheduler side
    num_external_tokens(request, num_cached_tokens)   prompt tokens whose KV arrives from elsewhere, after
                                   the prefix found in this engine's cache (0: compute them here)
    on_blocks_allocated(request, block_ids, num_external_tokens)   an admitted request holds its blocks
                                   now (cached prefix first): a transfer may start
    request_finished(request)      True: keep the finished request's blocks until its KV is sent
  worker side
    send_kv(cache, request, block_ids)   prefill role: hand the KV of a finished request to a sender
    load_kv(cache, block_ids, chunk)     decode role: write an arriving chunk into a request's blocks

Implementations: `KVConnector` (none: colocated), `PrefillConnector` (finished prompts' KV is gathered
for the sender: the prefill-server's gRPC stream, or `pdserve serve`'s device-to-device path) and
`DecodeConnector` (requests expected from a prefill replica wait in WAITING_FOR_REMOTE_KV; arriving
chunks are inserted (LLMEngine.load_kv); the first token starts them: LLMEngine.remote_kv_arrived).
The daemons own the wire (services/); connectors own what the engine does with the KV.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import kvtransfer
from engine.request import Request
from kvtransfer import HeadMap, KVChunk, KVLayout


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

    def send_kv(self, cache, request: Request, block_ids: Sequence[int]) -> None:
        return None

    def load_kv(self, cache, block_ids: Sequence[int], chunk: KVChunk):
        raise NotImplementedError(f"{type(self).__name__} receives no KV")


class PrefillConnector(KVConnector):
    """Prefill role: for each request the sender expects, its prompt's KV is gathered when it finishes
    (kvtransfer.gather_request: copies, dispatched at once, in the sender's frame plan, heads converted
    by `head_map` when given) and kept until the sender takes it; the blocks then return to the cache.
    Engine thread only."""

    def __init__(self, layout: KVLayout):
        self.layout = layout
        self._expected: dict[str, tuple[HeadMap | None, int, int]] = {}
        self._outbox: dict[str, list[KVChunk]] = {}

    def expect(
        self,
        request_id: str,
        head_map: HeadMap | None = None,
        max_frame_bytes: int = kvtransfer.MAX_FRAME_BYTES,
        first_block: int = 0,
    ) -> None:
        """The sender wants the request's KV: the prompt's blocks from `first_block` on (the receiver
        holds those before), heads converted by `head_map`, in the frame plan of `max_frame_bytes` (the
        wire's frames, or kvtransfer.LOCAL_CHUNK_BYTES device to device)."""
        self._expected[request_id] = (head_map, max_frame_bytes, first_block)

    def take(self, request_id: str) -> list[KVChunk]:
        """The gathered chunks of a finished request (KeyError: it did not finish)."""
        self._expected.pop(request_id, None)
        return self._outbox.pop(request_id)

    def forget(self, request_id: str) -> None:
        """The sender gave up (cancelled): drop whatever is kept for the request."""
        self._expected.pop(request_id, None)
        self._outbox.pop(request_id, None)

    def request_finished(self, request: Request) -> bool:
        return request.request_id in self._expected

    def send_kv(self, cache, request: Request, block_ids: Sequence[int]) -> None:
        head_map, max_frame_bytes, first_block = self._expected[request.request_id]
        bs = self.layout.block_size
        num_tokens = len(request.prompt_ids) - first_block * bs
        blocks = list(block_ids[first_block : kvtransfer.plan.cdiv(len(request.prompt_ids), bs)])
        self._outbox[request.request_id] = kvtransfer.gather_request(
            cache, self.layout, blocks, num_tokens, max_frame_bytes=max_frame_bytes, head_map=head_map
        )


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

    def load_kv(self, cache, block_ids: Sequence[int], chunk: KVChunk):
        """Writes one verified chunk (on this engine's mesh and layout) into a request's blocks; returns
        the cache (the argument is donated)."""
        return kvtransfer.insert(cache, chunk, block_ids)
