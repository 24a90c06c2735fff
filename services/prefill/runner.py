"""One prefill on an engine running in an EngineLoop: queue the prompt, await its first token, gather its KV.

Shared by the prefill-server (which then frames the KV for gRPC) and the in-process prefill of
`pdserve serve` (which moves the gathered device arrays to the decode mesh).
"""

from __future__ import annotations

import dataclasses

from engine.output import RequestOutput
from engine.request import Request
from kvtransfer import HeadMap, KVChunk, KVLayout
from services.engine_loop import EngineLoop
from services.kv import gather_retained


@dataclasses.dataclass
class PrefillResult:
    first: RequestOutput  # the first token (and its logprobs)
    chunks: list[KVChunk]  # the prompt's KV in frame-plan order, on the prefill mesh
    num_tokens: int


async def prefill_on_engine(
    loop: EngineLoop, request: Request, layout: KVLayout, head_map: HeadMap | None = None
) -> PrefillResult:
    """`request` comes from engine.make_request with the caller's seed. Cancelling frees its blocks.

    The request is cut to one token (its stop conditions are the decode side's business) and keeps its
    blocks past its end until they are gathered.
    """
    request.params = dataclasses.replace(request.params, max_tokens=1)
    request.retain_kv = True
    rid = request.request_id
    outputs = loop.open_stream(rid)
    gathered = False
    try:
        await loop.call(lambda e: e.add_prepared_request(request))
        first = await outputs.get()  # a one-token request: it ends with this output
        chunks, num_tokens = await loop.call(lambda e: gather_retained(e, rid, layout, head_map))
        gathered = True
        return PrefillResult(first, chunks, num_tokens)
    finally:
        loop.close_stream(rid)
        if not gathered:
            loop.submit(lambda e: e.abort(rid))
