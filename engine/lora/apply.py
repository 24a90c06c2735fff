"""The batched LoRA deltas of one decoder layer: every row (request) of a step adds its own adapter's.

Two ways to select each row's adapter, chosen by the step's static shape, with one set of formulas:
- decode steps (one token per row, many rows: memory-bound): every resident adapter is applied at once,
  as dense products over the slot axis, each row's low-rank input masked to its own slot (`sel` [B, S]:
  one-hot rows, all zeros for the base model). Each slot's weights are read once per step.
- prefill steps (many tokens, few rows: compute-bound): each row's adapter is gathered (`sel` [B]: 1 for
  a row with an adapter, 0 for the base model), so the products cost one adapter's FLOPs, not all slots'.
No shape depends on which adapters a step uses, so one compiled step serves every mix.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from engine.lora.slots import SLOT_AXIS, LoraWeights


def selection(slots: jax.Array, num_slots: int, per_row: bool, dtype) -> jax.Array:
    """[B] slot of each row (-1: no adapter) -> `sel` ([B] row scale when per_row, else [B, S] one-hot)."""
    if per_row:
        return (slots >= 0).astype(dtype)
    return jax.nn.one_hot(slots, num_slots, dtype=dtype)


def rows_of(lw: LoraWeights, slots: jax.Array) -> LoraWeights:
    """One layer's slots -> each row's adapter, the row axis where the slot axis was (base rows read slot
    0, scaled by 0)."""
    rows = jnp.maximum(slots, 0)
    return LoraWeights(
        **{name: jnp.take(getattr(lw, name), rows, axis=axis - 1) for name, axis in SLOT_AXIS.items()}
    )


def _einsum(spec: str, x: jax.Array, w: jax.Array, sel: jax.Array) -> jax.Array:
    """`spec` is written for the slot-mask form (`s`: the slot axis); per row, the weight's `s` becomes the
    row axis `b` and the intermediate loses it."""
    if sel.ndim == 1:
        operands, out = spec.split("->")
        x_sub, w_sub = operands.split(",")
        spec = f"{x_sub.replace('s', '')},{w_sub.replace('s', 'b')}->{out.replace('s', '')}"
    return jnp.einsum(spec, x, w)


def _select(s: jax.Array, sel: jax.Array) -> jax.Array:
    """Masks the low-rank activations s [B, T, (S,) ...] to each row's adapter."""
    w = sel[:, None, :] if sel.ndim == 2 else sel[:, None]
    return s * w.reshape(w.shape + (1,) * (s.ndim - w.ndim))


def qkv_delta(h: jax.Array, lw: LoraWeights, sel: jax.Array) -> jax.Array:
    """h [B, T, hidden] -> [B, T, kv_heads, (group + 2) * head_dim], the fused QKV layout."""
    s = _select(_einsum("btd,dspr->btspr", h, lw.qkv_a, sel), sel)
    q = _einsum("btsr,srkx->btkx", s[..., 0, :], lw.q_b, sel)
    kv = _einsum("btspr,psrkx->btkpx", s[..., 1:, :], lw.kv_b, sel)  # [B, T, kv_heads, 2, head_dim]
    return jnp.concatenate([q, kv.reshape(*kv.shape[:3], -1)], axis=-1)


def gate_up_delta(h: jax.Array, lw: LoraWeights, sel: jax.Array) -> jax.Array:
    """h [B, T, hidden] -> [B, T, 2, intermediate] (gate, up)."""
    s = _select(_einsum("btd,dscr->btscr", h, lw.gate_up_a, sel), sel)
    return _einsum("btscr,csri->btci", s, lw.gate_up_b, sel)


def linear_delta(x: jax.Array, a: jax.Array, b: jax.Array, sel: jax.Array) -> jax.Array:
    """x [B, T, in] with a [in, S, R], b [S, R, out] (o_proj, down_proj) -> [B, T, out]."""
    s = _select(_einsum("bti,isr->btsr", x, a, sel), sel)
    return _einsum("btsr,sro->bto", s, b, sel)
