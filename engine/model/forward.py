"""The decoder's forward pass (every family) as plain functions over a weights pytree and a paged KV cache.

One function, `forward_step`, runs a ragged step: one flat axis of new tokens holding decode tokens and
prefill chunks of any number of sequences, each attending to its own past through its block table
(engine.model.attention). Every projection is one matmul over all the step's tokens. Layers run under
`lax.scan` over the stacked weights (fast to compile, reads each weight once); projections held per layer
(engine.model.projection.PerLayer, on a CPU) are not scanned: each layer's is chosen by a switch. The new
tokens' K/V leave the scan as its per-layer output and are scattered into the cache once, after the last
layer; the cache is donated, so the scatter updates it in place. With a kernel that reads them from the cache
(the TPU's), the cache is carried through the scan instead and each layer writes its own before attending.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pdserve.engine.config import ModelConfig
from pdserve.engine.core.kv_groups import KVGroups
from pdserve.engine.model import lora as lora_ops
from pdserve.engine.model import mla, moe
from pdserve.engine.model.attention import (
    AttentionFn,
    kv_written_first,
    ragged_paged_attention_reference,
    soft_cap,
    token_sequences,
)
from pdserve.engine.model.kv_cache import to_cache_dtype
from pdserve.engine.model.layers import ACTIVATION_FNS, apply_rope, rms_norm, rope_inverse_frequencies
from pdserve.engine.model.lora import LoraWeights
from pdserve.engine.model.projection import at_layer, hold_apart, project
from pdserve.engine.model.weights import Weights


def _per_layer(cfg: ModelConfig, groups: KVGroups) -> tuple[jax.Array, ...]:
    """Scanned with the layers: each one's cache row, block table (its group's), sliding window (0: full)
    and row of rope frequencies."""
    windows = np.asarray([cfg.window(i) for i in range(cfg.num_layers)], np.int32)
    rows, tables = (jnp.asarray(np.asarray(a, np.int32)) for a in (groups.layer_row, groups.layer_group))
    return rows, tables, jnp.asarray(windows), jnp.asarray((windows > 0).astype(np.int32))


def _pair(lo: LoraWeights | None, name: str) -> tuple:
    """(A, B) of one plain projection of a layer's adapters (o, down); () without LoRA."""
    return () if lo is None else (getattr(lo, f"{name}_a"), getattr(lo, f"{name}_b"))


