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
    """Attention of new tokens over past (paged) and new (in-register) keys; invalid positions masked.

    Each KV head's query rows (group x tokens) are laid out as one matrix, so the scores are plain
    batched matmuls; that is twice as fast on CPU as a 5-D einsum.
    """
    b, t, kvh, g, d = q.shape
    q = (q * d**-0.5).transpose(0, 2, 3, 1, 4).reshape(b, kvh, g * t, d)  # rows: (group, token)
    k_new, v_new = k_new.transpose(0, 2, 1, 3), v_new.transpose(0, 2, 1, 3)  # [B, kv_heads, T, head_dim]
    valid_new = jnp.arange(t)[None, :] < num_new[:, None]  # [B, T]
    causal = jnp.tril(jnp.ones((t, t), bool))[None] & valid_new[:, None, :]  # [B, Tq, Tk]
    causal = jnp.broadcast_to(causal[:, None, None], (b, 1, g, t, t)).reshape(b, 1, g * t, t)
    s_new = jnp.where(causal, jnp.einsum("bkqd,bksd->bkqs", q, k_new), _NEG_INF)
    if block_tables.shape[1] == 0:
        out = jnp.einsum("bkqs,bksd->bkqd", jax.nn.softmax(s_new, axis=-1), v_new)
    else:
        # One gather straight from the stacked cache: slicing cache[layer] first would copy a whole layer.
        past = cache[layer, block_tables]  # [B, P, block_size, 2 * kv_heads, head_dim]
        past = past.reshape(b, -1, kvh, 2, d).transpose(0, 2, 3, 1, 4)  # [B, kv_heads, 2, S, head_dim]
        k_past, v_past = past[:, :, 0], past[:, :, 1]
        num_slots = k_past.shape[2]
        valid_past = jnp.arange(num_slots)[None, :] < num_past[:, None]  # [B, S]
        s_past = jnp.where(valid_past[:, None, None], jnp.einsum("bkqd,bksd->bkqs", q, k_past), _NEG_INF)
        probs = jax.nn.softmax(jnp.concatenate([s_past, s_new], axis=-1), axis=-1)
        out = jnp.einsum("bkqs,bksd->bkqd", probs[..., :num_slots], v_past)
        out = out + jnp.einsum("bkqs,bksd->bkqd", probs[..., num_slots:], v_new)
    return out.reshape(b, kvh, g, t, d).transpose(0, 3, 1, 2, 4)


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
