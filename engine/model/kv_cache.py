"""The device-side paged KV cache: one stacked array for all layers.

Layout: [rows, num_blocks, block_size, 2 * kv_heads, head_dim], K and V interleaved on the heads
axis (2h is K of KV head h, 2h+1 its V), sharded on that axis over the mesh axis `model`. A row per
layer, except in hybrid models, whose layer groups share rows (engine.core.kv_groups). Per layer this
is the `[num_blocks, block_size, 2 * kv_heads, head_dim]` layout kvtransfer moves. With multi-head latent
attention the heads axis holds one latent [kv_lora_rank | rope dims] a token, replicated over the mesh.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from pdserve import kvtransfer
from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.core.kv_groups import KVGroups
from pdserve.kvtransfer import KVLayout, LayerSpec, SpecKind


def kv_layout(model: ModelConfig, config: EngineConfig) -> KVLayout:
    """The cache of an engine of `model` and `config` (its dtype resolved) as kvtransfer sees it: each layer
    full or sliding-window attention (only the window's blocks are transferred), heads padded for TP. Its
    model names the weights too (name@digest): KV of other weights under the same name does not fit it.
    Weights quantized at load (EngineConfig.quantization) are named too (`+int8`): their KV differs.
    Its shardings (kvtransfer.cache_sharding, chunk_sharding) are the cache's and the chunks'."""
    if model.is_mla:  # one latent a token, the same on every chip
        specs = (LayerSpec(SpecKind.MLA),) * model.num_layers
        heads, head_dim = model.cache_token_shape(config.tp)
        mla = dict(kv_lora_rank=model.kv_lora_rank, qk_rope_head_dim=model.qk_rope_head_dim)
    else:
        windows = [model.window(i) for i in range(model.num_layers)]
        specs = tuple(LayerSpec(SpecKind.SLIDING, w) if w else LayerSpec(SpecKind.FULL) for w in windows)
        heads, head_dim, mla = model.num_kv_heads, model.head_dim, {}
    name = f"{model.name}@{model.weights_digest}" if model.weights_digest else model.name
    return KVLayout(
        model=name if config.quantization == "none" else f"{name}+{config.quantization}",
        layer_specs=specs,
        num_kv_heads=heads,
        head_dim=head_dim,
        dtype=config.cache_dtype,
        block_size=config.block_size,
        tp_size=config.tp,
        head_strategy="pad",
        **mla,
    )


def cache_shape(model: ModelConfig, engine: EngineConfig) -> tuple[int, ...]:
    rows = KVGroups.of(model).num_rows
    return (rows, engine.num_blocks, engine.block_size, *model.cache_token_shape(engine.tp))


def allocate_cache(model: ModelConfig, engine: EngineConfig, mesh: Mesh) -> jax.Array:
    """A zeroed cache, created directly in its sharding (no host copy)."""
    shape, dtype = cache_shape(model, engine), jnp.dtype(engine.cache_dtype)
    sharding = kvtransfer.cache_sharding(mesh, kv_layout(model, engine))
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()


def to_cache_dtype(kv: jax.Array, dtype) -> jax.Array:
    """New K/V as the cache stores them: cast, saturated to an fp8 type's finite range first (scale 1.0:
    a value past it would otherwise become NaN)."""
    dtype = jnp.dtype(dtype)
    if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 1:
        limit = float(jnp.finfo(dtype).max)
        kv = jnp.clip(kv, -limit, limit)
    return kv.astype(dtype)
