"""The Llama-family forward pass as plain functions over a weights pytree and a paged KV cache.

One function, `forward_step`, runs a ragged step: one flat axis of new tokens holding decode tokens and
prefill chunks of any number of sequences, each attending to its own past through its block table
(engine.attention). Every projection is one matmul over all the step's tokens. Layers run under
`lax.scan` over the stacked weights (fast to compile, reads each weight once). The new tokens' K/V
leave the scan as its per-layer output and are scattered into the cache once, after the last layer; the
cache is donated, so the scatter updates it in place.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from engine.attention import ragged_paged_attention, token_sequences
from engine.config import ModelConfig
from engine.lora import apply as lora_ops
from engine.lora.slots import LoraWeights
from engine.weights import Weights


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    variance = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(variance + eps) * weight


@functools.lru_cache(maxsize=8)
def rope_inverse_frequencies(cfg: ModelConfig) -> np.ndarray:
    """[head_dim // 2] inverse frequencies, with Llama 3's long-context scaling when configured."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    if cfg.rope_llama3_scaling is not None:
        factor, low_ff, high_ff, original = cfg.rope_llama3_scaling
        wavelen = 2 * np.pi / inv
        low_wavelen, high_wavelen = original / low_ff, original / high_ff
        smooth = (original / wavelen - low_ff) / (high_ff - low_ff)
        scaled = np.where(wavelen > low_wavelen, inv / factor, inv)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        inv = np.where(mid, (1 - smooth) * inv / factor + smooth * inv, scaled)
    return inv.astype(np.float32)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: np.ndarray) -> jax.Array:
    """Rotary embedding, halves layout (HF's rotate_half). x: [T, ..., head_dim], positions [T]."""
    angles = positions[:, None].astype(jnp.float32) * inv_freq  # [T, head_dim // 2]
    angles = angles.reshape(angles.shape[0], *([1] * (x.ndim - 2)), angles.shape[-1])
    cos, sin = jnp.cos(angles).astype(x.dtype), jnp.sin(angles).astype(x.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _pair(lo: LoraWeights | None, name: str) -> tuple:
    """(A, B) of one plain projection of a layer's adapters (o, down); () without LoRA."""
    return () if lo is None else (getattr(lo, f"{name}_a"), getattr(lo, f"{name}_b"))


def forward_step(
    weights: Weights,
    lora: LoraWeights | None,  # resident adapters (None: LoRA off, nothing added)
    cache: jax.Array,  # [num_layers, num_blocks, block_size, 2 * kv_heads, head_dim]
    tokens: jax.Array,  # [T] int32: every sequence's new tokens back to back, then padding
    cu_q_lens: jax.Array,  # [S + 1] where each sequence's tokens start; the last: tokens in use
    kv_lens: jax.Array,  # [S] context of each sequence once its new tokens are in (0: padding)
    block_tables: jax.Array,  # [S, P] blocks of each sequence (P: a multiple of KV_TILE_BLOCKS)
    lora_slots: jax.Array,  # [S] adapter slot of each sequence, -1: the base model
    *,
    cfg: ModelConfig,
) -> tuple[jax.Array, jax.Array]:  # logits [S, vocab] at each sequence's last new token, updated cache
    t = tokens.shape[0]
    num_blocks, block_size = cache.shape[1], cache.shape[2]
    kv_heads = cache.shape[3] // 2
    head_dim = cfg.head_dim
    seq, valid = token_sequences(cu_q_lens, t)
    positions = kv_lens[seq] - (cu_q_lens[seq + 1] - cu_q_lens[seq]) + jnp.arange(t) - cu_q_lens[seq]
    positions = jnp.where(valid, positions, 0)
    inv_freq = rope_inverse_frequencies(cfg)
    x = weights.embed[tokens]  # [T, hidden]
    token_slots = jnp.where(valid, lora_slots[seq], -1)
    mask = None if lora is None else lora_ops.selection(token_slots, lora.num_slots, x.dtype)
    any_lora = jnp.any(token_slots >= 0)

    def layer(x, lw):
        w, lo, index = lw

        def plus_lora(y, delta, *args):  # y + delta(*args); skipped at run time when no token has an adapter
            if lo is None:
                return y
            return jax.lax.cond(any_lora, lambda: y + delta(*args, mask), lambda: y)

        h = rms_norm(x, w.attn_norm, cfg.rms_norm_eps)
        qkv = jnp.einsum("td,dkx->tkx", h, w.w_qkv) + w.b_qkv  # [T, kv_heads, (group + 2) * head_dim]
        qkv = plus_lora(qkv, lora_ops.qkv_delta, h, lo)
        q = qkv[..., : -2 * head_dim].reshape(t, kv_heads, -1, head_dim)
        k, v = qkv[..., -2 * head_dim : -head_dim], qkv[..., -head_dim:]
        if cfg.qk_norm:  # per head (padded heads are zeros and stay zeros)
            q, k = rms_norm(q, w.q_norm, cfg.rms_norm_eps), rms_norm(k, w.k_norm, cfg.rms_norm_eps)
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        attn = ragged_paged_attention(q, k, v, cache, index, kv_lens, block_tables, cu_q_lens)
        attn = attn.reshape(t, -1)
        x = x + plus_lora(attn @ w.wo, lora_ops.linear_delta, attn, *_pair(lo, "o"))
        h = rms_norm(x, w.mlp_norm, cfg.rms_norm_eps)
        gate_up = jnp.einsum("td,dci->tci", h, w.w_gate_up)
        gate_up = plus_lora(gate_up, lora_ops.gate_up_delta, h, lo)
        act = jax.nn.silu(gate_up[:, 0]) * gate_up[:, 1]
        x = x + plus_lora(act @ w.w_down, lora_ops.linear_delta, act, *_pair(lo, "down"))
        new_kv = jnp.stack([k, v], axis=2).reshape(t, 2 * kv_heads, head_dim)  # K, V interleaved
        return x, new_kv

    x, new_kv = jax.lax.scan(layer, x, (weights.layers, lora, jnp.arange(cfg.num_layers)))
    column = jnp.minimum(positions // block_size, block_tables.shape[1] - 1)
    write_blocks = jnp.where(valid, block_tables[seq, column], num_blocks)  # padding: out of range, dropped
    cache = cache.at[:, write_blocks, positions % block_size].set(new_kv.astype(cache.dtype), mode="drop")
    last = x[jnp.maximum(cu_q_lens[1:] - 1, 0)]  # [S, hidden]
    last = rms_norm(last, weights.final_norm, cfg.rms_norm_eps)
    if weights.lm_head is None:
        logits = jnp.einsum("sd,vd->sv", last, weights.embed)
    else:
        logits = last @ weights.lm_head
    return logits.astype(jnp.float32), cache
