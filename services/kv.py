"""The engine's KV cache as kvtransfer sees it."""

from __future__ import annotations

from engine.engine import LLMEngine
from kvtransfer import KVLayout, LayerSpec, SpecKind


def engine_layout(engine: LLMEngine) -> KVLayout:
    """The layout of `engine`'s cache: each layer full or sliding-window attention (only the window's
    blocks are transferred); heads padded for TP."""
    cfg = engine.model.config
    windows = [cfg.window(i) for i in range(cfg.num_layers)]
    return KVLayout(
        model=cfg.name,
        layer_specs=tuple(LayerSpec(SpecKind.SLIDING, w) if w else LayerSpec(SpecKind.FULL) for w in windows),
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        dtype=engine.config.dtype,
        block_size=engine.config.block_size,
        tp_size=engine.config.tp,
        head_strategy="pad",
    )
