"""Helpers shared by the kvtransfer tests: small layouts, meshes on the 8 fake CPU devices, caches whose
every value is known (pdserve.testing.kv_cache), and readers that compare a decode cache with expectations."""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh

from pdserve.kvtransfer import KVLayout, LayerSpec, SpecKind, cache_sharding
from pdserve.testing.kv_cache import logical_layout, logical_values, make_cache, physical

SENTINEL = 256.0  # what a decode cache holds before insert (exact in every float cache dtype, fp8 too);
# synthetic values lie in [-125, 125]
INT8_SENTINEL = 127  # an int8 cache's (its scale bytes may hold any byte)


def sentinel(layout: KVLayout) -> float:
    return INT8_SENTINEL if layout.dtype == "int8" else SENTINEL


NUM_BLOCKS = 32

SPECS = {
    "full": (LayerSpec(),) * 4,
    # Two sliding layers (window 8 tokens = 2 blocks) and one layer sharing layer 0: 4 cache layers.
    "sliding": (
        LayerSpec(),
        LayerSpec(SpecKind.SLIDING, sliding_window=8),
        LayerSpec(SpecKind.SHARED, shared_with=0),
        LayerSpec(),
        LayerSpec(SpecKind.SLIDING, sliding_window=8),
    ),
    "mla": (LayerSpec(SpecKind.MLA),) * 3,
}


def make_layout(kind="full", dtype="float32", tp=1, strategy="pad", block_size=4, head_dim_multiple=1):
    if kind == "mla":
        return KVLayout(
            "tiny-mla", SPECS[kind], 1, 16, dtype, block_size, kv_lora_rank=12, qk_rope_head_dim=4,
            tp_size=tp, head_dim_multiple=head_dim_multiple,
        )  # fmt: skip
    return KVLayout(
        "tiny", SPECS[kind], 3, 8, dtype, block_size, tp_size=tp, head_strategy=strategy,
        head_dim_multiple=head_dim_multiple,
    )  # fmt: skip


def mesh(first: int, size: int) -> Mesh:
    return Mesh(np.array(jax.devices()[first : first + size]), ("model",))


def as_tree(stacked: np.ndarray, stacked_form: bool):
    return stacked if stacked_form else [stacked[i] for i in range(stacked.shape[0])]


def src_cache(layout: KVLayout, m: Mesh, stacked=True, num_blocks=NUM_BLOCKS):
    host = as_tree(make_cache(layout, num_blocks), stacked)
    return jax.device_put(host, cache_sharding(m, layout, stacked=stacked))


def dst_cache(layout: KVLayout, m: Mesh, stacked=True, num_blocks=NUM_BLOCKS):
    host = as_tree(np.full(layout.cache_shape(num_blocks), sentinel(layout), layout.np_dtype), stacked)
    return jax.device_put(host, cache_sharding(m, layout, stacked=stacked))


def to_host(cache) -> np.ndarray:
    """Any cache tree -> host [layers, num_blocks, block_size, slots, dim] as float32."""
    leaves = [np.asarray(leaf) for leaf in jax.tree.leaves(cache)]
    return np.concatenate([x if x.ndim == 5 else x[None] for x in leaves]).astype(np.float32)


def check_transferred(cache, src: KVLayout, dst: KVLayout, src_blocks, dst_blocks, num_tokens) -> None:
    """Every needed token of every cache layer arrived in dst's layout; unneeded blocks (sliding windows)
    and every block outside dst_blocks still hold the sentinel."""
    host = to_host(cache)
    layers, bs = src.num_cache_layers, src.block_size
    values = logical_values(src, layers, np.asarray(src_blocks, np.int64))
    values = values.reshape(layers, -1, *logical_layout(src).token_shape)
    expected = physical(dst, values).astype(np.float32)  # [layers, tokens, slots, dim]
    others = np.setdiff1d(np.arange(host.shape[1]), dst_blocks)
    assert (host[:, others] == sentinel(dst)).all(), "a block outside the request was written"
    got = host[:, list(dst_blocks)].reshape(layers, -1, *dst.token_shape)
    for layer in range(layers):
        first = src.first_needed_block(layer, num_tokens) * bs
        np.testing.assert_array_equal(got[layer, first:num_tokens], expected[layer, first:num_tokens])
        assert (got[layer, :first] == sentinel(dst)).all(), (
            f"layer {layer}: a block outside the window was written"
        )
