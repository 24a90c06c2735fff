"""One prefill on an engine running in an EngineLoop: queue the prompt, receive its KV as the prefill chunks
compute it, then its first token.

Shared by the prefill-server (which frames the KV for gRPC on a producer thread while the next chunk
computes) and the in-process prefill of `pdserve serve` (which moves the gathered device arrays to the
decode mesh). The request is added with SendKV; the engine's PrefillConnector (installed with
`install_connector`) gathers the chunks, which come out of the engine's steps as KVReady on the request's
stream, with its first token.
"""

from __future__ import annotations

import asyncio
import queue
import time
from collections.abc import Iterator

from pdserve.engine.boundary import Abort, AddRequest, KVReady, SendKV
from pdserve.engine.core.output import RequestOutput
from pdserve.engine.core.request import FinishReason, Request
from pdserve.engine.llm_engine import LLMEngine
from pdserve.kvtransfer import MAX_FRAME_BYTES, HeadMap, KVChunk
from pdserve.services.engine_loop import EngineFailure, EngineLoop, EngineStopped

_CLOSED = object()


class PrefillFailed(RuntimeError):
    """The engine failed on this prefill (its request ended with FinishReason.ERROR)."""


def install_connector(engine: LLMEngine) -> None:
    """Makes `engine` a prefill engine: the KV of the requests a sender expects goes to that sender."""
    engine.set_kv_connector(engine.prefill_connector())


class PrefillStream:
    """One request prefilled on `loop`'s engine, its prompt's KV from `first_block` on (the receiver holds
    the blocks before; heads converted by `head_map`, in the frame plan of `max_frame_bytes`).

    `request` comes from engine.make_request with the caller's seed and max_tokens=1 (the rest of its
    stop conditions are the decode side's business).
    Use: `await start()`; take the chunks (`chunks()` on a thread, or `achunks()`), which arrive while
    later prompt chunks compute; `await first_tokens()`; `close()` always (it aborts the request when it
    has not finished, freeing its blocks, and gives back the host slots its staged KV held). When the
    engine fails on the request, or stops, the chunks and the first token raise PrefillFailed /
    EngineStopped.
    """

    def __init__(
        self,
        loop: EngineLoop,
        request: Request,
        head_map: HeadMap | None = None,
        max_frame_bytes: int = MAX_FRAME_BYTES,
        first_block: int = 0,
    ):
        if request.params.max_tokens != 1:
            raise ValueError(f"a prefill samples one token, not {request.params.max_tokens}")
        self.loop, self.request = loop, request
        self.send = SendKV(head_map, max_frame_bytes, first_block)
        self.num_tokens = len(request.prompt_ids) - first_block * loop.engine.config.block_size
        self._chunks: queue.Queue = queue.Queue()  # KVChunk ..., then None (all sent), _CLOSED or an error
        self._first: asyncio.Future | None = None  # the first tokens' outputs (or the failure)
        self._firsts: dict[int, RequestOutput] = {}  # by sequence index, until all n are in
        self._watcher: asyncio.Task | None = None
        self.num_chunks_after_compute = 0  # handed over when the last prompt chunk was computed
        self.computed_at: float | None = None  # monotonic time the whole prompt's KV was handed over

    async def start(self) -> None:
        rid = self.request.request_id
        self._first = asyncio.get_running_loop().create_future()
        self._watcher = asyncio.create_task(self._watch(self.loop.open_stream(rid)))
        await self.loop.call(AddRequest(self.request, self.send))

    async def _watch(self, outputs: asyncio.Queue) -> None:
        """Reads the request's stream: KV chunks go to the chunks' consumer as they come; the first
        tokens' outputs (n of them) resolve first_tokens(); a failure (the request's or the engine's) also
        wakes the chunks' consumer with it."""
        while True:
            output = await outputs.get()
            if isinstance(output, KVReady):
                for chunk in output.chunks:
                    self._chunks.put(chunk)
                if output.last:
                    self.num_chunks_after_compute = len(output.chunks)
                    self.computed_at = time.monotonic()
                    self._chunks.put(None)
                continue
            error = None
            if isinstance(output, EngineFailure):
                error = EngineStopped(output.message)
            elif output.finish_reason is FinishReason.ERROR:
                error = PrefillFailed(f"the engine failed on this prefill: {output.error}")
            if error is not None:
                self._chunks.put(error)
                if not self._first.done():
                    self._first.set_exception(error)
                return
            self._firsts[output.index] = output
            if len(self._firsts) == self.request.params.n and not self._first.done():
                self._first.set_result([self._firsts[i] for i in range(len(self._firsts))])

    def chunks(self) -> Iterator[KVChunk]:
        """The chunks in plan order, blocking until each is computed (a producer thread's source); ends
        after the last, or early when the stream is closed; raises the engine's failure."""
        while True:
            chunk = self._chunks.get()
            if isinstance(chunk, Exception):
                raise chunk
            if chunk is None or chunk is _CLOSED:
                return
            yield chunk

    async def achunks(self):
        """chunks() for an asyncio consumer."""
        while True:
            chunk = await asyncio.to_thread(self._chunks.get)
            if isinstance(chunk, Exception):
                raise chunk
            if chunk is None or chunk is _CLOSED:
                return
            yield chunk

    async def first_tokens(self) -> list[RequestOutput]:
        """The first token's output of each of the request's n sequences, in index order (after the last
        chunk: the request finished with them)."""
        output = await self._first
        return output

    def close(self) -> None:
        rid = self.request.request_id
        self.loop.close_stream(rid)
        if self._watcher is not None:
            self._watcher.cancel()
        self._chunks.put(_CLOSED)  # wakes a consumer still waiting for chunks
        self.loop.submit(Abort(rid))  # (finished: the engine forgets its staged KV's slots)
