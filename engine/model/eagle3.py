"""An EAGLE-3 draft head on the device: its weights, and one jitted pass that catches its KV up with the
target and drafts k tokens per sequence.

The head (engine.loading.eagle3) reads, for each position j of a sequence, the token at j + 1 and the
target's hidden states at j (the residual stream entering three of its layers, fused by `fc`), and
predicts the token at j + 2. Its one layer attends to its own KV, which lives in the target's paged cache
as row `num_layers` (one more full layer, the target's block tables: engine.core.kv_groups), written at
the same positions as the target's. After every step of the target the engine hands `draft_step` the
positions the target has just computed for good (a prefill chunk's; a verifying row's up to its first
rejected draft), with their next tokens and the target's hidden states there: the head writes its KV
there, and from each proposing sequence's last position drafts one token, then k - 1 more, each feeding
the layer's own output (before its final norm) and the token just drafted at the next position. Drafts
are greedy (the argmax over the draft vocabulary, mapped to the target's ids by d2t).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from pdserve.engine.config import ModelConfig
from pdserve.engine.loading.eagle3 import Eagle3Head
from pdserve.engine.model.attention import AttentionFn, token_sequences
from pdserve.engine.model.kv_cache import to_cache_dtype
from pdserve.engine.model.layers import ACTIVATION_FNS, apply_rope, rms_norm, rope_inverse_frequencies
from pdserve.engine.model.projection import project
from pdserve.engine.model.sharding import named
from pdserve.engine.model.weights import LayerWeights, layer_arrays, put_layer


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DraftWeights:
    """The head on the mesh: `layer` its decoder layer (leading axis 1; attn_norm is the embedding's norm,
    mlp_norm the one after attention, Q/K/V over [embedding | hidden state], 2 x hidden wide)."""

    fc: jax.Array  # [aux layers * hidden, hidden]
    hidden_norm: jax.Array  # [hidden]
    layer: LayerWeights
    final_norm: jax.Array  # [hidden]
    lm_head: jax.Array  # [hidden, draft vocab]
    d2t: jax.Array  # [draft vocab] int32: target id = draft id + d2t[draft id]
    embed: jax.Array | None  # [vocab, hidden] the head's own embeddings; None: the target's


@dataclasses.dataclass(frozen=True)
class DraftModel:
    """A head ready to run: its weights on the mesh, its layer's config, the target layers it reads."""

    weights: DraftWeights
    config: ModelConfig
    aux_layers: tuple[int, ...]
    norm_before_residual: bool
    name: str  # ModelConfig.draft_layer

    @classmethod
    def build(cls, head: Eagle3Head, mesh: Mesh, dtype: np.dtype) -> DraftModel:
        """The head's tensors onto `mesh` (its layer sharded as the target's layers, the rest replicated)."""
        t, cfg = head.tensors, head.config
        tp = mesh.shape["model"]
        pre = "midlayer."

        def math(name: str) -> np.ndarray:  # a stored [out, in] weight as [in, out]
            return np.ascontiguousarray(t[pre + name].T)

        heads_q, heads_kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        layer = {
            "attn_norm": t[pre + "input_layernorm.weight"],
            "mlp_norm": t[pre + "post_attention_layernorm.weight"],
            "wq": math("self_attn.q_proj.weight"),
            "wk": math("self_attn.k_proj.weight"),
            "wv": math("self_attn.v_proj.weight"),
            "bq": np.zeros(heads_q, np.float32),
            "bk": np.zeros(heads_kv, np.float32),
            "bv": np.zeros(heads_kv, np.float32),
            "wo": math("self_attn.o_proj.weight"),
            "w_gate": math("mlp.gate_proj.weight"),
            "w_up": math("mlp.up_proj.weight"),
            "w_down": math("mlp.down_proj.weight"),
        }

        def put(array: np.ndarray, dtype_: np.dtype = dtype) -> jax.Array:
            return jax.device_put(np.asarray(array).astype(dtype_), named(mesh))

        d2t = t.get("d2t")
        weights = DraftWeights(
            fc=put(t["fc.weight"].T),
            hidden_norm=put(t[pre + "hidden_norm.weight"]),
            layer=put_layer(layer_arrays(cfg, layer, tp), mesh, dtype),
            final_norm=put(t["norm.weight"]),
            lm_head=put(t["lm_head.weight"].T),
            d2t=put(np.zeros(head.draft_vocab_size) if d2t is None else d2t, np.int32),
            embed=put(t["embed_tokens.weight"]) if "embed_tokens.weight" in t else None,
        )
        return cls(weights, cfg, head.aux_layers, head.norm_before_residual, head.name)


