"""Paged attention: a reference implementation in plain JAX, and the seam where a TPU kernel plugs in.

A step attends each row's new tokens (a prefill chunk, or one decode token) to
  * the row's past tokens, read from the paged cache through its block table, and
  * the new tokens themselves (causal), whose K/V have not been written to the cache yet.
Both parts share one softmax. The cache is written once per step, after all layers (see engine.model).

The seam: `set_attention_impl(fn)` swaps `paged_attention` for another function with the same signature,
e.g. a wrapper around JAX's Pallas ragged paged attention on TPU (jax.experimental.pallas.ops.tpu). The
reference runs everywhere and is what the tests pin down.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

_NEG_INF = -1e30


def paged_attention_reference(
    q: jax.Array,  # [B, T, kv_heads, group, head_dim]
    k_new: jax.Array,  # [B, T, kv_heads, head_dim]
    v_new: jax.Array,  # [B, T, kv_heads, head_dim]
    cache: jax.Array,  # [num_layers, num_blocks, block_size, 2 * kv_heads, head_dim]
    layer: jax.Array,  # [] index of this layer in `cache`
    block_tables: jax.Array,  # [B, P] past blocks of each row (P may be 0)
    num_past: jax.Array,  # [B] tokens already in the cache for each row
    num_new: jax.Array,  # [B] valid new tokens in each row (<= T)
) -> jax.Array:  # [B, T, kv_heads, group, head_dim]
    """Attention of new tokens over past (paged) and new (in-register) keys; invalid positions masked."""
    b, t, kvh, g, d = q.shape
    scale = d**-0.5
    q = q * scale
    valid_new = jnp.arange(t)[None, :] < num_new[:, None]  # [B, T]
    causal = jnp.tril(jnp.ones((t, t), bool))[None] & valid_new[:, None, :]  # [B, Tq, Tk]
    s_new = jnp.einsum("btkgd,bskd->bkgts", q, k_new)
    s_new = jnp.where(causal[:, None, None], s_new, _NEG_INF)
    if block_tables.shape[1] == 0:
        probs = jax.nn.softmax(s_new, axis=-1)
        return jnp.einsum("bkgts,bskd->btkgd", probs, v_new)
    # One gather straight from the stacked cache: slicing cache[layer] first would copy a whole layer.
    past = cache[layer, block_tables]  # [B, P, block_size, 2 * kv_heads, head_dim]
    past = past.reshape(b, -1, kvh, 2, d)
    k_past, v_past = past[..., 0, :], past[..., 1, :]  # [B, S, kv_heads, head_dim]
    s_past = jnp.einsum("btkgd,bskd->bkgts", q, k_past)
    valid_past = jnp.arange(k_past.shape[1])[None, :] < num_past[:, None]  # [B, S]
    s_past = jnp.where(valid_past[:, None, None, None], s_past, _NEG_INF)
    probs = jax.nn.softmax(jnp.concatenate([s_past, s_new], axis=-1), axis=-1)
    p_past, p_new = probs[..., : k_past.shape[1]], probs[..., k_past.shape[1] :]
    return jnp.einsum("bkgts,bskd->btkgd", p_past, v_past) + jnp.einsum("bkgts,bskd->btkgd", p_new, v_new)


AttentionFn = Callable[..., jax.Array]
_impl: AttentionFn = paged_attention_reference


def set_attention_impl(fn: AttentionFn | None) -> None:
    """Installs a kernel with `paged_attention_reference`'s signature (None restores the reference).

    Must be called before the engine compiles its steps.
    """
    global _impl
    _impl = fn or paged_attention_reference


def paged_attention(*args, **kwargs) -> jax.Array:
    return _impl(*args, **kwargs)
