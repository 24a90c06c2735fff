"""The batched LoRA deltas of one decoder layer: every row (request) of a step adds its own adapter's.

All resident adapters are applied at once as dense matmuls over the slot axis, with each row's input
to the low-rank product masked to its own slot (a one-hot row; all zeros for the base model). No
gathers and no shape depends on which adapters a step uses, so one compiled step serves every mix.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from engine.lora.slots import LoraWeights


def slot_mask(slots: jax.Array, num_slots: int, dtype) -> jax.Array:
    """[B] slot of each row (-1: no adapter) -> [B, S] one-hot rows."""
    return jax.nn.one_hot(slots, num_slots, dtype=dtype)


def qkv_delta(h: jax.Array, lw: LoraWeights, mask: jax.Array) -> jax.Array:
    """h [B, T, hidden] -> [B, T, kv_heads, (group + 2) * head_dim], the fused QKV layout."""
    s = jnp.einsum("btd,sdpr->btspr", h, lw.qkv_a) * mask[:, None, :, None, None]
    q = jnp.einsum("btsr,srkx->btkx", s[:, :, :, 0], lw.q_b)
    kv = jnp.einsum("btspr,sprkx->btkpx", s[:, :, :, 1:], lw.kv_b)  # [B, T, kv_heads, 2, head_dim]
    return jnp.concatenate([q, kv.reshape(*kv.shape[:3], -1)], axis=-1)


def gate_up_delta(h: jax.Array, lw: LoraWeights, mask: jax.Array) -> jax.Array:
    """h [B, T, hidden] -> [B, T, 2, intermediate] (gate, up)."""
    s = jnp.einsum("btd,sdcr->btscr", h, lw.gate_up_a) * mask[:, None, :, None, None]
    return jnp.einsum("btscr,scri->btci", s, lw.gate_up_b)


def linear_delta(x: jax.Array, a: jax.Array, b: jax.Array, mask: jax.Array) -> jax.Array:
    """x [B, T, in] with a [S, in, R], b [S, R, out] (o_proj, down_proj) -> [B, T, out]."""
    s = jnp.einsum("bti,sir->btsr", x, a) * mask[:, None, :, None]
    return jnp.einsum("btsr,sro->bto", s, b)
