"""The batched LoRA deltas of one decoder layer: every token of a ragged step adds its own sequence's
adapter's.

Every resident adapter is applied at once, as dense products over the slot axis, each token's low-rank
input masked to its own slot (`sel` [T, S]: one-hot rows, all zeros for the base model). Each slot's
weights are read once per step, and the extra FLOPs are T x hidden x (slots x rank) per projection (the
default 4 slots of rank 16: 64 columns next to the base projections' hundreds). No shape depends on which
adapters a step uses, so one compiled step serves every mix.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from engine.lora.slots import LoraWeights


def selection(slots: jax.Array, num_slots: int, dtype) -> jax.Array:
    """[T] slot of each token (-1: no adapter) -> `sel` [T, S], one-hot rows."""
    return jax.nn.one_hot(slots, num_slots, dtype=dtype)


def _select(s: jax.Array, sel: jax.Array) -> jax.Array:
    """Masks the low-rank activations s [T, S, ...] to each token's adapter."""
    return s * sel.reshape(sel.shape + (1,) * (s.ndim - sel.ndim))


def qkv_delta(h: jax.Array, lw: LoraWeights, sel: jax.Array) -> jax.Array:
    """h [T, hidden] -> [T, kv_heads, (group + 2) * head_dim], the fused QKV layout."""
    s = _select(jnp.einsum("td,dspr->tspr", h, lw.qkv_a), sel)
    q = jnp.einsum("tsr,srkx->tkx", s[..., 0, :], lw.q_b)
    kv = jnp.einsum("tspr,psrkx->tkpx", s[..., 1:, :], lw.kv_b)  # [T, kv_heads, 2, head_dim]
    return jnp.concatenate([q, kv.reshape(*kv.shape[:2], -1)], axis=-1)


def gate_up_delta(h: jax.Array, lw: LoraWeights, sel: jax.Array) -> jax.Array:
    """h [T, hidden] -> [T, 2, intermediate] (gate, up)."""
    s = _select(jnp.einsum("td,dscr->tscr", h, lw.gate_up_a), sel)
    return jnp.einsum("tscr,csri->tci", s, lw.gate_up_b)


def linear_delta(x: jax.Array, a: jax.Array, b: jax.Array, sel: jax.Array) -> jax.Array:
    """x [T, in] with a [in, S, R], b [S, R, out] (o_proj, down_proj) -> [T, out]."""
    s = _select(jnp.einsum("ti,isr->tsr", x, a), sel)
    return jnp.einsum("tsr,sro->to", s, b)