def forward_step(
    weights: Weights,
    lora: LoraWeights | None,  # resident adapters (None: LoRA off, nothing added)
    cache: jax.Array,  # [rows, num_blocks, block_size, 2 * kv_heads, head_dim] (engine.core.kv_groups)
    tokens: jax.Array,  # [T] int32: every sequence's new tokens back to back, then padding
    cu_q_lens: jax.Array,  # [S + 1] where each sequence's tokens start; the last: tokens in use
    kv_lens: jax.Array,  # [S] context of each sequence once its new tokens are in (0: padding)
    block_tables: jax.Array,  # [groups, S, P] blocks of each sequence (P: a multiple of KV_TILE_BLOCKS)
    lora_slots: jax.Array,  # [S] adapter slot of each sequence, -1: the base model
    logits_rows: jax.Array,  # [L] the tokens whose logits are returned (each sequence's last; drafts')
    *,
    cfg: ModelConfig,
    attention: AttentionFn = ragged_paged_attention_reference,  # the engine's (engine.model.attention)
    aux_layers: tuple[int, ...] = (),  # layers whose input is returned too (an EAGLE-3 head's)
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """(logits [L, vocab] at the tokens `logits_rows` names, the updated cache, every token's final hidden
    state [T, hidden], normed: what prompt_scores reads, and with `aux_layers` every token's residual
    stream entering each of them, concatenated [T, len(aux_layers) * hidden]: engine.model.eagle3's
    input; else None)."""
    t = tokens.shape[0]
    num_blocks, block_size = cache.shape[1], cache.shape[2]
    kv_heads = cache.shape[3] // 2
    head_dim = cfg.head_dim
    seq, valid = token_sequences(cu_q_lens, t)
    positions = kv_lens[seq] - (cu_q_lens[seq + 1] - cu_q_lens[seq]) + jnp.arange(t) - cu_q_lens[seq]
    positions = jnp.where(valid, positions, 0)
    inv_freqs = jnp.asarray(rope_inverse_frequencies(cfg))
    x = weights.embed[tokens]  # [T, hidden]
    if cfg.scale_embeddings:  # by sqrt(hidden) rounded to the weights' dtype, as Gemma does
        x = x * jnp.asarray(cfg.hidden_size**0.5, x.dtype)
    token_slots = jnp.where(valid, lora_slots[seq], -1)
    mask = None if lora is None else lora_ops.selection(token_slots, lora.num_slots, x.dtype)
    any_lora = jnp.any(token_slots >= 0)

    act_fn = ACTIVATION_FNS[cfg.hidden_act]
    windowed = bool(cfg.layer_windows)  # else no window is even traced: full attention everywhere
    groups = KVGroups.of(cfg)
    column = jnp.minimum(positions // block_size, block_tables.shape[2] - 1)
    # [groups, T] each token's block in each group's table; padding: out of range, dropped
    write_blocks = jnp.where(valid, block_tables[:, seq, column], num_blocks)
    # the kernel reads the new K/V from the cache: write them layer by layer
    first = kv_written_first(attention)

    def write(cache, rows, tables, new_kv):  # new_kv [(layers,) T, slots, dims] at the tokens' positions
        return cache.at[rows, write_blocks[tables], positions % block_size].set(
            to_cache_dtype(new_kv, cache.dtype), mode="drop"
        )

    aux_ids = jnp.asarray(aux_layers, jnp.int32)

    def layer(carry, lw, held: dict, start: int):  # held: the run's PerLayer projections
        (x, aux), cache_now = (carry[0], carry[1]) if first else (carry, cache)
        w, lo, row, table, window, rope_row, index = lw
        w = at_layer(w, held, index - start)
        if aux_layers:  # the residual stream entering an aux layer, kept
            aux = jnp.where((aux_ids == index)[:, None, None], x[None], aux)

        def plus_lora(y, delta, *args):  # y + delta(*args); skipped at run time when no token has an adapter
            if lo is None:
                return y
            return jax.lax.cond(any_lora, lambda: y + delta(*args, mask), lambda: y)

        h = rms_norm(x, w.attn_norm, cfg.rms_norm_eps)
        inv_freq = inv_freqs[rope_row]
        if cfg.is_mla:  # LoRA is refused with MLA (engine.llm_engine)
            q, k = mla.queries_and_latent(h, w, positions, inv_freq, cfg)
            v, new_kv = k[..., : cfg.kv_lora_rank], k
        else:
            qkv = project("td,dkx->tkx", h, w.w_qkv) + w.b_qkv  # [T, kv_heads, (group + 2) * head_dim]
            qkv = plus_lora(qkv, lora_ops.qkv_delta, h, lo)
            q = qkv[..., : -2 * head_dim].reshape(t, kv_heads, -1, head_dim)
            k, v = qkv[..., -2 * head_dim : -head_dim], qkv[..., -head_dim:]
            if cfg.qk_norm:  # per head (padded heads are zeros and stay zeros)
                q, k = rms_norm(q, w.q_norm, cfg.rms_norm_eps), rms_norm(k, w.k_norm, cfg.rms_norm_eps)
            rope_scale = cfg.rope_attention_factor
            q, k = (
                apply_rope(q, positions, inv_freq, rope_scale),
                apply_rope(k, positions, inv_freq, rope_scale),
            )
            new_kv = jnp.stack([k, v], axis=2).reshape(t, 2 * kv_heads, head_dim)  # K, V interleaved
        if first:
            cache_now = write(cache_now, row, table, new_kv)
        attn = attention(
            q,
            k,
            v,
            cache_now,
            row,
            kv_lens,
            block_tables[table],
            cu_q_lens,
            sm_scale=cfg.attention_scale,
            sliding_window=window if windowed else None,
            soft_cap=cfg.attn_logit_softcap,
            latent=cfg.is_mla,
        )
        attn = mla.heads_output(attn, w) if cfg.is_mla else attn.reshape(t, -1)
        out = plus_lora(project("ti,id->td", attn, w.wo), lora_ops.linear_delta, attn, *_pair(lo, "o"))
        x = x + (out if w.post_attn_norm is None else rms_norm(out, w.post_attn_norm, cfg.rms_norm_eps))
        h = rms_norm(x, w.mlp_norm, cfg.rms_norm_eps)
        if w.experts_gate_up is not None:  # LoRA is refused with experts (engine.llm_engine)
            route = moe.route(h, w.w_router, cfg)
            out = moe.experts_mlp(h, *route, valid, w.experts_gate_up, w.experts_down, act_fn)
            if w.shared_gate_up is not None:
                out = out + moe.gated_mlp(h, w.shared_gate_up, w.shared_down, act_fn)
        else:
            gate_up = project("td,dci->tci", h, w.w_gate_up)
            gate_up = plus_lora(gate_up, lora_ops.gate_up_delta, h, lo)
            act = act_fn(gate_up[:, 0]) * gate_up[:, 1]
            down = project("ti,id->td", act, w.w_down)
            out = plus_lora(down, lora_ops.linear_delta, act, *_pair(lo, "down"))
        x = x + (out if w.post_mlp_norm is None else rms_norm(out, w.post_mlp_norm, cfg.rms_norm_eps))
        return (((x, aux), cache_now), None) if first else ((x, aux), new_kv)

    indices = (*_per_layer(cfg, groups), jnp.arange(cfg.num_layers, dtype=jnp.int32))
    aux = jnp.zeros((len(aux_layers), *x.shape), x.dtype) if aux_layers else None
    new_kv = []
    for (start, end), segment in zip(cfg.layer_segments(), weights.layers, strict=True):  # one run: LoRA ok
        state = (x, aux)
        scanned, held = hold_apart(segment)  # (sliced by the scan, switched on: projection.PerLayer)
        carry, kv = jax.lax.scan(
            functools.partial(layer, held=held, start=start),
            (state, cache) if first else state,
            (scanned, lora, *(a[start:end] for a in indices)),
        )
        (x, aux), cache = carry if first else (carry, cache)
        new_kv.append(kv)
    if not first:  # every layer's new K/V in one scatter
        new_kv = jnp.concatenate(new_kv) if len(new_kv) > 1 else new_kv[0]
        if groups.is_identity:  # layer l in row l, one table (a draft layer's row after them untouched)
            cache = write(cache, slice(0, cfg.num_layers), 0, new_kv)
        else:
            cache = write(
                cache, indices[0][:, None], indices[1], new_kv
            )  # rows [layers, 1], blocks [layers, T]
    hidden = rms_norm(
        x, weights.final_norm, cfg.rms_norm_eps
    )  # [T, hidden] (row by row: as if gathered first)
    if aux_layers:
        aux = jnp.moveaxis(aux, 0, 1).reshape(t, -1)  # [T, aux layers * hidden], in the layers' order
    return output_logits(weights, hidden[logits_rows], cfg), cache, hidden, aux


def output_logits(weights: Weights, hidden: jax.Array, cfg: ModelConfig) -> jax.Array:
    """float32 logits [rows, vocab] of final hidden states [rows, hidden] (normed)."""
    if weights.lm_head is None:
        logits = jnp.einsum("sd,vd->sv", hidden, weights.embed)
    else:
        logits = hidden @ weights.lm_head
    return soft_cap(logits.astype(jnp.float32), cfg.final_logit_softcap)


SCORE_ROWS = 128  # prompt_scores' rows a pass: its vocabulary-wide temporaries are [SCORE_ROWS, vocab]


def prompt_scores(
    weights: Weights, hidden: jax.Array, targets: jax.Array, *, cfg: ModelConfig, num_top: int
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """For each of a step's tokens (hidden [T, hidden], forward_step's), the log probability of the token
    `targets` names as the next one (-1: none; its row is computed and ignored), that token's rank (from
    1), and the `num_top` likeliest tokens' ids and log probabilities: a prompt's logprobs, computed with
    its KV. Rows go in passes of at most SCORE_ROWS."""
    t = hidden.shape[0]
    rows = np.gcd(t, SCORE_ROWS)

    def score(args):
        h, target = args
        logprobs = jax.nn.log_softmax(output_logits(weights, h, cfg), axis=-1)
        chosen = jnp.take_along_axis(logprobs, jnp.maximum(target, 0)[:, None], axis=-1)[:, 0]
        rank = jnp.sum(logprobs > chosen[:, None], axis=-1, dtype=jnp.int32) + 1
        top_logprobs, top_ids = jax.lax.top_k(logprobs, num_top)
        return chosen, rank, top_ids.astype(jnp.int32), top_logprobs

    out = jax.lax.map(score, (hidden.reshape(t // rows, rows, -1), targets.reshape(t // rows, rows)))
    return tuple(a.reshape(t, *a.shape[2:]) for a in out)
