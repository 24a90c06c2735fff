"""The device-side paged KV cache: one stacked array for all layers.

Layout: [rows, num_blocks, block_size, 2 * kv_heads, head_dim], K and V interleaved on the heads
axis (2h is K of KV head h, 2h+1 its V), sharded on that axis over the mesh axis `model`. An int8 cache's
rows are head_dim + SCALE_BYTES wide: each K or V row of a token ends with its own scale (to_cache_dtype
writes them, from_cache reads them; kvtransfer moves them as the row's bytes). A row per
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
from pdserve.kvtransfer import SCALE_BYTES, SCALE_DTYPE, KVLayout, LayerSpec, SpecKind, scale_scheme


def kv_layout(model: ModelConfig, config: EngineConfig) -> KVLayout:
    """The cache of an engine of `model` and `config` (its dtype resolved) as kvtransfer sees it: each layer
    full or sliding-window attention (only the window's blocks are transferred), heads padded for TP. Its
    model names the weights too (name@digest): KV of other weights under the same name does not fit it.
    Weights quantized at load (EngineConfig.quantization) are named too (`+int8`): their KV differs.
    An EAGLE-3 draft layer (ModelConfig.draft_layer) is one more full layer, named in the model (`+eagle3@
    digest`). Its shardings (kvtransfer.cache_sharding, chunk_sharding) are the cache's and the chunks'."""
    if model.is_mla:  # one latent a token, the same on every chip
        specs = (LayerSpec(SpecKind.MLA),) * model.num_layers
        heads, head_dim = 1, model.kv_lora_rank + model.qk_rope_head_dim
        mla = dict(kv_lora_rank=model.kv_lora_rank, qk_rope_head_dim=model.qk_rope_head_dim)
    else:
        windows = [model.window(i) for i in range(model.num_layers)] + [0] * bool(model.draft_layer)
        specs = tuple(LayerSpec(SpecKind.SLIDING, w) if w else LayerSpec(SpecKind.FULL) for w in windows)
        heads, head_dim, mla = model.num_kv_heads, model.head_dim, {}
    name = f"{model.name}@{model.weights_digest}" if model.weights_digest else model.name
    if model.draft_layer:  # its KV is the last layer's (engine.core.kv_groups)
        name = f"{name}+{model.draft_layer}"
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
    return (rows, engine.num_blocks, engine.block_size, *kv_layout(model, engine).token_shape)


def allocate_cache(model: ModelConfig, engine: EngineConfig, mesh: Mesh) -> jax.Array:
    """A zeroed cache, created directly in its sharding (no host copy)."""
    shape, dtype = cache_shape(model, engine), jnp.dtype(engine.cache_dtype)
    sharding = kvtransfer.cache_sharding(mesh, kv_layout(model, engine))
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)()


INT8_MAX = 127  # symmetric: int8 values in [-127, 127]


def to_cache_dtype(kv: jax.Array, dtype) -> jax.Array:
    """New K/V [..., head rows, head_dim] as the cache stores them: cast, saturated to an fp8 type's finite
    range first (scale 1.0: a value past it would otherwise become NaN); int8: quantized per row, each
    row followed by its scale's bytes (kvtransfer.layout.SCALE_SCHEMES: [..., head_dim + SCALE_BYTES])."""
    dtype = jnp.dtype(dtype)
    if scale_scheme(dtype.name) == "token_head":
        return _quantize_rows(kv)
    if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 1:
        limit = float(jnp.finfo(dtype).max)
        kv = jnp.clip(kv, -limit, limit)
    return kv.astype(dtype)


def _quantize_rows(kv: jax.Array) -> jax.Array:
    """Symmetric int8 with one scale a row: the row's max |x| / 127, rounded to SCALE_DTYPE first so that
    value = int8 x stored scale exactly as dequantize reads it (a row of zeros: scale 0)."""
    kv = kv.astype(jnp.float32)
    scale = (jnp.max(jnp.abs(kv), axis=-1) / INT8_MAX).astype(SCALE_DTYPE)
    divisor = jnp.where(scale > 0, scale.astype(jnp.float32), 1.0)[..., None]
    values = jnp.clip(jnp.round(kv / divisor), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    scale_bytes = jax.lax.bitcast_convert_type(scale, jnp.int8)  # [..., SCALE_BYTES]
    return jnp.concatenate([values, scale_bytes], axis=-1)


def from_cache(kv: jax.Array) -> jax.Array:
    """Rows read from the cache [..., row width] as float32 K/V [..., head_dim]: cast, or an int8 row's
    values times its scale."""
    if scale_scheme(kv.dtype.name) != "token_head":
        return kv.astype(jnp.float32)
    scale = jax.lax.bitcast_convert_type(kv[..., -SCALE_BYTES:], SCALE_DTYPE).astype(jnp.float32)
    return kv[..., :-SCALE_BYTES].astype(jnp.float32) * scale[..., None]