def _layer(
    dw: DraftWeights,
    embed: jax.Array,
    cache: jax.Array,
    tokens: jax.Array,  # [T]
    hidden: jax.Array,  # [T, hidden]: fused target states, or the layer's own earlier output
    cu_q_lens: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,  # [S, P]
    writable: jax.Array,  # [T] bool: the token's KV is written (its block is the sequence's)
    *,
    cfg: ModelConfig,
    row: int,
    attention: AttentionFn,
    norm_before_residual: bool,
) -> tuple[jax.Array, jax.Array]:
    """The head's layer over a ragged batch: (the updated cache, each token's output before the final
    norm)."""
    t, num_blocks, block_size = tokens.shape[0], cache.shape[1], cache.shape[2]
    kv_heads, head_dim = cache.shape[3] // 2, cfg.head_dim
    w = jax.tree.map(lambda a: a[0], dw.layer)
    seq, valid = token_sequences(cu_q_lens, t)
    positions = kv_lens[seq] - (cu_q_lens[seq + 1] - cu_q_lens[seq]) + jnp.arange(t) - cu_q_lens[seq]
    positions = jnp.where(valid, jnp.maximum(positions, 0), 0)
    e = rms_norm(embed[tokens], w.attn_norm, cfg.rms_norm_eps)
    normed = rms_norm(hidden, dw.hidden_norm, cfg.rms_norm_eps)
    residual = normed if norm_before_residual else hidden
    x = jnp.concatenate([e, normed], axis=-1)  # [T, 2 x hidden]
    qkv = project("td,dkx->tkx", x, w.w_qkv) + w.b_qkv
    q = qkv[..., : -2 * head_dim].reshape(t, kv_heads, -1, head_dim)
    k, v = qkv[..., -2 * head_dim : -head_dim], qkv[..., -head_dim:]
    inv_freq = jnp.asarray(rope_inverse_frequencies(cfg))[0]
    q = apply_rope(q, positions, inv_freq, cfg.rope_attention_factor)
    k = apply_rope(k, positions, inv_freq, cfg.rope_attention_factor)
    new_kv = jnp.stack([k, v], axis=2).reshape(t, 2 * kv_heads, head_dim)
    column = jnp.minimum(positions // block_size, block_tables.shape[1] - 1)
    blocks = jnp.where(valid & writable, block_tables[seq, column], num_blocks)  # else dropped
    cache = cache.at[row, blocks, positions % block_size].set(
        to_cache_dtype(new_kv, cache.dtype), mode="drop"
    )
    attn = attention(
        q,
        k,
        v,
        cache,
        row,
        kv_lens,
        block_tables,
        cu_q_lens,
        sm_scale=cfg.attention_scale,
        sliding_window=None,
        soft_cap=None,
        latent=False,
    )
    residual = residual + project("ti,id->td", attn.reshape(t, -1), w.wo)
    h = rms_norm(residual, w.mlp_norm, cfg.rms_norm_eps)
    gate_up = project("td,dci->tci", h, w.w_gate_up)
    out = project("ti,id->td", ACTIVATION_FNS[cfg.hidden_act](gate_up[:, 0]) * gate_up[:, 1], w.w_down)
    return cache, out + residual


def _greedy(dw: DraftWeights, prenorm: jax.Array, eps: float) -> jax.Array:
    """The draft token (a target id) of each output row [S, hidden]."""
    logits = rms_norm(prenorm, dw.final_norm, eps) @ dw.lm_head
    draft = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    return draft + dw.d2t[draft]


def draft_step(
    dw: DraftWeights,
    embed: jax.Array,  # [vocab, hidden] the target's embeddings (the head's own when it has them)
    cache: jax.Array,  # the target's cache (donated); the head's KV is row `row`
    aux: jax.Array,  # [A, aux layers * hidden] the target's aux states (forward_step's)
    aux_rows: jax.Array,  # [T] the row of `aux` of each token
    tokens: jax.Array,  # [T] each position's next token, sequences back to back, then padding
    cu_q_lens: jax.Array,  # [S + 1]
    kv_lens: jax.Array,  # [S] each sequence's positions once these are in (0: padding)
    block_tables: jax.Array,  # [S, P] the sequences' blocks (group 0's)
    last_rows: jax.Array,  # [S] each sequence's last token
    lookahead: jax.Array,  # [S] positions past kv_lens whose blocks the sequence holds (<= k - 1)
    *,
    cfg: ModelConfig,
    row: int,
    num_drafts: int,
    attention: AttentionFn,
    norm_before_residual: bool,
) -> tuple[jax.Array, jax.Array]:
    """The head's KV written at the given positions and `num_drafts` greedy drafts after each sequence's
    last: (drafts [S, num_drafts] target ids, the cache). Draft i > 0 of sequence s is computed at
    position kv_lens[s] + i - 1, whose KV is written only where `lookahead` allows (its drafts past that
    are computed against KV not written, and are not used)."""
    embed = embed if dw.embed is None else dw.embed
    layer = dict(cfg=cfg, row=row, attention=attention, norm_before_residual=norm_before_residual)
    hidden = project("ta,ad->td", aux[aux_rows], dw.fc)
    writable = jnp.ones(tokens.shape, bool)
    cache, out = _layer(dw, embed, cache, tokens, hidden, cu_q_lens, kv_lens, block_tables, writable, **layer)
    h = out[last_rows]
    first = _greedy(dw, h, cfg.rms_norm_eps)
    s = kv_lens.shape[0]
    cu = jnp.arange(s + 1, dtype=jnp.int32)

    def draft_more(carry, i):  # draft i + 1, at position kv_lens + i
        cache, token, h = carry
        cache, h = _layer(
            dw, embed, cache, token, h, cu, kv_lens + i + 1, block_tables, i < lookahead, **layer
        )
        token = _greedy(dw, h, cfg.rms_norm_eps)
        return (cache, token, h), token

    (cache, _, _), more = jax.lax.scan(draft_more, (cache, first, h), jnp.arange(num_drafts - 1))
    return jnp.concatenate([first[:, None], more.T], axis=1), cache
