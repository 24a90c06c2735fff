"""The host tier's copies on a real sharded cache (8 CPU devices, heads split over 4): blocks copied out
land in their slots byte for byte, and slots loaded into other blocks write exactly those blocks, in
batches padded to their buckets and split past the largest."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from pdserve import kvtransfer
from pdserve.engine.host_kv import BATCH_BUCKETS, HostKVStore
from pdserve.engine.model.sharding import make_mesh
from pdserve.kvtransfer import KVLayout, LayerSpec, SpecKind

pytestmark = pytest.mark.fast


@pytest.mark.parametrize("dtype", ["bfloat16", "int8"])  # (an int8 cache's rows end with their scales)
def test_blocks_round_trip_through_host_slots(dtype):
    layout = KVLayout(
        model="m", layer_specs=(LayerSpec(SpecKind.FULL),) * 3, num_kv_heads=4, head_dim=8,
        dtype=dtype, block_size=4, tp_size=4, head_strategy="pad",
    )  # fmt: skip
    mesh = make_mesh(4, jax.devices()[:4])
    rng = np.random.default_rng(0)
    num_blocks = 100
    shape = (3, num_blocks, 4, *layout.token_shape)
    host_cache = (16 * rng.standard_normal(shape)).astype(layout.np_dtype)
    cache = jax.device_put(host_cache, kvtransfer.cache_sharding(mesh, layout))
    store = HostKVStore(cache, num_slots=80)
    out = rng.permutation(num_blocks)[: BATCH_BUCKETS[-1] + 5].tolist()  # two batches: 64, then 5 of 16
    slots = rng.permutation(80)[: len(out)].tolist()
    store.offload(cache, list(zip(out, slots, strict=True)))
    landed = store.landed(wait=True)
    assert sorted(landed) == sorted(slots) and store.num_in_flight == 0
    np.testing.assert_array_equal(store.slots[:, slots], host_cache[:, out])
    into = [b for b in range(num_blocks) if b not in out][:7]
    load = store.start_load(list(zip(slots[:7], into, strict=True)))
    store.slots[:, slots[:7]] = 0  # the slots were read: they may be reused at once
    cache = store.finish_load(cache, load)
    expected = host_cache.copy()
    expected[:, into] = host_cache[:, out[:7]]
    np.testing.assert_array_equal(np.asarray(cache), expected)
    assert cache.sharding == kvtransfer.cache_sharding(mesh, layout)
    assert (store.num_offloaded, store.num_loaded) == (len(out), 7)
