"""Every resident adapter's weights on the device (LoraWeights, filled by engine/lora_slots.py), and the
batched LoRA deltas of one decoder layer: every token of a ragged step adds its own sequence's
adapter's.

Every resident adapter is applied at once, as dense products over the slot axis, each token's low-rank
input masked to its own slot (`sel` [T, S]: one-hot rows, all zeros for the base model). Each slot's
weights are read once per step, and the extra FLOPs are T x hidden x (slots x rank) per projection (the
default 4 slots of rank 16: 64 columns next to the base projections' hundreds). No shape depends on which
adapters a step uses, so one compiled step serves every mix.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class LoraWeights:
    """A (rank R), B (R, scaling folded in) of every slot S, layers stacked (L)."""

    qkv_a: jax.Array  # [L, hidden, S, 3, R]  (q, k, v)
    q_b: jax.Array  # [L, S, R, kv_heads, group * head_dim]
    kv_b: jax.Array  # [L, 2, S, R, kv_heads, head_dim]  (k, v)
    o_a: jax.Array  # [L, heads * head_dim, S, R]
    o_b: jax.Array  # [L, S, R, hidden]
    gate_up_a: jax.Array  # [L, hidden, S, 2, R]  (gate, up)
    gate_up_b: jax.Array  # [L, 2, S, R, intermediate]
    down_a: jax.Array  # [L, intermediate, S, R]
    down_b: jax.Array  # [L, S, R, hidden]

    @property
    def num_slots(self) -> int:
        return self.q_b.shape[1]


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
