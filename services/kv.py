"""The engine's KV cache as kvtransfer sees it."""

from __future__ import annotations

from engine.engine import LLMEngine
from kvtransfer import KVLayout, LayerSpec, SpecKind


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
