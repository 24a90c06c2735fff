"""The engine's KV cache as kvtransfer sees it, and the two ends of one request's transfer."""

from __future__ import annotations

import kvtransfer
from engine.engine import LLMEngine
from kvtransfer import KVChunk, KVLayout, LayerSpec, SpecKind


def engine_layout(engine: LLMEngine) -> KVLayout:
    """The layout of `engine`'s cache: Llama-family layers are all full attention; heads padded for TP."""
    cfg = engine.model.config
    return KVLayout(
        model=cfg.name,
        layer_specs=(LayerSpec(SpecKind.FULL),) * cfg.num_layers,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        dtype=engine.config.dtype,
        block_size=engine.config.block_size,
        tp_size=engine.config.tp,
        head_strategy="pad",
    )


def gather_retained(
    engine: LLMEngine, request_id: str, layout: KVLayout, head_map=None
) -> tuple[list[KVChunk], int]:
    """Prefill side, on the engine thread: dispatches the gather of a finished request's KV, then frees
    its blocks. The gathered chunks are copies, so later steps may reuse the blocks at once (device work
    runs in dispatch order). Returns (chunks, num_tokens)."""
    request = engine.retained[request_id]
    num_tokens = len(request.prompt_ids)
    blocks = request.blocks.block_ids[: kvtransfer.plan.cdiv(num_tokens, layout.block_size)]
    try:
        chunks = kvtransfer.gather_request(engine.runner.cache, layout, blocks, num_tokens, head_map=head_map)
    finally:
        engine.release(request_id)
    return chunks, num_tokens
