"""The model's weights as a registered dataclass pytree: layers stacked on a leading axis for `lax.scan`.

Head padding for tensor parallelism lives here: KV heads are padded up to a multiple of the TP size by
appending zero heads, and query heads are padded group by group so every padded KV head keeps a full
group. Padded query heads have zero output projections, so they add nothing to the result.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from engine.config import ModelConfig
from engine.sharding import named


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LayerWeights:
    """One decoder layer's weights, each stacked over layers (leading axis L)."""

    attn_norm: jax.Array  # [L, hidden]
    wq: jax.Array  # [L, hidden, heads * head_dim]
    wk: jax.Array  # [L, hidden, kv_heads * head_dim]
    wv: jax.Array  # [L, hidden, kv_heads * head_dim]
    bq: jax.Array  # [L, heads * head_dim]  (zeros without qkv bias)
    bk: jax.Array  # [L, kv_heads * head_dim]
    bv: jax.Array  # [L, kv_heads * head_dim]
    wo: jax.Array  # [L, heads * head_dim, hidden]
    mlp_norm: jax.Array  # [L, hidden]
    w_gate: jax.Array  # [L, hidden, intermediate]
    w_up: jax.Array  # [L, hidden, intermediate]
    w_down: jax.Array  # [L, intermediate, hidden]


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Weights:
    embed: jax.Array  # [vocab, hidden]
    layers: LayerWeights
    final_norm: jax.Array  # [hidden]
    lm_head: jax.Array | None  # [hidden, vocab]; None when tied to `embed`


_LAYER_AXES = {
    "attn_norm": ("layers", "embed"),
    "wq": ("layers", "embed", "heads"),
    "wk": ("layers", "embed", "kv_heads"),
    "wv": ("layers", "embed", "kv_heads"),
    "bq": ("layers", "heads"),
    "bk": ("layers", "kv_heads"),
    "bv": ("layers", "kv_heads"),
    "wo": ("layers", "heads", "embed"),
    "mlp_norm": ("layers", "embed"),
    "w_gate": ("layers", "embed", "mlp"),
    "w_up": ("layers", "embed", "mlp"),
    "w_down": ("layers", "mlp", "embed"),
}


def _pad_heads(w: np.ndarray, axis: int, cfg: ModelConfig, tp: int, kv: bool) -> np.ndarray:
    """Pads a fused (heads * head_dim) axis: KV heads appended, query heads appended per KV group."""
    kv_pad = cfg.padded_num_kv_heads(tp) - cfg.num_kv_heads
    if kv_pad == 0:
        return w
    axis = axis % w.ndim
    shape = list(w.shape)
    if kv:
        grouped = w.reshape(*shape[:axis], cfg.num_kv_heads, cfg.head_dim, *shape[axis + 1 :])
    else:
        grouped = w.reshape(
            *shape[:axis], cfg.num_kv_heads, cfg.group_size * cfg.head_dim, *shape[axis + 1 :]
        )
    widths = [(0, 0)] * grouped.ndim
    widths[axis] = (0, kv_pad)
    padded = np.pad(grouped, widths)
    return padded.reshape(*shape[:axis], -1, *shape[axis + 1 :])


def build_weights(
    cfg: ModelConfig, host: dict[str, np.ndarray], mesh: Mesh, dtype: jnp.dtype = jnp.float32
) -> Weights:
    """Pads heads for the mesh's TP size and places every array with its sharding.

    `host` holds numpy arrays in math layout (x @ W): `embed` [V, D], `final_norm` [D], optional
    `lm_head` [D, V], and the per-layer names of `LayerWeights` stacked over layers.
    """
    tp = mesh.shape["model"]
    layers = {}
    for name, axes in _LAYER_AXES.items():
        w = host[name]
        if axes[-1] in ("heads", "kv_heads"):
            w = _pad_heads(w, -1, cfg, tp, kv=axes[-1] == "kv_heads")
        elif name == "wo":
            w = _pad_heads(w, 1, cfg, tp, kv=False)
        layers[name] = jax.device_put(w.astype(dtype), named(mesh, *axes))
    lm_head = host.get("lm_head")
    return Weights(
        embed=jax.device_put(host["embed"].astype(dtype), named(mesh, "vocab", "embed")),
        layers=LayerWeights(**layers),
        final_norm=jax.device_put(host["final_norm"].astype(dtype), named(mesh, "embed")),
        lm_head=None
        if lm_head is None
        else jax.device_put(lm_head.astype(dtype), named(mesh, "embed", "vocab")),
    )


def weight_bytes(weights: Weights) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(weights))
