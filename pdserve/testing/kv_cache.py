"""Synthetic paged caches for tests and benchmarks: every value is a known function of its position."""

from __future__ import annotations

import numpy as np

from pdserve.kvtransfer.layout import SCALE_DTYPE, KVLayout, head_map


def logical_layout(layout: KVLayout) -> KVLayout:
    """The unpadded physical form: real heads once each, real head_dim, TP 1."""
    return layout.with_physical(tp_size=1, head_strategy="pad", head_dim_multiple=1, dp_size=1)


def logical_values(layout: KVLayout, layers: int, blocks: np.ndarray) -> np.ndarray:
    """[layers, len(blocks), block_size, slots, head_dim] of the logical layout, cast to layout's dtype:
    a value that differs for every (layer, block, token, slot, dim) within a block's range. A layout
    with scales (int8) gets a valid one in each row, positive and differing by row."""
    logical = logical_layout(layout)
    slots, dim = logical.token_shape
    idx = np.indices((layers, len(blocks), layout.block_size, slots, dim), dtype=np.int64)
    idx[1] = np.asarray(blocks)[idx[1]]
    code = ((idx[0] * 131 + idx[1] * 31 + idx[2] * 7 + idx[3] * 3 + idx[4]) % 251) - 125
    values = code.astype(layout.np_dtype)
    if layout.scale_bytes:
        scales = (np.abs(code[..., 0]) + 1).astype(SCALE_DTYPE) / SCALE_DTYPE.type(64)
        values[..., -layout.scale_bytes :] = scales[..., None].view(layout.np_dtype)
    return values


def physical(layout: KVLayout, values: np.ndarray) -> np.ndarray:
    """Logical values [..., slots, dim] -> layout's physical heads axis and head_dim (dummies zero)."""
    out = np.empty((*values.shape[:-2], *layout.token_shape), layout.np_dtype)
    head_map(logical_layout(layout), layout).apply_numpy(values, out)
    return out


def make_cache(layout: KVLayout, num_blocks: int) -> np.ndarray:
    """Host stacked cache [num_cache_layers, num_blocks, block_size, slots, padded_head_dim]."""
    layout.cache_shape(num_blocks)  # checks the dp multiple
    return physical(layout, logical_values(layout, layout.num_cache_layers, np.arange(num_blocks)))
