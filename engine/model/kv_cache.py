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
from jax.sharding import Mesh, NamedSharding

from pdserve.engine.config import EngineConfig, ModelConfig
from pdserve.engine.core.kv_groups import KVGroups
from pdserve.engine.model.sharding import named


def _heads_axis(model: ModelConfig) -> str | None:
    return None if model.is_mla else "kv_heads"


def cache_sharding(mesh: Mesh, model: ModelConfig) -> NamedSharding:
    return named(mesh, "layers", "blocks", "block_slots", _heads_axis(model), "head_dim")


def chunk_sharding(mesh: Mesh, model: ModelConfig) -> NamedSharding:
    """A KV chunk [layers, tokens, 2 * kv_heads, head_dim] on the mesh, sharded like the cache."""
    return named(mesh, "layers", "tokens", _heads_axis(model), "head_dim")


def cache_shape(model: ModelConfig, engine: EngineConfig) -> tuple[int, ...]:
    rows = KVGroups.of(model).num_rows
    return (rows, engine.num_blocks, engine.block_size, *model.cache_token_shape(engine.tp))


def allocate_cache(model: ModelConfig, engine: EngineConfig, mesh: Mesh) -> jax.Array:
    """A zeroed cache, created directly in its sharding (no host copy)."""
    shape, dtype = cache_shape(model, engine), jnp.dtype(engine.dtype)
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=cache_sharding(mesh, model))()
