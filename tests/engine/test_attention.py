"""The ragged reference attention equals plain per-sequence attention, for any mix of decode tokens,
verification rows of a few tokens and prefill chunks, with or without a cached past, in any blocks."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.engine.model.attention import KV_TILE_BLOCKS, Q_WINDOW, ragged_paged_attention_reference

pytestmark = pytest.mark.fast

LAYERS, BLOCKS, BS, KVH, G, D = 2, 720, 4, 2, 3, 8
T, WIDTH = 3 * Q_WINDOW, 8 * KV_TILE_BLOCKS  # one compiled shape per sequence-slot count
_jitted = jax.jit(ragged_paged_attention_reference, static_argnames=("short_rows", "new_tile"))


def naive(q, k_new, v_new, cache, layer, seqs, scale=D**-0.5, window=None, cap=None):
    """Per sequence: its past gathered from its blocks, then its new tokens; causal softmax (over the last
    `window` positions only, scores soft-capped, when given)."""
    out = np.zeros_like(q)
    start = 0
    for past, q_len, blocks in seqs:
        kv = cache[layer, blocks].reshape(-1, KVH, 2, D)[:past]
        k = np.concatenate([kv[:, :, 0], k_new[start : start + q_len]])  # [past + q_len, KVH, D]
        v = np.concatenate([kv[:, :, 1], v_new[start : start + q_len]])
        qs = q[start : start + q_len] * scale  # [q_len, KVH, G, D]
        scores = np.einsum("qhgd,khd->hgqk", qs, k)
        if cap is not None:
            scores = cap * np.tanh(scores / cap)
        distance = past + np.arange(q_len)[:, None] - np.arange(past + q_len)[None, :]  # query - key position
        seen = (distance >= 0) & (distance < (window or np.inf))
        scores = np.where(seen, scores, -np.inf)
        p = np.exp(scores - scores.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[start : start + q_len] = np.einsum("hgqk,khd->qhgd", p, v)
        start += q_len
    return out


# (tokens in the cache, new tokens) per sequence: decodes, fresh prompts, chunks after a past longer than
# a tile and than a query window
SEQ = st.tuples(st.integers(0, 3 * KV_TILE_BLOCKS * BS + 5), st.integers(1, Q_WINDOW + 9))


@settings(max_examples=12, deadline=None)
# the decode loop's tile: 8, 4 and 2 blocks; its rows per sequence: 1 (decodes) or up to 1 + k tokens;
# new over new: one product (a tile past T), tiles that divide T, tiles that leave a padded one
@pytest.mark.parametrize(
    ("slots", "short_rows", "new_tile"), [(2, 1, 512), (6, 4, 64), (32, 1, 128), (32, 3, 80)]
)
@given(
    seqs=st.lists(SEQ, min_size=1, max_size=8),
    window=st.integers(0, 3 * KV_TILE_BLOCKS * BS),  # 0: full attention (None, the models' default: below)
    cap=st.sampled_from([None, 3.0]),
    rnd=st.randoms(),
)
def test_matches_per_sequence_attention(slots, short_rows, new_tile, seqs, window, cap, rnd):
    """Also with a sliding window (Gemma, Mistral), a soft cap on the scores (Gemma 2) and another scale;
    rows of 2 to 5 tokens read their past in the decode loop up to `short_rows`, beyond it in windows;
    the new tokens over each other in one product or in tiles of `new_tile` (sequences across tiles)."""
    rng = np.random.default_rng(rnd.randint(0, 2**32))
    kinds = [rnd.random() for _ in seqs[:slots]]  # about 0.4 decodes, 0.3 short rows, 0.3 chunks
    seqs = [
        (past, 1 if r < 0.4 else rnd.randint(2, 5) if r < 0.7 else q_len)
        for r, (past, q_len) in zip(kinds, seqs[:slots], strict=True)
    ]
    while sum(q for _, q in seqs) > T:
        seqs.pop()
    total = sum(q for _, q in seqs)  # the rest of the T tokens and of the slots: padding
    t, s, width, pad_seqs = T, slots, WIDTH, slots - len(seqs)
    free = list(rng.permutation(BLOCKS))
    layout = []
    tables = np.zeros((s, width), np.int32)
    for i, (past, q_len) in enumerate(seqs):
        n = -(-(past + q_len) // BS)
        blocks = [int(free.pop()) for _ in range(n)]  # scattered blocks
        tables[i, :n] = blocks
        layout.append((past, q_len, blocks))
    q = rng.standard_normal((t, KVH, G, D), np.float32)
    k_new, v_new = (rng.standard_normal((t, KVH, D), np.float32) for _ in range(2))
    cache = rng.standard_normal((LAYERS, BLOCKS, BS, 2 * KVH, D), np.float32)
    q_lens = [q for _, q in seqs] + [0] * pad_seqs
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    kv_lens = np.asarray([p + q for p, q in seqs] + [0] * pad_seqs, np.int32)
    scale = rnd.uniform(0.1, 0.5)
    args = (q, k_new, v_new, cache, np.int32(1), kv_lens, tables, cu)
    got = np.asarray(
        _jitted(
            *args,
            sm_scale=scale,
            sliding_window=window,
            soft_cap=cap,
            short_rows=short_rows,
            new_tile=new_tile,
        )
    )
    expected = naive(q, k_new, v_new, cache, 1, layout, scale, window, cap)
    np.testing.assert_allclose(got[:total], expected[:total], atol=2e-5)
    assert np.isfinite(got).all()


def test_bfloat16_weights_and_cache_attend_in_float32():
    """A bfloat16 cache and projections (the default on TPU): the result is bfloat16, computed in float32
    from the same rounded inputs (one decode over a past, one chunk after a past, one fresh prompt)."""
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    seqs, blocks, tables = (
        [(37, 1), (20, 150), (0, 9)],
        iter(rng.permutation(BLOCKS)),
        np.zeros((3, WIDTH), np.int32),
    )
    layout = []
    for i, (past, q_len) in enumerate(seqs):
        ids = [int(next(blocks)) for _ in range(-(-(past + q_len) // BS))]
        tables[i, : len(ids)] = ids
        layout.append((past, q_len, ids))
    bf16 = lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))  # noqa: E731
    q = bf16(rng.standard_normal((T, KVH, G, D)))
    k_new, v_new = (bf16(rng.standard_normal((T, KVH, D))) for _ in range(2))
    cache = bf16(rng.standard_normal((LAYERS, BLOCKS, BS, 2 * KVH, D)))
    cu = np.asarray([0, 1, 151, 160], np.int32)
    kv_lens = np.asarray([p + n for p, n in seqs], np.int32)
    args = [jnp.asarray(x, jnp.bfloat16) for x in (q, k_new, v_new, cache)]
    got = _jitted(*args, np.int32(0), kv_lens, tables, cu)
    assert got.dtype == jnp.bfloat16
    expected = naive(q, k_new, v_new, cache, 0, layout)[:160]
    np.testing.assert_allclose(np.asarray(got.astype(jnp.float32))[:160], expected, atol=2e-2)


def test_a_latent_cache_attends_like_keys_and_values_made_of_it():
    """MLA: one latent head a token is the key, its first dims the value; the same as a K/V cache holding
    the latent as K and its head as V (one decode over a past, one chunk after a past, one fresh prompt)."""
    rng = np.random.default_rng(1)
    heads, dim, value_dim = 4, 12, 8
    seqs = [(37, 1), (70, 150), (0, 9)]
    tables = np.zeros((3, WIDTH), np.int32)
    blocks = iter(rng.permutation(BLOCKS))
    for i, (past, q_len) in enumerate(seqs):
        ids = [int(next(blocks)) for _ in range(-(-(past + q_len) // BS))]
        tables[i, : len(ids)] = ids
    q = rng.standard_normal((T, 1, heads, dim), np.float32)
    latent_new = rng.standard_normal((T, 1, dim), np.float32)
    latent_cache = rng.standard_normal((LAYERS, BLOCKS, BS, 1, dim), np.float32)
    kv_cache = np.concatenate(
        [latent_cache, np.pad(latent_cache[..., :value_dim], [(0, 0)] * 4 + [(0, 4)])], 3
    )
    cu = np.asarray([0, 1, 151, 160], np.int32)
    kv_lens = np.asarray([p + n for p, n in seqs], np.int32)
    common = (np.int32(1), kv_lens, tables, cu)
    latent_attention = jax.jit(ragged_paged_attention_reference, static_argnames="latent")
    got = latent_attention(q, latent_new, latent_new[..., :value_dim], latent_cache, *common, latent=True)
    v_padded = np.pad(latent_new[..., :value_dim], [(0, 0), (0, 0), (0, 4)])
    expected = _jitted(q, latent_new, v_padded, kv_cache, *common)[..., :value_dim]
    assert got.shape == (T, 1, heads, value_dim)
    np.testing.assert_allclose(np.asarray(got)[:160], np.asarray(expected)[:160], atol=1e-5)


def test_an_int8_cache_is_read_as_its_values_times_their_scales():
    """--kv-cache-dtype int8: each head row of each token is stored as int8 values and its own bfloat16
    scale (max |x| / 127) in the row's last two bytes. Reading it back gives values within half a step of
    the original (a row of zeros stays zeros), and attention over the int8 cache equals attention over
    the float32 cache holding exactly what it stores (one decode over a past, one chunk after a past, one
    fresh prompt)."""
    import jax.numpy as jnp

    from pdserve.engine.model.kv_cache import from_cache, to_cache_dtype
    from pdserve.kvtransfer import SCALE_BYTES

    rng = np.random.default_rng(2)
    original = rng.standard_normal((LAYERS, BLOCKS, BS, 2 * KVH, D), np.float32) * rng.uniform(
        0.01, 30, (LAYERS, BLOCKS, BS, 2 * KVH, 1)
    ).astype(np.float32)
    original[0, 0, 0, 1] = 0.0
    cache = jax.jit(to_cache_dtype, static_argnums=1)(original, jnp.int8)
    assert cache.dtype == jnp.int8 and cache.shape == (*original.shape[:-1], D + SCALE_BYTES)
    read = np.asarray(jax.jit(from_cache)(cache))
    step = np.abs(original).max(-1, keepdims=True) / 127
    assert (np.abs(read - original) <= 0.5 * step * (1 + 2**-7) + 1e-12).all()
    assert (read[0, 0, 0, 1] == 0).all() and (np.asarray(cache)[0, 0, 0, 1] == 0).all()

    seqs, tables = [(37, 1), (20, 150), (0, 9)], np.zeros((3, WIDTH), np.int32)
    blocks = iter(rng.permutation(BLOCKS))
    for i, (past, q_len) in enumerate(seqs):
        ids = [int(next(blocks)) for _ in range(-(-(past + q_len) // BS))]
        tables[i, : len(ids)] = ids
    q = rng.standard_normal((T, KVH, G, D), np.float32)
    k_new, v_new = (rng.standard_normal((T, KVH, D), np.float32) for _ in range(2))
    common = (
        np.int32(1),
        np.asarray([p + n for p, n in seqs], np.int32),
        tables,
        np.asarray([0, 1, 151, 160]),
    )
    got = np.asarray(_jitted(q, k_new, v_new, cache, *common))[:160]
    np.testing.assert_allclose(got, np.asarray(_jitted(q, k_new, v_new, read, *common))[:160], atol=1e-6)
