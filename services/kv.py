"""The engine's KV cache as kvtransfer sees it."""

from __future__ import annotations

from pdserve.engine.llm_engine import LLMEngine
from pdserve.kvtransfer import KVLayout, LayerSpec, SpecKind


def engine_layout(engine: LLMEngine) -> KVLayout:
    """The layout of `engine`'s cache: each layer full or sliding-window attention (only the window's
    blocks are transferred); heads padded for TP."""
    return model_layout(engine.model.config, engine.config)


def model_layout(cfg, config) -> KVLayout:
    """engine_layout of an engine of model config `cfg` and EngineConfig `config` (its dtype resolved),
    without building one."""
    if cfg.is_mla:  # one latent a token, the same on every chip
        specs = (LayerSpec(SpecKind.MLA),) * cfg.num_layers
        heads, head_dim = cfg.cache_token_shape(config.tp)
        mla = dict(kv_lora_rank=cfg.kv_lora_rank, qk_rope_head_dim=cfg.qk_rope_head_dim)
    else:
        windows = [cfg.window(i) for i in range(cfg.num_layers)]
        specs = tuple(LayerSpec(SpecKind.SLIDING, w) if w else LayerSpec(SpecKind.FULL) for w in windows)
        heads, head_dim, mla = cfg.num_kv_heads, cfg.head_dim, {}
    return KVLayout(
        model=cfg.name,
        layer_specs=specs,
        num_kv_heads=heads,
        head_dim=head_dim,
        dtype=config.dtype,
        block_size=config.block_size,
        tp_size=config.tp,
        head_strategy="pad",
        **mla,
    )
