"""Multi-head latent attention (DeepSeek-V2): the projections around the attention, with the key and value
up-projections absorbed.

A token's K and V for all heads come from one latent: c = RMSNorm(h @ W_kv_a[:, :r]) (r = kv_lora_rank)
and a rotated key part k_pe = rope(h @ W_kv_a[:, r:]) shared by every head. The cache stores [c | k_pe] per
token and layer: one "head" of r + rope dims (kvtransfer's MLA spec), replicated over the mesh, while the
query heads are split over it. Head h's key is [c @ W_uk[h] | k_pe] and its value c @ W_uv[h]; so
    q_h . k_h = (q_nope_h @ W_uk[h]^T) . c + q_pe_h . k_pe
and the attention runs on the latent as multi-query attention of head_dim r + rope whose value is the
latent's first r dims (engine.model.attention, `latent=True`); W_uv[h] maps each head's result afterwards. The
up-projections are never applied to the cache: decode reads r + rope numbers per past token, not
2 * heads * head_dim. Prefill uses the same absorbed form (the expanded form would compute fewer flops for
long prompts at 128-dim heads; a kernel choice left to the TPU path).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pdserve.engine.config import ModelConfig
from pdserve.engine.model.layers import apply_rope, rms_norm
from pdserve.engine.model.weights import LayerWeights


def queries_and_latent(
    h: jax.Array, w: LayerWeights, positions: jax.Array, inv_freq: jax.Array, cfg: ModelConfig
) -> tuple[jax.Array, jax.Array]:
    """(queries [T, 1, heads, r + rope] in the latent's space, latents [T, 1, r + rope] of the new tokens)."""
    r, nope = cfg.kv_lora_rank, cfg.head_dim - cfg.rope_dim
    h_q = rms_norm(h @ w.w_q_a, w.q_a_norm, cfg.rms_norm_eps) if cfg.q_lora_rank else h
    q = jnp.einsum("td,dhx->thx", h_q, w.w_q)  # [T, heads, nope + rope]
    q_pe = apply_rope(q[..., nope:], positions, inv_freq, cfg.rope_attention_factor)
    q_latent = jnp.einsum("thn,hnr->thr", q[..., :nope], w.w_uk)  # keys' up-projection absorbed
    kv = h @ w.w_kv_a  # [T, r + rope]
    c = rms_norm(kv[:, :r], w.kv_a_norm, cfg.rms_norm_eps)
    k_pe = apply_rope(kv[:, None, r:], positions, inv_freq, cfg.rope_attention_factor)  # [T, 1, rope]
    latent = jnp.concatenate([c[:, None], k_pe], axis=-1)
    return jnp.concatenate([q_latent, q_pe], axis=-1)[:, None], latent


def heads_output(attn: jax.Array, w: LayerWeights) -> jax.Array:
    """attn [T, 1, heads, r] (each head's mix of latents) -> [T, heads * v_head_dim], o_proj's input."""
    out = jnp.einsum("thr,hrv->thv", attn[:, 0], w.w_uv)
    return out.reshape(out.shape[0], -1)
