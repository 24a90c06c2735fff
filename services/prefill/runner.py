"""One prefill on an engine running in an EngineLoop: queue the prompt, await its first token, take its KV.

Shared by the prefill-server (which then frames the KV for gRPC) and the in-process prefill of
`pdserve serve` (which moves the gathered device arrays to the decode mesh). The engine's
PrefillConnector (installed with `install_connector`) gathers a finished request's KV for the sender.
"""

from __future__ import annotations

import dataclasses

from engine.engine import LLMEngine
from engine.kv_connector import PrefillConnector
from engine.output import RequestOutput
from engine.request import Request
from kvtransfer import MAX_FRAME_BYTES, HeadMap, KVChunk
from services.engine_loop import EngineLoop
from services.kv import engine_layout


@dataclasses.dataclass
class PrefillResult:
    first: RequestOutput  # the first token (and its logprobs)
    chunks: list[KVChunk]  # the prompt's KV from first_block on, in frame-plan order, on the prefill mesh
    num_tokens: int  # tokens the chunks carry


def install_connector(engine: LLMEngine) -> None:
    """Makes `engine` a prefill engine: finished requests' KV goes to the sender that expects it."""
    engine.set_kv_connector(PrefillConnector(engine_layout(engine)))


async def prefill_on_engine(
    loop: EngineLoop,
    request: Request,
    head_map: HeadMap | None = None,
    max_frame_bytes: int = MAX_FRAME_BYTES,
    first_block: int = 0,
) -> PrefillResult:
    """`request` comes from engine.make_request with the caller's seed. Cancelling frees its blocks.

    The request is cut to one token (its stop conditions are the decode side's business); when it
    finishes, the connector gathers the KV of its prompt's blocks from `first_block` on (the receiver
    holds the ones before; heads converted by `head_map`, in chunks of at most `max_frame_bytes`) and its
    blocks go back to the prefix cache at once (the chunks are copies).
    """
    request.params = dataclasses.replace(request.params, max_tokens=1)
    rid = request.request_id
    outputs = loop.open_stream(rid)
    taken = False

    def add(engine: LLMEngine) -> None:
        engine.kv_connector.expect(rid, head_map, max_frame_bytes, first_block)
        engine.add_prepared_request(request)

    try:
        await loop.call(add)
        first = await outputs.get()  # a one-token request: it ends with this output
        chunks = await loop.call(lambda e: e.kv_connector.take(rid))
        taken = True
        num_tokens = len(request.prompt_ids) - first_block * loop.engine.config.block_size
        return PrefillResult(first, chunks, num_tokens)
    finally:
        loop.close_stream(rid)
        if not taken:
            loop.submit(lambda e: (e.kv_connector.forget(rid), e.abort(rid)))
