"""Ragged paged attention: a reference implementation in plain JAX, and the seam where a TPU kernel plugs in.

A step is one flat axis of new tokens: the tokens of sequence s are q[cu_q_lens[s]:cu_q_lens[s + 1]]
(a decode token, or a prefill chunk), and s has kv_lens[s] tokens of context once they are in: the
first kv_lens[s] - q_len(s) are already in the paged cache, in the blocks `block_tables[s]` lists; the
new ones are in registers (`k_new`, `v_new`). The arguments are those of JAX's and tpu-inference's
`ragged_paged_attention` (queries, new keys and values, the paged cache with K/V interleaved on the
heads axis, kv_lens, page indices, cu_q_lens), plus the layer index of pdserve's stacked cache. The
model writes the new K/V into the cache once, after all layers (engine.model.forward); a kernel that writes
them itself is equally valid, the cache it is handed is not read back.

Per model it also takes the softmax scale, a sliding window (a query sees the last `sliding_window`
positions, itself included; the loops start at the first tile a window reaches) and a soft cap on the
scores (Gemma 2), and with `latent` a multi-head-latent cache (MLA, engine.model.mla): one latent head a token
that is the key and, its first dims, the value.

The reference runs everywhere and is what the tests pin down. Its cost follows the work, not the static
shape: three parts share one softmax (flash-attention style running max and sum), each looping only over
the tokens the step's sequences hold:
  * new tokens over new tokens (causal, same sequence): one [T, T] masked product in a step of up to
    NEW_TILE tokens; in a longer one, tiles of NEW_TILE queries over tiles of as many keys, each query
    tile over the key tiles from its first sequence's start (or its window's) up to its own, as far as
    the step's tokens go: the upper half of the square and other sequences' tiles are skipped;
  * short sequences (decodes, and with `short_rows` = 1 + k the verification rows of speculative
    decoding) over their past, flash-decoding style: each one's past cut into tiles of PAIR_TILE_BLOCKS
    blocks from the first its rows reach, the (sequence, tile) pairs of all of them laid end to end and
    read PAIRS_PER_ITERATION at a time, each pair folded into its sequence's state; so the work follows the
    tokens in the cache, not the step's sequence slots times its longest context;
  * longer sequences (prefill chunks after a cached or computed head) over their past: one window
    of Q_WINDOW queries at a time, CHUNK_TILE_BLOCKS of the sequence's past blocks per iteration.
The prefill-window part is skipped at run time when the step has no such sequence.
The static shape is (tokens, sequences, block-table width); the number of past blocks read is not part
of it, so one compiled step serves every context length.

The seam: each engine's runner attends with an `AttentionFn` of its own (LLMEngine picks it: this
reference, or on a TPU engine/model/tpu_attention.py's wrapper of jax's Pallas kernel over that engine's
mesh, which reads the new K/V from the cache: `kv_written_first`). It is a static argument of the jitted
step, so two engines of one process (`pdserve serve`) each compile with their own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp

from pdserve.engine.model.kv_cache import from_cache

_NEG_INF = -1e30  # finite: a fully masked row stays finite (padding tokens), exp(-1e30 - m) == 0
_NO_WINDOW = 1 << 30  # the reach of full attention: past any context
# Cache blocks read per iteration of the past loops. Measured on CPU: an iteration costs about 14 us
# besides its work, while a tile longer than the context is wasted reading. The decode loop reads
# (sequence, tile) pairs of PAIR_TILE_BLOCKS blocks, PAIRS_PER_ITERATION of them an iteration (one pair a
# sequence slot where there are more slots; at most KV_TILE_BLOCKS blocks a slot: one sequence reads 4
# pairs, 8 blocks); the prefill windows' matmuls take 8-block tiles. Block tables are padded to whole tiles
# of the largest size (KV_TILE_BLOCKS), which every tile size divides.
PAIR_TILE_BLOCKS = 2
PAIRS_PER_ITERATION = 16
CHUNK_TILE_BLOCKS = 8
KV_TILE_BLOCKS = 8


def block_table_width(config) -> int:
    """Columns of a step's block tables for an engine.config.EngineConfig: the longest sequence's blocks,
    in whole attention tiles."""
    return -(-config.max_blocks_per_seq // KV_TILE_BLOCKS) * KV_TILE_BLOCKS


Q_WINDOW = 128  # queries of a prefill chunk attended to its past together
# Tokens of a new-over-new tile: a step of more tokens attends to its own in tiles (causal: the tiles above
# the diagonal are skipped). Measured on CPU at 2,048 tokens of one prompt: see docs/benchmark-history.md.
NEW_TILE = 256


def token_sequences(cu_q_lens: jax.Array, num_tokens: int) -> tuple[jax.Array, jax.Array]:
    """(sequence of each token, clamped to a valid index; whether the token is a real one) [T] each."""
    num_seqs = cu_q_lens.shape[0] - 1
    tokens = jnp.arange(num_tokens)
    seq = jnp.searchsorted(cu_q_lens[1:], tokens, side="right")  # sequences ending at or before t
    return jnp.minimum(seq, num_seqs - 1), tokens < cu_q_lens[-1]


def _merge(a, b):
    """Two partial softmax states (running max m, sum l, unnormalized output o) of the same queries."""
    (m1, l1, o1), (m2, l2, o2) = a, b
    m = jnp.maximum(m1, m2)
    c1, c2 = jnp.exp(m1 - m), jnp.exp(m2 - m)
    return m, l1 * c1 + l2 * c2, o1 * c1[..., None] + o2 * c2[..., None]


def soft_cap(x: jax.Array, cap: float | None) -> jax.Array:
    """x squashed into (-cap, cap) as cap * tanh(x / cap) (Gemma 2's scores and logits); None: x."""
    return x if cap is None else cap * jnp.tanh(x / cap)


def _attend(q, k, v, mask, cap=None):
    """q [..., Q, d] over k, v [..., K, d] with mask [..., Q, K] broadcastable -> one partial state."""
    s = jnp.where(mask, soft_cap(jnp.einsum("...qd,...kd->...qk", q, k), cap), _NEG_INF)
    m = jnp.max(s, axis=-1)
    p = jnp.exp(s - m[..., None])
    return m, jnp.sum(p, axis=-1), jnp.einsum("...qk,...kd->...qd", p, v)


def _empty(shape, d, dtype):
    return jnp.full(shape, _NEG_INF, dtype), jnp.zeros(shape, dtype), jnp.zeros((*shape, d), dtype)


def _gather_blocks(cache, layer, blocks, flat_rows):
    """cache[layer, blocks]: [..., block_size, 2 kv_heads (latent: 1), row width]. With `flat_rows` each
    block is read as one row of the cache seen as [layers * blocks, block bytes]: XLA:CPU's gather copies
    a whole row at a time, and a decode step's attention takes 0.64-0.81x the time it takes gathering
    [block_size, heads, dims] slices (docs/benchmark-history.md, "Reading the paged cache as rows"). On a
    TPU the reshape would copy the cache into another tiling, so the TPU seam reads blocks as they are."""
    if not flat_rows:
        return cache[layer, blocks]
    layers, num_blocks, *block = cache.shape
    rows = cache.reshape(layers * num_blocks, -1)
    return jnp.take(rows, blocks + layer * num_blocks, axis=0, mode="clip").reshape(*blocks.shape, *block)


def _split_kv(kv, value_dim=None):
    """Gathered blocks [..., blocks, block_size, 2 kv_heads (latent: 1), head_dim] (as stored) -> K, V
    [..., kv_heads, blocks * block_size, head_dim] (a latent cache: K is the one latent head, V its first
    value_dim dims)."""
    kv = from_cache(kv)
    *lead, nb, bs, h2, d = kv.shape
    if value_dim is not None:
        k = jnp.moveaxis(kv.reshape(*lead, nb * bs, 1, d), -2, -3)
        return k, k[..., :value_dim]
    kv = kv.reshape(*lead, nb * bs, h2 // 2, 2, d)
    kv = jnp.moveaxis(kv, -4, -2)  # [..., kv_heads, 2, tile tokens, head_dim]
    return kv[..., 0, :, :], kv[..., 1, :, :]


def _past_tile(cache, layer, block_tables, j, tile_blocks, value_dim=None, flat_rows=True):
    """Tile j of each listed sequence's past: K, V [..., kv_heads, tile tokens, head_dim]."""
    blocks = jax.lax.dynamic_slice_in_dim(block_tables, j * tile_blocks, tile_blocks, axis=-1)
    return _split_kv(_gather_blocks(cache, layer, blocks, flat_rows), value_dim)


def _short_over_past(q_rows, cache, layer, block_tables, past, row_from, attend, dv, latent, flat_rows):
    """Short sequences' rows over their past as partial states [S, kv_heads, group * R] (flash-decoding
    style): each sequence's past is cut into tiles of PAIR_TILE_BLOCKS blocks from the first one its rows
    reach to its last, the (sequence, tile) pairs of all sequences are laid end to end, and each iteration
    attends PAIRS_PER_ITERATION of them and folds them into their sequences' states. The work follows the
    tokens in the cache: padding slots and sequences shorter than the longest read nothing.

    q_rows [S, kv_heads, group * R, d] (group-major: row r of the head's query g at g * R + r);
    block_tables [S, P]; past [S] tokens each sequence's rows attend to in the cache (0: none); row_from
    [S, R] the first key position each row sees; dv: the values' dims (`latent`: the first dv of the one
    latent head)."""
    num_seqs, kvh, rows, _ = q_rows.shape
    block_size = cache.shape[2]
    tile = PAIR_TILE_BLOCKS * block_size
    first = row_from[:, 0] // tile  # row 0 reaches furthest back (no past: no pairs whatever it is)
    count = jnp.maximum(-(-past // tile) - first, 0)  # [S] pairs of each sequence
    ends = jnp.cumsum(count)
    pairs = min(max(PAIRS_PER_ITERATION, num_seqs), num_seqs * (KV_TILE_BLOCKS // PAIR_TILE_BLOCKS))
    flat_tables = block_tables.reshape(-1)
    group = rows // row_from.shape[1]

    def iteration(i, acc):
        pair = i * pairs + jnp.arange(pairs)
        seq = jnp.minimum(jnp.searchsorted(ends, pair, side="right"), num_seqs - 1)
        real = pair < ends[-1]
        j = first[seq] + pair - (ends[seq] - count[seq])  # the pair's tile of its sequence
        columns = jnp.minimum(
            j[:, None] * PAIR_TILE_BLOCKS + jnp.arange(PAIR_TILE_BLOCKS), block_tables.shape[1] - 1
        )
        kv = _gather_blocks(
            cache, layer, flat_tables[seq[:, None] * block_tables.shape[1] + columns], flat_rows
        )
        k, v = _split_kv(kv, dv if latent else None)  # [W, kv_heads, tile, d]
        pos = j[:, None] * tile + jnp.arange(tile)  # [W, tile]
        seen = (  # a padding pair sees nothing: its m is -1e30, its scale_p 0
            real[:, None, None]
            & (pos[:, None] < past[seq, None, None])
            & (pos[:, None] >= row_from[seq][:, :, None])
        )
        seen = jnp.broadcast_to(seen[:, None], (pairs, group, *seen.shape[1:])).reshape(pairs, 1, rows, tile)
        m_p, l_p, o_p = attend(q_rows[seq], k, v, seen)  # [W, kv_heads, rows(, dims)]
        m_acc, l_acc, o_acc = acc
        m = m_acc.at[seq].max(m_p)
        scale_p = jnp.where(real[:, None, None], jnp.exp(m_p - m[seq]), 0.0)
        scale_acc = jnp.exp(m_acc - m)
        sums = l_acc * scale_acc + jnp.zeros_like(l_acc).at[seq].add(l_p * scale_p)
        o = o_acc * scale_acc[..., None] + jnp.zeros_like(o_acc).at[seq].add(o_p * scale_p[..., None])
        return m, sums, o

    empty = _empty((num_seqs, kvh, rows), dv, jnp.float32)
    return jax.lax.fori_loop(0, -(-ends[-1] // pairs), iteration, empty)


def _new_over_new(q, k_new, v_new, seq, valid, cu_q_lens, reach, attend, tile):
    """The new tokens over the new tokens (causal, same sequence) as a partial state [kv_heads, group, T]:
    q [kv_heads, group, T, d] (scaled), k_new and v_new [T, kv_heads, dims]; `tile` tokens a tile."""
    kvh, g, t, d = q.shape
    k, v = k_new.transpose(1, 0, 2), v_new.transpose(1, 0, 2)  # [kv_heads, T, dims]
    tok = jnp.arange(t)

    def masked(q_pos, k_pos):  # [Q] and [K] token indices -> [group * Q, K]
        causal = (k_pos[None, :] <= q_pos[:, None]) & (q_pos[:, None] - k_pos[None, :] < reach)
        mask = (seq[q_pos][:, None] == seq[k_pos][None, :]) & causal & valid[k_pos][None, :]
        return jnp.broadcast_to(mask, (g, *mask.shape)).reshape(g * q_pos.shape[0], k_pos.shape[0])

    if t <= tile:  # one product
        m, s, o = attend(q.reshape(kvh, g * t, d), k, v, masked(tok, tok))
        return m.reshape(kvh, g, t), s.reshape(kvh, g, t), o.reshape(kvh, g, t, -1)
    padded = -(-t // tile) * tile
    q = jnp.pad(q, ((0, 0), (0, 0), (0, padded - t), (0, 0)))
    k, v = (jnp.pad(x, ((0, 0), (0, padded - t), (0, 0))) for x in (k, v))
    seq, valid = jnp.pad(seq, (0, padded - t), constant_values=-1), jnp.pad(valid, (0, padded - t))

    def query_tile(i, state):
        q_pos = i * tile + jnp.arange(tile)
        qi = jax.lax.dynamic_slice_in_dim(q, i * tile, tile, axis=2).reshape(kvh, g * tile, d)
        # the first key any of its queries sees: its first sequence's start, or the first query's window
        first_key = jnp.maximum(cu_q_lens[seq[i * tile]], i * tile + 1 - reach)

        def key_tile(j, acc):
            k_pos = j * tile + jnp.arange(tile)
            kj, vj = (jax.lax.dynamic_slice_in_dim(x, j * tile, tile, axis=1) for x in (k, v))
            return _merge(acc, attend(qi, kj, vj, masked(q_pos, k_pos)))

        empty = _empty((kvh, g * tile), v.shape[-1], jnp.float32)
        part = jax.lax.fori_loop(first_key // tile, i + 1, key_tile, empty)
        part = [x.reshape(kvh, g, tile, *x.shape[2:]) for x in part]
        return tuple(
            jax.lax.dynamic_update_slice_in_dim(x, p, i * tile, axis=2)
            for x, p in zip(state, part, strict=True)
        )

    state = _empty((kvh, g, padded), v.shape[-1], jnp.float32)  # tiles past the step's tokens stay empty
    state = jax.lax.fori_loop(0, -(-cu_q_lens[-1] // tile), query_tile, state)
    return tuple(x[:, :, :t] for x in state)


def ragged_paged_attention_reference(
    q: jax.Array,  # [T, kv_heads, group, head_dim] new tokens' queries, sequences back to back
    k_new: jax.Array,  # [T, kv_heads, head_dim]
    v_new: jax.Array,  # [T, kv_heads, head_dim]
    cache: jax.Array,  # [num_layers, num_blocks, block_size, 2 * kv_heads, head_dim]
    layer: jax.Array,  # [] index of this layer in `cache`
    kv_lens: jax.Array,  # [S] context of each sequence, new tokens included (0: padding sequence)
    block_tables: jax.Array,  # [S, P] blocks of each sequence, P a multiple of KV_TILE_BLOCKS
    cu_q_lens: jax.Array,  # [S + 1] where each sequence's new tokens start; the last: tokens in use
    *,
    sm_scale: float | None = None,  # scores are q.k times this (None: head_dim ** -0.5)
    sliding_window: jax.Array | int | None = None,  # [] tokens a query sees, itself included (0/None: all)
    soft_cap: float | None = None,  # scores -> soft_cap * tanh(scores / soft_cap) (None: as they are)
    latent: bool = False,  # MLA: the cache holds one latent "head" a token, the key; the value is its
    # first v_new.shape[-1] dims (k_new [T, 1, head_dim], v_new [T, 1, value dims], kv_heads 1)
    short_rows: int = 1,  # sequences of up to this many new tokens attend to their past in the decode loop
    new_tile: int = NEW_TILE,  # tokens of a new-over-new tile
    flat_rows: bool = True,  # read past blocks as flat rows of the cache (see _gather_blocks; False on TPUs)
) -> jax.Array:  # [T, kv_heads, group, value dims]; rows of padding tokens are finite garbage
    t, kvh, g, d = q.shape
    dv = v_new.shape[-1]
    past_tile_of = functools.partial(_past_tile, value_dim=dv if latent else None, flat_rows=flat_rows)
    out_dtype = q.dtype  # scores, softmax and sums in float32 whatever the weights' and cache's dtype
    q, k_new, v_new = (x.astype(jnp.float32) for x in (q, k_new, v_new))
    num_seqs = kv_lens.shape[0]
    chunk_tile = CHUNK_TILE_BLOCKS * cache.shape[2]
    q = (q * (d**-0.5 if sm_scale is None else sm_scale)).transpose(1, 2, 0, 3)  # [kv_heads, group, T, d]
    q_lens = cu_q_lens[1:] - cu_q_lens[:-1]
    past = kv_lens - q_lens
    seq, valid = token_sequences(cu_q_lens, t)
    dtype = jnp.float32
    # a query at position p sees keys at positions > p - reach (reach: the window, or beyond any context)
    reach = (
        _NO_WINDOW if sliding_window is None else jnp.where(sliding_window > 0, sliding_window, _NO_WINDOW)
    )
    attend = functools.partial(_attend, cap=soft_cap)

    # new over new: causal within each sequence; each KV head's query rows (group x tokens) form one matrix
    state = _new_over_new(q, k_new, v_new, seq, valid, cu_q_lens, reach, attend, new_tile)

    # short sequences (decodes; verification rows of 1 + k tokens, up to `short_rows`) over their past,
    # row r of a sequence at position past + r; each sequence's tiles start at the first its window reaches
    short = (q_lens >= 1) & (q_lens <= short_rows) & (past > 0)
    short_past = jnp.where(short, past, 0)  # (0: not a short sequence, no tile of its past is read)

    def short_pass(rows_per_seq, state):  # every short sequence has at most rows_per_seq tokens
        rows = jnp.arange(rows_per_seq)
        row_from = jnp.maximum(past[:, None] + rows + 1 - reach, 0)  # [S, R] first key position each row sees
        row_at = jnp.where(short[:, None] & (rows < q_lens[:, None]), cu_q_lens[:-1, None] + rows, t)
        row_at = row_at.reshape(-1)  # the rows' tokens (t: none, dropped by the scatter below)
        q_rows = jnp.take(q, jnp.minimum(row_at, t - 1), axis=2)  # [kv_heads, group, S * R, d]
        q_rows = q_rows.reshape(kvh, g, num_seqs, rows_per_seq, d).transpose(2, 0, 1, 3, 4)
        q_rows = q_rows.reshape(num_seqs, kvh, g * rows_per_seq, d)  # each sequence's rows, group-major
        m, s, o = _short_over_past(
            q_rows, cache, layer, block_tables, short_past, row_from, attend, dv, latent, flat_rows
        )

        def as_tokens(x):  # [S, kv_heads, group * R, ...] -> [kv_heads, group, S * R, ...]
            x = x.reshape(num_seqs, kvh, g, rows_per_seq, *x.shape[3:])
            return jnp.moveaxis(x, 0, 2).reshape(kvh, g, num_seqs * rows_per_seq, *x.shape[4:])

        at = (slice(None), slice(None), row_at)  # merged in place at the rows' tokens
        merged = _merge(tuple(x[at] for x in state), (as_tokens(m), as_tokens(s), as_tokens(o)))
        return tuple(x.at[at].set(y, mode="drop") for x, y in zip(state, merged, strict=True))

    if short_rows == 1:
        state = short_pass(1, state)
    else:  # a step of decodes only pays for one row a sequence
        longest = jnp.max(jnp.where(short, q_lens, 0))
        one_row, all_rows = functools.partial(short_pass, 1), functools.partial(short_pass, short_rows)
        state = jax.lax.cond(longest > 1, all_rows, one_row, state)

    # longer sequences (prefill chunks after a head in the cache) over their past, Q_WINDOW
    # queries at a time: window i belongs to the sequence whose running count of windows passes i
    windows = jnp.where((q_lens > short_rows) & (past > 0), -(-q_lens // Q_WINDOW), 0)
    ends = jnp.cumsum(windows)
    pad = ((0, 0), (0, 0), (0, Q_WINDOW))  # a window starting near the end stays in bounds
    q_pad = jnp.pad(q, (*pad, (0, 0)))

    def window(i, state):
        s = jnp.searchsorted(ends, i, side="right")
        start = cu_q_lens[s] + (i - (ends[s] - windows[s])) * Q_WINDOW
        qw = jax.lax.dynamic_slice_in_dim(q_pad, start, Q_WINDOW, axis=2).reshape(kvh, g * Q_WINDOW, d)
        q_pos = jnp.tile(past[s] + start - cu_q_lens[s] + jnp.arange(Q_WINDOW), g)  # of qw's rows

        def past_tile(j, acc):
            k, v = past_tile_of(cache, layer, block_tables[s], j, CHUNK_TILE_BLOCKS)  # [kv_heads, tile, d]
            pos = j * chunk_tile + jnp.arange(chunk_tile)
            seen = (pos[None, :] < past[s]) & (q_pos[:, None] - pos[None, :] < reach)
            return _merge(acc, attend(qw, k, v, seen))

        first_tile = jnp.maximum(q_pos[0] + 1 - reach, 0) // chunk_tile  # the window's first query reaches
        w_state = jax.lax.fori_loop(
            first_tile, -(-past[s] // chunk_tile), past_tile, _empty((kvh, g * Q_WINDOW), dv, dtype)
        )
        w_state = [x.reshape(kvh, g, Q_WINDOW, *x.shape[2:]) for x in w_state]
        old = [jax.lax.dynamic_slice_in_dim(x, start, Q_WINDOW, axis=2) for x in state]
        rows = start + jnp.arange(Q_WINDOW) < cu_q_lens[s + 1]  # the window's tokens of sequence s
        new = _merge(old, w_state)
        new = [
            jnp.where(rows.reshape(-1, *([1] * (x.ndim - 3))), n, x) for n, x in zip(new, old, strict=True)
        ]
        return tuple(
            jax.lax.dynamic_update_slice_in_dim(x, n, start, axis=2) for x, n in zip(state, new, strict=True)
        )

    def chunks(state):
        state = tuple(jnp.pad(x, pad + ((0, 0),) * (x.ndim - 3)) for x in state)
        return tuple(x[:, :, :t] for x in jax.lax.fori_loop(0, ends[-1], window, state))

    if t > 1:  # a step of one token holds no chunk: not even the branch is compiled
        state = jax.lax.cond(ends[-1] > 0, chunks, lambda state: state, state)
    m, s, o = state
    out = o / jnp.where(s > 0, s, 1.0)[..., None]  # (a padding token past the new-over-new tiles: s == 0)
    return out.transpose(2, 0, 1, 3).astype(out_dtype)


AttentionFn = Callable[..., jax.Array]  # ragged_paged_attention_reference's signature


def kv_written_first(attention: AttentionFn) -> bool:
    """Whether `attention` reads the step's new K/V from the cache (its `reads_new_kv_from_cache`
    attribute; a Pallas kernel does): the model then writes each layer's into the cache before its
    attention, inside the layer scan, instead of all layers' once after it."""
    return bool(getattr(attention, "reads_new_kv_from_cache", False))
