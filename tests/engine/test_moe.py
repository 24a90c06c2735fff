"""The mixture-of-experts MLP: a batch equals each of its rows alone and the dense per-expert sum, whatever
the rows route to; experts no real token chose are never read (their weights may be NaN)."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdserve.engine.model import moe

pytestmark = pytest.mark.fast

E, D, INTER = 8, 16, 24


def dense(h, weights, experts, gate_up, down):
    """Every (token, choice) through its expert, one at a time."""
    out = np.zeros_like(h)
    for t in range(h.shape[0]):
        for w, e in zip(weights[t], experts[t], strict=True):
            gu = h[t] @ gate_up[e].reshape(D, 2 * INTER)
            g, u = gu.reshape(2, INTER)
            out[t] += w * ((g / (1 + np.exp(-g))) * u) @ down[e]
    return out


_mlp = jax.jit(moe.experts_mlp, static_argnums=6)


@settings(max_examples=15, deadline=None)
@given(
    tokens=st.sampled_from([1, 4, 32]),  # buckets: tiles of 8 pairs, several experts' pairs in one bucket
    k=st.integers(1, 3),
    skew=st.booleans(),  # most pairs on one expert: it takes several tiles
    rnd=st.randoms(),
)
def test_a_batch_equals_each_row_alone_and_the_dense_sum(tokens, k, skew, rnd):
    rng = np.random.default_rng(rnd.randint(0, 2**32))
    h = rng.standard_normal((tokens, D), np.float32)
    gate_up = rng.standard_normal((E, D, 2, INTER), np.float32) * 0.3
    down = rng.standard_normal((E, INTER, D), np.float32) * 0.3
    experts = np.stack([rng.permutation(E - 2)[:k] for _ in range(tokens)]).astype(np.int32)  # 6, 7: unused
    if skew:
        experts[:, 0] = 3
        experts[:, 1:] = np.where(experts[:, 1:] == 3, 5, experts[:, 1:])
    weights = rng.random((tokens, k), np.float32)
    valid = np.arange(tokens) < max(1, tokens - 2)  # the last rows are padding
    gate_up[6:], down[6:] = np.nan, np.nan  # chosen by no token: never read
    sel = lambda rows: (h[rows], weights[rows], experts[rows], valid[rows], gate_up, down, jax.nn.silu)  # noqa: E731
    batch = np.asarray(_mlp(*sel(slice(None))))
    assert np.isfinite(batch).all()
    want = dense(h, weights, experts, gate_up, down)
    np.testing.assert_allclose(batch[valid], want[valid], rtol=1e-4, atol=1e-5)
    assert not batch[~valid].any()  # padding routes to no expert
    alone = np.concatenate([np.asarray(_mlp(*sel(slice(t, t + 1)))) for t in np.flatnonzero(valid)])
    np.testing.assert_allclose(batch[valid], alone, rtol=1e-5, atol=1e-6)


def _router(k, renormalize=False, scale=1.0, groups=None):
    """The routing fields of a ModelConfig."""
    return SimpleNamespace(
        num_experts_per_tok=k, norm_topk_prob=renormalize, routed_scaling_factor=scale, router_groups=groups
    )


def test_routing_takes_the_top_k_of_the_softmax():
    h = jnp.asarray([[1.0, 0.0], [0.0, 1.0]])
    w_router = jnp.asarray([[3.0, 1.0, 2.0, 0.0], [0.0, 5.0, 4.0, 4.5]])
    probs = jax.nn.softmax(h @ w_router)
    weights, experts = moe.route(h, w_router, _router(2))
    assert experts.tolist() == [[0, 2], [1, 3]]
    np.testing.assert_allclose(weights, jnp.take_along_axis(probs, experts, axis=1), rtol=1e-6)
    weights, _ = moe.route(h, w_router, _router(2, renormalize=True))
    np.testing.assert_allclose(weights.sum(axis=1), [1.0, 1.0], rtol=1e-6)
    scaled, _ = moe.route(h, w_router, _router(2, scale=2.5))
    np.testing.assert_allclose(scaled, 2.5 * jnp.take_along_axis(probs, experts, axis=1), rtol=1e-6)
    # DeepSeek's group-limited choice: groups {0, 1} and {2, 3}, one kept, by its best expert
    _, experts = moe.route(h, w_router, _router(2, groups=(2, 1)))
    assert experts.tolist() == [[0, 1], [1, 0]]


def test_one_compiled_shape_serves_any_routing():
    """The grouped loop's trip count is a run-time value: routings that spread or pile up the pairs run
    the same executable."""
    mlp = jax.jit(lambda *args: moe.experts_mlp(*args, jax.nn.silu))  # a cache of its own
    rng = np.random.default_rng(0)
    h = rng.standard_normal((16, D), np.float32)
    gate_up, down = (
        rng.standard_normal((E, D, 2, INTER), np.float32),
        rng.standard_normal((E, INTER, D), np.float32),
    )
    weights, valid = np.ones((16, 2), np.float32), np.ones(16, bool)
    for experts in (np.arange(32).reshape(16, 2) % E, np.zeros((16, 2)) + [0, 1], np.full((16, 2), [5, 7])):
        mlp(h, weights, experts.astype(np.int32), valid, gate_up, down)
    assert mlp._cache_size() == 1


def test_experts_split_over_a_mesh_compute_the_same():
    """Tensor-parallel experts (each expert's intermediate axis over 2 devices, as engine.model.weights shards
    them) give the single-device result."""
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = Mesh(np.array(jax.devices()[:2]), ("model",))
    rng = np.random.default_rng(2)
    h = rng.standard_normal((16, D), np.float32)
    gate_up = rng.standard_normal((E, D, 2, INTER), np.float32)
    down = rng.standard_normal((E, INTER, D), np.float32)
    experts = rng.integers(0, E, (16, 2)).astype(np.int32)
    args = (h, rng.random((16, 2), np.float32), experts, np.ones(16, bool))
    sharded = (
        jax.device_put(gate_up, NamedSharding(mesh, P(None, None, None, "model"))),
        jax.device_put(down, NamedSharding(mesh, P(None, "model", None))),
    )
    got = _mlp(*args, *sharded, jax.nn.silu)
    np.testing.assert_allclose(
        np.asarray(got), np.asarray(_mlp(*args, gate_up, down, jax.nn.silu)), rtol=1e-5, atol=1e-5
    )
