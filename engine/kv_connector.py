"""KV connectors: how a request's KV enters or leaves an engine other than by its own steps.

In the spirit of vLLM's KV connector, a connector has a scheduler side (called by engine.scheduler while
it admits and finishes requests) and a worker side (called on the engine thread with the device cache):

  scheduler side
    num_external_tokens(request)   prompt tokens whose KV arrives from elsewhere (0: compute them here)
    on_blocks_allocated(request, block_ids)   such a request holds its blocks now: the transfer may start
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

    def num_external_tokens(self, request: Request) -> int:
        return 0

    def on_blocks_allocated(self, request: Request, block_ids: Sequence[int]) -> None:
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
        self._expected: dict[str, tuple[HeadMap | None, int]] = {}
        self._outbox: dict[str, list[KVChunk]] = {}

    def expect(
        self,
        request_id: str,
        head_map: HeadMap | None = None,
        max_frame_bytes: int = kvtransfer.MAX_FRAME_BYTES,
    ) -> None:
        """The sender wants the request's KV: heads converted by `head_map`, in the frame plan of
        `max_frame_bytes` (the wire's frames, or kvtransfer.LOCAL_CHUNK_BYTES device to device)."""
        self._expected[request_id] = (head_map, max_frame_bytes)

    def take(self, request_id: str) -> list[KVChunk]:
        """The gathered chunks of a finished request (KeyError: it did not finish)."""
        self._expected.pop(request_id, None)
        return self._outbox.pop(request_id)

    def forget(self, request_id: str) -> None:
        """The sender gave up (cancelled): drop whatever is kept for the request."""
        self._expected.pop(request_id, None)
        self._outbox.pop(request_id, None)

    @property
    def num_pending(self) -> int:
        return len(self._outbox)

    def request_finished(self, request: Request) -> bool:
        return request.request_id in self._expected

    def send_kv(self, cache, request: Request, block_ids: Sequence[int]) -> None:
        num_tokens = len(request.prompt_ids)
        blocks = list(block_ids[: kvtransfer.plan.cdiv(num_tokens, self.layout.block_size)])
        head_map, max_frame_bytes = self._expected[request.request_id]
        self._outbox[request.request_id] = kvtransfer.gather_request(
            cache, self.layout, blocks, num_tokens, max_frame_bytes=max_frame_bytes, head_map=head_map
        )


class DecodeConnector(KVConnector):
    """Decode role: a request `expect`ed before it is added waits for blocks like any other, is admitted
    into WAITING_FOR_REMOTE_KV with blocks for its prompt and first token, and `on_ready` is called
    (engine thread) so the receiver starts the transfer. Chunks are written with `load_kv` as they
    arrive (LLMEngine.load_kv); the receiver then calls LLMEngine.remote_kv_arrived (or remote_kv_failed).
    Engine thread only."""

    def __init__(self):
        self._expected: dict[str, Callable[[], None]] = {}

    def expect(self, request_id: str, on_ready: Callable[[], None]) -> None:
        self._expected[request_id] = on_ready

    def forget(self, request_id: str) -> None:
        self._expected.pop(request_id, None)

    def num_external_tokens(self, request: Request) -> int:
        return len(request.prompt_ids) if request.request_id in self._expected else 0

    def on_blocks_allocated(self, request: Request, block_ids: Sequence[int]) -> None:
        self._expected.pop(request.request_id)()

    def load_kv(self, cache, block_ids: Sequence[int], chunk: KVChunk):
        """Writes one verified chunk (on this engine's mesh and layout) into a request's blocks; returns
        the cache (the argument is donated)."""
        return kvtransfer.insert(cache, chunk, block_ids)
